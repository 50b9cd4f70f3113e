"""``qcomm.sync(inner, shard_params=True)``: sharded data parallelism (ZeRO-3 / FSDP).

The parameters live as 1/D shards over the data axes (:class:`qcomm.ParamShard`), and so do the
gradients and the whole state of ``inner``. The model gathers each layer's full parameters where
it runs (:func:`qcomm.gather_params`, with this transformation's codecs inside
:func:`qcomm.data_parallel`'s step), and the gather's backward pass reduce-scatters the gradient to
the shards: what ``update`` receives is already each shard's mean gradient, so it sends nothing
itself. It accumulates (``accum_steps``), skips a non-finite window (one decision for the whole
model: one scalar psum) and runs ``inner`` on this device's shards.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm import _compat
from jax_qcomm.codecs import Codec
from jax_qcomm.collectives import packing, sharded_params
from jax_qcomm.transforms import _parts
from jax_qcomm.transforms.specs import find_states, register_state
from jax_qcomm.transport import _varying
from jax_qcomm.transport.axes import axis_names, axis_size


@register_state
class ParamShardSyncState(NamedTuple):
  """State of ``qcomm.sync(..., shard_params=True)``.

  Sharded like the parameters (:func:`qcomm.shard_specs`: a :class:`qcomm.ParamShard` 's data
  ``[*layers, D, m]`` split over the data axes; other leaves replicated):
    inner_opt_state: ``inner``'s state for the shards (Adam's moments are ParamShards; its
      count is replicated).
    acc_grads: float32 sum of the shards' gradients in the current window (``()`` if
      accum_steps == 1).
  Replicated: mini_step, key, gradient_step, total_notfinite, as in :class:`qcomm.SyncState`.
  config: the settings (:class:`qcomm.transforms.sync.SyncConfig`), static.
  """

  inner_opt_state: Any
  mini_step: jax.Array
  key: jax.Array
  acc_grads: Any
  gradient_step: jax.Array
  total_notfinite: jax.Array
  config: Any = None

  PER_DEVICE_FIELDS = ()
  NESTED_FIELDS = ()
  PER_DEVICE_NESTED_FIELDS = ()
  PARAM_SHARD_FIELDS = ("inner_opt_state", "acc_grads")
  #: Its fields are a subset of SyncState's: a mapping of them (nnx.state) is a SyncState's.
  #: (The sharded mode never runs with an nnx.Optimizer.)
  MAPPING_FORM = False
  REPLICATED_FIELDS = ("mini_step", "key", "gradient_step", "total_notfinite")


def _check_shards(tree: Any, name: str) -> None:
  for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=sharded_params.is_shard)[0]:
    if not sharded_params.is_shard(x):
      raise ValueError(
          f"{name} must be a pytree of qcomm.ParamShard with shard_params=True (the parameters "
          f"as shards: dp.shard(params) or qcomm.shard_params(params, D)), got leaf "
          f"'{packing.path_str(path) or '<root>'}' of type {type(x).__name__}")


class ParamShardSync:
  """The functions of ``sync(..., shard_params=True)``; ``config`` is its settings."""

  state_type = ParamShardSyncState

  def __init__(self, inner, config):
    self.inner = inner
    self.config = config
    self.names = tuple(axis_names(config.axis_name))

  def init(self, params: Any) -> ParamShardSyncState:
    """``params``: the shards (``[*layers, D, m]`` globally, ``[*layers, 1, m]`` inside
    ``shard_map``), or the full parameters outside ``shard_map``: sharded first
    (:func:`qcomm.shard_params`, D the current mesh's data axes or ``jax.device_count()``)."""
    cfg = self.config
    if not sharded_params.has_shards(params):
      d, bound = _parts.num_devices(cfg.axis_name)
      if bound:
        raise ValueError("params must be the shards inside shard_map with shard_params=True "
                         "(qcomm.shard_params(params, D), placed with qcomm.shard_specs)")
      params = sharded_params.shard_params(params, d)
    _check_shards(params, "params")
    f32 = lambda: jax.tree_util.tree_map(  # noqa: E731
        lambda s: sharded_params.ParamShard(jnp.zeros(jnp.shape(s.data), jnp.float32), s.shape,
                                            jnp.float32),
        params, is_leaf=sharded_params.is_shard)
    return ParamShardSyncState(
        inner_opt_state=self.inner.init(params), mini_step=_parts.zero(),
        key=_parts.seed_key(cfg.seed), acc_grads=f32() if cfg.accum_steps > 1 else (),
        gradient_step=_parts.zero(), total_notfinite=_parts.zero(), config=cfg)

  def update(self, grads: Any, state: ParamShardSyncState, params: Any = None, **extra_args):
    """``grads``: the shards' mean gradients (what :func:`qcomm.gather_params`' backward hands
    the shards); accumulates, and every ``accum_steps``-th call steps ``inner`` on the shards."""
    cfg = self.config
    axis_size(cfg.axis_name)  # clear error outside shard_map
    _check_shards(grads, "grads")
    if params is None:
      raise ValueError("params must be given to update with shard_params=True (the shards)")
    _check_shards(params, "params")
    if not isinstance(state, ParamShardSyncState):
      raise TypeError(f"state must be the qcomm.ParamShardSyncState made by this "
                      f"transformation's init, got {type(state).__name__}")
    packing.check_float_leaves(grads, "grads")
    if cfg.check_varying:
      _varying.check_per_device(grads, self.names, "grads", "qcomm.sync(...).update")
    g32 = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
    if cfg.accum_steps == 1:
      return self._step(g32, state, params, extra_args)
    acc = jax.tree_util.tree_map(lambda a, g: a + g, state.acc_grads, g32)
    mini_step = state.mini_step + 1

    def emit():
      mean = jax.tree_util.tree_map(lambda a: a * jnp.float32(1.0 / cfg.accum_steps), acc)
      updates, new = self._step(mean, state, params, extra_args)
      return updates, new._replace(acc_grads=jax.tree_util.tree_map(jnp.zeros_like, acc))

    def accumulate():
      zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, p.dtype), params)
      return zeros, state._replace(mini_step=mini_step, acc_grads=acc)

    return _compat.cond(mini_step >= cfg.accum_steps, (emit, accumulate))

  def _step(self, grads: Any, state: ParamShardSyncState, params: Any, extra_args: dict):
    # Whole-model finiteness, the same decision on every device: one scalar psum.
    bad = sum((jnp.sum(~jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)),
              jnp.int32(0))
    finite = lax.psum(bad, self.names) == 0
    grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, params)
    weights = (1.0,) * len(jax.tree_util.tree_leaves(grads))

    run = _parts.inner_on_shards(self.inner, self.names, extra_args, grads,
                                 state.inner_opt_state, params)

    def step():
      with _parts.sharded((self.names, weights)):
        return run(grads, state.inner_opt_state, params)

    def skip():
      return (jax.tree_util.tree_map(jnp.zeros_like, params), state.inner_opt_state)

    updates, inner_state = _compat.cond(finite, (step, skip))
    key, _ = _parts.split_key(state.key)
    return updates, state._replace(
        inner_opt_state=inner_state, mini_step=_parts.zero(), key=key,
        gradient_step=state.gradient_step + 1,
        total_notfinite=_parts.count_notfinite(state.total_notfinite, finite))


