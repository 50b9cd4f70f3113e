"""``qcomm.sync``: an optax wrapper that synchronises gradients across devices, compressed.

    tx = qcomm.sync(optax.sgd(0.1, momentum=0.9), axis_name="data", bits=4, accum_steps=2)
    # inside jax.shard_map / jax.pmap over "data":
    updates, opt_state = tx.update(local_grads, opt_state, params)

Inside ``jax.shard_map`` take the gradient with respect to a *varying* copy of the parameters
(``lax.pcast(params, "data", to="varying")``): the gradient of a replicated parameter is summed
across the axis by JAX's autodiff itself (uncompressed). ``update`` raises a ValueError for such
gradients (:func:`qcomm.data_parallel` does the whole step for you).

Gradients accumulate locally (float32) for ``accum_steps`` calls; on the last one they are averaged
across ``axis_name`` with the chosen codec and handed to ``inner``. The other calls return zero
updates and leave ``inner``'s state alone, and — unlike ``optax.MultiSteps`` around a synchronised
gradient — they run no collective: the allreduce sits in the taken branch of a ``lax.cond``.

The state (:class:`SyncState`) is replicated except for its per-device parts (the accumulator and
the error-feedback residual), which carry a leading device axis: shape ``(D, *param.shape)`` as a
global array split over the axis (``PartitionSpec(axis_name)``), ``(1, *param.shape)`` on each
device. :func:`state_partition_spec` gives the ``shard_map`` specs of any pytree holding sync
states (optax chains, ``MultiSteps``, ``inject_hyperparams``, flax ``TrainState``, ``nnx.State``).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import weakref
from typing import Any, NamedTuple, Sequence

import optax

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_qcomm import _compat, _varying, collectives, packing
from jax_qcomm._checks import check_array_leaves, check_axis_name, check_bool, check_int
from jax_qcomm.codecs import Codec, codec_for_bits


class SyncState(NamedTuple):
  """State of :func:`sync` (a pytree of arrays; checkpointable with orbax).

  Replicated (the same on every device; ``PartitionSpec()``):
    inner: the wrapped optimizer's state.
    step: calls since the last communication (int32; 0 right after one). Counts micro-steps.
    key: rounding key data (uint32[2]), advanced at every communication.
    gradient_step: communications so far (int32), i.e. optimizer steps: how often ``inner`` was
      stepped. ``gradient_step * accum_steps + step`` is the number of ``update`` calls.
    total_notfinite: communications whose averaged gradient held a NaN or an infinity (int32).
      Those steps hand the non-finite gradient to ``inner`` unchanged (wrap ``inner`` in
      ``optax.apply_if_finite`` to skip them) and leave the error-feedback residual as it was.

  Per device (a leading device axis; ``PartitionSpec(axis_name)``, see :func:`state_partition_spec`):
    acc: float32 sum of this device's gradients in the current accumulation window, one array
      ``(1, *param.shape)`` per parameter inside the step (``()`` if accum_steps == 1).
    residual: float32 error-feedback residual of this device, likewise (``()`` unless
      error_feedback).
  """

  inner: Any
  step: jax.Array
  key: jax.Array
  acc: Any
  residual: Any
  gradient_step: jax.Array
  total_notfinite: jax.Array


PER_DEVICE_FIELDS = ("acc", "residual")


@dataclasses.dataclass(frozen=True)
class SyncConfig:
  """The settings of a :func:`sync` transformation (read by :func:`qcomm.describe`)."""

  axis_name: Any
  codec: Codec
  policy: packing.LeafPolicy
  accum_steps: int
  error_feedback: bool
  comm_bucket_size: int


# update function of every sync transformation -> its settings. Weak keys: a transformation that is
# dropped (inject_hyperparams rebuilds one at every call) leaves nothing behind.
_CONFIGS: "weakref.WeakKeyDictionary[Any, SyncConfig]" = weakref.WeakKeyDictionary()


def config_of(tx: Any) -> SyncConfig:
  """The :class:`SyncConfig` of a transformation returned by :func:`sync`.

  ValueError for anything else, including a chain that contains a sync: optax combinators build
  new functions and do not expose their parts, so keep a reference to the sync transformation.
  """
  cfg = _CONFIGS.get(getattr(tx, "update", None)) if hasattr(tx, "update") else None
  if cfg is None:
    raise ValueError(
        f"tx must be the transformation returned by qcomm.sync(...), got {tx!r}. A sync inside "
        f"optax.chain / MultiSteps / inject_hyperparams cannot be found from the outer "
        f"transformation: keep a reference (s = qcomm.sync(...); tx = optax.chain(s, ...)) and "
        f"pass s.")
  return cfg


def num_devices(axis_name: collectives.AxisName = "data") -> tuple[int, bool]:
  """(D, bound): the number of devices along ``axis_name`` and whether the axis is bound here.

  Inside ``shard_map`` / ``pmap`` over the axis: its size, True. Elsewhere (False): the size of the
  axis in the current mesh (``jax.set_mesh(mesh)``; ``jax.sharding.get_abstract_mesh()``) if it
  has that axis, else ``jax.device_count()`` (all devices of all processes).
  """
  try:
    return collectives.axis_size(axis_name), True
  except ValueError:
    pass
  names = collectives.axis_names(axis_name)
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and all(n in mesh.axis_names for n in names):
    return math.prod(mesh.shape[n] for n in names), False
  return jax.device_count(), False


def _all_finite(tree: Any) -> jax.Array:
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves:
    return jnp.bool_(True)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _fix_hint(axis_name: Any) -> str:
  return (f"Give jax.shard_map the specs qcomm.state_partition_spec(opt_state, {axis_name!r}) "
          f"for the optimizer state, in in_specs and out_specs: they split the per-device parts "
          f"over the axis and replicate the rest (P() for the whole state is what goes wrong). "
          f"Under jax.pmap, create the state inside pmap: jax.pmap(tx.init, "
          f"axis_name={axis_name!r}). qcomm.data_parallel does all of this for you.")


def sync(inner: optax.GradientTransformation, *, axis_name: collectives.AxisName = "data",
         bits: int = 4, bucket_size: int = 128, accum_steps: int = 1, min_size: int = 1024,
         exclude: str | Sequence[str] = (), scheme: str = "maxmin", error_feedback: bool = False,
         compress_1d: bool = False, overrides: dict[str, Codec] | None = None,
         comm_bucket_size: int = collectives.DEFAULT_COMM_BUCKET,
         seed: int = 0, check_varying: bool = True,
         summable: bool = False) -> optax.GradientTransformation:
  """Wraps ``inner`` so that it sees gradients averaged across ``axis_name``.

  Args:
    inner: the optimizer applied to the synchronised gradients.
    axis_name: the data-parallel axis (a name, a tuple of names, or ``qcomm.Hierarchical``); ``update``
      must run inside ``jax.shard_map`` or ``jax.pmap`` binding it.
    bits: 32 exact ``pmean``; 16 bfloat16 on the wire with float32 sums; 1..8 QSGD.
    bucket_size: QSGD bucket (positive multiple of 8).
    accum_steps: communicate (and step ``inner``) every ``accum_steps`` calls; the gradients of the
      calls in between are averaged locally first. Counters outside (``TrainState.step``,
      ``nnx.Optimizer.step``) count calls; ``inner``'s own counts and ``SyncState.gradient_step``
      count optimizer steps.
    min_size, exclude, compress_1d, overrides: the per-leaf policy (:class:`qcomm.LeafPolicy`): leaves
      under ``min_size`` elements, 1-D leaves (unless ``compress_1d``) and leaves whose path matches
      an ``exclude`` regex travel exact; ``overrides`` maps path regexes to codecs.
    scheme: QSGD scheme, ``"maxmin"`` or ``"norm"``.
    summable: with ``bits`` 2..8, use :class:`qcomm.Summable` instead of QSGD: a scale shared by
      all devices (one small ``pmax``) and integer levels packed into uint32 words that XLA's own
      all-reduce sums (one ``psum``), each value quantised once; where the all-gather and
      all-to-all of QSGD's scatter-reduce-allgather run slower than the all-reduce (gloo on CPU),
      the faster choice at the same bits. ``scheme`` must stay ``"maxmin"``; bits 32/16/1 with
      ``summable=True`` are a ValueError. Error feedback works alike (rounding to nearest).
    error_feedback: keep, per device, what its own quantisation lost and add it to the next
      gradient; QSGD then rounds to nearest (EF-SGD's deterministic compressor). Costs one float32
      copy of the gradients per device (plus, with accumulation, the accumulator: another copy).
    comm_bucket_size: most elements per flat communication buffer.
    seed: seeds the rounding key (the device index is folded in, so replicas still differ).
    check_varying: ``update`` raises ValueError for a gradient that is the same on every device
      (not varying over ``axis_name`` inside ``shard_map``): the gradient of a replicated
      parameter, already summed across devices by autodiff, which averaged once more would give
      updates D times too large. Pass False only if every device really computes the same
      gradient. JAX records variation only inside ``shard_map`` with ``check_vma=True`` (the
      default): under ``jax.pmap`` or ``check_vma=False`` this is not checked.

  Returns:
    An ``optax.GradientTransformation``. ``init(params)`` builds a :class:`SyncState`; called
    inside ``shard_map``/``pmap`` over the axis its per-device parts are this device's,
    ``(1, *param.shape)``; called anywhere else (``tx.init(params)``, flax ``TrainState.create``,
    ``nnx.Optimizer``) they are global, ``(D, *param.shape)``, with D from :func:`num_devices`
    (the current mesh's axis if set, else ``jax.device_count()``), to be passed to ``shard_map``
    with :func:`state_partition_spec`. ``update(grads, state, params)`` must run inside
    ``shard_map``/``pmap``; it raises ValueError if the per-device parts arrive replicated.

  Non-finite gradients: a communication whose averaged gradient holds a NaN or an infinity (the
  same decision on every device: all replicas hold the same average) passes it to ``inner``
  unchanged, so it is never made finite, counts it in ``total_notfinite`` and keeps the
  error-feedback residual of before the window; the accumulator restarts from zero after every
  communication. Wrap the inner optimizer, ``sync(optax.apply_if_finite(inner, k))``, to skip
  such steps and train on. Not ``optax.apply_if_finite(sync(...))``: outside, it would test each
  device's own gradient, and the devices would disagree on whether to communicate.
  """
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise ValueError(f"inner must be an optax.GradientTransformation, got {inner!r}")
  check_axis_name("axis_name", axis_name, (collectives.Hierarchical,),
                  "qcomm.Hierarchical(inner, outer)")
  # Error feedback compensates a deterministic compressor; with stochastic rounding at 1 bit the
  # residual (up to a whole bucket range) feeds the next range and training diverged.
  codec = codec_for_bits(bits, bucket_size, scheme,
                         rounding="nearest" if error_feedback else "stochastic", summable=summable)
  check_int("accum_steps", accum_steps)
  check_bool("error_feedback", error_feedback)
  check_bool("check_varying", check_varying)
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise ValueError(f"seed must be an integer, got {seed!r}")
  policy = packing.LeafPolicy(min_size=min_size, compress_1d=compress_1d, exclude=exclude,
                              overrides={} if overrides is None else overrides)
  check_int("comm_bucket_size", comm_bucket_size)
  use_ef = error_feedback and codec.lossy
  names = collectives.axis_names(axis_name)

  def init(params: Any) -> SyncState:
    check_array_leaves("params", params)
    d, bound = num_devices(axis_name)
    tracked = bound and _varying.tracked(names)

    def per_device(p):
      # Bound: this device's own part (1, ...), typed as varying like what update returns.
      # Elsewhere: the global array of all D devices' parts, to be split by state_partition_spec.
      z = jnp.zeros((1 if bound else d,) + jnp.shape(p), jnp.float32)
      return _compat.make_varying(z, frozenset(names)) if tracked else z

    return SyncState(
        inner=inner.init(params),
        step=jnp.zeros((), jnp.int32),
        key=jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32),
        acc=jax.tree_util.tree_map(per_device, params) if accum_steps > 1 else (),
        residual=jax.tree_util.tree_map(per_device, params) if use_ef else (),
        gradient_step=jnp.zeros((), jnp.int32),
        total_notfinite=jnp.zeros((), jnp.int32),
    )

  def check_state(state: Any, grads: Any) -> None:
    """Clear errors for a state that does not fit this step (the commonest: passed with P())."""
    if not isinstance(state, SyncState):
      raise TypeError(f"state must be the qcomm.SyncState made by this transformation's init, "
                      f"got {type(state).__name__}")
    tracked = _varying.tracked(names)
    want_treedef = jax.tree_util.tree_structure(grads)
    for field, used in (("acc", accum_steps > 1), ("residual", use_ef)):
      part = getattr(state, field)
      if not used:
        if jax.tree_util.tree_leaves(part):
          raise ValueError(f"state.{field} is not empty but this sync has "
                           f"{'accum_steps == 1' if field == 'acc' else 'no error feedback'}: "
                           f"the state was made by a sync with other settings")
        continue
      leaves, treedef = jax.tree_util.tree_flatten_with_path(part)
      if treedef != want_treedef:
        raise ValueError(f"state.{field} does not have the structure of the gradients: "
                         f"{treedef} vs {want_treedef}")
      for (path, a), g in zip(leaves, jax.tree_util.tree_leaves(grads)):
        where = f"SyncState.{field}, leaf '{packing.path_str(path) or '<root>'}'"
        want = (1,) + tuple(jnp.shape(g))
        if tuple(jnp.shape(a)) != want:
          raise ValueError(
              f"qcomm.sync: the per-device part of the optimizer state ({where}) has shape "
              f"{tuple(jnp.shape(a))} inside the step; it must be {want}: a leading device axis "
              f"of size 1 on each device, varying over {axis_name!r}. " + _fix_hint(axis_name))
        if tracked and _varying.unvarying(a, names):
          raise ValueError(
              f"qcomm.sync: the per-device part of the optimizer state ({where}) is replicated "
              f"(not varying over {axis_name!r}) inside the step. " + _fix_hint(axis_name))

  def communicate(grads: Any, state: SyncState, params: Any):
    """Allreduce (with error feedback) + inner step. grads: float32, this device's mean."""
    key, sub = jax.random.split(jax.random.wrap_key_data(state.key))
    if use_ef:
      grads = jax.tree_util.tree_map(lambda g, r: g + r[0], grads, state.residual)
    synced, lost = collectives.allreduce(
        grads, axis_name, codec, sub, "mean", policy=policy, comm_bucket_size=comm_bucket_size,
        return_residual=True, check_varying=False)  # grads were checked in update
    # Every device holds the same average (bit-identical replicas), so this decision is the same
    # everywhere without another collective.
    finite = _all_finite(synced)
    residual = ()
    if use_ef:  # a non-finite window must not poison the residual of every later step
      residual = jax.tree_util.tree_map(lambda new, old: jnp.where(finite, new, old[0])[None],
                                        lost, state.residual)
    if params is not None:  # inner sees gradients in the parameters' dtypes
      try:
        synced = jax.tree_util.tree_map(lambda g, p: g.astype(jnp.result_type(p)), synced, params)
      except (ValueError, TypeError) as e:
        raise ValueError(f"params must be None or the parameters, a pytree with the structure of "
                         f"grads, got {jax.tree_util.tree_structure(params)}: {e}") from None
    updates, inner_state = inner.update(synced, state.inner, params)
    return updates, SyncState(
        inner=inner_state, step=jnp.zeros((), jnp.int32),
        key=jax.random.key_data(key).astype(jnp.uint32), acc=state.acc, residual=residual,
        gradient_step=state.gradient_step + 1,
        total_notfinite=state.total_notfinite + jnp.logical_not(finite).astype(jnp.int32))

  def update(grads: Any, state: SyncState, params: Any = None):
    collectives.axis_size(axis_name)  # clear error outside shard_map / pmap
    packing.check_float_leaves(grads, "grads")
    if check_varying:
      _varying.check_per_device(grads, names, "grads", "qcomm.sync(...).update")
    check_state(state, grads)
    g32 = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
    if accum_steps == 1:
      updates, new_state = communicate(g32, state, params)
      return _like(updates, grads), new_state

    acc = jax.tree_util.tree_map(lambda a, g: a + g[None], state.acc, g32)
    step = state.step + 1

    def do_sync():
      mean = jax.tree_util.tree_map(lambda a: a[0] * jnp.float32(1.0 / accum_steps), acc)
      updates, new = communicate(mean, state._replace(acc=()), params)
      # The accumulator restarts after every communication, finite or not.
      return _like(updates, grads), new._replace(acc=_f32_zeros(acc))

    def skip():
      # Fresh zeros, not zeros_like: replicated (like real updates), not varying like grads.
      zeros = jax.tree_util.tree_map(lambda g: jnp.zeros(g.shape, g.dtype), grads)
      return zeros, state._replace(step=step, acc=acc)

    return _compat.cond(step >= accum_steps, (do_sync, skip))

  tx = optax.GradientTransformation(init, update)
  _CONFIGS[update] = SyncConfig(axis_name=axis_name, codec=codec, policy=policy,
                                accum_steps=accum_steps, error_feedback=use_ef,
                                comm_bucket_size=comm_bucket_size)
  return tx


def _f32_zeros(tree: Any) -> Any:
  return jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), tree)


