"""Elastic per-step data parallelism: the round of :mod:`jax_qcomm.runners.elastic` for a
``qcomm.sync`` (replicated state), each optimizer step averaged over the processes alive.

Each process computes the gradient of its share of the batch on its own devices; the round (the
live set agreed, the holders' update, a restarted process admitted with the group's state) is
the one elastic diloco's synchronisation uses (docs/distributed.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jax_qcomm import _compat
from jax_qcomm.runners.elastic import ElasticDataParallel
from jax_qcomm.runners.replay import Replayed, global_shapes
from jax_qcomm.transforms import layout
from jax_qcomm.transforms.specs import _SpecKey, apply_update, find_states, place
from jax_qcomm.transport.axes import axis_names


@dataclasses.dataclass(eq=False)
class ElasticSyncDataParallel(ElasticDataParallel):
  """Elastic per-step data parallelism, made by ``qcomm.data_parallel(..., elastic=True)`` for a
  ``tx`` whose qcomm transformation is :func:`qcomm.sync` (module docstring; every call is a
  round).

  Each process computes the gradient of its share of the batch on its own devices (the mean over
  them: one row per process); then, among the processes alive, the holders of the newest state
  run ``tx.update`` on those rows over their devices (the sync's allreduce averages the rows of
  the replicas present, compressed by its codec) and hand the result to any restarted process.
  A replica lost during the round costs that step its share of the batch: the mean is over the
  others. ``replicas_per_sync`` holds the replicas averaged at each optimizer step. A restarted process
  takes the parameters, the optimizer state (codec state and counters included) and the step
  count from the lowest holder; its error-feedback residual starts at zero (it was the source's
  own). With ``accum_steps`` k, the calls that only accumulate run on each process's devices, and
  the round is the call that communicates: a replica lost inside a window loses its share of the
  whole window, and a restarted one is admitted at a window's end.
  """

  ROUND = "step"
  STATE_TYPE: Any = None
  OWN_FIELDS = ("residual", "acc_grads")
  # The last gradient call: (with a key, number of extra arguments, its arguments' and its
  # gradients' shapes), for the programs loaded after a rebuild.
  _grads_call = None

  def _rows(self, state: Any) -> tuple[str, np.ndarray]:
    names = axis_names(self.axis_name)
    name = names[0]
    axis = self.mesh.axis_names.index(name)
    return name, np.moveaxis(self.mesh.devices, axis, 0).reshape(self.mesh.devices.shape[axis], -1)

  def _need_init(self, opt_state: Any) -> None:
    if self._replica_axis is None or _sync_state(opt_state) is None:
      raise ValueError("opt_state must come from this runner's init (dp.init(params))")

  def _build_local(self) -> None:
    self._grad_fn.cache_clear()
    self._local_update_fn.cache_clear()

  @functools.lru_cache(maxsize=None)
  def _local_update_fn(self, spec: _SpecKey) -> Callable:
    """``tx.update`` of this process's gradient on its own devices (an accumulating call)."""
    return Replayed(_update_program(self.tx, self._local_mesh, spec.spec, P(),
                                     frozenset(axis_names(self.axis_name)), rows=False),
                     self._traces, ("local update", spec))

  def _local_init(self, params: Any) -> Any:
    return self.local_runner(self.tx, self._local_mesh).init(params)

  def init(self, params: Any) -> Any:
    """This process's part of ``tx.init(params)``, on its own devices."""
    layout.refuse_sharded(params, "elastic")
    if self._replica_axis is None:
      self._set_replica_axis(None)
    state = self._local_init(params)
    sync = _sync_state(state)
    if sync is None or getattr(sync.config, "shard_state", False):
      raise ValueError(
          "elastic=True runs qcomm.diloco, or qcomm.sync with replicated state (one per process): "
          "the state of shard_state=True / shard_params=True is split over the processes, and a "
          "lost process would take its part with it")
    name = self.mesh.axis_names[self._replica_axis]
    if name not in axis_names(sync.config.axis_name):
      raise ValueError(
          f"elastic=True with qcomm.sync: the sync must average over the process axis {name!r} "
          f"(the first of data_parallel's axis_name), got axis_name="
          f"{sync.config.axis_name!r}")
    self._sync_calls = 1
    return state

  def calls(self, opt_state: Any) -> int:
    """Calls of ``step`` the group's state has seen (optimizer steps x accum_steps, plus the
    calls of the current window)."""
    sync = _sync_state(opt_state)
    return int(sync.gradient_step) * sync.config.accum_steps + int(sync.mini_step)

  def _rounds_of(self, opt_state: Any) -> int:
    return int(_sync_state(opt_state).gradient_step)  # optimizer steps: one round each

  def step(self, params: Any, opt_state: Any, batch: Any, *extra: Any,
           key: jax.Array | None = None) -> tuple[Any, Any, jax.Array, Any]:
    """One step on this process's share of the batch, averaged over the processes alive. Returns
    (params, opt_state, loss, aux): the loss and aux of this process's share."""
    params, opt_state = self.join(params, opt_state, batch, *extra, key=key)
    grads, loss, aux = self._grads(params, batch, extra, key)
    sync = _sync_state(opt_state)
    if int(sync.mini_step) + 1 < sync.config.accum_steps:
      # A call that only accumulates: no collective, so no round; on this process's devices.
      spec = self._spec(opt_state)
      params, opt_state = self._local_update_fn(_SpecKey(spec))(
          params, place(opt_state, spec, self._local_mesh), grads)
      return params, opt_state, loss, aux
    host = jax.device_get((loss, aux))
    backend = self._backend
    params, opt_state = self._synchronise(params, opt_state, grads)
    if backend != self._backend:  # rebuilt: the loss and aux of before are gone
      loss, aux = jax.tree_util.tree_map(jnp.asarray, host)
    return params, opt_state, loss, aux

  __call__ = step

  def _grads(self, params: Any, batch: Any, extra: tuple, key: jax.Array | None) -> tuple:
    """(grads, loss, aux) of this process's share of the batch."""
    put = functools.partial(place, mesh=self._local_mesh)
    args = (put(params, P()), put(batch, P(axis_names(self.axis_name))), put(extra, P()))
    if key is not None:
      args += (put(key, P()),)
    out = self._grad_fn(key is not None, len(extra))(*args)
    if self._grads_call is None:
      self._grads_call = (key is not None, len(extra), _shapes(args), _shapes(out[0]))
    return out

  def _grads_like(self) -> Any:
    return None if self._grads_call is None else self._grads_call[3]

  def _load_local_programs(self, params: Any, state: Any) -> None:
    if self._grads_call is None:
      return
    with_key, n_extra, shapes, _ = self._grads_call
    specs = (P(), P(axis_names(self.axis_name)), P()) + ((P(),) if with_key else ())
    args = tuple(global_shapes(group, self._local_mesh, spec)
                 for group, spec in zip(shapes, specs, strict=True))
    self._grad_fn(with_key, n_extra).lower(*args).compile()
    if _sync_state(state).config.accum_steps > 1:  # the update of the accumulating calls
      spec, mesh = self._spec(state), self._local_mesh
      self._local_update_fn(_SpecKey(spec)).lower(
          global_shapes(params, mesh, P()), global_shapes(state, mesh, spec),
          global_shapes(self._grads_like(), mesh, P())).compile()

  def _prepare(self, params: Any, opt_state: Any, batch: Any, *extra: Any,
               key: jax.Array | None = None) -> None:
    """Compiles the gradient program (run once; it records the shapes the others are loaded
    from: ``join`` loads the accumulating update and the round next, ``_load_programs``)."""
    jax.block_until_ready(self._grads(params, batch, extra, key)[0])

  @functools.lru_cache(maxsize=None)
  def _grad_fn(self, with_key: bool, n_extra: int) -> Callable:
    """The mean gradient, loss and aux of this process's share of the batch, over its devices."""
    runner = self.local_runner(self.tx, self._local_mesh)
    loss_fn, has_aux, names = runner.loss_fn, runner.has_aux, axis_names(self.axis_name)
    axes = frozenset(names)

    def grads_of(params, batch, extra, key=None):
      kwargs = {}
      if key is not None:
        kwargs["key"] = jax.random.fold_in(key, lax.axis_index(names))
      diff = jax.tree_util.tree_map(lambda p: _compat.make_varying(p, axes), params)
      out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(diff, batch, *extra, **kwargs)
      loss, aux = out if has_aux else (out, None)
      return (jax.tree_util.tree_map(lambda g: lax.pmean(g, names), grads), lax.pmean(loss, names),
              jax.tree_util.tree_map(lambda a: lax.pmean(a, names), aux))

    in_specs = (P(), P(names), P()) + ((P(),) if with_key else ())
    return Replayed(jax.jit(jax.shard_map(grads_of, mesh=self._local_mesh.abstract_mesh,
                                           in_specs=in_specs, out_specs=(P(), P(), P()))),
                     self._traces, ("grads", with_key, n_extra))

  @functools.lru_cache(maxsize=None)
  def _outer_fn(self, holders: tuple, spec: _SpecKey, weighted: bool = False) -> Callable:
    name = self.mesh.axis_names[self._replica_axis]
    inside = frozenset(n for n in axis_names(self.axis_name) if n != name)
    return Replayed(_update_program(self.tx, self._mesh_of(list(holders)), spec.spec, P(name),
                                     inside, rows=True),
                     self._traces, ("outer", holders, spec))


def _update_program(tx: Any, mesh: Mesh, state_spec: Any, grads_spec: P, varying: frozenset,
                    rows: bool) -> Callable:
  """``tx.update`` and the update applied, as one program over ``mesh``: the gradient (with
  ``rows``, a leading row per process, ``grads_spec`` splitting them) made varying over the axes
  ``varying``, so that the sync's allreduce averages it."""
  def update(params, state, grads):
    grads = jax.tree_util.tree_map(
        lambda g: _compat.make_varying(g[0] if rows else g, varying), grads)
    return apply_update(tx, grads, state, params)

  return jax.jit(jax.shard_map(update, mesh=mesh.abstract_mesh,
                               in_specs=(P(), state_spec, grads_spec),
                               out_specs=(P(), state_spec)))


def _shapes(tree: Any) -> Any:
  """``tree``'s arrays as ``jax.ShapeDtypeStruct`` values, without shardings."""
  return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _sync_state(opt_state: Any) -> Any:
  """The qcomm.sync state in ``opt_state`` (None if there is none)."""
  return next((s for s in find_states(opt_state) if hasattr(s, "gradient_step")), None)
