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

import dataclasses
from typing import Any, NamedTuple, Sequence

import optax

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm import _compat
from jax_qcomm.transforms import _parts, param_shards
from jax_qcomm.transport import _varying
from jax_qcomm.collectives import ops as collectives, packing
from jax_qcomm._checks import (check_array_leaves, check_axis_name, check_bool, check_instance,
                               check_int, check_int_or_none)
from jax_qcomm.transport.axes import AxisName, Hierarchical, axis_names, axis_size
from jax_qcomm.codecs import QSGD, Codec, NoCompression
from jax_qcomm.transforms.specs import register_state
from jax_qcomm.collectives.shard_layout import Layout


@dataclasses.dataclass(frozen=True)
class SyncConfig:
  """The settings of a :func:`sync` transformation. Its state carries them
  (``SyncState.config``, a static pytree node with no leaves), which is how
  :func:`qcomm.state_partition_spec`, :func:`qcomm.data_parallel` and :func:`qcomm.describe` find
  a sync inside any optax combinator."""

  axis_name: Any
  codec: Codec
  policy: packing.LeafPolicy
  accum_steps: int
  error_feedback: bool
  comm_bucket_size: int | None
  seed: int = 0
  check_varying: bool = True
  shard_state: bool = False
  gather_codec: Codec | None = None
  shard_params: bool = False
  param_codec: Codec | None = None
  hpz: bool = False
  #: The replicated sync's finite guard is the codecs' mark (Codec.allreduce_leaves_marked), so
  #: describe counts what the mark sends (Codec.mark_traffic).
  uses_mark = True

  def __hash__(self):  # static pytree data must hash; a policy's overrides may hold unhashables
    return hash((type(self).__name__, repr(self.axis_name), self.accum_steps))


jax.tree_util.register_static(SyncConfig)


@register_state
class SyncState(NamedTuple):
  """State of :func:`sync` (a pytree of arrays; checkpointable with orbax). Field names follow
  ``optax.MultiStepsState`` where the meaning is the same.

  Replicated (the same on every device; ``PartitionSpec()``):
    inner_opt_state: the wrapped optimizer's state.
    mini_step: calls since the last communication (int32; 0 right after one).
    key: rounding key data (uint32[2]), advanced at every communication.
    gradient_step: communications so far (int32), i.e. optimizer steps: how often ``inner`` was
      stepped. ``gradient_step * accum_steps + mini_step`` is the number of ``update`` calls.
    total_notfinite: communications whose averaged gradient held a NaN or an infinity (int32).
      Those steps hand the non-finite gradient to ``inner`` unchanged (wrap ``inner`` in
      ``optax.apply_if_finite`` to skip them) and leave the error-feedback residual as it was.
    codec_state: what the codecs carry from one communication to the next, one entry per
      gradient leaf in tree order (``qcomm.PowerSGD``'s Q factors, for its warm start; ``()``
      for codecs without state, so no arrays at all for most codecs). A non-finite window keeps
      it as it was.

  Per device (a leading device axis; ``PartitionSpec(axis_name)``, see :func:`state_partition_spec`):
    acc_grads: float32 sum of this device's gradients in the current accumulation window, one
      array ``(1, *param.shape)`` per parameter inside the step (``()`` if accum_steps == 1).
      Unlike ``MultiStepsState.acc_grads`` it is a sum, not a running mean.
    residual: float32 error-feedback residual of this device, likewise (``()`` unless
      error_feedback).

  config: the settings (:class:`SyncConfig`), a static pytree node with no arrays.
  """

  inner_opt_state: Any
  mini_step: jax.Array
  key: jax.Array
  acc_grads: Any
  residual: Any
  gradient_step: jax.Array
  total_notfinite: jax.Array
  codec_state: Any = ()
  config: SyncConfig | None = None

  # What state_partition_spec reads of a qcomm state class (jax_qcomm.transforms.specs).
  PER_DEVICE_FIELDS = ("acc_grads", "residual")
  NESTED_FIELDS = ("inner_opt_state",)
  PER_DEVICE_NESTED_FIELDS = ()
  REPLICATED_FIELDS = ("mini_step", "key", "gradient_step", "total_notfinite")


#: The weight differences' codec of the sharded mode by default (sync(..., shard_state=True)): 4
#: bits, rounded to nearest. On the byte-level LM it ends as close to fp32 as 8-bit differences
#: (+0.05% and +0.00% over two seeds, whose own spread is 1.3%; docs/accuracy.md), at 0.70x the
#: bytes of the sharded step and 0.81x its time on the 2-node 1 Gbit/s cluster (docs/benchmarks.md).
DEFAULT_GATHER_CODEC = QSGD(4, rounding="nearest")
#: The parameters' gather codec of sync(..., shard_params=True) by default: ZeRO++'s qwZ, 8 bits
#: rounded to nearest (docs/accuracy.md, "Sharded parameters").
DEFAULT_PARAM_CODEC = QSGD(8, rounding="nearest")





