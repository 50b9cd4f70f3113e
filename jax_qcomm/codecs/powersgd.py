""":class:`PowerSGD`: low-rank compression of every matrix-shaped leaf (Vogels et al., 2019), one
step of power iteration per reduction, warm-started from the previous one."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm._checks import check_int, check_real
from jax_qcomm.transport.axes import AxisName, axis_size
from jax_qcomm.codecs.base import (Codec, _check_traffic, _ring, abs_max, bounded_mark,
                                   nonfinite_mark, split_leaves)

_HIGHEST = lax.Precision.HIGHEST


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
  """``(rest, out)``: a leaf of ``shape`` as the matrix its row-major values fill, the last axis (a
  flax kernel's output features, ``(..., out)``) against all the others; that is Mᵀ for the
  class's ``M`` of shape ``(out, rest)``. ``(n, 1)`` for 0-d and 1-D leaves."""
  shape = tuple(int(d) for d in shape)
  if len(shape) < 2:
    return (math.prod(shape), 1)
  return (math.prod(shape[:-1]), shape[-1])


#: Ranks up to which a product of factors ``q pᵀ`` is an unrolled sum of ``rank`` broadcast
#: products, which XLA:CPU fuses with what consumes it (the residual's subtraction): at rank 4 on
#: ResNet-50's kernels the residual took 8.5 ms against 23 ms as a dot (equal at rank 1).
_UNROLLED_RANK = 8


def _outer(q: jax.Array, p: jax.Array) -> jax.Array:
  """float32[m, r], float32[n, r] -> q pᵀ, float32[m, n]."""
  if q.shape[1] > _UNROLLED_RANK:
    return jnp.dot(q, p.T, precision=_HIGHEST)
  out = q[:, 0:1] * p[:, 0][None, :]
  for k in range(1, q.shape[1]):
    out = out + q[:, k:k + 1] * p[:, k][None, :]
  return out


def _psum_split(pieces: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
  """One ``psum`` of the flat ``pieces`` concatenated, cut into the pieces again."""
  return split_leaves(lax.psum(jnp.concatenate(pieces), axis_name), [p.shape[0] for p in pieces], 1)


def _orthonormalise(p: jax.Array) -> jax.Array:
  """float32[m, r] -> the same columns made orthonormal by Gram-Schmidt, in order; a column that is
  zero (or becomes zero) stays zero instead of dividing by 0."""
  cols = []
  for j in range(p.shape[1]):
    c = p[:, j]
    for q in cols:
      c = c - jnp.dot(q, c, precision=_HIGHEST) * q
    norm = jnp.sqrt(jnp.dot(c, c, precision=_HIGHEST))
    cols.append(c / jnp.where(norm > 0, norm, 1.0))
  return jnp.stack(cols, axis=1)


@dataclasses.dataclass(frozen=True)
class PowerSGD(Codec):
  """Rank-``rank`` approximation of every matrix-shaped leaf, PowerSGD's algorithm.

  A leaf of shape ``(..., out)`` is the matrix ``M`` of shape ``(out, rest)`` (``rest`` the
  product of the other axes: a ``Dense`` kernel ``(in, out)``, a convolution ``(H, W, in, out)``;
  PyTorch's layout puts ``out`` first: the same matrix up to the order of its columns). With ``Q``
  of shape ``(rest, rank)``, one reduction is:

  1. ``P = M Q`` on every device, an allreduce of P (summed), P orthonormalised (Gram-Schmidt);
  2. ``Q = Mᵀ P`` on every device, an allreduce of Q (averaged);
  3. the result ``P Qᵀ``, the same bits everywhere; what this device's matrix lost,
     ``M - P (Mᵀ P)ᵀ``, is its residual (for error feedback).

  Per matrix each device sends ``(out + rest) * rank`` float32 values in two all-reduces, where an
  exact allreduce sends ``out * rest``. A leaf whose matrix would not shrink at least
  ``min_compression_rate`` times (``(out + rest) * rank * min_compression_rate >= out * rest``,
  PyTorch's rule), and 0-d and 1-D leaves, travel exact in the first all-reduce. All the leaves
  of a communication buffer share the two all-reduces.

  **State.** Q is the state the codec carries between reductions (:meth:`Codec.init_state`):
  ``qcomm.sync`` keeps the averaged Q of each leaf in ``SyncState.codec_state`` and starts the
  next step's power iteration from it (warm start; after a non-finite step, whose Q makes its
  result non-finite too, the sync keeps the Q of before it, as all its state). Before the
  first step, Q is drawn from a standard normal with the sync's seed. ``qcomm.allreduce`` and
  ``qcomm.diloco`` draw a fresh Q from their key at every call (pass the same key on every
  device).

  **Error feedback** is part of the algorithm (:attr:`Codec.wants_error_feedback`): ``qcomm.sync``
  and ``qcomm.diloco`` turn it on unless given ``error_feedback=False``. A NaN or an infinity in
  any device's leaf makes that leaf's result non-finite on every device.

  PowerSGD reduces matrices: it has no payload of its own outside the allreduce (``encode`` /
  ``decode`` raise), no reduce-scatter (``sync(..., shard_state=True)``) and no flat-buffer
  allreduce (``qcomm.Hierarchical`` axes).

  Args:
    rank: the approximation's rank, a positive integer.
    min_compression_rate: compress a matrix only where it shrinks at least this many times
      (a real >= 1; PyTorch's default 2).
  """

  rank: int = 1
  min_compression_rate: float = 2.0
  wants_error_feedback = True

  def __post_init__(self):
    object.__setattr__(self, "rank", check_int("rank", self.rank))
    rate = check_real("min_compression_rate", self.min_compression_rate)
    if not rate >= 1:
      raise ValueError(f"min_compression_rate must be a real number >= 1, "
                       f"got {self.min_compression_rate!r}")
    object.__setattr__(self, "min_compression_rate", rate)

  @property
  def name(self) -> str:
    return f"PowerSGD rank {self.rank}"

  # -- which leaves are compressed, and their sizes ----------------------------------------------
  def compresses(self, shape: Sequence[int]) -> bool:
    """True if a leaf of ``shape`` is sent as its rank-``rank`` factors (else exact)."""
    rest, out = matrix_shape(shape)
    if len(tuple(shape)) < 2:
      return False
    return (rest + out) * self.rank * self.min_compression_rate < rest * out

  def _first_length(self, shape) -> int:
    """float32 values of a leaf in the first all-reduce: P, or the whole leaf if exact."""
    rest, out = matrix_shape(shape)
    return out * self.rank if self.compresses(shape) else rest * out

  def _second_length(self, shape) -> int:
    """float32 values of a leaf in the second all-reduce: Q (0 for an exact leaf)."""
    rest, _ = matrix_shape(shape)
    return rest * self.rank if self.compresses(shape) else 0

  def leaf_payload_size(self, shape: tuple[int, ...]) -> int:
    return 4 * (self._first_length(shape) + self._second_length(shape))

  def leaves_traffic(self, shapes: Sequence[tuple[int, ...]], devices: int,
                     collective: str = "allreduce") -> tuple[tuple[str, float], ...]:
    """Two all-reduces of float32: the P factors and the exact leaves, then the Q factors (the
    second only where a leaf is compressed)."""
    _, d, collective = _check_traffic(0, devices, collective)
    if collective != "allreduce":
      raise self._no(collective)
    first = sum(self._first_length(s) for s in shapes)
    second = sum(self._second_length(s) for s in shapes)
    return tuple(("all-reduce", _ring(d, 4.0 * k)) for k in (first, second) if k)

  # -- the reduction ------------------------------------------------------------------------------
  def init_state(self, shape: tuple[int, ...], key: jax.Array) -> Any:
    """Q, float32 ``(rest, rank)``, standard normal from ``key`` (``()`` for an exact leaf)."""
    if not self.compresses(shape):
      return ()
    rest, _ = matrix_shape(shape)
    return jax.random.normal(key, (rest, self.rank), jnp.float32)

  def allreduce_leaves_with_state(self, parts, shapes, states, axis_name: AxisName, key,
                                  op: str = "mean", exchange: str = "auto"):
    del key, exchange
    d = axis_size(axis_name)
    scale = jnp.float32(1.0 / d if op == "mean" else 1.0)
    mats = [i for i, s in enumerate(shapes) if self.compresses(s)]
    exact = [i for i in range(len(parts)) if i not in mats]
    ms = {i: parts[i].reshape(matrix_shape(shapes[i])) for i in mats}  # (rest, out) = Mᵀ

    # 1. P = M Q of every matrix (out, rank) and the exact leaves: one all-reduce.
    # Mᵀ-side product as a fused multiply-reduce over the rows: XLA:CPU's dot with the
    # transposed operand is 5-20x slower (163 ms against 8 ms at rank 1 on ResNet-50's kernels).
    ps = {i: jnp.sum(ms[i][:, :, None] * states[i][:, None, :], axis=0) for i in mats}
    first = _psum_split([ps[i].reshape(-1) for i in mats] + [parts[i] for i in exact], axis_name)
    outs: list[Any] = [None] * len(parts)
    lost: list[Any] = [None] * len(parts)
    new_states = list(states)
    for i, p in zip(mats, first):
      ps[i] = _orthonormalise(p.reshape(ps[i].shape))
    for i, total in zip(exact, first[len(mats):]):
      outs[i] = total * scale
      lost[i] = jnp.zeros_like(parts[i])
    mark = nonfinite_mark([outs[i] for i in exact])
    if not mats:
      return outs, lost, new_states, mark

    # 2. Q = Mᵀ P of every matrix (rest, rank): the second all-reduce, averaged.
    qs = {i: jnp.dot(ms[i], ps[i], precision=_HIGHEST) for i in mats}
    second = _psum_split([qs[i].reshape(-1) for i in mats], axis_name)
    bound = jnp.float32(0)
    for i, q_sum in zip(mats, second):
      q_sum = q_sum.reshape(qs[i].shape)
      # The finite guard from the factors: |(q pᵀ)_jk| <= rank max|q| max|p|, twice that a bound.
      bound = bound + abs_max(q_sum) * abs_max(ps[i]) * (2.0 * self.rank * scale)
      # 3. the result P Qᵀ (as (rest, out)), the residual, the warm start of the next call (a
      # sync keeps the old one after a non-finite step, whose result this makes non-finite too).
      out = _outer(q_sum, ps[i])
      outs[i] = (out * scale if op == "mean" else out).reshape(-1)
      lost[i] = parts[i] - _outer(qs[i], ps[i]).reshape(-1)
      new_states[i] = q_sum * jnp.float32(1.0 / d)
    return outs, lost, new_states, mark + bounded_mark(bound, lambda: nonfinite_mark(
        [_outer(q.reshape(qs[i].shape), ps[i]) for i, q in zip(mats, second)]))

  # -- what PowerSGD does not have -----------------------------------------------------------------
  def _no(self, what: str) -> ValueError:
    return ValueError(
        f"qcomm.PowerSGD has no {what}: it must see each leaf as a matrix and reduces it in two "
        f"all-reduces (qcomm.sync, qcomm.allreduce of an array or pytree, qcomm.diloco); it cannot "
        f"run with shard_state=True, a qcomm.Hierarchical axis, or as a standalone encode / "
        f"decode")

  def allreduce_leaves(self, parts, axis_name, key, op="mean", exchange="auto"):
    raise self._no("allreduce of leaves without their shapes")

  def allreduce_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    raise self._no("allreduce of a flat buffer")

  def reduce_scatter_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    raise self._no("reduce-scatter")

  def all_gather_flat(self, x, axis_name, key):
    raise self._no("all-gather")

  def traffic(self, n, devices, collective="allreduce"):
    _check_traffic(n, devices, collective)
    raise self._no(f"traffic of a flat buffer ({collective}; its bytes depend on the leaves' "
                   f"shapes: leaves_traffic)")

  def payload_size(self, n: int) -> int:
    check_int("n", n, 0)
    raise self._no("payload of a flat buffer (leaf_payload_size gives a leaf's bytes)")

  def wire_bits(self, devices: int = 1) -> float:
    check_int("devices", devices)
    raise self._no("fixed bits per value (its bytes depend on the leaves' shapes)")

  def wire_encode(self, x, key):
    raise self._no("standalone payload")

  def wire_decode_sum(self, wires, n):
    raise self._no("standalone payload")
