"""``qcomm.sync``: an optax wrapper that synchronises gradients across devices, compressed.

    tx = qcomm.sync(optax.sgd(0.1, momentum=0.9), axis_name="data", bits=4, accum_steps=2)
    # inside jax.shard_map / jax.pmap over "data":
    updates, opt_state = tx.update(local_grads, opt_state, params)

Inside ``jax.shard_map`` take the gradient with respect to a *varying* copy of the parameters
(``lax.pcast(params, "data", to="varying")``): the gradient of a replicated parameter is summed
across the axis by JAX's autodiff itself (uncompressed), which would make the wrapper pointless.

Gradients accumulate locally (float32) for ``accum_steps`` calls; on the last one they are averaged
across ``axis_name`` with the chosen codec and handed to ``inner``. The other calls return zero
updates and leave ``inner``'s state alone, and — unlike ``optax.MultiSteps`` around a synchronised
gradient — they run no collective: the allreduce sits in the taken branch of a ``lax.cond``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import optax

import jax
import jax.numpy as jnp

from jax_qcomm import _vma, collectives, packing
from jax_qcomm._checks import check_int
from jax_qcomm.codecs import QSGD, Cast, Codec, NoCompression


class SyncState(NamedTuple):
  """State of :func:`sync` (a pytree of arrays; checkpointable with orbax).

  inner: the wrapped optimizer's state.
  step: micro-steps since the last communication (int32; 0 right after one).
  key: rounding key data (uint32[2]), advanced at every communication.
  acc: float32 sum of the gradients of this accumulation window (``()`` if accum_steps == 1).
  residual: float32 error-feedback residual of this device (``()`` unless error_feedback).
  """

  inner: Any
  step: jax.Array
  key: jax.Array
  acc: Any
  residual: Any


def codec_for_bits(bits: int, bucket_size: int = 128, scheme: str = "maxmin") -> Codec:
  """32 -> NoCompression, 16 -> Cast(bfloat16), 1..8 -> QSGD(bits, bucket_size, scheme)."""
  if isinstance(bits, bool) or not isinstance(bits, int) or not (bits in (16, 32) or 1 <= bits <= 8):
    raise ValueError(f"bits must be 32 (exact), 16 (bf16 on the wire) or 1..8 (QSGD), got {bits!r}")
  if bits == 32:
    return NoCompression()
  if bits == 16:
    return Cast(jnp.bfloat16)
  return QSGD(bits=bits, bucket_size=bucket_size, scheme=scheme)


def _f32_zeros(tree: Any) -> Any:
  return jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), tree)


def sync(inner: optax.GradientTransformation, *, axis_name: collectives.AxisName = "data",
         bits: int = 4, bucket_size: int = 128, accum_steps: int = 1, min_size: int = 1024,
         exclude: str | Sequence[str] = (), scheme: str = "maxmin", error_feedback: bool = False,
         compress_1d: bool = False, overrides: dict[str, Codec] | None = None,
         comm_bucket_size: int = collectives.DEFAULT_COMM_BUCKET,
         seed: int = 0) -> optax.GradientTransformation:
  """Wraps ``inner`` so that it sees gradients averaged across ``axis_name``.

  Args:
    inner: the optimizer applied to the synchronised gradients.
    axis_name: the data-parallel axis (a name, a tuple of names, or ``qcomm.Hierarchical``); ``update``
      must run inside ``jax.shard_map`` or ``jax.pmap`` binding it.
    bits: 32 exact ``pmean``; 16 bfloat16 on the wire with float32 sums; 1..8 QSGD.
    bucket_size: QSGD bucket (positive multiple of 8).
    accum_steps: communicate (and step ``inner``) every ``accum_steps`` calls; the gradients of the
      calls in between are averaged locally first.
    min_size, exclude, compress_1d, overrides: the per-leaf policy (:class:`qcomm.LeafPolicy`): leaves
      under ``min_size`` elements, 1-D leaves (unless ``compress_1d``) and leaves whose path matches
      an ``exclude`` regex travel exact; ``overrides`` maps path regexes to codecs.
    scheme: QSGD scheme, ``"maxmin"`` or ``"norm"``.
    error_feedback: keep, per device, what its own quantisation lost and add it to the next
      gradient; QSGD then rounds to nearest (EF-SGD's deterministic compressor). Costs one float32 copy of the gradients per device (plus, with accumulation, the
      accumulator: another copy).
    comm_bucket_size: most elements per flat communication buffer.
    seed: seeds the rounding key (the device index is folded in, so replicas still differ).
  """
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise ValueError(f"inner must be an optax.GradientTransformation, got {inner!r}")
  codec = codec_for_bits(bits, bucket_size, scheme)
  if error_feedback and isinstance(codec, QSGD):
    # Error feedback compensates a deterministic compressor; with stochastic rounding at 1 bit
    # the residual (up to a whole bucket range) feeds the next range and training diverged.
    codec = QSGD(bits=bits, bucket_size=bucket_size, scheme=scheme, rounding="nearest")
  check_int("accum_steps", accum_steps)
  if not isinstance(error_feedback, bool):
    raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise ValueError(f"seed must be an integer, got {seed!r}")
  policy = packing.LeafPolicy(min_size=min_size, compress_1d=compress_1d, exclude=exclude,
                              overrides=overrides or {})
  check_int("comm_bucket_size", comm_bucket_size)
  use_ef = error_feedback and codec.lossy

  def init(params: Any) -> SyncState:
    return SyncState(
        inner=inner.init(params),
        step=jnp.zeros((), jnp.int32),
        key=jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32),
        acc=_f32_zeros(params) if accum_steps > 1 else (),
        residual=_f32_zeros(params) if use_ef else (),
    )

  def communicate(grads: Any, state: SyncState, params: Any):
    """Allreduce (with error feedback) + inner step. grads: float32, this device's mean."""
    key, sub = jax.random.split(jax.random.wrap_key_data(state.key))
    if use_ef:
      grads = jax.tree_util.tree_map(jnp.add, grads, state.residual)
    synced, residual = collectives.allreduce(
        grads, axis_name, codec, sub, "mean", policy=policy, comm_bucket_size=comm_bucket_size,
        return_residual=True)
    if params is not None:  # inner sees gradients in the parameters' dtypes
      synced = jax.tree_util.tree_map(lambda g, p: g.astype(jnp.result_type(p)), synced, params)
    updates, inner_state = inner.update(synced, state.inner, params)
    return updates, SyncState(inner_state, jnp.zeros((), jnp.int32),
                              jax.random.key_data(key).astype(jnp.uint32),
                              state.acc, residual if use_ef else ())

  def update(grads: Any, state: SyncState, params: Any = None):
    collectives.axis_size(axis_name)  # clear error outside shard_map / pmap
    packing.check_float_leaves(grads, "grads")
    g32 = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
    if accum_steps == 1:
      updates, new_state = communicate(g32, state, params)
      return _like(updates, grads), new_state

    acc = jax.tree_util.tree_map(jnp.add, state.acc, g32)
    step = state.step + 1

    def do_sync():
      mean = jax.tree_util.tree_map(lambda a: a * jnp.float32(1.0 / accum_steps), acc)
      updates, new = communicate(mean, state._replace(acc=()), params)
      return _like(updates, grads), new._replace(acc=_f32_zeros(acc))

    def skip():
      # Fresh zeros, not zeros_like: replicated (like real updates), not varying like grads.
      zeros = jax.tree_util.tree_map(lambda g: jnp.zeros(g.shape, g.dtype), grads)
      return zeros, state._replace(step=step, acc=acc)

    return _vma.cond(step >= accum_steps, (do_sync, skip))

  return optax.GradientTransformation(init, update)


def state_partition_spec(state: SyncState, axis_name: Any = "data") -> SyncState:
  """shard_map specs for a :class:`SyncState`: per-device parts (the accumulator and the error
  feedback residual) are split over ``axis_name``, everything else is replicated.

  Create the state inside shard_map with these specs so each device owns its parts:
  ``jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec)(params)``.
  """
  from jax.sharding import PartitionSpec as P
  rep = lambda _: P()  # noqa: E731
  dev = lambda _: P(axis_name)  # noqa: E731
  return SyncState(inner=jax.tree_util.tree_map(rep, state.inner), step=P(), key=P(),
                   acc=jax.tree_util.tree_map(dev, state.acc),
                   residual=jax.tree_util.tree_map(dev, state.residual))


def _like(updates: Any, grads: Any) -> Any:
  return jax.tree_util.tree_map(lambda u, g: u.astype(g.dtype), updates, grads)