def config_of(tx: Any) -> SyncConfig:
  """The :class:`SyncConfig` of a transformation returned by :func:`sync` (or the config of
  another qcomm transformation whose ``update`` is a method of an object with a ``config`` that has
  the fields :func:`qcomm.describe` reads: ``axis_name``, ``codec``, ``policy``,
  ``comm_bucket_size`` and ``accum_steps``, the calls per communication).

  ValueError for anything else, including a chain that contains a sync: optax combinators build
  new functions and do not expose their parts, so keep a reference to the sync transformation.
  """
  owner = getattr(getattr(tx, "update", None), "__self__", None)
  if not hasattr(owner, "config") or not all(
      hasattr(owner.config, a) for a in ("axis_name", "codec", "policy", "comm_bucket_size",
                                         "accum_steps")):
    raise ValueError(
        f"tx must be the transformation returned by qcomm.sync(...), got {tx!r}. A sync inside "
        f"optax.chain / MultiSteps / inject_hyperparams cannot be found from the outer "
        f"transformation: keep a reference (s = qcomm.sync(...); tx = optax.chain(..., s)) and "
        f"pass s.")
  return owner.config


# Keyword arguments of earlier versions of sync -> what replaces them.
_REMOVED = {
    "summable": "codec=qcomm.Summable(bits, bucket_size)",
    "scheme": "codec=qcomm.QSGD(bits, bucket_size, scheme=...)",
    "compress_1d": "policy=qcomm.LeafPolicy(compress_1d=...)",
    "overrides": "policy=qcomm.LeafPolicy(overrides={regex: codec})",
}


def _resolve_policy(policy: Any, min_size: Any, exclude: Any) -> packing.LeafPolicy:
  """The leaf policy from ``policy=`` or the ``min_size`` / ``exclude`` shorthand."""
  if policy is not None:
    if min_size is not None or exclude is not None:
      raise ValueError(f"pass either policy= or the min_size= / exclude= shorthand, not both; "
                       f"got policy={policy!r}, min_size={min_size!r}, exclude={exclude!r}")
    return check_instance("policy", policy, packing.LeafPolicy, "a qcomm.LeafPolicy")
  return packing.LeafPolicy(min_size=min_size, exclude=() if exclude is None else exclude)


