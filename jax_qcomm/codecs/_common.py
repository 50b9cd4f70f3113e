"""What the codecs share below the protocol: dtype and payload checks, padding, rows and chunks of
the reduction's buffers, summing in order, the non-finite marks and the ring's traffic.

:mod:`.base` (the :class:`~jax_qcomm.codecs.base.Codec` protocol) and every codec import these; they
know nothing of any codec but the protocol's name.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm import _compat
from jax_qcomm.native import wire
from jax_qcomm._checks import check_array, check_float_dtype, check_int

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


def concat_leaves(parts: Sequence[jax.Array], codec: Any) -> jax.Array:
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
  """The inverse of :func:`concat_leaves`: flat[..., N] -> one array [..., sizes[i]] per leaf,
  padding dropped (along the last axis: the rows of packed buffers split alike)."""
  out, offset = [], 0
  for n in sizes:
    out.append(flat[..., offset:offset + n])
    offset += wire.leaves_span([n], multiple)
  return out


def _rows_of(chunks: jax.Array) -> jax.Array:
  """float[P, D, c] (P runs of D chunks) -> float[D, P * c]: row j, device j's chunks in order (a
  reshape where P == 1, else a copy)."""
  p, d, c = chunks.shape
  return chunks.reshape(d, c) if p == 1 else jnp.swapaxes(chunks, 0, 1).reshape(d, p * c)


def _chunks_of(rows: jax.Array, shape: tuple[int, int, int]) -> jax.Array:
  """The inverse of :func:`_rows_of`: float[D, P * c] -> float[P, D, c]."""
  p, d, c = shape
  return rows.reshape(1, d, c) if p == 1 else jnp.swapaxes(rows.reshape(d, p, c), 0, 1)


def _run_rows(chunks: jax.Array, runs: tuple[int, int]) -> jax.Array:
  """float[P, D, c] -> float[runs, D, n] (:func:`jax_qcomm.native.wire.chunk_runs`): the chunks
  themselves, or (runs = 1) each device's shard end to end (a copy)."""
  return chunks if runs[0] == chunks.shape[0] else _rows_of(chunks)[None]


def _shard_of(chunks: jax.Array, index: jax.Array) -> jax.Array:
  """float[P, D, c] -> float[P * c]: shard ``index`` (a traced device index), its chunks in order."""
  return lax.dynamic_index_in_dim(chunks, index, axis=1, keepdims=False).reshape(-1)


def _concat_rows(payloads: Sequence[jax.Array]) -> jax.Array:
  """[wire[k, W_i]] -> wire[k, sum W_i]: the payloads of a buffer's leaves, one message per row."""
  return payloads[0] if len(payloads) == 1 else jnp.concatenate(payloads, axis=1)


def reduce_packed(parts: Sequence[jax.Array], codec: Any, reduce_flat) -> tuple:
  """``reduce_flat(buffer) -> (out, residual, *more)`` on :func:`concat_leaves` of ``parts``:
  ``(outs, residuals, *more)``, out and residual split per leaf again and anything more (a
  mark) passed through: how a reduction of a packed buffer serves the leaves it carries."""
  sizes = [p.shape[0] for p in parts]
  out, lost, *more = reduce_flat(concat_leaves(parts, codec))
  return (split_leaves(out, sizes, codec.pad_multiple),
          split_leaves(lost, sizes, codec.pad_multiple), *more)


def nonfinite_mark(tree: Any) -> jax.Array:
  """A float32 scalar: 0 if no leaf of ``tree`` holds a NaN or an infinity, NaN otherwise.

  The sum of ``x - x`` over every element: a finite value minus itself is 0, an infinity or a NaN
  gives NaN, and a sum of zeros cannot overflow. XLA:CPU vectorises this float sum, with no
  constant to broadcast; ``all(isfinite(x))`` reduces booleans at a third of the speed, and a
  ``max(abs(x))`` misses NaNs there. A scalar that ``psum`` can carry. One pass over ``tree``."""
  leaves = jax.tree_util.tree_leaves(tree)
  return sum((jnp.sum(x - x, dtype=jnp.float32) for x in leaves), jnp.float32(0))


def bounded_mark(bound: jax.Array, exact: Callable[[], jax.Array]) -> jax.Array:
  """A :func:`nonfinite_mark` from ``bound``, a float32 scalar that is at least every ``|value|``
  of the results wherever it is finite (NaN or infinite where it cannot say): 0 where ``bound`` is
  finite, without reading the results; otherwise ``exact()``, their own mark, in a ``lax.cond``,
  so that it runs only then. ``exact`` should recompute the results from what they were made of
  (the summed words, the factors) rather than close over them: an operand of the ``cond`` is a
  buffer XLA must materialise, where the results themselves may be fused into their consumer.
  How a codec that holds its results' scale reports their finiteness for a scalar's price."""
  return _compat.cond(jnp.isfinite(bound), (lambda: jnp.float32(0), exact))


def abs_max(x: jax.Array) -> jax.Array:
  """The largest ``|x|`` (float32 scalar), NaN where x holds a NaN: ``max(|x|)`` plus
  :func:`nonfinite_mark` (XLA:CPU's vectorised max drops NaNs). For small arrays."""
  return jnp.max(jnp.abs(x)).astype(jnp.float32) + nonfinite_mark(x)


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