def _like(updates: Any, grads: Any) -> Any:
  return jax.tree_util.tree_map(lambda u, g: u.astype(g.dtype), updates, grads)


# ---- shard_map specs of any pytree holding sync states ------------------------------------------

_REPLICATED_FIELDS = ("step", "key", "gradient_step", "total_notfinite")


def _single_leaf(tree: Any) -> Any:
  leaves = jax.tree_util.tree_leaves(tree)
  return leaves[0] if len(leaves) == 1 else None


def _is_sync_mapping(x: Any) -> bool:
  """A SyncState seen through a container that turned it into a mapping (``nnx.State`` of an
  ``nnx.Optimizer``, a dict restored without a target): keys among SyncState's fields, with the
  counters and the key of the right shapes and dtypes."""
  if isinstance(x, SyncState) or not isinstance(x, collections.abc.Mapping):
    return False
  keys = set(x.keys())
  if not (set(_REPLICATED_FIELDS) <= keys <= set(SyncState._fields)):
    return False
  key, step = _single_leaf(x["key"]), _single_leaf(x["step"])
  return (key is not None and step is not None
          and tuple(getattr(key, "shape", ())) == (2,) and getattr(key, "dtype", None) == jnp.uint32
          and tuple(getattr(step, "shape", (0,))) == () and getattr(step, "dtype", None) == jnp.int32)