def sync(inner: optax.GradientTransformation, *, codec: Codec | None = None,
         policy: packing.LeafPolicy | None = None, axis_name: AxisName = "data",
         accum_steps: int = 1, error_feedback: bool | None = None,
         comm_bucket_size: int | None = None, seed: int = 0, check_varying: bool = True,
         bits: int | None = None, bucket_size: int | None = None, min_size: int | None = None,
         exclude: str | Sequence[str] | None = None, shard_state: bool = False,
         gather_codec: Codec | None = None, shard_params: bool = False,
         param_codec: Codec | None = None, hpz: bool = False,
         **removed: Any) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that it sees gradients averaged across ``axis_name``.

  Args:
    inner: the optimizer applied to the synchronised gradients (any optax transformation; extra
      arguments given to ``update``, such as ``value=`` for ``optax.contrib.reduce_on_plateau``,
      reach it).
    codec: the default codec, any :class:`qcomm.Codec` object: ``qcomm.QSGD(4)``,
      ``qcomm.QSGD(2, bucket_size=256)``, ``qcomm.Summable(4)``, ``qcomm.Cast(jnp.bfloat16)``,
      ``qcomm.NoCompression()``, or one of your own. Default: ``qcomm.Auto(4)`` (the ``bits``
      shorthand's 4 bits).
    policy: the per-leaf rules (:class:`qcomm.LeafPolicy`): which leaves travel exact (small ones,
      1-D ones, names matching ``exclude``) and which get another codec (``overrides``). Default
      ``LeafPolicy()``.
    axis_name: the data-parallel axis (a name, a tuple of names, or ``qcomm.Hierarchical``);
      ``update`` must run inside ``jax.shard_map`` or ``jax.pmap`` binding it.
    accum_steps: communicate (and step ``inner``) every ``accum_steps`` calls; the gradients of the
      calls in between are averaged locally first. Counters outside (``TrainState.step``,
      ``nnx.Optimizer.step``) count calls; ``inner``'s own counts and ``SyncState.gradient_step``
      count optimizer steps.
    error_feedback: keep, per device, what its own quantisation lost and add it to the next
      gradient (only for lossy codecs). Costs one float32 copy of the gradients per device. With
      the ``bits`` shorthand QSGD then rounds to nearest (EF-SGD's deterministic compressor); a
      codec object is used as given (``QSGD(1, rounding="nearest")`` is the stable choice).
      Default (None): on for a codec that wants it (:attr:`qcomm.Codec.wants_error_feedback`:
      ``qcomm.TopK``, ``qcomm.PowerSGD``), off otherwise.
    comm_bucket_size: most elements per flat communication buffer (None: the codec's own
      :meth:`~qcomm.Codec.comm_buffer_size`, 2**24 elements; Summable 2**26).
    seed: seeds the rounding key (the device index is folded in, so replicas still differ).
    check_varying: ``update`` raises ValueError for a gradient that is the same on every device
      (not varying over ``axis_name`` inside ``shard_map``): the gradient of a replicated
      parameter, already summed across devices by autodiff, which averaged once more would give
      updates D times too large. Pass False only if every device really computes the same
      gradient. JAX records variation only inside ``shard_map`` with ``check_vma=True`` (the
      default): under ``jax.pmap`` or ``check_vma=False`` this is not checked.
    bits, bucket_size: shorthand for ``codec``: 32 exact (``NoCompression``), 16 ``Wire16()``
      (bf16-class accuracy in fixed-point fields summed as integers on CPU, where XLA's
      all-reduce widens bf16; the bf16 cast on GPUs), 1..8 ``Auto(bits, bucket_size)`` (QSGD or
      Summable, whichever the transport makes faster; default 4 bits; bucket 128, or 64 at 1 and
      2 bits: ``qcomm.codecs.default_bucket``). Where 2 bits are not few enough (below about 0.3x
      of fp32's time on a 1 Gbit/s link for a ResNet-50), ``codec=qcomm.PowerSGD(1)`` sends 18x
      fewer bytes and is faster (docs/benchmarks.md).
    min_size, exclude: shorthand for ``policy=qcomm.LeafPolicy(min_size=..., exclude=...)``.
    shard_state: sharded optimizer state (ZeRO-1 style, per-parameter shards as PyTorch FSDP2):
      the gradients are reduce-scattered with ``codec`` (each value quantised once on its way to
      its owner); ``inner`` runs on this device's shard of every parameter (a pytree with the
      parameters' structure; each leaf keeps its rank and is split along its first axis that D
      divides, else its least padded one, to ``ceil(n / D)``: dim 0 of a ``Dense`` kernel, a
      channel axis of a convolution kernel ``(H, W, in, out)``; 0-d leaves whole) against
      an fp32 master shard; the new parameters travel as the quantised *difference* from the
      current ones through ``gather_codec``, and every device applies the same decoded
      difference (what quantisation lost stays in the master: error feedback on the weight path).
      ``update`` needs ``params`` and returns that difference, so ``optax.apply_updates`` works
      as always. The optimizer state per device is 1/D of the replicated one. Whole-model
      quantities inside ``inner``: use :func:`qcomm.clip_by_global_norm` (one scalar psum).
      An ``inner`` that reduces over a parameter's elements (``optax.clip_by_global_norm``, the
      trust ratios of LAMB and LARS, Adafactor's factored moments) would see a shard and is
      refused (ValueError, found in its trace); use those unsharded. ``optax.apply_if_finite`` inside is an error: a non-finite window is skipped by
      the sync itself (the same decision on every device, one scalar psum) and counted in
      ``total_notfinite``.
    gather_codec: the codec of the weight differences with ``shard_state`` (default
      ``qcomm.QSGD(4, rounding="nearest")``, as accurate as 8 bits in our measurements;
      ``QSGD(8, rounding="nearest")`` doubles those bytes).
      Leaves the policy sends exact travel exact on both paths.
    shard_params: sharded parameters (ZeRO-3 / FSDP; :func:`qcomm.data_parallel` runs it). The
      parameters themselves live as 1/D shards over ``axis_name`` (:class:`qcomm.ParamShard`:
      ``dp.shard(params)``), and so do the gradients and ``inner``'s whole state. ``loss_fn``
      receives the shards and gathers each layer's full parameters where it runs with
      ``qcomm.gather_params(shards)``, which takes this sync's codecs: the forward all-gather
      with ``param_codec``, the backward reduce-scatter of the gradient with ``codec`` (each
      shard receives the devices' mean gradient; the policy's exact leaves travel exact both
      ways). ``update`` then steps ``inner`` on the shards and sends nothing itself. Unlike
      ``shard_state`` (replicated parameters, sharded optimizer state: one reduce-scatter and
      one all-gather of weight differences per step), the full parameters never exist outside
      the layer that runs. No error feedback (its residual would be a full-size copy of the
      gradient per device).
    param_codec: with ``shard_params``, the codec of the parameters' all-gathers (default
      ``qcomm.QSGD(8, rounding="nearest")``, ZeRO++'s qwZ: each gathered weight within half a
      step of 1/255 of its bucket's range; the master copy in the shards stays exact;
      ``qcomm.NoCompression()`` for exact gathers).
    hpz: with ``shard_params`` and ``axis_name=(node, gpu)``: ZeRO++'s hpZ, the gathers in two
      stages, across nodes with ``param_codec`` to a secondary shard of ``1/gpu`` of each layer,
      then exactly inside the node; the model's ``jax.checkpoint(..., policy=
      qcomm.hpz_remat_policy)`` keeps the secondary shard, so backward's re-gather stays inside
      the node (see :func:`qcomm.gather_params`).

  Returns:
    An ``optax.GradientTransformationExtraArgs``. ``init(params)`` builds a :class:`SyncState`;
    called inside ``shard_map``/``pmap`` over the axis its per-device parts are this device's,
    ``(1, *param.shape)``; called anywhere else (``tx.init(params)``, flax ``TrainState.create``,
    ``nnx.Optimizer``) they are global, ``(D, *param.shape)``, with D the current mesh's
    axis (``jax.set_mesh``) if set, else ``jax.device_count()``, to be passed to ``shard_map``
    with :func:`state_partition_spec`. ``update(grads, state, params, **extra_args)`` must run
    inside ``shard_map``/``pmap``; it raises ValueError if the per-device parts arrive replicated.

  Composition: put everything stateful *inside* (``sync(optax.chain(clip, adamw), ...)``). With
  ``accum_steps > 1`` the calls that do not communicate return zero updates, which a stateful
  transformation chained *after* the sync would take for real gradients (Adam's moments decay);
  :func:`state_partition_spec` and :func:`qcomm.data_parallel` raise for such a chain. A stateless
  transformation after it that does not map zero to zero (``optax.add_decayed_weights``) would
  still act on those calls: :func:`qcomm.data_parallel` applies updates only on the calls that
  communicate, so it decays once per optimizer step; in your own step, do the same (or put it
  inside the sync).

  Non-finite gradients: a communication whose averaged gradient holds a NaN or an infinity (the
  same decision on every device: all replicas hold the same average) passes it to ``inner``
  unchanged, so it is never made finite, counts it in ``total_notfinite`` and keeps the
  error-feedback residual of before the window; the accumulator restarts from zero after every
  communication. Wrap the inner optimizer, ``sync(optax.apply_if_finite(inner, k))``, to skip
  such steps and train on. Not ``optax.apply_if_finite(sync(...))``: outside, it would test each
  device's own gradient, and the devices would disagree on whether to communicate.
  """
  for name in removed:
    if name in _REMOVED:
      raise ValueError(f"sync's {name}= was replaced: pass {_REMOVED[name]}")
    raise TypeError(f"sync() got an unexpected keyword argument {name!r}")
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise ValueError(f"inner must be an optax.GradientTransformation, got {inner!r}")
  check_axis_name("axis_name", axis_name, (Hierarchical,), "qcomm.Hierarchical(inner, outer)")
  error_feedback = _parts.resolve_error_feedback(error_feedback, codec)
  codec = _parts.resolve_codec(codec, bits, bucket_size, error_feedback)
  policy = _resolve_policy(policy, min_size, exclude)
  shard_state = check_bool("shard_state", shard_state)
  shard_params = check_bool("shard_params", shard_params)
  hpz = check_bool("hpz", hpz)
  if shard_params:
    param_codec = _check_shard_params(shard_state, error_feedback, param_codec, hpz, axis_name,
                                      codec, policy)
  elif param_codec is not None or hpz:
    raise ValueError("param_codec and hpz apply to shard_params=True only (the parameters' "
                     "gathers); pass shard_params=True or leave them out")
  if gather_codec is not None and not shard_state:
    raise ValueError("gather_codec applies to shard_state=True only (the weight differences of "
                     "the sharded mode); pass shard_state=True or leave gather_codec out")
  if shard_state:
    for c in (codec,) + tuple(c for _, c in policy.overrides):
      try:  # a codec without a reduce-scatter says so here, not inside the first step
        c.leaves_traffic([(2 * c.pad_multiple,)], 2, "reduce_scatter")
      except ValueError as e:
        raise ValueError(f"codec {c.name} cannot run with shard_state=True: {e}") from None
    gather_codec = DEFAULT_GATHER_CODEC if gather_codec is None else check_instance(
        "gather_codec", gather_codec, Codec, "a jax_qcomm codec, e.g. qcomm.QSGD(8, "
        "rounding='nearest')")
    if isinstance(axis_name, Hierarchical):
      raise ValueError("axis_name must be a name or a tuple of names with shard_state=True: the "
                       "shards are split over the whole axis (qcomm.Hierarchical is not sharded)")
  config = SyncConfig(axis_name=axis_name, codec=codec, policy=policy,
                      accum_steps=check_int("accum_steps", accum_steps),
                      error_feedback=error_feedback and codec.lossy,
                      comm_bucket_size=check_int_or_none("comm_bucket_size", comm_bucket_size),
                      seed=_parts.check_seed(seed), check_varying=check_bool("check_varying", check_varying),
                      shard_state=shard_state, gather_codec=gather_codec,
                      shard_params=shard_params, param_codec=param_codec, hpz=hpz)
  kind = (param_shards.ParamShardSync if shard_params else _ShardedSync if shard_state else _Sync)
  s = kind(optax.with_extra_args_support(inner), config)
  return optax.GradientTransformationExtraArgs(s.init, s.update)


def _check_shard_params(shard_state, error_feedback, param_codec, hpz, axis_name, codec, policy):
  """The checks of ``shard_params=True``; returns the parameters' codec."""
  if shard_state:
    raise ValueError(
        "shard_params=True and shard_state=True cannot be combined: shard_state keeps the "
        "parameters replicated and shards the optimizer state (ZeRO-1); shard_params shards the "
        "parameters, gradients and optimizer state alike (ZeRO-3), which includes what "
        "shard_state does. Pass one of them")
  if isinstance(axis_name, Hierarchical):
    raise ValueError("axis_name must be a name or a tuple of names with shard_params=True "
                     "(qcomm.Hierarchical is not sharded; hpz=True gathers in two stages)")
  if hpz and len(axis_names(axis_name)) < 2:
    raise ValueError(f"hpz=True needs axis_name=(node, gpu), two or more axes: the secondary "
                     f"shard is gathered across all but the last; got {axis_name!r}")
  if policy.exclude or policy.overrides:
    raise ValueError("policy's exclude and overrides name parameter paths, which the gathers of "
                     "shard_params=True do not see (each gathers a subtree): with shard_params, "
                     "the policy picks exact leaves by shape alone (min_size, compress_1d)")
  param_codec = DEFAULT_PARAM_CODEC if param_codec is None else check_instance(
      "param_codec", param_codec, Codec, "a jax_qcomm codec, e.g. qcomm.QSGD(8, "
      "rounding='nearest')")
  param_shards.check_codecs(codec, param_codec)
  if error_feedback and codec.lossy:
    raise ValueError("error_feedback is not available with shard_params=True: its residual "
                     "would be a full-size copy of the gradient per device, what sharding the "
                     "parameters exists to avoid. Use an unbiased codec (QSGD with stochastic "
                     "rounding, the bits= default) for the gradients")
  return param_codec


class _Sync:
  """The functions of one sync transformation, in named steps; ``config`` is its settings."""

  state_type = SyncState

  def __init__(self, inner: optax.GradientTransformationExtraArgs, config: SyncConfig):
    self.inner = inner
    self.config = config
    self.names = axis_names(config.axis_name)

  # -- init ----------------------------------------------------------------------------------------
  def init(self, params: Any) -> SyncState:
    check_array_leaves("params", params)
    cfg = self.config
    d, bound = _parts.num_devices(cfg.axis_name)
    # Bound: this device's own part (1, ...), typed as varying like what update returns.
    # Elsewhere: the global array of all D devices' parts, to be split by state_partition_spec.
    zeros = lambda: _parts.per_device(_f32_zeros(params), self.names, d, bound)  # noqa: E731
    return SyncState(
        inner_opt_state=self.inner.init(params), mini_step=_parts.zero(),
        key=_parts.seed_key(cfg.seed), acc_grads=zeros() if cfg.accum_steps > 1 else (),
        residual=zeros() if cfg.error_feedback else (), gradient_step=_parts.zero(),
        total_notfinite=_parts.zero(),
        codec_state=collectives.init_codec_state(
            params, cfg.codec, cfg.policy, jax.random.fold_in(jax.random.key(cfg.seed), 1)),
        config=cfg)

  # -- update ----------------------------------------------------------------------------------------
  def update(self, grads: Any, state: SyncState, params: Any = None, **extra_args: Any):
    """Accumulates this device's gradients; every ``accum_steps``-th call communicates."""
    cfg = self.config
    axis_size(cfg.axis_name)  # clear error outside shard_map / pmap
    packing.check_float_leaves(grads, "grads")
    if cfg.check_varying:
      _varying.check_per_device(grads, self.names, "grads", "qcomm.sync(...).update")
    self._check_state(state, grads)
    g32 = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
    if cfg.accum_steps == 1:
      updates, new_state = self._communicate(g32, state, params, extra_args)
      return _like(updates, grads), new_state

    acc = jax.tree_util.tree_map(lambda a, g: a + g[None], state.acc_grads, g32)
    mini_step = state.mini_step + 1

    def emit():
      mean = jax.tree_util.tree_map(lambda a: a[0] * jnp.float32(1.0 / cfg.accum_steps), acc)
      updates, new = self._communicate(mean, state._replace(acc_grads=()), params, extra_args)
      # The accumulator restarts after every communication, finite or not.
      return _like(updates, grads), new._replace(acc_grads=_f32_zeros(acc))

    def accumulate():
      # Fresh zeros, not zeros_like: replicated (like real updates), not varying like grads.
      zeros = jax.tree_util.tree_map(lambda g: jnp.zeros(g.shape, g.dtype), grads)
      return zeros, state._replace(mini_step=mini_step, acc_grads=acc)

    return _compat.cond(mini_step >= cfg.accum_steps, (emit, accumulate))

  def _communicate(self, grads: Any, state: SyncState, params: Any, extra_args: dict):
    """Allreduce (with error feedback) + inner step. grads: float32, this device's mean."""
    cfg = self.config
    key, sub = _parts.split_key(state.key)
    if cfg.error_feedback:
      grads = _parts.add_residual(grads, state.residual)
    synced, lost, codec_state, mark = collectives.allreduce_tree(
        grads, cfg.axis_name, cfg.codec, sub, "mean", policy=cfg.policy,
        comm_bucket_size=cfg.comm_bucket_size, codec_state=state.codec_state)
    # The codecs' mark of the average (Codec.allreduce_leaves_marked), the same on every device,
    # so this decision is too (over every shard of a model-sharded step).
    finite = jnp.isfinite(_parts.whole_model(mark, self.names))
    # A non-finite window must not poison the residual of later steps.
    residual = _parts.next_residual(finite, lost, state.residual) if cfg.error_feedback else ()
    if params is not None:  # inner sees gradients in the parameters' dtypes
      try:
        synced = jax.tree_util.tree_map(lambda g, p: g.astype(jnp.result_type(p)), synced, params)
      except (ValueError, TypeError) as e:
        raise ValueError(f"params must be None or the parameters, a pytree with the structure of "
                         f"grads, got {jax.tree_util.tree_structure(params)}: {e}") from None
    with _parts.inside(self.names):
      updates, inner_state = self.inner.update(synced, state.inner_opt_state, params,
                                               **extra_args)
    return updates, SyncState(
        inner_opt_state=inner_state, mini_step=_parts.zero(), key=key,
        acc_grads=state.acc_grads, residual=residual, gradient_step=state.gradient_step + 1,
        total_notfinite=_parts.count_notfinite(state.total_notfinite, finite),
        codec_state=_parts.keep_if_finite(finite, codec_state, state.codec_state), config=cfg)

  def _check_state(self, state: Any, grads: Any) -> None:
    """Clear errors for a state that does not fit this step (the commonest: passed with P())."""
    cfg = self.config
    if not isinstance(state, self.state_type):
      raise TypeError(f"state must be the qcomm.{self.state_type.__name__} made by this "
                      f"transformation's init, got {type(state).__name__}")
    tracked = _varying.tracked(self.names)
    want_treedef = jax.tree_util.tree_structure(grads)
    for field, used, why in (("acc_grads", cfg.accum_steps > 1, "accum_steps == 1"),
                             ("residual", cfg.error_feedback, "no error feedback")):
      part = getattr(state, field)
      if not used:
        if jax.tree_util.tree_leaves(part):
          raise ValueError(f"state.{field} is not empty but this sync has {why}: the state was "
                           f"made by a sync with other settings")
        continue
      leaves, treedef = jax.tree_util.tree_flatten_with_path(part)
      if treedef != want_treedef:
        raise ValueError(f"state.{field} does not have the structure of the gradients: "
                         f"{treedef} vs {want_treedef}")
      for (path, a), g in zip(leaves, jax.tree_util.tree_leaves(grads)):
        where = f"SyncState.{field}, leaf '{packing.path_str(path) or '<root>'}'"
        want = (1,) + tuple(jnp.shape(g))
        got = tuple(jnp.shape(a))
        if got != want:
          raise ValueError(
              f"qcomm.sync: the per-device part of the optimizer state ({where}) has shape {got} "
              f"inside the step; it must be {want}: a leading device axis of size 1 on each "
              f"device, varying over {cfg.axis_name!r}. " + _parts.state_shape_hint(got, want, cfg.axis_name))
        if tracked and _varying.unvarying(a, self.names):
          raise ValueError(
              f"qcomm.sync: the per-device part of the optimizer state ({where}) is replicated "
              f"(not varying over {cfg.axis_name!r}) inside the step. " + _parts.state_fix_hint(cfg.axis_name))


@register_state
class ShardedSyncState(NamedTuple):
  """State of ``qcomm.sync(..., shard_state=True)``: :class:`SyncState`'s fields, with the inner
  optimizer's state and the fp32 master copy of this device's shards per device.

  Per device (a leading device axis; ``PartitionSpec(axis_name)``):
    inner_opt_state: ``inner``'s state for this device's shards (every leaf ``(1, ...)`` inside
      the step, ``(D, ...)`` as a global array).
    master: float32 shards of the parameters (``(1, ceil(n0 / D), *rest)`` per leaf inside the
      step; 0-d leaves whole), which the weight differences are taken from.
    acc_grads, residual: as in :class:`SyncState` (full-size, this device's own).
  Replicated: mini_step, key, gradient_step, total_notfinite, as in :class:`SyncState`.
  config: the settings (:class:`SyncConfig`), a static pytree node with no arrays.
  """

  inner_opt_state: Any
  master: Any
  mini_step: jax.Array
  key: jax.Array
  acc_grads: Any
  residual: Any
  gradient_step: jax.Array
  total_notfinite: jax.Array
  config: SyncConfig | None = None

  PER_DEVICE_FIELDS = ("inner_opt_state", "master", "acc_grads", "residual")
  NESTED_FIELDS = ()
  PER_DEVICE_NESTED_FIELDS = ()
  REPLICATED_FIELDS = ("mini_step", "key", "gradient_step", "total_notfinite")


def _refuse_shard_blind(inner_state: Any) -> None:
  """ValueError for an inner transformation that a shard makes silently wrong and that its state
  shows (optax.apply_if_finite). The trust ratios of LAMB / LARS keep an optax.EmptyState, which
  shows nothing: the docs say to use them unsharded."""
  for node in jax.tree_util.tree_leaves(
      inner_state, is_leaf=lambda x: isinstance(x, optax.ApplyIfFiniteState)):
    if isinstance(node, optax.ApplyIfFiniteState):
      raise ValueError("optax.apply_if_finite inside a sync with shard_state=True would decide per "
                       "shard, differently on every device; the sharded sync itself skips a "
                       "non-finite window (counted in total_notfinite): drop apply_if_finite.")


class _ShardedSync(_Sync):
  """The sharded mode: reduce-scatter, ``inner`` on this device's shards, all-gather of the
  quantised weight differences (see :func:`sync`, ``shard_state``)."""

  state_type = ShardedSyncState

  def _layout(self, tree: Any, devices: int) -> Layout:
    leaves = jax.tree_util.tree_leaves(tree)
    codecs = packing.leaf_codecs(tree, self.config.codec, self.config.policy)
    # Leaves that vary over other manual axes (model-sharded) travel apart from the rest.
    kinds = [packing.vma_kind(x) - set(self.names) for x in leaves]
    return Layout.of([tuple(jnp.shape(x)) for x in leaves], devices, codecs,
                     self.config.comm_bucket_size, kinds)

  def _gather_codec(self, grad_codec: Codec) -> Codec:
    return NoCompression() if grad_codec.exact else self.config.gather_codec

  def init(self, params: Any) -> ShardedSyncState:
    check_array_leaves("params", params)
    cfg = self.config
    d, bound = _parts.num_devices(cfg.axis_name)
    tracked = bound and _varying.tracked(self.names)
    layout = self._layout(params, d)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    f32 = [jnp.asarray(x, jnp.float32) for x in leaves]
    if bound:  # this device's shards, (1, ...)
      index = lax.axis_index(self.names)
      shards = [layout.shard_of(x, i, index) for i, x in enumerate(f32)]
      master = jax.tree_util.tree_unflatten(treedef, shards)
      inner_state = jax.tree_util.tree_map(lambda a: a[None], self.inner.init(master))
      master = jax.tree_util.tree_map(lambda a: a[None], master)
    else:  # every device's shards, (D, ...): split by state_partition_spec
      shards = [layout.to_shard(layout.rows(x, i), i) for i, x in enumerate(f32)]
      master = jax.tree_util.tree_unflatten(treedef, shards)
      inner_state = jax.vmap(self.inner.init)(master)
    _refuse_shard_blind(inner_state)

    def per_device(tree):
      return jax.tree_util.tree_map(lambda z: _compat.make_varying(z, frozenset(self.names)),
                                    tree) if tracked else tree

    zeros = lambda: _parts.per_device(_f32_zeros(params), self.names, d, bound)  # noqa: E731
    return ShardedSyncState(
        inner_opt_state=per_device(inner_state), master=per_device(master),
        mini_step=_parts.zero(), key=_parts.seed_key(cfg.seed),
        acc_grads=zeros() if cfg.accum_steps > 1 else (),
        residual=zeros() if cfg.error_feedback else (),
        gradient_step=_parts.zero(), total_notfinite=_parts.zero(), config=cfg)

  def _check_state(self, state: Any, grads: Any) -> None:
    super()._check_state(state, grads)
    for path, a in jax.tree_util.tree_flatten_with_path(state.master)[0]:
      if jnp.shape(a)[:1] != (1,):
        raise ValueError(
            f"qcomm.sync: the per-device part of the optimizer state (ShardedSyncState.master, "
            f"leaf '{packing.path_str(path) or '<root>'}') has shape {tuple(jnp.shape(a))} inside "
            f"the step; it must have a leading device axis of size 1. "
            + _parts.state_fix_hint(self.config.axis_name))

  def _communicate(self, grads: Any, state: ShardedSyncState, params: Any, extra_args: dict):
    cfg = self.config
    if params is None:
      raise ValueError("params must be given to update with shard_state=True: the weight "
                       "differences are taken from them (tx.update(grads, state, params))")
    names = self.names
    d = axis_size(cfg.axis_name)
    index = lax.axis_index(names)
    layout = self._layout(grads, d)
    key, sub = _parts.split_key(state.key)
    if cfg.error_feedback:
      grads = _parts.add_residual(grads, state.residual)
    g_leaves, treedef = jax.tree_util.tree_flatten(grads)
    p_leaves = jax.tree_util.tree_leaves(params)
    n = len(g_leaves)

    # 1. Reduce-scatter: this device's shard of the mean gradient of every leaf.
    shards, lost, marks = [None] * n, [None] * n, []
    for k, group in enumerate(layout.groups):
      blocks, res, mark = group.codec.reduce_scatter_leaves_marked(
          [layout.chunks(g_leaves[i], i) for i in group.leaves], cfg.axis_name,
          jax.random.fold_in(sub, 2 * k), "mean")
      marks.append(mark)
      for i, block, r in zip(group.leaves, blocks, res):
        shards[i], lost[i] = layout.to_shard(block, i), layout.unchunks(r, i)

    # 2. Whole-model finiteness, the same decision on every device: one scalar psum of the
    # codecs' marks of this device's shards.
    finite = jnp.isfinite(_parts.whole_model(lax.psum(sum(marks, jnp.float32(0)), names), names))

    # 3. inner on the shards, against the fp32 master; a non-finite window keeps both. Written so
    # that XLA updates the donated state in place: mapped over the state's own leading device axis
    # (size 1), the new state is computed in the shape it is stored in, and a cond rather than a
    # select of old and new (which reads the old state beside the new: a copy of every array).
    inner_state = jax.tree_util.tree_map(lambda a: a[0], state.inner_opt_state)
    master = jax.tree_util.tree_map(lambda a: a[0], state.master)
    grad_shards = jax.tree_util.tree_unflatten(treedef, shards)
    weights = tuple(1.0 if leaf.split else 1.0 / d for leaf in layout.leaves)
    run = _parts.inner_on_shards(self.inner, self.names, extra_args, grad_shards, inner_state,
                                 master)

    def step():
      lead = jax.tree_util.tree_map(lambda a: a[None], grad_shards)
      with _parts.sharded((names, weights)):
        updates, new_inner = jax.vmap(run)(lead, state.inner_opt_state, state.master)
      return optax.apply_updates(state.master, updates), new_inner

    new_master, new_inner = _compat.cond(
        finite, (step, lambda: (state.master, state.inner_opt_state)))

    # 4. All-gather of the quantised differences from the current (replicated) parameters.
    m_leaves = [a[0] for a in jax.tree_util.tree_leaves(new_master)]
    diffs = [None] * n
    for k, group in enumerate(layout.groups):
      rows = self._gather_codec(group.codec).all_gather_differences(
          [layout.from_shard(m_leaves[i], i) for i in group.leaves],
          [layout.chunks(jnp.asarray(p_leaves[i], jnp.float32), i) for i in group.leaves], index,
          cfg.axis_name, jax.random.fold_in(sub, 2 * k + 1))
      for i, r in zip(group.leaves, rows):
        diffs[i] = jnp.where(finite, layout.unrows(r, i), 0.0).astype(jnp.result_type(p_leaves[i]))

    residual = ()
    if cfg.error_feedback:
      residual = _parts.next_residual(finite, jax.tree_util.tree_unflatten(treedef, lost),
                                      state.residual)
    return jax.tree_util.tree_unflatten(treedef, diffs), ShardedSyncState(
        inner_opt_state=new_inner, master=new_master,
        mini_step=_parts.zero(), key=key, acc_grads=state.acc_grads, residual=residual,
        gradient_step=state.gradient_step + 1,
        total_notfinite=_parts.count_notfinite(state.total_notfinite, finite), config=cfg)


def _f32_zeros(tree: Any) -> Any:
  return jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), tree)


def _like(updates: Any, grads: Any) -> Any:
  return jax.tree_util.tree_map(lambda u, g: u.astype(g.dtype), updates, grads)
