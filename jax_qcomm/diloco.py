"""``qcomm.diloco``: infrequent, compressed outer synchronisation (the DiLoCo family).

    tx = qcomm.diloco(optax.adamw(3e-4), axis_name="node", every=50, codec=qcomm.QSGD(4))
    dp = qcomm.diloco_data_parallel(loss_fn, tx, mesh)
    local_params, opt_state = dp.init(params)
    local_params, opt_state, losses, aux = dp.step(local_params, opt_state, batch)
    eval_params = qcomm.diloco_params(opt_state)          # the anchor: evaluate / checkpoint it

Each replica along ``axis_name`` runs ``inner`` on its own gradients, with no collective, for
``every`` inner optimizer steps. Then, on one call, every replica computes its pseudo-gradient
``delta = anchor - local parameters`` (float32), the codec's allreduce averages it (with this
replica's error-feedback residual added), the outer optimizer takes the mean as a *gradient* and
moves the anchor (``anchor <- anchor + outer.update(mean)``), and the local parameters are reset to
the new anchor. Every replica applies the same decoded mean to the same anchor, so the anchors stay
bit-identical. The collective sits in the taken branch of a ``lax.cond``: the other calls run none.

Parameters and ``inner``'s state are per replica between synchronisations (a leading replica axis,
``PartitionSpec(axis_name)``); the anchor and the outer optimizer's state are replicated, float32.
``inner`` may itself be :func:`qcomm.sync` over a faster axis (``axis_name="gpu"`` inside a node):
its ``accum_steps`` is honoured (``every`` counts its optimizer steps).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import optax

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jax_qcomm import _compat, _varying, collectives, packing
from jax_qcomm._checks import (check_array_leaves, check_axis_name, check_bool, check_instance,
                               check_int, check_int_or_none, check_key)
from jax_qcomm.axes import AxisName, Hierarchical, axis_names, axis_size
from jax_qcomm.codecs import QSGD, Codec
from jax_qcomm.data_parallel import _SpecKey, place
from jax_qcomm.sync import (SyncConfig, _all_finite, holds_sync, num_devices, register_state,
                            state_partition_spec)


@register_state
class DiLoCoState(NamedTuple):
  """State of :func:`diloco` (a pytree of arrays; checkpointable with orbax as it is).

  Per replica (a leading replica axis: ``(D, ...)`` as a global array, ``(1, ...)`` inside the
  step; :func:`diloco_partition_spec`):
    inner_opt_state: ``inner``'s state, every leaf with the replica axis in front. Never reset,
      never sent.
    residual: float32 error-feedback residual of the pseudo-gradient (``()`` without error
      feedback).
  Replicated (``PartitionSpec()``):
    anchor: the float32 global parameters: what to evaluate and checkpoint
      (:func:`diloco_params`).
    outer_opt_state: the outer optimizer's state (float32, the anchor's structure).
    mini_step: calls since the last synchronisation (int32; 0 right after one).
    outer_step: synchronisations so far (int32).
    key: rounding key data (uint32[2]), advanced at every synchronisation.
    total_notfinite: synchronisations whose mean pseudo-gradient held a NaN or an infinity; they
      leave the anchor, the outer state and the residual as they were.
  """

  inner_opt_state: Any
  anchor: Any
  outer_opt_state: Any
  residual: Any
  mini_step: jax.Array
  outer_step: jax.Array
  key: jax.Array
  total_notfinite: jax.Array

  # What state_partition_spec reads (correct when inner holds no qcomm.sync; otherwise use
  # diloco_partition_spec, which also knows the inner sync's axis).
  PER_DEVICE_FIELDS = ("inner_opt_state", "residual")
  NESTED_FIELDS = ()
  REPLICATED_FIELDS = ("anchor", "outer_opt_state", "mini_step", "outer_step", "key",
                       "total_notfinite")


@dataclasses.dataclass(frozen=True)
class DiLoCoConfig:
  """The settings of a :func:`diloco` transformation (read by ``config_of`` and
  :func:`qcomm.describe`, which reports bytes per call = bytes per synchronisation /
  ``accum_steps``)."""

  axis_name: Any
  codec: Codec
  policy: packing.LeafPolicy
  every: int
  error_feedback: bool
  comm_bucket_size: int | None
  seed: int = 0
  inner_accum_steps: int = 1
  inner_axis_name: Any = None

  @property
  def accum_steps(self) -> int:
    """Calls per communication: ``every`` inner optimizer steps of ``inner_accum_steps`` calls."""
    return self.every * self.inner_accum_steps


def _sync_config(tx: Any) -> SyncConfig | None:
  config = getattr(getattr(getattr(tx, "update", None), "__self__", None), "config", None)
  return config if isinstance(config, SyncConfig) else None


def diloco(inner: optax.GradientTransformation, *, axis_name: AxisName, every: int,
           codec: Codec | None = None, outer: optax.GradientTransformation | None = None,
           error_feedback: bool = False, policy: packing.LeafPolicy | None = None,
           comm_bucket_size: int | None = None,
           seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """Local steps of ``inner``, and every ``every`` steps a compressed outer step across replicas.

  Args:
    inner: the optimizer each replica runs on its own gradients (any optax transformation), or
      ``qcomm.sync(...)`` over another, faster axis (data parallelism inside a replica: the
      "GPU-poor" topology of fast links inside a node and a slow link between nodes).
    axis_name: the replica axis (a name or a tuple of names); ``update`` runs inside
      ``jax.shard_map`` binding it.
    every: inner optimizer steps between synchronisations (H). If ``inner`` is a ``qcomm.sync``
      with ``accum_steps=k``, a synchronisation happens every ``every * k`` calls, on the call
      where the inner optimizer stepped; otherwise every ``every`` calls.
    codec: the pseudo-gradient's codec (any :class:`qcomm.Codec`); default ``qcomm.QSGD(4)``.
      ``qcomm.NoCompression()`` is DiLoCo's fp32.
    outer: the outer optimizer, applied to the mean pseudo-gradient as a gradient; default
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` (DiLoCo's). Its state is float32 and
      replicated. ``optax.sgd(1.0)`` makes the anchor the replicas' mean.
    error_feedback: keep, per replica, what its quantisation of the pseudo-gradient lost and add it
      to the next one (float32; only for lossy codecs).
    policy: which leaves travel exact (:class:`qcomm.LeafPolicy`; default ``LeafPolicy()``: small
      and 1-D leaves exact).
    comm_bucket_size: most elements per flat communication buffer (None: the codec's own
      :meth:`~qcomm.Codec.comm_buffer_size`).
    seed: seeds the rounding key.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. ``init(params)`` builds a :class:`DiLoCoState`
    (inside ``shard_map``: this replica's parts ``(1, ...)``; outside: global ``(D, ...)``, D the
    current mesh's axis or ``jax.device_count()``). ``update(grads, state, params)`` needs this
    replica's *local* parameters (varying over ``axis_name``): on a synchronising call the
    returned updates take them to the new anchor (``anchor - params`` in their dtype); use
    :func:`diloco_apply_updates`, which lands on the anchor exactly, where
    ``optax.apply_updates`` may be off by a rounding. :func:`diloco_data_parallel` runs it all.
  """
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise ValueError(f"inner must be an optax.GradientTransformation, got {inner!r}")
  check_axis_name("axis_name", axis_name)
  every = check_int("every", every)
  codec = QSGD(4) if codec is None else check_instance(
      "codec", codec, Codec, "a jax_qcomm codec (qcomm.QSGD(4), qcomm.NoCompression(), ...)")
  if outer is None:
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  elif not (hasattr(outer, "init") and hasattr(outer, "update")):
    raise ValueError(f"outer must be an optax.GradientTransformation, got {outer!r}")
  error_feedback = check_bool("error_feedback", error_feedback)
  policy = packing.LeafPolicy() if policy is None else check_instance(
      "policy", policy, packing.LeafPolicy, "a qcomm.LeafPolicy")
  comm_bucket_size = check_int_or_none("comm_bucket_size", comm_bucket_size)
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise ValueError(f"seed must be an integer, got {seed!r}")
  inner_cfg = _sync_config(inner)
  inner_accum, inner_axis = 1, None
  if inner_cfg is not None:
    inner_accum, inner_axis = inner_cfg.accum_steps, inner_cfg.axis_name
    shared = set(axis_names(inner_axis)) & set(axis_names(axis_name))
    if shared:
      raise ValueError(f"axis_name {axis_name!r} must differ from the inner sync's axis "
                       f"{inner_axis!r} (they share {sorted(shared)})")
  config = DiLoCoConfig(axis_name=axis_name, codec=codec, policy=policy, every=every,
                        error_feedback=error_feedback and codec.lossy,
                        comm_bucket_size=comm_bucket_size, seed=seed,
                        inner_accum_steps=inner_accum, inner_axis_name=inner_axis)
  d = _DiLoCo(optax.with_extra_args_support(inner), outer, config)
  return optax.GradientTransformationExtraArgs(d.init, d.update)


class _DiLoCo:
  """The functions of one diloco transformation; ``config`` is its settings."""

  def __init__(self, inner: optax.GradientTransformationExtraArgs,
               outer: optax.GradientTransformation, config: DiLoCoConfig):
    self.inner = inner
    self.outer = outer
    self.config = config
    self.names = axis_names(config.axis_name)

  def init(self, params: Any) -> DiLoCoState:
    check_array_leaves("params", params)
    cfg = self.config
    d, bound = num_devices(cfg.axis_name)
    tracked = bound and _varying.tracked(self.names)
    axes = frozenset(self.names)

    def per_replica(a):
      a = jnp.asarray(a)
      if not bound:  # every replica's part: split by diloco_partition_spec
        return jnp.broadcast_to(a[None], (d,) + a.shape)
      return _compat.make_varying(a[None], axes) if tracked else a[None]

    anchor = jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.float32), params)
    zeros = lambda p: per_replica(jnp.zeros(jnp.shape(p), jnp.float32))  # noqa: E731
    return DiLoCoState(
        inner_opt_state=jax.tree_util.tree_map(per_replica, self.inner.init(params)),
        anchor=anchor, outer_opt_state=self.outer.init(anchor),
        residual=jax.tree_util.tree_map(zeros, params) if cfg.error_feedback else (),
        mini_step=jnp.zeros((), jnp.int32), outer_step=jnp.zeros((), jnp.int32),
        key=jax.random.key_data(jax.random.key(cfg.seed)).astype(jnp.uint32),
        total_notfinite=jnp.zeros((), jnp.int32))

  def update(self, grads: Any, state: DiLoCoState, params: Any = None, **extra_args: Any):
    cfg = self.config
    axis_size(cfg.axis_name)  # clear error outside shard_map
    packing.check_float_leaves(grads, "grads")
    self._check(grads, state, params)
    tracked = _varying.tracked(self.names)
    axes = frozenset(self.names)
    inner_state = jax.tree_util.tree_map(lambda a: a[0], state.inner_opt_state)
    updates, inner_state = self.inner.update(grads, inner_state, params, **extra_args)
    inner_state = jax.tree_util.tree_map(
        lambda a: _compat.make_varying(a[None], axes) if tracked else a[None], inner_state)
    mini_step = state.mini_step + 1

    def local():
      return updates, state._replace(inner_opt_state=inner_state, mini_step=mini_step)

    def outer_step():
      new_local = optax.apply_updates(params, updates)
      delta = jax.tree_util.tree_map(lambda a, p: a - p.astype(jnp.float32), state.anchor,
                                     new_local)
      if cfg.error_feedback:
        delta = jax.tree_util.tree_map(lambda x, r: x + r[0], delta, state.residual)
      key, sub = jax.random.split(jax.random.wrap_key_data(state.key))
      # With a sync inside, delta is the same on every device of its axis: each sends only its
      # share across the slow axis (collectives' Hierarchical path for values equal inside).
      axis = (cfg.axis_name if cfg.inner_axis_name is None
              else Hierarchical(cfg.inner_axis_name, cfg.axis_name))
      mean, lost = collectives.allreduce(
          delta, axis, cfg.codec, sub, "mean", policy=cfg.policy,
          comm_bucket_size=cfg.comm_bucket_size, return_residual=True, check_varying=False)
      # The mean is bit-identical on every replica, so this decision is too.
      finite = _all_finite(mean)
      outer_updates, outer_state = self.outer.update(mean, state.outer_opt_state, state.anchor)
      anchor = optax.apply_updates(state.anchor, outer_updates)
      keep = lambda new, old: jax.tree_util.tree_map(  # noqa: E731
          lambda a, b: jnp.where(finite, a, b).astype(b.dtype), new, old)
      anchor, outer_state = keep(anchor, state.anchor), keep(outer_state, state.outer_opt_state)
      residual = ()
      if cfg.error_feedback:
        residual = jax.tree_util.tree_map(lambda new, old: jnp.where(finite, new, old[0])[None],
                                          lost, state.residual)
      to_anchor = jax.tree_util.tree_map(
          lambda a, p: a.astype(jnp.result_type(p)) - p, anchor, params)
      return to_anchor, DiLoCoState(
          inner_opt_state=inner_state, anchor=anchor, outer_opt_state=outer_state,
          residual=residual, mini_step=jnp.zeros((), jnp.int32),
          outer_step=state.outer_step + 1, key=jax.random.key_data(key).astype(jnp.uint32),
          total_notfinite=state.total_notfinite + jnp.logical_not(finite).astype(jnp.int32))

    return _compat.cond(mini_step >= cfg.accum_steps, (outer_step, local))

  def _check(self, grads: Any, state: Any, params: Any) -> None:
    cfg = self.config
    if not isinstance(state, DiLoCoState):
      raise TypeError(f"state must be the qcomm.DiLoCoState made by this transformation's init, "
                      f"got {type(state).__name__}")
    if params is None:
      raise ValueError("params must be given to a qcomm.diloco update: this replica's local "
                       "parameters, which the pseudo-gradient is taken from "
                       "(tx.update(grads, state, params))")
    check_array_leaves("params", params)
    if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(grads):
      raise ValueError(f"params must have the structure of grads, got "
                       f"{jax.tree_util.tree_structure(params)} vs "
                       f"{jax.tree_util.tree_structure(grads)}")
    if _varying.tracked(self.names) and _varying.unvarying(params, self.names):
      path, _ = _varying.unvarying(params, self.names)[0]
      raise ValueError(
          f"params must be this replica's local parameters, varying over {cfg.axis_name!r}; leaf "
          f"'{path}' is replicated. Between synchronisations every replica has its own "
          f"parameters: carry them with a leading replica axis split over {cfg.axis_name!r} "
          f"(qcomm.diloco_data_parallel does; qcomm.data_parallel replicates them and cannot run "
          f"diloco).")
    hint = (f"Pass the state with qcomm.diloco_partition_spec(state, {cfg.axis_name!r}"
            + (f", inner_axis_name={cfg.inner_axis_name!r}" if cfg.inner_axis_name else "")
            + ") in in_specs and out_specs (qcomm.diloco_data_parallel does).")
    for field in ("inner_opt_state", "residual"):
      for path, a in jax.tree_util.tree_flatten_with_path(getattr(state, field))[0]:
        if jnp.shape(a)[:1] != (1,):
          raise ValueError(
              f"qcomm.diloco: the per-replica part of the state (DiLoCoState.{field}, leaf "
              f"'{packing.path_str(path) or '<root>'}') has shape {tuple(jnp.shape(a))} inside "
              f"the step; it must have a leading replica axis of size 1. " + hint)


# ---- the anchor, and parameters that land on it -------------------------------------------------

def _find_state(tree: Any, name: str) -> DiLoCoState:
  found = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, DiLoCoState))
           if isinstance(x, DiLoCoState)]
  if len(found) != 1:
    raise ValueError(f"{name} must hold exactly one qcomm.DiLoCoState (the state of a "
                     f"qcomm.diloco transformation), found {len(found)}")
  return found[0]


def diloco_params(opt_state: Any) -> Any:
  """The parameters to evaluate and to checkpoint: the anchor (float32, replicated, the same bits
  on every replica) of the :class:`DiLoCoState` in ``opt_state`` (a bare state, or a pytree such
  as an ``optax.chain`` state holding one)."""
  return _find_state(opt_state, "opt_state").anchor


def diloco_apply_updates(params: Any, updates: Any, opt_state: Any) -> Any:
  """``optax.apply_updates`` for :func:`diloco`, exact on synchronising calls.

  On a call that synchronised (``mini_step == 0`` in the new state) the result is the new anchor
  cast to the parameters' dtypes, bit for bit (``params + (anchor - params)`` may differ from it by
  a rounding); on the other calls ``params + updates``. Call it inside the step, with the state
  ``update`` returned."""
  state = _find_state(opt_state, "opt_state")
  check_array_leaves("params", params)
  check_array_leaves("updates", updates)
  if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(updates):
    raise ValueError(f"updates must have the structure of params, got "
                     f"{jax.tree_util.tree_structure(updates)} vs "
                     f"{jax.tree_util.tree_structure(params)}")
  synced = state.mini_step == 0
  stepped = optax.apply_updates(params, updates)
  return jax.tree_util.tree_map(
      lambda a, s: jnp.where(synced, a.astype(s.dtype), s), state.anchor, stepped)


# ---- shard_map specs -----------------------------------------------------------------------------

def _prefixed(dev: Any, spec: P) -> P:
  return P(dev, *spec)


def diloco_partition_spec(tree: Any, axis_name: AxisName,
                          inner_axis_name: AxisName | None = None) -> Any:
  """``shard_map`` specs for a pytree holding :class:`DiLoCoState` s.

  The anchor, the outer state and the counters are replicated (``PartitionSpec()``); the residual
  is split over ``axis_name``; ``inner``'s state has the replica axis in front of whatever its own
  spec is: ``PartitionSpec(axis_name)`` for a plain optax state, and for a ``qcomm.sync`` over
  ``inner_axis_name`` inside, ``PartitionSpec(axis_name, inner_axis_name)`` for the sync's own
  per-device parts. Every other leaf of ``tree`` is replicated. The local parameters' spec is
  ``PartitionSpec(axis_name)`` (a leading replica axis).
  """
  check_axis_name("axis_name", axis_name)
  if inner_axis_name is not None:
    check_axis_name("inner_axis_name", inner_axis_name)
  names = axis_names(axis_name)
  dev = names[0] if len(names) == 1 else names

  def inner_specs(inner: Any) -> Any:
    if holds_sync(inner):
      if inner_axis_name is None:
        raise ValueError("inner_axis_name must name the axis of the qcomm.sync inside "
                         "qcomm.diloco (its state holds one), got None")
      specs = state_partition_spec(inner, inner_axis_name)
    else:
      specs = jax.tree_util.tree_map(lambda _: P(), inner)
    return jax.tree_util.tree_map(lambda s: _prefixed(dev, s), specs,
                                  is_leaf=lambda s: isinstance(s, P))

  def one(x: Any) -> Any:
    if isinstance(x, DiLoCoState):
      rep = lambda t: jax.tree_util.tree_map(lambda _: P(), t)  # noqa: E731
      return DiLoCoState(
          inner_opt_state=inner_specs(x.inner_opt_state), anchor=rep(x.anchor),
          outer_opt_state=rep(x.outer_opt_state),
          residual=jax.tree_util.tree_map(lambda _: P(dev), x.residual),
          mini_step=P(), outer_step=P(), key=P(), total_notfinite=P())
    return P()

  return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: isinstance(x, DiLoCoState))


# ---- the step ------------------------------------------------------------------------------------

def _diloco_config(tx: Any) -> DiLoCoConfig | None:
  config = getattr(getattr(getattr(tx, "update", None), "__self__", None), "config", None)
  return config if isinstance(config, DiLoCoConfig) else None


@dataclasses.dataclass(frozen=True, eq=False)
class DiLoCoDataParallel:
  """The train step of a :func:`diloco` transformation, made by :func:`diloco_data_parallel`."""

  loss_fn: Callable[..., Any]
  tx: optax.GradientTransformation
  mesh: Mesh
  has_aux: bool = False
  batch_spec: P | None = None

  def __post_init__(self):
    _check_dp(self.loss_fn, self.tx, self.mesh, self.has_aux, self.batch_spec)

  @property
  def config(self) -> DiLoCoConfig:
    return _diloco_config(self.tx)

  @property
  def data_axes(self) -> tuple:
    """The replica axis, then the inner sync's axis (if any): the axes the batch is split over."""
    cfg = self.config
    inner = () if cfg.inner_axis_name is None else axis_names(cfg.inner_axis_name)
    return axis_names(cfg.axis_name) + inner

  @property
  def param_spec(self) -> P:
    """The local parameters' spec: a leading replica axis split over the replica axis."""
    names = axis_names(self.config.axis_name)
    return P(names[0] if len(names) == 1 else names)

  def state_spec(self, opt_state: Any) -> Any:
    """``shard_map`` specs of ``opt_state`` (:func:`diloco_partition_spec`)."""
    return diloco_partition_spec(opt_state, self.config.axis_name, self.config.inner_axis_name)

  def _put(self, tree: Any, spec: Any) -> Any:
    return place(tree, spec, self.mesh)

  def init(self, params: Any) -> tuple[Any, Any]:
    """(local_params, opt_state): every replica's copy of ``params`` (a leading replica axis,
    split over it) and the state, placed on the mesh."""
    check_array_leaves("params", params)
    with jax.set_mesh(self.mesh):
      spec = self.state_spec(jax.eval_shape(self.tx.init, params))
    params = self._put(params, P())
    return self._local_fn()(params), self._init_fn(_SpecKey(spec))(params)

  @functools.lru_cache(maxsize=None)
  def _init_fn(self, spec_key):
    return jax.jit(jax.shard_map(self.tx.init, mesh=self.mesh, in_specs=P(),
                                 out_specs=spec_key.spec))

  @functools.lru_cache(maxsize=None)
  def _local_fn(self):
    axes = frozenset(axis_names(self.config.axis_name))
    fn = lambda p: jax.tree_util.tree_map(  # noqa: E731
        lambda a: _compat.make_varying(a[None], axes), p)
    return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=P(), out_specs=self.param_spec))

  def params(self, opt_state: Any) -> Any:
    """The anchor (:func:`diloco_params`): the parameters to evaluate and checkpoint."""
    return diloco_params(opt_state)

  def step(self, local_params: Any, opt_state: Any, batch: Any, *extra: Any,
           key: jax.Array | None = None) -> tuple[Any, Any, jax.Array, Any]:
    """One call: ``(local_params, opt_state, losses, aux)``.

    ``losses`` (and ``aux``, with ``has_aux``) hold every device's own value, one row per device
    over the data axes (no collective: calls that do not synchronise send nothing)."""
    check_key("key", key)
    spec = self.state_spec(opt_state)
    fn = self._step_fn(_SpecKey(spec), len(extra), key is not None)
    args = (self._put(local_params, self.param_spec), self._put(opt_state, spec),
            self._put(batch, self._batch_spec), self._put(extra, P()))
    if key is not None:
      args += (self._put(key, P()),)
    return fn(*args)

  __call__ = step

  @property
  def _batch_spec(self) -> P:
    axes = self.data_axes
    return self.batch_spec if self.batch_spec is not None else P(
        axes[0] if len(axes) == 1 else axes)

  @functools.lru_cache(maxsize=None)
  def _step_fn(self, spec_key, n_extra: int, with_key: bool):
    names = self.data_axes
    axes = frozenset(names)
    loss_fn, tx, has_aux = self.loss_fn, self.tx, self.has_aux
    stacked = P(names[0] if len(names) == 1 else names)

    def local_step(local_params, opt_state, batch, extra, key=None):
      params = jax.tree_util.tree_map(lambda a: a[0], local_params)
      # Varying over every data axis: each device's own gradient (not autodiff's psum).
      diff = jax.tree_util.tree_map(lambda p: _compat.make_varying(p, axes), params)
      kwargs = {}
      if key is not None:
        kwargs["key"] = jax.random.fold_in(key, lax.axis_index(names))
      out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(diff, batch, *extra, **kwargs)
      loss, aux = out if has_aux else (out, None)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = diloco_apply_updates(params, updates, opt_state)
      row = lambda a: _compat.make_varying(jnp.asarray(a), axes)[None]  # noqa: E731
      return (jax.tree_util.tree_map(lambda a: a[None], params), opt_state, row(loss),
              jax.tree_util.tree_map(row, aux))

    in_specs = (self.param_spec, spec_key.spec, self._batch_spec, P()) + (
        (P(),) if with_key else ())
    fn = jax.shard_map(local_step, mesh=self.mesh, in_specs=in_specs,
                       out_specs=(self.param_spec, spec_key.spec, stacked, stacked))
    return jax.jit(fn)


def diloco_data_parallel(loss_fn: Callable[..., Any], tx: optax.GradientTransformation,
                         mesh: Mesh, *, has_aux: bool = False,
                         batch_spec: P | None = None) -> DiLoCoDataParallel:
  """A jitted train step for a :func:`diloco` transformation ``tx`` on ``mesh``.

  Args:
    loss_fn: ``loss_fn(params, batch, *extra) -> loss`` (the mean over this device's share of the
      batch) or ``-> (loss, aux)`` with ``has_aux``; called with ``key=`` when the step gets one.
    tx: the transformation returned by :func:`qcomm.diloco` (itself, not wrapped).
    mesh: a mesh with the replica axis (and the inner sync's axis, if ``inner`` is a
      ``qcomm.sync``).
    has_aux: loss_fn returns ``(loss, aux)``.
    batch_spec: how the batch is split (default: its leading axis over the replica axis and the
      inner sync's axis, ``PartitionSpec((axis_name, inner_axis_name))``).

  Returns:
    A :class:`DiLoCoDataParallel`: ``local_params, opt_state = dp.init(params)``, then
    ``local_params, opt_state, losses, aux = dp.step(local_params, opt_state, batch)``;
    ``dp.params(opt_state)`` is the anchor. ``local_params`` have a leading replica axis
    (``dp.param_spec``); after a synchronising call every row equals the anchor exactly.
  """
  return DiLoCoDataParallel(loss_fn=loss_fn, tx=tx, mesh=mesh, has_aux=has_aux,
                            batch_spec=batch_spec)


def _check_dp(loss_fn, tx, mesh, has_aux, batch_spec) -> None:
  if not callable(loss_fn):
    raise ValueError(f"loss_fn must be callable, got {loss_fn!r}")
  if _diloco_config(tx) is None:
    raise ValueError(f"tx must be the transformation returned by qcomm.diloco(...), got {tx!r}")
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}")
  cfg = _diloco_config(tx)
  inner = () if cfg.inner_axis_name is None else axis_names(cfg.inner_axis_name)
  missing = [n for n in axis_names(cfg.axis_name) + inner if n not in mesh.axis_names]
  if missing:
    raise ValueError(f"mesh must have the axes of tx ({cfg.axis_name!r}"
                     + (f" and the inner sync's {cfg.inner_axis_name!r}" if inner else "")
                     + f"); it has {mesh.axis_names}, missing {missing}")
  check_bool("has_aux", has_aux)
  if batch_spec is not None and not isinstance(batch_spec, P):
    raise ValueError(f"batch_spec must be None or a PartitionSpec, got {batch_spec!r}")