def _is_sync(x: Any) -> bool:
  return isinstance(x, SyncState) or _is_sync_mapping(x)


def _holds_sync(tree: Any) -> bool:
  return any(_is_sync(node) for node in jax.tree_util.tree_leaves(tree, is_leaf=_is_sync))


def _is_special(x: Any) -> bool:
  return _is_sync(x) or (isinstance(x, (optax.MultiStepsState, optax.ApplyIfFiniteState))
                         and _holds_sync(x))


def _specs(tree: Any, dev: P) -> Any:
  rep = lambda t: jax.tree_util.tree_map(lambda _: P(), t)  # noqa: E731
  split = lambda t: jax.tree_util.tree_map(lambda _: dev, t)  # noqa: E731

  def one(x):
    if isinstance(x, SyncState):
      return SyncState(inner=_specs(x.inner, dev), step=rep(x.step), key=rep(x.key),
                       acc=split(x.acc), residual=split(x.residual),
                       gradient_step=rep(x.gradient_step), total_notfinite=rep(x.total_notfinite))
    if _is_sync_mapping(x):
      return type(x)({k: split(v) if k in PER_DEVICE_FIELDS else
                      _specs(v, dev) if k == "inner" else rep(v) for k, v in x.items()})
    if isinstance(x, optax.MultiStepsState):
      raise ValueError(
          "optax.MultiSteps around qcomm.sync is not supported: MultiSteps adds up the raw "
          "per-device gradients in its own state (acc_grads), which has no replicated form, and "
          "runs sync at every micro-step, so it would communicate at every call. Use "
          "qcomm.sync(inner, accum_steps=k) instead: the same update, communicating every k-th "
          "call (or optax.MultiSteps inside sync: qcomm.sync(optax.MultiSteps(inner, k))).")
    if isinstance(x, optax.ApplyIfFiniteState):
      raise ValueError(
          "optax.apply_if_finite around qcomm.sync is not supported: it tests the gradients it "
          "receives, which around sync are each device's own, so the devices would disagree on "
          "whether to run the allreduce (and with accumulation it would restore an accumulator "
          "holding the bad gradient). Put it inside, where every device sees the same averaged "
          "gradient: qcomm.sync(optax.apply_if_finite(inner, max_consecutive_errors), ...).")
    return P()

  return jax.tree_util.tree_map(one, tree, is_leaf=_is_special)


