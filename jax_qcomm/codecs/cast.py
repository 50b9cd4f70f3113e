"""The unquantised codecs: :class:`Cast` (16-bit floats on the wire, float32 accumulation) and
:class:`NoCompression` (float32, reduced by XLA's own collectives)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm.transport import _exchange, cost as _transport
from jax_qcomm._checks import check_int
from jax_qcomm.transport.axes import axis_size
from jax_qcomm.codecs.base import (Codec, _check_traffic, _ring, _rows_of, _sum_in_order,
                                   nonfinite_mark, split_leaves)


@dataclasses.dataclass(frozen=True)
class Cast(Codec):
  """bfloat16 or float16 on the wire (round to nearest even), float32 accumulation.

  The narrow values travel as raw uint8 bytes so that XLA cannot promote the collective to float32
  (it does so for a bf16 all-reduce on CPU).
  """

  dtype: Any = jnp.bfloat16

  def __post_init__(self):
    try:
      dtype = jnp.dtype(self.dtype)
    except Exception:  # "foo", an object: not a dtype at all
      dtype = None
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      raise ValueError(f"dtype must be bfloat16 or float16, got "
                       f"{dtype if dtype is not None else repr(self.dtype)}")
    object.__setattr__(self, "dtype", dtype)

  def payload_size(self, n: int) -> int:
    return 2 * check_int("n", n, 0)

  def wire_bits(self, devices: int = 1) -> float:
    check_int("devices", devices)
    return 16.0

  # Words of uint16 in the collectives: the same bytes as the uint8 payload, but XLA CPU converts
  # float32 -> bf16 -> uint16 about 4x faster than into a uint8 view (a relayout of every value
  # into two bytes).
  wire_dtype = np.uint16

  @property
  def name(self) -> str:
    return f"Cast {jnp.dtype(self.dtype).name}"

  def wire_encode(self, x, key):
    return lax.bitcast_convert_type(x.astype(self.dtype), jnp.uint16)

  def wire_decode_sum(self, wires, n):
    return _sum_in_order(lax.bitcast_convert_type(wires, self.dtype).astype(jnp.float32))


def _shares_the_mark(devices: int) -> bool:
  """Whether the devices split the exact results' finite mark and join it with a scalar psum:
  where messages cost no latency (:func:`jax_qcomm.transport.current`) and there are several."""
  return devices > 1 and _transport.current(devices).latency_s == 0


def _on_a_list(parts: Sequence[jax.Array], collective, own_operand: int) -> list[jax.Array]:
  """``collective(operands) -> results`` on a list (XLA's float32 collectives take one): every part
  of at least ``own_operand`` values (:attr:`jax_qcomm.transport.Transport.own_operand`) as it is
  (XLA combines the operands itself; a packed copy would cost two passes over it), the smaller
  ones packed along their last axis into one operand (many small operands cost more than their
  copy), split again afterwards."""
  large = [i for i, x in enumerate(parts) if x.size >= own_operand]
  small = [i for i in range(len(parts)) if i not in large]
  operands = [parts[i] for i in large]
  if small:
    operands.append(jnp.concatenate([parts[i] for i in small], axis=-1))
  results = collective(operands)
  outs = [None] * len(parts)
  for i, r in zip(large, results):
    outs[i] = r
  if small:
    for i, r in zip(small, split_leaves(results[-1], [parts[i].shape[-1] for i in small], 1)):
      outs[i] = r
  return outs


def _mean_or_sum(sums: Sequence[jax.Array], axis_name, op: str) -> list[jax.Array]:
  """``sums`` divided by the axis size as ``lax.pmean`` divides (``op="mean"``), or as they are."""
  d = axis_size(axis_name)
  return [s / d for s in sums] if op == "mean" else list(sums)


@dataclasses.dataclass(frozen=True)
class NoCompression(Codec):
  """Exact float32. Reduces with XLA's own ``psum`` / ``psum_scatter`` / ``all_gather`` of the
  float32 values (no padding, no residual); encode/decode are the float32 bytes."""

  exact = True

  @property
  def name(self) -> str:
    return "exact fp32"

  def payload_size(self, n: int) -> int:
    return 4 * check_int("n", n, 0)

  def wire_bits(self, devices: int = 1) -> float:
    check_int("devices", devices)
    return 32.0

  def wire_encode(self, x, key):
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)

  def wire_decode_sum(self, payloads, n):
    k = payloads.shape[0]
    return _sum_in_order(lax.bitcast_convert_type(payloads.reshape(k, n, 4), jnp.float32))

  # -- the reduction protocol: XLA's float32 collectives --------------------------------------------
  def buffer_length(self, n: int, devices: int) -> int:
    return n

  def allreduce_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    out = lax.pmean(x, axis_name) if op == "mean" else lax.psum(x, axis_name)
    return out, jnp.zeros_like(x)

  def allreduce_leaves(self, parts, axis_name, key, op="mean", exchange="auto"):
    """One ``psum`` of a list: each leaf of at least the transport's ``own_operand`` values
    (:func:`jax_qcomm.transport.current`: 2**15 where messages cost no latency, one process or
    NCCL; 2**18 over gloo across processes, about 2 ms per operand) as it is (XLA combines the
    operands itself; a packed copy would cost two passes over it) and the smaller ones packed
    into one buffer (many small operands cost more than their copy); the mean divides the sums
    as ``lax.pmean`` does."""
    return _mean_or_sum(self._sums(parts, axis_name), axis_name, op), \
        [jnp.zeros_like(x) for x in parts]

  @staticmethod
  def _sums(parts, axis_name):
    own = _transport.current(axis_size(axis_name)).own_operand
    return _on_a_list(parts, lambda ops: lax.psum(ops, axis_name), own)

  def allreduce_leaves_marked(self, parts, axis_name, key, op="mean", exchange="auto"):
    """The mark is read from the sums, before the mean's division (finite exactly where the
    means are): the division then fuses into the results' consumers rather than being written
    out for the mark's reduction (XLA:CPU does not fuse it into that reduction). Where messages
    cost no latency, each device marks its own 1/D of every sum (they are the same on every
    device) and one scalar ``psum`` joins the marks: one pass over the results in all instead of
    one per device. Elsewhere each device reads them all (a message would cost more than the
    pass)."""
    sums = self._sums(parts, axis_name)
    outs, lost = _mean_or_sum(sums, axis_name, op), [jnp.zeros_like(x) for x in parts]
    d = axis_size(axis_name)
    if not _shares_the_mark(d):
      return outs, lost, nonfinite_mark(sums)
    index = lax.axis_index(axis_name)
    mine = []
    for total in sums:
      chunk = -(-total.shape[0] // d)  # a last slice that would overrun starts earlier (clamped)
      mine.append(lax.dynamic_slice_in_dim(total, index * chunk, chunk) if chunk else total)
    return outs, lost, lax.psum(nonfinite_mark(mine), axis_name)

  def mark_traffic(self, devices):
    """Where messages cost no latency: the scalar all-reduce that joins the devices' marks."""
    return (("all-reduce", _ring(devices, 4)),) if _shares_the_mark(devices) else ()

  def reduce_scatter_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    block = _exchange.scatter_sum(x, axis_name)
    return _mean_or_sum([block], axis_name, op)[0], jnp.zeros_like(x)

  def all_gather_flat(self, x, axis_name, key):
    return _exchange.gather(x, axis_name)

  def reduce_scatter_leaves(self, chunks, axis_name, key, op="mean", exchange="auto"):
    """Where messages cost no latency, one ``psum_scatter`` of a list of the leaves' chunks
    (scattered along their device axis), as :meth:`allreduce_leaves`: no copy of the large ones,
    the small ones' rows packed; elsewhere the packed buffer (the list is not measured across
    processes)."""
    d = axis_size(axis_name)
    transport = _transport.current(d)
    if len(chunks) < 2 or transport.latency_s > 0:
      return super().reduce_scatter_leaves(chunks, axis_name, key, op, exchange)

    def scatter(ops):
      return _mean_or_sum(lax.psum_scatter(ops, axis_name, scatter_dimension=1, tiled=True),
                          axis_name, op)

    own = transport.own_operand
    parts = [x if x.size >= own else _rows_of(x)[None] for x in chunks]
    return ([b.reshape(-1) for b in _on_a_list(parts, scatter, own)],
            [jnp.zeros_like(x) for x in chunks])

  def all_gather_leaves(self, parts, axis_name, key):
    """Where messages cost no latency, one ``all_gather`` of a list, as :meth:`allreduce_leaves`;
    elsewhere the packed buffer."""
    transport = _transport.current(axis_size(axis_name))
    if len(parts) < 2 or transport.latency_s > 0:
      return super().all_gather_leaves(parts, axis_name, key)
    return _on_a_list(parts, lambda ops: lax.all_gather(ops, axis_name, to="invarying"),
                      transport.own_operand)

  def traffic(self, n, devices, collective="allreduce"):
    n, d, collective = _check_traffic(n, devices, collective)
    if collective == "allreduce":
      return (("all-reduce", _ring(d, 4 * n)),)
    if collective == "reduce_scatter":
      return (("reduce-scatter", (d - 1) * 4 * (-(-n // d))),)
    return (("all-gather", (d - 1) * 4 * n),)
