"""Codecs: how an array is turned into bytes on the wire and back.

Every codec maps an array of any shape to one flat ``uint8`` payload (``encode``), back to an
array (``decode``), and sums several payloads in float32 (``decode_sum``, the middle of a
compressed allreduce). Payload layouts are specified in docs/wire-format.md. :class:`Codec` is the
interface, written down: what the collectives, the packing, the cost model and ``describe`` read
from a codec, and the four methods a new codec implements.

* :class:`QSGD` -- per-bucket quantisation to 1..8 bits with stochastic or nearest rounding;
  two implementations of one format: the C++/CUDA FFI kernels and a pure-JAX reference.
* :class:`Cast` -- bfloat16 / float16 bits on the wire, float32 accumulation.
* :class:`NoCompression` -- float32 bytes (collectives use plain ``psum`` for it).
* :class:`Summable` -- levels with a scale shared by all devices, packed into uint32 words that
  XLA's own all-reduce sums (one ``psum``; C++ kernel on CPU, pure JAX elsewhere).
* :class:`Wire16` -- 16-bit fixed-point fields summed as integers (CPU), the bf16 cast elsewhere.
* :class:`Auto` -- QSGD or Summable, whichever the transport and the device count make faster.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm import _exchange, _ffi, _reference, _selftest, wire
from jax_qcomm import transport as _transport
from jax_qcomm.axes import AxisName, axis_size, device_key
from jax_qcomm._checks import (as_array, check_array, check_float_dtype, check_int,
                               check_int_in, check_key, check_real, check_shape)

Shape = Sequence[int]
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
IMPLS = ("auto", "ffi", "jax")


def is_float_dtype(dtype: Any) -> bool:
  """float32, bfloat16 or float16: the dtypes codecs and collectives accept."""
  return any(jnp.dtype(dtype) == d for d in FLOAT_DTYPES)


def _check_float(x: jax.Array, name: str = "x") -> None:
  if not is_float_dtype(x.dtype):
    raise ValueError(f"{name} must be a float32, bfloat16 or float16 array, got dtype {x.dtype}")


def _check_out_dtype(dtype: Any) -> jnp.dtype:
  return check_float_dtype("dtype", dtype)


def _check_payload(payload: jax.Array, expected: int, lead: tuple[int, ...] = ()) -> None:
  check_array("payload" if not lead else "payloads", payload)
  if payload.dtype != jnp.uint8:
    raise ValueError(f"payload must be a uint8 array, got dtype {payload.dtype}")
  if tuple(payload.shape) != lead + (expected,):
    raise ValueError(f"payload must have shape {lead + (expected,)} for this shape and codec, "
                     f"got {tuple(payload.shape)}")


def seed_words(key: jax.Array) -> jax.Array:
  """Two uint32 words drawn from a JAX PRNG key (typed or raw): the codec's rounding seed."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.shape != ():
      raise ValueError(f"key must be a single PRNG key, got a key array of shape {key.shape}")
  elif not (key.dtype == jnp.uint32 and key.ndim == 1):
    raise ValueError("key must be a JAX PRNG key (jax.random.key(...) or jax.random.PRNGKey(...)), "
                     f"got an array of dtype {key.dtype} and shape {key.shape}")
  return jax.random.bits(key, (2,), jnp.uint32)


COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather")


def _check_traffic(n: Any, devices: Any, collective: Any) -> tuple[int, int, str]:
  if collective not in COLLECTIVES:
    raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
  return check_int("n", n, 0), check_int("devices", devices), collective


def _pad_to(x: jax.Array, size: int) -> jax.Array:
  """float32[n] -> float32[size], zeros appended (size >= n)."""
  pad = size - x.shape[0]
  return jnp.pad(x, (0, pad)) if pad else x


def concat_leaves(parts: Sequence[jax.Array], codec: "Codec") -> jax.Array:
  """Flat float32 leaves -> the one buffer that carries them: each padded to a whole number of
  ``codec.pad_multiple`` elements with ``codec.pad_fill`` (the leaf's own last value for QSGD's
  maxmin, 0 otherwise: the last bucket's scales stay the leaf's), then concatenated."""
  m = codec.pad_multiple
  padded = []
  for x in parts:
    pad = -x.shape[0] % m
    if pad:
      x = jnp.concatenate([x, jnp.broadcast_to(codec.pad_fill(x), (pad,)).astype(x.dtype)])
    padded.append(x)
  return padded[0] if len(padded) == 1 else jnp.concatenate(padded)


def split_leaves(flat: jax.Array, sizes: Sequence[int], multiple: int) -> list[jax.Array]:
  """The inverse of :func:`concat_leaves`: flat[N] -> one array of sizes[i] per leaf, padding
  dropped."""
  out, offset = [], 0
  for n in sizes:
    out.append(flat[offset:offset + n])
    offset += wire.leaves_span([n], multiple)
  return out


def reduce_packed(parts: Sequence[jax.Array], codec: "Codec", reduce_flat
                  ) -> tuple[list[jax.Array], list[jax.Array]]:
  """``reduce_flat(buffer) -> (out, residual)`` on :func:`concat_leaves` of ``parts``, both split
  per leaf again: how a reduction of a packed buffer serves the leaves it carries."""
  sizes = [p.shape[0] for p in parts]
  out, lost = reduce_flat(concat_leaves(parts, codec))
  return (split_leaves(out, sizes, codec.pad_multiple),
          split_leaves(lost, sizes, codec.pad_multiple))


def _ring(devices: int, nbytes: float) -> float:
  """Bytes each device sends in a ring all-reduce of a buffer of ``nbytes``: 2 (D-1)/D of it."""
  return 2.0 * (devices - 1) / devices * nbytes


def _sum_in_order(vals: jax.Array) -> jax.Array:
  """vals[0] + vals[1] + ... in float32, unrolled: XLA CPU's reduce over a short axis is slow."""
  out = vals[0]
  for j in range(1, vals.shape[0]):
    out = out + vals[j]
  return out


#: Float32 elements per communication buffer where neither the caller nor the codec says otherwise
#: (64 MiB of float32): :meth:`Codec.comm_buffer_size`.
DEFAULT_COMM_BUCKET = 1 << 24