def state_partition_spec(tree: Any, axis_name: collectives.AxisName = "data") -> Any:
  """``shard_map`` specs for a pytree holding :class:`SyncState` s, e.g. an optimizer state.

  The per-device parts of every sync state in ``tree`` (the accumulator and the error-feedback
  residual, arrays ``(D, *param.shape)``) are split over ``axis_name``
  (``PartitionSpec(axis_name)``: ``(1, *param.shape)`` on each device); every other leaf is
  replicated (``PartitionSpec()``). ``tree`` may be a bare ``SyncState``, an ``optax.chain`` tuple,
  an ``inject_hyperparams`` state, a flax ``TrainState``, an ``nnx.State`` from
  ``nnx.state(optimizer)`` / ``nnx.split(...)`` (the result is then an ``nnx.State`` of
  ``PartitionSpec`` s, like ``nnx.get_partition_spec``), or any pytree of these, of arrays or of
  ``jax.ShapeDtypeStruct`` s (``jax.eval_shape(tx.init, params)``). Only the structure of ``tree``
  is read.

  Use the result for the state in both ``in_specs`` and ``out_specs``; ``tx.init`` may run inside
  the ``shard_map`` (``jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec)(params)``)
  or outside it. ValueError for ``optax.MultiSteps(sync(...))`` and
  ``optax.apply_if_finite(sync(...))``, naming the call to use instead.
  """
  check_axis_name("axis_name", axis_name, (collectives.Hierarchical,),
                  "qcomm.Hierarchical(inner, outer)")
  names = collectives.axis_names(axis_name)
  return _specs(tree, P(names[0] if len(names) == 1 else names))