def gather_scope(opt_state: Any) -> contextlib.AbstractContextManager:
  """Inside a runner's step: the context in which ``qcomm.gather_params(shards)`` takes the
  settings of the ``shard_params`` sync in ``opt_state`` (a no-op context if there is none)."""
  states = [s for s in find_states(opt_state) if isinstance(s, ParamShardSyncState)]
  if not states:
    return contextlib.nullcontext()
  if len(states) > 1:
    raise ValueError(f"tx holds {len(states)} qcomm.sync(..., shard_params=True): the parameters "
                     f"have one set of shards, gathered by one sync's codecs")
  s = states[0]
  cfg = s.config
  key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(s.key), s.mini_step),
                           0x5A3)
  return sharded_params.gathering(cfg.axis_name, cfg.param_codec, cfg.codec, key, cfg.hpz,
                                  cfg.policy)


def sharded_params_config(opt_state: Any) -> Any:
  """The config of the ``shard_params`` sync in ``opt_state``, or None."""
  for s in find_states(opt_state):
    if isinstance(s, ParamShardSyncState):
      return s.config
  return None


def check_codecs(codec: Codec, param_codec: Codec) -> None:
  """ValueError for codecs that cannot run the sharded parameters' collectives."""
  sharded_params.check_gather_codec("param_codec", param_codec)
  sharded_params.check_gather_codec("codec", codec, "reduce_scatter")