class Codec(abc.ABC):
  """A codec: how values cross the wire, as array functions and as a reduction across devices.

  A codec is an immutable, hashable value (a frozen dataclass): the collectives group leaves by
  codec and ``jit`` sees it as a static part of the traced program. Every other module talks to a
  codec through the members below, and none looks at a codec's type: a new codec is one subclass.

  **What it states**

  * :attr:`exact` -- ``decode(encode(x)) == x`` bit for bit (:attr:`lossy` is its negation:
    error feedback and codec-time accounting apply only to lossy codecs).
  * :attr:`needs_key` -- :meth:`encode` needs a JAX PRNG key (stochastic rounding).
  * :attr:`pad_multiple` -- the quantisation bucket: a buffer is padded to a multiple of this many
    elements (per leaf in a packed communication buffer) so that no group of values sharing scales
    straddles two leaves. :meth:`pad_fill` is the value padding uses.
  * :attr:`wire_dtype` -- the word type the payload travels as inside the collectives.
  * :attr:`name` -- a short human-readable name.

  **Sizes**: :meth:`payload_size` (bytes of the payload of ``n`` elements), :meth:`wire_size`
  (the same in words of :attr:`wire_dtype`) and :meth:`wire_bits` (bits per element).

  **Array API** (public, any shape, ``uint8`` payloads in the documented wire format):
  :meth:`encode`, :meth:`decode`, :meth:`decode_sum`, :meth:`decode_sum_reencode`,
  :meth:`roundtrip`. Built here from the wire API; subclasses need not touch them.

  **Wire API** (flat float32 in, rows of :attr:`wire_dtype` words out):

  * ``wire_encode(x: float32[n], key) -> wire[wire_size(n)]``
  * ``wire_decode_sum(wires: wire[k, W], n) -> float32[n]``: the in-order float32 sum of the k
    decodes (``k = 1`` decodes);
  * ``wire_decode_sum_reencode(wires, n, key, scale) -> wire[W]``:
    ``wire_encode(wire_decode_sum(wires, n) * float32(scale), key)`` (no multiplication where
    ``scale == 1``); a codec may fuse it into one kernel with the same bytes (QSGD does).

  **The reduction protocol** (what :func:`jax_qcomm.allreduce`, :func:`jax_qcomm.reduce_scatter`,
  :func:`jax_qcomm.all_gather`, :func:`jax_qcomm.sync`, :func:`jax_qcomm.describe` and the cost
  model call; inside ``shard_map`` / ``pmap``, ``axis_name`` a bound name or tuple of names, D its
  size, x this device's flat float32 values):

  * ``allreduce_flat(x: float32[n], axis_name, key, op, exchange) -> (out: float32[n], residual:
    float32[n])``: the mean (``op="mean"``) or sum over the D devices, the same bits on every
    device, and ``residual``, what this device's own quantisation lost (x minus what it
    contributed; zeros for exact codecs), for error feedback.
  * ``allreduce_leaves(parts: [float32[n_i]], axis_name, key, op, exchange) -> (outs, residuals)``:
    the same for the leaves a communication buffer carries (lists of float32[n_i]): the result of
    ``allreduce_flat`` on :func:`concat_leaves` of them (each leaf padded to whole buckets),
    split again. The default builds that buffer; a codec may read and write the leaves in place
    of the packed copy instead, with the same bytes on the wire (:class:`Summable` on CPU does).
  * ``reduce_scatter_flat(x: float32[D*m], axis_name, key, op, exchange) -> (block: float32[m],
    residual: float32[D*m])``: block i of the reduction lands on the device with axis index i.
    ``exchange`` is the schedule of an all-to-all (``jax_qcomm._exchange``); codecs that use none
    ignore it.
  * ``all_gather_flat(x: float[m], axis_name, key) -> float[D, m]``: every device's values,
    decoded, the same bits everywhere (the sender's own row included); x may be any float dtype
    (an exact codec gathers it as it is; lossy ones encode float32 and return float32).
  * ``traffic(n, devices, collective="allreduce") -> ((xla_collective, bytes), ...)``: the bytes
    each device sends for each XLA collective of one such call on a buffer of ``n`` elements, in
    the ring convention of nccl-tests (all-reduce ``2 (D-1)/D`` of its buffer, all-gather and
    all-to-all ``(D-1)/D`` of the gathered size, reduce-scatter ``(D-1)`` times its output).
    ``collective`` is ``"allreduce"``, ``"reduce_scatter"`` or ``"all_gather"``.
    :meth:`sent_bytes` is their sum: the one byte count of the library.
  * ``comm_buffer_size(devices, collective="allreduce") -> int``: the most elements a
    communication buffer of this codec carries in ``collective`` where the caller leaves
    ``comm_bucket_size=None``; leaves of one codec are packed up to it (:data:`DEFAULT_COMM_BUCKET`
    here).

  The defaults implement the scatter-reduce-allgather (SRA) from the wire API: each device's
  buffer is padded to whole buckets per device chunk and cut into D chunks, chunk j encoded and
  sent to device j (an all-to-all), the owner decodes and sums the D payloads it received,
  re-encodes the scaled sum once and every device all-gathers and decodes all chunks: each value is
  quantised twice. :class:`NoCompression` overrides them with XLA's float32 ``psum`` /
  ``psum_scatter`` / ``all_gather``; :class:`Summable` with one ``pmax`` of the scales and one
  ``psum`` of summable words. A codec with another way of reducing overrides the three methods and
  :meth:`traffic` together.

  **Adding a codec**: subclass as a frozen dataclass and implement :meth:`payload_size`,
  :meth:`wire_bits`, :meth:`wire_encode` and :meth:`wire_decode_sum`; override the stated
  attributes where the defaults (lossy, no key, no padding, ``uint8`` words) do not hold, and the
  reduction protocol where the SRA is not how it should reduce.
  """

  #: True if decode(encode(x)) == x bit for bit.
  exact: bool = False
  #: Word type of the payload inside the collectives; its size divides every payload size.
  wire_dtype: Any = np.uint8

  @property
  def lossy(self) -> bool:
    """True if the codec discards information (error feedback then has a residual to keep)."""
    return not self.exact

  @property
  def needs_key(self) -> bool:
    """True if :meth:`encode` needs a PRNG key (stochastic rounding)."""
    return False

  @property
  def pad_multiple(self) -> int:
    """Buffers are padded to a multiple of this many elements (the quantisation bucket)."""
    return 1

  @property
  def name(self) -> str:
    """A short human-readable name ('QSGD 4b/128 maxmin', 'Cast bfloat16', 'exact fp32')."""
    return type(self).__name__

  def pad_fill(self, x: jax.Array) -> jax.Array:
    """The float32 scalar that pads float32[n] ``x`` without changing its last group's scales."""
    del x
    return jnp.float32(0)

  @abc.abstractmethod
  def payload_size(self, n: int) -> int:
    """Bytes of the payload of an array of n elements (what :meth:`encode` returns)."""

  @abc.abstractmethod
  def wire_bits(self, devices: int = 1) -> float:
    """Bits on the wire per element, for whole buckets, when ``devices`` payloads are reduced
    (1: the standalone payload); only codecs whose fields widen with the sum depend on it."""

  def wire_size(self, n: int) -> int:
    """Words of :attr:`wire_dtype` in the payload of n elements."""
    return self.payload_size(n) // np.dtype(self.wire_dtype).itemsize

  # -- wire API: to implement --------------------------------------------------------------------
  @abc.abstractmethod
  def wire_encode(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """float32[n] -> wire_dtype[wire_size(n)]: the payload of x."""

  @abc.abstractmethod
  def wire_decode_sum(self, wires: jax.Array, n: int) -> jax.Array:
    """wire_dtype[k, wire_size(n)] -> float32[n]: the in-order float32 sum of the k decodes."""

  def wire_decode_sum_reencode(self, wires: jax.Array, n: int, key: jax.Array | None,
                               scale: float = 1.0) -> jax.Array:
    """wire[k, W] -> wire[W]: ``wire_encode(wire_decode_sum(wires, n) * float32(scale), key)``."""
    reduced = self.wire_decode_sum(wires, n)
    if scale != 1.0:
      reduced = reduced * jnp.float32(scale)
    return self.wire_encode(reduced, key)

  # -- the reduction protocol (default: scatter-reduce-allgather) ---------------------------------
  def padded_size(self, n: int, devices: int) -> int:
    """Elements a flat buffer of ``n`` takes in :meth:`allreduce_flat` over ``devices``: here a
    multiple of ``devices * pad_multiple``, so that every device's chunk is whole buckets."""
    m = devices * self.pad_multiple
    return -(-n // m) * m

  def allreduce_flat(self, x: jax.Array, axis_name: AxisName, key: jax.Array | None,
                     op: str = "mean", exchange: str = "auto") -> tuple[jax.Array, jax.Array]:
    """float32[n] -> (mean or sum over the axis, this device's residual); see the class doc."""
    n = x.shape[0]
    d = axis_size(axis_name)
    x = _pad_to(x, self.padded_size(n, d))
    c = x.shape[0] // d
    chunks = x.reshape(d, c)
    payloads = self._encode_rows(chunks, device_key(key, axis_name, 0))
    residual = (chunks - self._decode_rows(payloads, c)).reshape(-1)
    received = _exchange.exchange(payloads, axis_name, exchange)  # row s: my chunk from device s
    scale = 1.0 / d if op == "mean" else 1.0
    mine = self.wire_decode_sum_reencode(received, c, device_key(key, axis_name, 1), scale)
    gathered = lax.all_gather(mine, axis_name, to="invarying")  # [D, W], the same everywhere
    return self._decode_rows(gathered, c).reshape(-1)[:n], residual[:n]

  def allreduce_leaves(self, parts: Sequence[jax.Array], axis_name: AxisName,
                       key: jax.Array | None, op: str = "mean", exchange: str = "auto"
                       ) -> tuple[list[jax.Array], list[jax.Array]]:
    """[float32[n_i]] -> ([mean or sum], [residual]): :meth:`allreduce_flat` of the packed
    buffer (:func:`concat_leaves`), split per leaf."""
    return reduce_packed(
        parts, self, lambda flat: self.allreduce_flat(flat, axis_name, key, op, exchange))

  def reduce_scatter_flat(self, x: jax.Array, axis_name: AxisName, key: jax.Array | None,
                          op: str = "mean", exchange: str = "auto") -> tuple[jax.Array, jax.Array]:
    """float32[D*m] -> (this device's block float32[m], residual float32[D*m]): the SRA's first
    half; each value is quantised once on its way to its owner."""
    d = axis_size(axis_name)
    rows = x.reshape(d, -1)
    m = rows.shape[1]
    payloads = self._encode_rows(rows, device_key(key, axis_name, 0))
    residual = (rows - self._decode_rows(payloads, m)).reshape(-1)
    block = self.wire_decode_sum(_exchange.exchange(payloads, axis_name, exchange), m)
    if op == "mean":
      block = block * jnp.float32(1.0 / d)
    return block, residual

  def all_gather_flat(self, x: jax.Array, axis_name: AxisName,
                      key: jax.Array | None) -> jax.Array:
    """float[m] -> float32[D, m]: every device's payload, decoded (the SRA's second half)."""
    payload = self.wire_encode(x.astype(jnp.float32), device_key(key, axis_name, 0))
    gathered = lax.all_gather(payload, axis_name, to="invarying")
    return self._decode_rows(gathered, x.shape[0])

  def traffic(self, n: int, devices: int,
              collective: str = "allreduce") -> tuple[tuple[str, float], ...]:
    """Bytes each device sends per XLA collective for one reduction of a buffer of ``n`` elements
    over ``devices`` (ring convention; see the class doc). SRA: an all-to-all of D chunk payloads
    and an all-gather of D reduced ones; reduce_scatter: the all-to-all, of blocks of n / D;
    all_gather: an all-gather of D payloads of n each."""
    n, d, collective = _check_traffic(n, devices, collective)
    f = (d - 1) / d
    if collective == "all_gather":
      return (("all-gather", f * d * self.payload_size(n)),)
    if collective == "reduce_scatter":
      return (("all-to-all", f * d * self.payload_size(-(-n // d))),)
    chunk = self.payload_size(self.padded_size(n, d) // d)
    return (("all-to-all", f * d * chunk), ("all-gather", f * d * chunk))

  def sent_bytes(self, n: int, devices: int, collective: str = "allreduce") -> float:
    """Bytes each device sends for one reduction of ``n`` elements over ``devices`` devices: the
    sum of :meth:`traffic`, equal to what the compiled program's collectives send."""
    return float(sum(b for _, b in self.traffic(n, devices, collective)))

  def comm_buffer_size(self, devices: int, collective: str = "allreduce") -> int:
    """The most float32 elements one communication buffer of this codec carries in ``collective``
    (``"allreduce"``, or ``"reduce_scatter"`` for the rows of sharded state) over ``devices``
    where the caller passes ``comm_bucket_size=None`` (the default of :func:`jax_qcomm.allreduce`,
    :func:`jax_qcomm.sync` and :func:`jax_qcomm.diloco`): :data:`DEFAULT_COMM_BUCKET`. Each buffer
    is one reduction, so fewer buffers mean fewer collectives; a bound keeps packed copies small."""
    return DEFAULT_COMM_BUCKET

  def resolve(self, devices: int, collective: str = "allreduce",
              transport: _transport.Transport | None = None) -> Codec:
    """The codec that carries out ``collective`` over ``devices`` devices on ``transport``
    (default: :func:`jax_qcomm.transport.current` for ``devices``): this codec itself;
    :class:`Auto` names the candidate it runs. What :func:`jax_qcomm.describe` shows."""
    _check_traffic(0, devices, collective)
    if transport is not None and not isinstance(transport, _transport.Transport):
      raise ValueError(f"transport must be a jax_qcomm.transport.Transport or None, "
                       f"got {transport!r}")
    return self

  # -- helpers of the reductions -------------------------------------------------------------------
  def _encode_rows(self, rows: jax.Array, key: jax.Array | None) -> jax.Array:
    """float32[k, c] -> wire[k, W], a key per row."""
    if key is None:
      return jax.vmap(lambda r: self.wire_encode(r, None))(rows)
    return jax.vmap(self.wire_encode)(rows, jax.random.split(key, rows.shape[0]))

  def _decode_rows(self, wires: jax.Array, c: int) -> jax.Array:
    """wire[k, W] -> float32[k, c], each row decoded on its own."""
    return jax.vmap(lambda w: self.wire_decode_sum(w[None], c))(wires)

  # -- array API ---------------------------------------------------------------------------------
  def _to_bytes(self, wire: jax.Array) -> jax.Array:
    """wire[..., W] -> uint8[..., W * itemsize] (the same bytes, little-endian)."""
    if wire.dtype == jnp.uint8:
      return wire
    return lax.bitcast_convert_type(wire, jnp.uint8).reshape(wire.shape[:-1] + (-1,))

  def _from_bytes(self, payloads: jax.Array) -> jax.Array:
    """uint8[..., P] -> wire[..., P / itemsize]."""
    size = np.dtype(self.wire_dtype).itemsize
    if size == 1:
      return payloads
    words = payloads.reshape(payloads.shape[:-1] + (payloads.shape[-1] // size, size))
    return lax.bitcast_convert_type(words, self.wire_dtype)

  def encode(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """Encodes x (any shape; float32/bfloat16/float16) to uint8[payload_size(x.size)]."""
    x = as_array("x", x)
    _check_float(x)
    check_key("key", key)
    return self._to_bytes(self.wire_encode(x.reshape(-1).astype(jnp.float32), key))

  def decode(self, payload: jax.Array, shape: Shape, dtype: Any = jnp.float32) -> jax.Array:
    """Decodes a payload made by ``encode`` of an array of ``shape``; returns ``dtype``."""
    shape = check_shape("shape", shape)
    dtype = _check_out_dtype(dtype)
    n = math.prod(shape)
    _check_payload(payload, self.payload_size(n))
    return self.wire_decode_sum(self._from_bytes(payload[None]), n).reshape(shape).astype(dtype)

  def decode_sum(self, payloads: jax.Array, shape: Shape, dtype: Any = jnp.float32) -> jax.Array:
    """Sum of the decodes of payloads[k, P] (float32 accumulation, in order 0..k-1)."""
    shape = check_shape("shape", shape)
    dtype = _check_out_dtype(dtype)
    n = math.prod(shape)
    self._check_payloads(payloads, n)
    return self.wire_decode_sum(self._from_bytes(payloads), n).reshape(shape).astype(dtype)

  def decode_sum_reencode(self, payloads: jax.Array, shape: Shape, key: jax.Array | None = None,
                          scale: float = 1.0) -> jax.Array:
    """``encode(decode_sum(payloads, shape) * float32(scale), key)``: the middle of the compressed
    allreduce, where the owner of a chunk sums the k payloads it received and re-encodes the
    (scaled) sum. The bytes are those of the three steps done apart (the multiplication is skipped
    where ``scale == 1``, as the collectives do); a codec may fuse them (QSGD's FFI kernels do).
    """
    shape = check_shape("shape", shape)
    check_key("key", key)
    scale = check_real("scale", scale)
    n = math.prod(shape)
    self._check_payloads(payloads, n)
    wire = self.wire_decode_sum_reencode(self._from_bytes(payloads), n, key, scale)
    return self._to_bytes(wire)

  def roundtrip(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """decode(encode(x, key)): what the receiver sees, in x's shape and dtype."""
    x = as_array("x", x)
    return self.decode(self.encode(x, key), x.shape, x.dtype)

  def _check_payloads(self, payloads: jax.Array, n: int) -> None:
    check_array("payloads", payloads)
    if payloads.ndim != 2 or payloads.shape[0] < 1:
      raise ValueError(f"payloads must have shape [k >= 1, {self.payload_size(n)}], "
                       f"got {payloads.shape}")
    _check_payload(payloads, self.payload_size(n), lead=(payloads.shape[0],))


class _Bucketed(Codec):
  """What the bucketed quantisers (QSGD, Summable, Wire16) share: buffers padded to whole buckets,
  a key needed exactly when rounding is stochastic, and the choice between a compiled kernel and
  the pure-JAX reference. Subclasses have ``bucket_size`` and ``rounding``; those with kernels
  also ``bits`` and ``impl``."""

  def _kernel_platforms(self) -> tuple[str, ...]:
    """The lowering platforms ("cpu", "cuda") with a compiled kernel of this codec."""
    raise NotImplementedError

  def _select(self, ffi_fn, jax_fn, *args):
    """Runs ffi_fn on platforms with a compiled kernel, jax_fn elsewhere (chosen per lowering by
    ``lax.platform_dependent``); impl="auto" uses a platform's kernels once they passed their
    known-answer test there (:mod:`jax_qcomm._selftest`); impl="jax": always jax_fn;
    impl="ffi": the kernels, untested, with no fallback."""
    platforms = self._kernel_platforms()
    if self.impl == "auto":  # only kernels that passed their known-answer test on this platform
      platforms = tuple(p for p in platforms if _selftest.trusted(p))
    if self.impl == "jax" or not platforms:
      return jax_fn(*args)
    branches = {p: ffi_fn for p in platforms}
    if self.impl == "ffi":
      return lax.platform_dependent(*args, **branches)
    return lax.platform_dependent(*args, default=jax_fn, **branches)

  def _seed(self, key: jax.Array | None) -> jax.Array:
    """The kernels' uint32[2] rounding seed; a key is required for stochastic rounding."""
    if key is not None:
      return seed_words(key)
    if self.rounding == "stochastic":
      raise ValueError("key is required for rounding='stochastic' (pass a jax.random key)")
    return jnp.zeros((2,), jnp.uint32)

  @property
  def needs_key(self) -> bool:
    return self.rounding == "stochastic"

  @property
  def pad_multiple(self) -> int:
    return self.bucket_size

  def _check_bucket_size(self) -> None:
    if (isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, (int, np.integer))
        or self.bucket_size <= 0 or self.bucket_size % 8):
      raise ValueError(f"bucket_size must be a positive multiple of 8, got {self.bucket_size!r}")

  def _check_rounding_and_impl(self, kernels: str) -> None:
    """The last checks of ``__post_init__``; then ``bits`` and ``bucket_size`` become plain ints."""
    if self.rounding not in wire.ROUNDINGS:
      raise ValueError(f"rounding must be one of {wire.ROUNDINGS}, got {self.rounding!r}")
    if self.impl not in IMPLS:
      raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
    if self.impl == "ffi" and not self._kernel_platforms():
      raise ValueError(f"impl='ffi' but no compiled {kernels} were found (build the package)")
    object.__setattr__(self, "bits", int(self.bits))
    object.__setattr__(self, "bucket_size", int(self.bucket_size))


@dataclasses.dataclass(frozen=True)
class QSGD(_Bucketed):
  """QSGD: quantisation of each bucket of ``bucket_size`` values to ``bits`` bits.

  Each bucket is scaled by the power of two that brings its largest magnitude to [1, 2) (exact),
  quantised there, and stores its step in those units with the exponent (docs/wire-format.md), so
  every magnitude is handled alike. With ``L = 2**bits - 1`` (maxmin) or ``2**(bits-1) - 1``
  (norm) levels and ``step`` the bucket's stored step:

  * Valid range: any finite float32, from the smallest normal (2**-126 ~ 1.2e-38) to the largest
    finite (3.4e38), mixed freely within a bucket; every decoded value is then finite.
  * Error bound, per element: ``|decoded - x| <= step`` (stochastic; ``E[decoded] = x`` but for
    values that clamp to the top level, within 2**-11 of the bucket's largest ``|x|``) or
    ``<= step / 2`` (nearest), up to float32 rounding (2**-20 of the bucket's largest ``|x|``)
    and the flush below 2**-126 (next point), where ``step <= (max - min) / L`` (maxmin) or
    ``step <= min(||bucket||_2, 3.4e38) / L`` (norm), each times ``1 + 2**-14`` (the step has
    16 significant bits, rounded up). For ``"norm"`` this is
    QSGD's bound: ``||decoded - x||^2 <= n * step^2 ~ n / L^2 * ||x||^2`` per bucket of ``n``
    values, and ``E||decoded - x||^2 <= min(n / L^2, sqrt(n) / L) * ||x||^2`` when stochastic.
  * Below the smallest normal, all implementations flush denormals as XLA's CPU runtime does
    (FTZ/DAZ): a subnormal input reads as 0 (a bucket of subnormals and zeros decodes to zeros) and
    a decoded value below 2**-126 in magnitude is 0, so the bound above holds up to an absolute
    2**-126. Values more than 2**126 times smaller than their bucket's largest count as 0.
  * A bucket holding NaN or +-Inf decodes to NaN throughout (never to finite values).

  The C++ kernels (each ISA), the CUDA kernels and the pure-JAX reference give the same payload
  bytes and the same decoded float32 values for the same key.

  Args:
    bits: 1..8 bits per value (``"norm"`` needs at least 2: one is the sign).
    bucket_size: values sharing one set of scales; a positive multiple of 8.
    scheme: ``"maxmin"`` (CGX: levels spread between the bucket's min and max) or ``"norm"`` (QSGD
      paper: sign + level in units of the bucket's L2 norm).
    rounding: ``"stochastic"`` (unbiased; needs a key) or ``"nearest"``.
    impl: ``"auto"`` (FFI kernel where one is built for the platform, else pure JAX), ``"ffi"``
      or ``"jax"``.
  """

  bits: int = 4
  bucket_size: int = 128
  scheme: str = "maxmin"
  rounding: str = "stochastic"
  impl: str = "auto"

  def __post_init__(self):
    check_int_in("bits", self.bits, 1, 8)
    self._check_bucket_size()
    if self.scheme not in wire.SCHEMES:
      raise ValueError(f"scheme must be one of {wire.SCHEMES}, got {self.scheme!r}")
    if self.scheme == "norm" and self.bits < 2:
      raise ValueError("bits must be >= 2 for scheme='norm' (one bit is the sign), got 1")
    self._check_rounding_and_impl("kernels")

  @property
  def _fmt(self) -> dict:
    return dict(bits=self.bits, bucket_size=self.bucket_size, scheme=self.scheme)

  @property
  def name(self) -> str:
    rounding = "" if self.rounding == "stochastic" else f" {self.rounding}"
    return f"QSGD {self.bits}b/{self.bucket_size} {self.scheme}{rounding}"

  def pad_fill(self, x: jax.Array) -> jax.Array:
    # maxmin: repeating the last value keeps the bucket's min and max; norm: 0 keeps its norm.
    if self.scheme == "maxmin" and x.shape[0] > 0:
      return x[-1]
    return jnp.float32(0)

  def payload_size(self, n: int) -> int:
    return wire.qsgd_payload_bytes(check_int("n", n, 0), **self._fmt)

  def wire_bits(self, devices: int = 1) -> float:
    check_int("devices", devices)
    return 32.0 / wire.qsgd_compression_ratio(**self._fmt)

  def _kernel_platforms(self) -> tuple[str, ...]:
    return (("cpu",) if _ffi.has_cpu_kernels() else ()) + (("cuda",) if _ffi.has_cuda_kernels() else ())

  def wire_encode(self, x, key):
    n = x.shape[0]
    seed = self._seed(key)
    if n == 0:
      return jnp.zeros((0,), jnp.uint8)
    kw = dict(rounding=self.rounding, **self._fmt)
    return self._select(lambda a, s: _ffi.qsgd_encode(a, s, **kw),
                        lambda a, s: _reference.encode(a, s, **kw), x, seed)

  def wire_decode_sum(self, payloads, n):
    if n == 0:
      return jnp.zeros((0,), jnp.float32)
    kw = self._fmt
    return self._select(lambda p: _ffi.qsgd_decode_sum(p, n, **kw),
                        lambda p: _reference.decode_sum(p, n, **kw), payloads)

  def wire_decode_sum_reencode(self, payloads, n, key, scale=1.0):
    # One kernel on the FFI platforms (CPU, CUDA); the pure-JAX reference composes the three steps.
    # Same bytes either way (tests/test_codec.py).
    seed = self._seed(key)
    if n == 0:
      return jnp.zeros((0,), jnp.uint8)
    kw = dict(rounding=self.rounding, **self._fmt)

    def reference(p, s):
      reduced = _reference.decode_sum(p, n, **self._fmt)
      if scale != 1.0:
        reduced = reduced * jnp.float32(scale)
      return _reference.encode(reduced, s, **kw)

    return self._select(
        lambda p, s: _ffi.qsgd_decode_sum_reencode(p, s, n, scale, **kw), reference, payloads, seed)


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
  def padded_size(self, n: int, devices: int) -> int:
    return n

  def allreduce_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    out = lax.pmean(x, axis_name) if op == "mean" else lax.psum(x, axis_name)
    return out, jnp.zeros_like(x)

  def reduce_scatter_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    block = lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
    if op == "mean":
      block = block / axis_size(axis_name)
    return block, jnp.zeros_like(x)

  def all_gather_flat(self, x, axis_name, key):
    return lax.all_gather(x, axis_name, to="invarying")

  def traffic(self, n, devices, collective="allreduce"):
    n, d, collective = _check_traffic(n, devices, collective)
    if collective == "allreduce":
      return (("all-reduce", _ring(d, 4 * n)),)
    if collective == "reduce_scatter":
      return (("reduce-scatter", (d - 1) * 4 * (-(-n // d))),)
    return (("all-gather", (d - 1) * 4 * n),)


class _SummedFields(_Bucketed):
  """What the codecs whose payloads XLA's own all-reduce sums share (Summable, Wire16): one
  ``lax.pmax`` of a per-bucket statistic (the scales every device quantises with), one ``lax.psum``
  (or ``psum_scatter``) of uint32 words whose fields have room for the sum of D payloads, one
  decode of the sum. A subclass states its fields through four hooks: ``_field_size(n)`` (the
  length x is padded to), ``_stat(x)`` (float32[_field_size(n)] -> per-bucket statistic),
  ``_fields(x, shared, key, devices)`` (-> uint32 words), ``_unfields(words, shared, devices,
  count, n, scale)`` (the sum of ``count`` devices' words -> float32[n] times ``scale``), and
  ``_words(n, devices)`` (words of n values); ``_stat_bytes`` is the size of one statistic."""

  _stat_bytes = 4

  def _summed(self, stat, fields, unfields, axis_name, key, op):
    """The reduction, once: one pmax of ``stat()``, ``fields(shared, key, D)`` words, one psum,
    ``unfields(words, shared, D, count, scale)`` of the sum (the result) and of this device's own
    words (what it contributed, for the residual)."""
    d = self.check_devices(axis_size(axis_name))
    shared = lax.pmax(stat(), axis_name)  # the same on every device
    words = fields(shared, device_key(key, axis_name, 0), d)
    total = lax.psum(words, axis_name)
    out = unfields(total, shared, d, d, 1.0 / d if op == "mean" else 1.0)
    return out, unfields(words, shared, d, 1, 1.0)

  def allreduce_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    """One pmax of the statistics, one psum of the words, one decode; the residual is x minus
    this device's own decode."""
    n = x.shape[0]
    xp = _pad_to(x, self._field_size(n))
    out, own = self._summed(
        lambda: self._stat(xp), lambda sh, k, d: self._fields(xp, sh, k, d),
        lambda w, sh, d, c, scale: self._unfields(w, sh, d, c, n, scale), axis_name, key, op)
    return out, x - own

  def allreduce_leaves(self, parts, axis_name, key, op="mean", exchange="auto"):
    """:meth:`allreduce_flat` of the leaves' packed buffer, through the ``_*_leaves`` hooks (which
    a codec may implement on the leaves in place)."""
    sizes = [p.shape[0] for p in parts]
    outs, own = self._summed(
        lambda: self._stat_leaves(parts), lambda sh, k, d: self._fields_leaves(parts, sh, k, d),
        lambda w, sh, d, c, scale: self._unfields_leaves(w, sh, d, c, sizes, scale),
        axis_name, key, op)
    return outs, [p - o for p, o in zip(parts, own)]

  # The hooks on leaves: by default the packed buffer's (concat_leaves) through the flat hooks.
  def _packed(self, parts):
    flat = concat_leaves(parts, self)
    return _pad_to(flat, self._field_size(flat.shape[0]))

  def _stat_leaves(self, parts):
    return self._stat(self._packed(parts))

  def _fields_leaves(self, parts, shared, key, devices):
    return self._fields(self._packed(parts), shared, key, devices)

  def _unfields_leaves(self, words, shared, devices, count, sizes, scale=1.0):
    n = wire.leaves_span(sizes, self.pad_multiple)
    flat = self._unfields(words, shared, devices, count, n, scale)
    return split_leaves(flat, sizes, self.pad_multiple)

  def reduce_scatter_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    """Block i's words summed onto device i: one psum_scatter of [D, W] words (whole rows), the
    statistics of every block shared by one pmax."""
    d = self.check_devices(axis_size(axis_name))
    rows = x.reshape(d, -1)
    m = rows.shape[1]
    rows_p = jax.vmap(lambda r: _pad_to(r, self._field_size(m)))(rows)
    shared = lax.pmax(jax.vmap(self._stat)(rows_p), axis_name)
    row_key = device_key(key, axis_name, 0)
    keys = None if row_key is None else jax.random.split(row_key, d)
    words = jax.vmap(lambda r, sh, k: self._fields(r, sh, k, d),
                     in_axes=(0, 0, None if keys is None else 0))(rows_p, shared, keys)
    mine = lax.psum_scatter(words, axis_name, scatter_dimension=0, tiled=True)[0]
    own = lax.dynamic_index_in_dim(shared, lax.axis_index(axis_name), keepdims=False)
    block = self._unfields(mine, own, d, d, m, 1.0 / d if op == "mean" else 1.0)
    mine_decoded = jax.vmap(lambda w, sh: self._unfields(w, sh, d, 1, m))(words, shared)
    return block, (rows - mine_decoded).reshape(-1)

  def traffic(self, n, devices, collective="allreduce"):
    """allreduce: ring all-reduces of the uint32 words (fields for D summed payloads) and of one
    statistic per bucket (the pmax, ``_stat_bytes`` each); reduce_scatter: a reduce-scatter of D
    blocks' words and the pmax of every block's statistics; all_gather: the standalone payloads."""
    n, d, collective = _check_traffic(n, devices, collective)
    if collective == "all_gather":
      return super().traffic(n, d, collective)
    d = self.check_devices(d)
    stat = self._stat_bytes
    if collective == "allreduce":
      return (("all-reduce", _ring(d, 4 * self._words(n, d))),
              ("all-reduce", _ring(d, stat * wire.num_buckets(n, self.bucket_size))))
    m = -(-n // d)
    return (("reduce-scatter", (d - 1) * 4 * self._words(m, d)),
            ("all-reduce", _ring(d, stat * d * wire.num_buckets(m, self.bucket_size))))


@dataclasses.dataclass(frozen=True)
class Summable(_SummedFields):
  """A summable (homomorphic) codec: payloads that XLA's own all-reduce sums (IntSGD / THC style).

  Every device quantises each bucket of ``bucket_size`` values with the same scale, the bucket's
  largest ``|x|`` over all devices (one small ``lax.pmax`` of :meth:`bucket_scale`), to signed
  levels ``q`` in ``[-L, L]``, ``L = 2**(bits-1) - 1`` (stochastic rounding: ``q = floor(x/s + u)``;
  or nearest). The offset codes ``q + L`` are packed as fields of uint32 words, wide enough for
  the sum over ``D`` devices (``bit_length(2 L D)`` bits); the words go through one ``lax.psum``
  (XLA's all-reduce, at link rate on every backend) and the sum is decoded once. Each value is
  quantised once (the scatter-reduce-allgather of :class:`QSGD` quantises twice), and every device
  ends with the same result. Wire bits per element: ``32 / (32 // bit_length(2 L D)) +
  16 / bucket_size`` (4 bits, D = 2: 5.46; docs/wire-format.md "Summable" has the table).

  In a reduction the shared scale of a bucket is its largest ``|x|`` over the devices rounded up
  to a bfloat16 (8 significant bits; the pmax sends 2 bytes per bucket). With ``step = s * 2**k``
  the bucket's step (``s`` that scale, brought to [1, 2) by the power of two ``2**k``, over ``L``,
  rounded up to 16 significant bits: ``step <= max|x| / L * (1 + 2**-7) * (1 + 2**-15)``; the
  standalone payload of :meth:`encode` keeps the exact maximum, ``(1 + 2**-15)``):

  * Error bound, per element and device: ``|decoded - x| <= step`` (stochastic; unbiased,
    ``E[decoded] = x``, but for values that clamp to the top level, within ``2**-15`` of the
    bucket's largest ``|x|``) or ``<= step / 2`` (nearest), up to float32 rounding (``2**-22`` of
    the shared max); so the decoded sum of D devices is within ``D * step`` (the mean within
    ``step``), and with independent stochastic roundings its standard deviation is at most
    ``sqrt(D) * step / 2`` (the mean's ``step / (2 sqrt(D))``).
  * Valid range: any finite float32, mixed freely (scaling by powers of two as QSGD, docs
    /wire-format.md); subnormals read as 0 (FTZ/DAZ, as XLA CPU), an all-zero bucket decodes to
    exact zeros; a decoded value beyond the largest float32 (a sum of D values near 3.4e38)
    saturates to +-3.4e38. A bucket holding NaN or +-Inf on any device decodes to NaN throughout,
    on every device.
  * D is limited by the word: ``2 L D < 2**32`` (``wire.summable_max_devices(bits)``; 4 bits:
    306 783 378 devices), ValueError beyond.

  The C++ CPU kernel (each ISA) and the pure-JAX reference give the same words and decoded values
  for the same key. There is no CUDA kernel: on GPUs (and any platform without a compiled kernel)
  the pure-JAX reference runs. On CPU, a pytree's leaves are encoded and decoded in place of their
  packed buffer (:meth:`~Codec.allreduce_leaves`; the same words).

  Args:
    bits: 2..8 bits per level (``2 L + 1`` levels, ``L = 2**(bits-1) - 1``; 2 bits: ternary).
    bucket_size: values sharing one scale; a positive multiple of 8.
    rounding: ``"stochastic"`` (unbiased; needs a key) or ``"nearest"`` (error feedback).
    impl: ``"auto"`` (the C++ kernel on CPU, the pure-JAX reference elsewhere), ``"ffi"`` or
      ``"jax"``.
  """

  bits: int = 4
  bucket_size: int = 128
  rounding: str = "stochastic"
  impl: str = "auto"

  def __post_init__(self):
    check_int_in("bits", self.bits, 2, 8, " for Summable")
    self._check_bucket_size()
    self._check_rounding_and_impl("CPU kernels")

  @property
  def name(self) -> str:
    rounding = "" if self.rounding == "stochastic" else f" {self.rounding}"
    return f"Summable {self.bits}b/{self.bucket_size}{rounding}"

  def check_devices(self, devices: int) -> int:
    """``devices`` as an int; ValueError unless 1 <= devices and the sum of that many payloads
    fits the fields of a uint32 word (``2 L D < 2**32``)."""
    return check_int_in("devices", devices, 1, wire.summable_max_devices(self.bits),
                        f" for {self.name} (the sum over the devices of a field must fit a uint32 "
                        f"word: 2 L D < 2**32)")

  def payload_size(self, n: int) -> int:
    """Bytes of the standalone payload of :meth:`encode`: one int32 scale statistic per bucket,
    then the uint32 words of one device (D = 1). In a reduction over D devices the fields are
    wider (:meth:`traffic`)."""
    return wire.summable_payload_bytes(check_int("n", n, 0), self.bits, self.bucket_size, 1)

  def wire_bits(self, devices: int = 1) -> float:
    """Bits per element for whole words and buckets when ``devices`` payloads are summed."""
    return wire.summable_wire_bits(self.bits, self.bucket_size, self.check_devices(devices))

  def _kernel_platforms(self) -> tuple[str, ...]:
    return ("cpu",) if _ffi.has_cpu_kernels() else ()  # no CUDA kernel: GPUs run the reference

  def comm_buffer_size(self, devices: int, collective: str = "allreduce") -> int:
    """In an allreduce ``4 * DEFAULT_COMM_BUCKET`` (2**26 elements): a buffer costs a ``pmax`` and
    a ``psum`` of its own, and on CPU the kernels read and write the leaves in place (no packed
    copy to bound), so a model of up to 67M values travels in one buffer. On 2 nodes at 1 Gbit/s
    ResNet-50 in one buffer took 168.6 ms against 176.9 ms in two (docs/benchmarks-log.md). Where
    the reference runs (GPUs) or the axis is Hierarchical, the packed copy of a buffer takes up to
    256 MiB. The rows of sharded state keep :data:`DEFAULT_COMM_BUCKET`."""
    return 4 * DEFAULT_COMM_BUCKET if collective == "allreduce" else DEFAULT_COMM_BUCKET

  # -- the reduction protocol: one pmax of the scales, one psum of the words -------------------------
  def padded_size(self, n: int, devices: int) -> int:
    return -(-n // self.bucket_size) * self.bucket_size  # whole buckets; no chunks per device

  # -- the summed fields (see _SummedFields) ----------------------------------------------------------
  def _field_size(self, n):
    return n  # the kernels take a partial last bucket

  # The statistic a reduction shares: the largest |x| of each bucket as bfloat16 bits rounded up
  # (a uint16; finite maxima stay finite), so the pmax sends 2 bytes per bucket; the kernels read
  # it back as the int32 bits of that bfloat16.
  _stat_bytes = 2

  @staticmethod
  def _narrow(scale_bits: jax.Array) -> jax.Array:
    """int32 bits of the largest |x| -> uint16: the bits of the smallest bfloat16 >= it (at most
    the largest finite bfloat16 for a finite maximum; NaN and Inf keep their class)."""
    m = lax.bitcast_convert_type(scale_bits, jnp.uint32)
    up = (m >> 16) + jnp.where((m & 0xFFFF) != 0, jnp.uint32(1), jnp.uint32(0))
    finite = m < jnp.uint32(0x7F800000)
    return jnp.where(finite, jnp.minimum(up, jnp.uint32(0x7F7F)), m >> 16).astype(jnp.uint16)

  @staticmethod
  def _widen(shared: jax.Array) -> jax.Array:
    """The uint16 statistic -> the int32 scale bits the kernels take."""
    return lax.shift_left(shared.astype(jnp.int32), jnp.int32(16))

  def _stat(self, x):
    return self._narrow(self.bucket_scale(x))

  def _fields(self, x, shared, key, devices):
    return self.wire_encode_summable(x, self._widen(shared), key, devices)

  def _unfields(self, words, shared, devices, count, n, scale=1.0):
    return self.wire_decode_summed(words, self._widen(shared), devices, count, n, scale)

  def _words(self, n, devices):
    return wire.summable_words(n, self.bits, devices)

  # On CPU the kernels read and write the leaves in place of the packed buffer (the same words and
  # values); elsewhere the reference runs on the packed buffer.
  def _stat_leaves(self, parts):
    b = self.bucket_size
    return self._narrow(self._select(
        lambda *ps: _ffi.summable_scale_leaves(ps, bucket_size=b),
        lambda *ps: _reference.summable_bucket_scale(self._packed(ps), b), *parts))

  def _fields_leaves(self, parts, shared, key, devices):
    kw = dict(bits=self.bits, bucket_size=self.bucket_size, devices=devices, rounding=self.rounding)
    return self._select(
        lambda m, s, *ps: _ffi.summable_encode_leaves(ps, m, s, **kw),
        lambda m, s, *ps: _reference.summable_encode(self._packed(ps), m, s, **kw),
        self._widen(shared), self._seed(key), *parts)

  def _unfields_leaves(self, words, shared, devices, count, sizes, scale=1.0):
    kw = dict(bits=self.bits, bucket_size=self.bucket_size, devices=devices, count=count,
              scale=float(scale))
    n = wire.leaves_span(sizes, self.bucket_size)
    return self._select(
        lambda w, m: _ffi.summable_decode_leaves(w, m, sizes, **kw),
        lambda w, m: split_leaves(_reference.summable_decode(w, m, n, **kw), sizes,
                                  self.bucket_size),
        words, self._widen(shared))

  # -- summable wire API ---------------------------------------------------------------------------
  def bucket_scale(self, x: jax.Array) -> jax.Array:
    if x.shape[0] == 0:
      return jnp.zeros((0,), jnp.int32)
    return self._select(lambda a: _ffi.summable_scale(a, bucket_size=self.bucket_size),
                        lambda a: _reference.summable_bucket_scale(a, self.bucket_size), x)

  def wire_encode_summable(self, x, shared, key, devices):
    devices = self.check_devices(devices)
    seed = self._seed(key)
    if x.shape[0] == 0:
      return jnp.zeros((0,), jnp.uint32)
    kw = dict(bits=self.bits, bucket_size=self.bucket_size, devices=devices, rounding=self.rounding)
    return self._select(lambda a, m, s: _ffi.summable_encode(a, m, s, **kw),
                        lambda a, m, s: _reference.summable_encode(a, m, s, **kw), x, shared, seed)

  def wire_decode_summed(self, words, shared, devices, count, n, scale=1.0):
    devices = self.check_devices(devices)
    count = check_int_in("count", count, 1, devices, hi_text=f"devices={devices}")
    if n == 0:
      return jnp.zeros((0,), jnp.float32)
    kw = dict(bits=self.bits, bucket_size=self.bucket_size, devices=devices, count=count,
              scale=float(scale))
    return self._select(lambda w, m: _ffi.summable_decode(w, m, n, **kw),
                        lambda w, m: _reference.summable_decode(w, m, n, **kw), words, shared)

  # -- the standalone payload (array API): [int32 scale statistic x nb][uint32 words, D = 1] -------
  def wire_encode(self, x, key):
    shared = self.bucket_scale(x)
    words = self.wire_encode_summable(x, shared, key, 1)
    return jnp.concatenate([self._to_bytes(shared), self._to_bytes(words)])

  def wire_decode_sum(self, payloads, n):
    if n == 0:
      return jnp.zeros((0,), jnp.float32)
    nb = wire.num_buckets(n, self.bucket_size)
    out = None
    for j in range(payloads.shape[0]):  # in order
      p = payloads[j]
      shared = lax.bitcast_convert_type(p[:4 * nb].reshape(nb, 4), jnp.int32)
      words = lax.bitcast_convert_type(p[4 * nb:].reshape(-1, 4), jnp.uint32)
      v = self.wire_decode_summed(words, shared, 1, 1, n)
      out = v if out is None else out + v
    return out


#: Wire16: the radix of ``k`` fields in one uint32 word, the largest ``R`` with ``R**k <= 2**32``.
_RADIX = {2: 1 << 16, 3: 1625}
#: Wire16 packs three fields per word only where that keeps at least this many levels per side
#: (D <= 2): on normal values its error is then within the bf16 cast's (docs/wire-format.md).
_MIN_LEVELS_3 = 400


def _levels(fields: int, devices: int) -> int:
  """Wire16's largest level with ``fields`` per word summed over ``devices``: ``(R - 1) // 2D``."""
  return (_RADIX[fields] - 1) // (2 * devices)


@dataclasses.dataclass(frozen=True)
class Wire16(_SummedFields):
  """bfloat16-class accuracy in fields that the transport sums at its integer rate: ``sync(bits=16)``.

  On CPU (XLA's collectives over gloo) a bfloat16 all-reduce is carried out in float32, so the
  bf16 cast halves nothing there. This codec sends fixed-point fields instead, ``k`` per uint32
  word, which XLA's ``psum`` sums as integers: every bucket of ``bucket_size`` values shares one
  scale, its largest ``|x|`` over all devices (one float32 ``lax.pmax`` per bucket); over D devices
  a value becomes a level ``q`` in ``[-L, L]``, ``L = (R - 1) // (2 D)`` with ``R`` the radix of
  ``k`` fields (``R**k <= 2**32``: 65536 for two, 1625 for three), sent as the field ``q + L``;
  one ``psum`` of the words and one decode give every device the same sum. Each value is quantised
  once.

  * ``fields=None`` (the default) packs three fields per word where they keep at least 400 levels
    per side (D <= 2; ``L = 406`` at D = 2): ``32 / 3 + 32 / bucket_size`` bits per value, 10.8 at
    the default bucket of 192. Elsewhere it packs two, ``L = (2**16 - 1) // (2 D)`` (10922 at
    D = 3, 4095 at D = 8, 511 at D = 64): ``16 + 32 / bucket_size`` bits. Three fields need a
    ``bucket_size`` divisible by 3; with any other bucket the codec packs two at every D.
    ``fields=2`` or ``3`` fixes the packing; :meth:`resolve` names the one a reduction uses.
  * Error per value and device: ``<= step / 2`` (nearest, the default: like the bf16 cast's
    round-to-nearest, biased but small) or ``< step`` (stochastic: unbiased), ``step = max|x| / L``
    of the bucket (float32 arithmetic aside). Against bf16's ``2**-9`` of each value: on normal
    values the mean's relative error at D = 2 is 2.3e-3 with three fields (the bf16 cast's
    all-reduce: 2.4e-3) and 6e-5 with two; on heavy-tailed values (Student t with 3 degrees of
    freedom) three fields reach 6.4e-3 against the cast's 2.4e-3: pass ``fields=2`` there.
  * Valid range: any finite float32; an all-zero bucket decodes to exact zeros; a bucket holding
    NaN or +-Inf on any device decodes to NaN throughout, on every device. D <= 32767 (two
    fields; 812 with ``fields=3``).
  * On other platforms (GPUs, whose NCCL sums bf16 natively) the same codec sends the bf16 cast:
    ``Cast(bfloat16)``'s scatter-reduce-allgather. :meth:`traffic` reports the bytes of the
    platform ``jax.default_backend()`` names.

  Args:
    bucket_size: values sharing one scale; a positive multiple of 8 (and of 3 for three fields).
    rounding: ``"nearest"`` (default) or ``"stochastic"`` (unbiased; needs a key).
    fields: fields per uint32 word: ``None`` (three where they keep 400 levels, else two), 2 or 3.
  """

  bucket_size: int = 192
  rounding: str = "nearest"
  fields: int | None = None

  wire_dtype = np.uint32

  def __post_init__(self):
    self._check_bucket_size()
    if self.rounding not in wire.ROUNDINGS:
      raise ValueError(f"rounding must be one of {wire.ROUNDINGS}, got {self.rounding!r}")
    object.__setattr__(self, "bucket_size", int(self.bucket_size))
    if self.fields is not None:
      check_int_in("fields", self.fields, 2, 3, " (fields per uint32 word) or None")
      object.__setattr__(self, "fields", int(self.fields))
      if self.bucket_size % self.fields:
        raise ValueError(f"bucket_size must be a multiple of fields={self.fields}, "
                         f"got {self.bucket_size}")

  @property
  def name(self) -> str:
    rounding = "" if self.rounding == "nearest" else f" {self.rounding}"
    fields = "" if self.fields is None else f" {self.fields}x"
    return f"Wire16{fields} /{self.bucket_size}{rounding}"

  def _kernel_platforms(self) -> tuple[str, ...]:
    return ()  # pure JAX: XLA fuses the few elementwise passes

  def fields_for(self, devices: int) -> int:
    """Fields per word when ``devices`` payloads are summed (the rule of ``fields=None``)."""
    if self.fields is not None:
      return self.fields
    if self.bucket_size % 3 == 0 and _levels(3, devices) >= _MIN_LEVELS_3:
      return 3
    return 2

  def levels(self, devices: int) -> int:
    """L: the largest level when ``devices`` fields are summed (their sum fits the radix)."""
    return _levels(self.fields_for(devices), devices)

  def resolve(self, devices, collective="allreduce", transport=None):
    super().resolve(devices, collective, transport)  # the checks
    d = self.check_devices(devices)
    return self if self.fields is not None else dataclasses.replace(self, fields=self.fields_for(d))

  def check_devices(self, devices: int) -> int:
    r = _RADIX[self.fields or 2]  # fields=None packs two where three would not fit
    return check_int_in("devices", devices, 1, (r - 1) // 2,
                        f" for {self.name} (at least one level per side: 2 D < {r})")

  def _buckets(self, n: int) -> int:
    return -(-n // self.bucket_size)

  def payload_size(self, n: int) -> int:
    """Standalone payload (D = 1): a float32 scale per bucket, then the words of whole buckets."""
    nb = self._buckets(check_int("n", n, 0))
    return 4 * nb + 4 * nb * self.bucket_size // self.fields_for(1)

  def wire_bits(self, devices: int = 1) -> float:
    d = self.check_devices(devices)
    if not _fixed16_here():
      return 16.0
    return 32.0 / self.fields_for(d) + 32.0 / self.bucket_size

  # -- the fixed-point fields ----------------------------------------------------------------------
  def bucket_max(self, x: jax.Array) -> jax.Array:
    """float32[k * bucket_size] -> float32[k]: each bucket's largest |x|; +inf for a bucket
    holding NaN or +-inf (an inf reaches every device through the pmax); subnormals read as 0
    (FTZ/DAZ, as XLA CPU). NaN is made +inf before the max, so no max can drop it (XLA CPU's
    vectorised float max does); one fused pass over x."""
    xr = x.reshape(-1, self.bucket_size)
    return jnp.max(jnp.where(jnp.isnan(xr), jnp.float32(jnp.inf), jnp.abs(xr)), axis=1)

  def encode_fields(self, x: jax.Array, shared: jax.Array, key: jax.Array | None,
                    devices: int) -> jax.Array:
    """float32[m * bucket_size] -> uint32[m * bucket_size / k]: fields ``q + L`` for ``devices``,
    ``k = fields_for(devices)``; word i of a bucket holds value ``i + j bucket_size / k`` as digit
    j (``R**j`` times its field: for two fields, the low and the high 16 bits)."""
    k, lv = self.fields_for(devices), self.levels(devices)
    inv = jnp.where(shared > 0, lv / shared, 0.0).astype(jnp.float32)  # 0 for zero / inf buckets
    parts = x.reshape(-1, k, self.bucket_size // k)
    if self.rounding == "stochastic":
      if key is None:
        raise ValueError("key is required for rounding='stochastic' (pass a jax.random key)")
      u = jax.random.uniform(key, parts.shape, jnp.float32)

    def field(h):  # one part of every bucket; a fused pass each (XLA CPU vectorises them apart)
      v = parts[:, h] * inv[:, None]
      q = jnp.floor(v + u[:, h]) if self.rounding == "stochastic" else jnp.round(v)
      # NaN (only in a bucket whose scale is inf, decoded as NaN) -> the clip's lower end.
      return (jnp.clip(q, -lv, lv) + lv).astype(jnp.uint32)

    words = field(k - 1)
    for h in range(k - 2, -1, -1):  # Horner: ((f_{k-1} R) + ... ) R + f_0
      words = words * jnp.uint32(_RADIX[k]) + field(h)
    return words.reshape(-1)

  def decode_fields(self, words: jax.Array, shared: jax.Array, devices: int, count: int,
                    scale: float = 1.0) -> jax.Array:
    """The inverse for a sum of ``count`` devices' words: float32[k * words] times ``scale``."""
    k, lv = self.fields_for(devices), self.levels(devices)
    r = jnp.uint32(_RADIX[k])
    w = words.reshape(-1, 1, self.bucket_size // k)
    digits = []
    for _ in range(k - 1):
      digits.append(w % r)
      w = w // r
    fields = jnp.concatenate(digits + [w], axis=1)
    q = fields.astype(jnp.int32) - jnp.int32(count * lv)
    step = (shared / jnp.float32(lv)) * jnp.float32(scale)  # NaN / inf for NaN / inf buckets
    out = q.astype(jnp.float32) * step[:, None, None]
    bad = ~jnp.isfinite(shared)
    return jnp.where(bad[:, None, None], jnp.float32(jnp.nan), out).reshape(-1)

  # -- the standalone payload: [float32 scale x nb][uint32 words] as uint32 ------------------------
  def wire_encode(self, x, key):
    n = x.shape[0]
    x = _pad_to(x.astype(jnp.float32), self._buckets(n) * self.bucket_size)
    shared = self.bucket_max(x)
    words = self.encode_fields(x, shared, key, 1)
    return jnp.concatenate([lax.bitcast_convert_type(shared, jnp.uint32), words])

  def wire_decode_sum(self, wires, n):
    nb = self._buckets(n)
    vals = jnp.stack([self.decode_fields(wires[j, nb:],
                                         lax.bitcast_convert_type(wires[j, :nb], jnp.float32),
                                         1, 1)[:n] for j in range(wires.shape[0])])
    return _sum_in_order(vals)

  # -- the reduction protocol: one pmax of the scales, one psum of the words ------------------------
  def padded_size(self, n: int, devices: int) -> int:
    if not _fixed16_here():
      return _BF16.padded_size(n, devices)
    return self._buckets(n) * self.bucket_size

  def allreduce_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    if not _fixed16_here():
      return _BF16.allreduce_flat(x, axis_name, key, op, exchange)
    return super().allreduce_flat(x, axis_name, key, op, exchange)

  def allreduce_leaves(self, parts, axis_name, key, op="mean", exchange="auto"):
    if not _fixed16_here():
      return _BF16.allreduce_leaves(parts, axis_name, key, op, exchange)
    return super().allreduce_leaves(parts, axis_name, key, op, exchange)

  def reduce_scatter_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    if not _fixed16_here():
      return _BF16.reduce_scatter_flat(x, axis_name, key, op, exchange)
    return super().reduce_scatter_flat(x, axis_name, key, op, exchange)

  def all_gather_flat(self, x, axis_name, key):
    if not _fixed16_here():
      return _BF16.all_gather_flat(x, axis_name, key)
    return super().all_gather_flat(x, axis_name, key)

  def traffic(self, n, devices, collective="allreduce"):
    """CPU: the summed fields' (``32 / fields_for(D)`` bits per value and a float32 scale per
    bucket; see ``_SummedFields.traffic``). Elsewhere: ``Cast(bfloat16)``'s."""
    n, d, collective = _check_traffic(n, devices, collective)
    if not _fixed16_here():
      return _BF16.traffic(n, d, collective)
    return super().traffic(n, d, collective)

  # -- the summed fields (see _SummedFields) ----------------------------------------------------------
  def _field_size(self, n):
    return self._buckets(n) * self.bucket_size  # whole buckets

  def _stat(self, x):
    return self.bucket_max(x)

  def _fields(self, x, shared, key, devices):
    return self.encode_fields(x, shared, key, devices)

  def _unfields(self, words, shared, devices, count, n, scale=1.0):
    return self.decode_fields(words, shared, devices, count, scale)[:n]

  def _words(self, n, devices):
    return self._buckets(n) * self.bucket_size // self.fields_for(devices)


_BF16 = Cast(jnp.bfloat16)


def _fixed16_here() -> bool:
  """Wire16 sends fixed-point fields where XLA's all-reduce would widen bf16 (CPU: gloo)."""
  return jax.default_backend() == "cpu"


#: The bucket of the ``bits`` shorthand: 64 values at 1 and 2 bits, 128 from 3 bits. At 2 bits the
#: bucket's range sets most of the error: on normal values at D = 2 a bucket of 64 brings the
#: relative error of the mean from 1.08 to 0.96 for 3.0 wire bits per value instead of 2.5.
def default_bucket(bits: int) -> int:
  """The bucket size ``codec_for_bits(bits)`` and ``sync(bits=...)`` use when none is given."""
  return 64 if bits <= 2 else 128


@dataclasses.dataclass(frozen=True)
class Auto(_Bucketed):
  """The fastest ``bits``-bit codec for the transport and the number of devices: ``sync(bits=b)``.

  The candidates are :class:`QSGD` (a scatter-reduce-allgather: an all-to-all and an all-gather
  of ``b``-bit payloads) and, for 3..8 bits, :class:`Summable` (one all-reduce of fields that widen
  with log2(D)), both with this ``bucket_size``, ``rounding`` and ``impl`` (``scheme`` is QSGD's).
  Summable's ``2**b - 1`` levels span ``[-max, max]`` and QSGD's ``2**b`` span ``[min, max]``: from
  3 bits their steps are within 1.2x of each other, and Summable quantises once where QSGD
  quantises twice; at 2 bits Summable is ternary (a 1.5x step) and is not a candidate.

  For each reduction, at trace time, :meth:`resolve` picks the candidate whose
  :meth:`~Codec.traffic` takes the least time on the transport: each collective's bytes times the
  transport's factor for it (:class:`jax_qcomm.transport.Transport`); QSGD on a tie. The transport
  is :func:`jax_qcomm.transport.current`. Between two CPU processes over gloo the all-reduce runs
  at the link rate and the exchange and all-gather at about half of it, so Summable's one
  all-reduce wins the allreduce at D = 2; from three processes on, and wherever every collective
  runs at the link rate (GPUs, one process), QSGD's fewer bytes win at every D (measured on the
  simulated cluster: docs/benchmarks.md). ``qcomm.describe`` names the codec picked; pass
  ``codec=qcomm.QSGD(...)`` or ``codec=qcomm.Summable(...)`` to force one.

  The standalone array API (:meth:`encode` and the rest, one device) is QSGD's.

  Args:
    bits: 1..8 (1 and 2 bits: QSGD only).
    bucket_size: values sharing scales; a positive multiple of 8; default :func:`default_bucket`
      (64 at 1 and 2 bits, 128 from 3).
    scheme: QSGD's ``"maxmin"`` or ``"norm"``.
    rounding: ``"stochastic"`` (needs a key) or ``"nearest"``.
    impl: ``"auto"``, ``"ffi"`` or ``"jax"``, as the candidates take it.
  """

  bits: int = 4
  bucket_size: int | None = None
  scheme: str = "maxmin"
  rounding: str = "stochastic"
  impl: str = "auto"

  def __post_init__(self):
    check_int_in("bits", self.bits, 1, 8, " for Auto")
    if self.bucket_size is None:
      object.__setattr__(self, "bucket_size", default_bucket(int(self.bits)))
    candidates = [QSGD(self.bits, self.bucket_size, self.scheme, self.rounding, self.impl)]
    if self.bits >= 3:  # 2-bit Summable is ternary: 3 levels against QSGD's 4, a 1.5x step
      candidates.append(Summable(self.bits, self.bucket_size, self.rounding, self.impl))
    object.__setattr__(self, "bits", int(self.bits))
    object.__setattr__(self, "bucket_size", int(self.bucket_size))
    object.__setattr__(self, "_candidates", tuple(candidates))

  @property
  def candidates(self) -> tuple[Codec, ...]:
    """The codecs :meth:`resolve` chooses from, QSGD first."""
    return self._candidates

  def resolve(self, devices: int, collective: str = "allreduce",
              transport: _transport.Transport | None = None) -> Codec:
    super().resolve(devices, collective, transport)  # the checks
    d = int(devices)
    if transport is None:
      transport = _transport.current(d)
    n = 1 << 20  # a reference buffer: large enough that padding and scales weigh as in a model
    best, best_t = None, math.inf
    for codec in self._candidates:
      try:
        t = transport.weighted_bytes(codec.traffic(n, d, collective))
      except ValueError:  # D beyond what the codec's fields hold
        continue
      if t < best_t:
        best, best_t = codec, t
    return best

  @property
  def name(self) -> str:
    rounding = "" if self.rounding == "stochastic" else f" {self.rounding}"
    return f"auto {self.bits}b/{self.bucket_size}{rounding}"

  # One device and the array API: QSGD.
  def pad_fill(self, x):
    return self._candidates[0].pad_fill(x)

  def payload_size(self, n):
    return self._candidates[0].payload_size(n)

  def wire_bits(self, devices=1):
    return self.resolve(devices).wire_bits(devices)

  def wire_encode(self, x, key):
    return self._candidates[0].wire_encode(x, key)

  def wire_decode_sum(self, wires, n):
    return self._candidates[0].wire_decode_sum(wires, n)

  def wire_decode_sum_reencode(self, wires, n, key, scale=1.0):
    return self._candidates[0].wire_decode_sum_reencode(wires, n, key, scale)

  # The reduction protocol: the candidate resolved for the axis.
  def padded_size(self, n, devices):
    return self.resolve(devices).padded_size(n, devices)

  def comm_buffer_size(self, devices, collective="allreduce"):
    return self.resolve(devices, collective).comm_buffer_size(devices, collective)

  def allreduce_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    return self.resolve(axis_size(axis_name)).allreduce_flat(x, axis_name, key, op, exchange)

  def allreduce_leaves(self, parts, axis_name, key, op="mean", exchange="auto"):
    return self.resolve(axis_size(axis_name)).allreduce_leaves(parts, axis_name, key, op, exchange)

  def reduce_scatter_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    codec = self.resolve(axis_size(axis_name), "reduce_scatter")
    return codec.reduce_scatter_flat(x, axis_name, key, op, exchange)

  def all_gather_flat(self, x, axis_name, key):
    return self.resolve(axis_size(axis_name), "all_gather").all_gather_flat(x, axis_name, key)

  def traffic(self, n, devices, collective="allreduce"):
    n, d, collective = _check_traffic(n, devices, collective)
    return self.resolve(d, collective).traffic(n, d, collective)


def codec_for_bits(bits: int, bucket_size: int | None = None, scheme: str = "maxmin",
                   rounding: str = "stochastic") -> Codec:
  """The codec a ``bits`` shorthand names: 32 -> NoCompression, 16 -> Wire16 (fixed-point fields
  summed as integers on CPU, the bf16 cast on GPUs), 1..8 -> ``Auto(bits, bucket_size, scheme,
  rounding)``: QSGD or Summable, whichever the transport and the number of devices make faster
  (``bucket_size`` default :func:`default_bucket`: 64 at 1 and 2 bits, 128 from 3;
  ``bucket_size``, ``scheme`` and ``rounding`` apply to 1..8 bits; they are checked even where
  they do not apply). Any other codec, e.g. ``QSGD(4)`` to force the scatter-reduce-allgather, is
  passed as an object: ``sync(inner, codec=...)``."""
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not (
      bits in (16, 32) or 1 <= bits <= 8):
    raise ValueError(f"bits must be 32 (exact), 16 (16 bits on the wire) or 1..8 (quantised), "
                     f"got {bits!r}")
  bits = int(bits)
  if bits in (16, 32):
    QSGD(bits=4, bucket_size=128 if bucket_size is None else bucket_size, scheme=scheme,
         rounding=rounding)
  if bits == 32:
    return NoCompression()
  if bits == 16:
    return Wire16()
  return Auto(bits=bits, bucket_size=bucket_size, scheme=scheme, rounding=rounding)
