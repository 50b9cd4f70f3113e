"""Overlapped DiLoCo: the outer collective on devices of its own, while the next round computes.

    tx = qcomm.diloco(optax.adamw(1e-3), axis_name="node", every=50, delay=1)
    dp = qcomm.data_parallel(loss_fn, tx, mesh, axis_name="node", overlap=True)
    opt_state = dp.init(params)
    for batch in batches:
      params, opt_state, loss, aux = dp.step(params, opt_state, batch)
    opt_state = dp.flush(opt_state)   # the mean in flight, before a checkpoint

With ``delay=1`` a synchronisation's mean is applied at the next one, so nothing the next round
computes waits for the collective (:func:`qcomm.diloco`). XLA:CPU runs the programs of one device
one after the other, and a collective inside the train step stops its compute (docs/usage.md
measures both), but a program on another device of the same process runs beside them. So this
runner gives each replica a **communication device**: a device of the replica's process that the
mesh does not use (start the processes with one host device more than the mesh needs,
``QCOMM_LOCAL_DEVICES`` or ``jax_num_cpu_devices``). On a synchronising call it runs

1. the inner step (the ordinary runner, diloco's ``"inner"`` phase);
2. diloco's ``"arrive"`` phase on the mesh: the mean received since the last synchronisation moves
   the anchor, each replica moves onto the new anchor keeping its round's progress, and the
   progress (plus the error-feedback residual) is what it sends;
3. the codec's allreduce of that over the communication devices (one per replica), dispatched and
   not waited for. Its mean and residual become the state's ``pending`` fields at the next
   synchronisation, when the arrive program needs them.

The anchors, the replicas' parameters and every state field equal, bit for bit, those of the same
``tx`` run by the ordinary runner (one program, the collective inside it), as the tests check.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import numpy as np
import optax

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_qcomm.collectives import ops as collectives
from jax_qcomm.transforms.diloco import PHASE_ARG, DiLoCoState, delayed_send, replica_rows
from jax_qcomm.transforms import layout
from jax_qcomm.transforms.specs import _SpecKey, checked_spec


@dataclasses.dataclass(eq=False)
class OverlappedDataParallel:
  """The runner made by ``qcomm.data_parallel(..., overlap=True)`` (module docstring).

  init(params) -> opt_state; step(params, opt_state, batch, *extra, key=None) -> (params,
  opt_state, loss, aux), as :class:`qcomm.data_parallel`'s; flush(opt_state) -> opt_state with
  the mean in flight received (blocks until it has arrived): the state to checkpoint, or to give
  to another runner. ``step`` dispatches several programs and counts calls on the host: call it
  eagerly, not inside ``jax.jit``.
  """
  tx: optax.GradientTransformation
  mesh: Mesh
  axis_name: Any
  #: ``local_runner(tx, mesh)``: the ordinary runner of ``tx`` on ``mesh`` with the caller's loss
  #: and options (it runs the inner steps).
  local_runner: Callable[[optax.GradientTransformation, Mesh], Any]

  def __post_init__(self):
    inner = optax.GradientTransformationExtraArgs(
        self.tx.init, functools.partial(self.tx.update, **{PHASE_ARG: "inner"}))
    self._inner = self.local_runner(inner, self.mesh)
    self._comm_mesh = None
    self._last = None
    self._inflight = None
    self._mini = 0

  # -- devices --------------------------------------------------------------------------------------
  def _set_devices(self, state: Any) -> None:
    self._name, rows = replica_rows(state, self.mesh, "overlap=True")
    if not state.config.delay:
      raise ValueError("overlap=True runs qcomm.diloco(..., delay=1): without the delay the "
                       "next round needs the synchronisation's result; got delay=0")
    used = {d.id for d in self.mesh.devices.flat}
    comm = []
    for r, row in enumerate(rows):
      owners = {d.process_index for d in row}
      spare = [d for d in jax.devices() if d.process_index in owners and d.id not in used]
      if len(owners) != 1 or not spare:
        raise ValueError(
            f"overlap=True needs, for each replica, a device of the replica's process that the "
            f"mesh does not use (its communication device): replica {r} of {self._name!r} has "
            f"{'devices of processes ' + str(sorted(owners)) if len(owners) != 1 else 'none'}. "
            f"Start each process with one host device more than the mesh takes from it "
            f"(QCOMM_LOCAL_DEVICES or jax_num_cpu_devices) and leave it out of the mesh")
      comm.append(spare[0])
      used.add(spare[0].id)
    self._comm_mesh = Mesh(np.array(comm), (self._name,))
    # Where each copy comes from: a communication device takes its replica's first device's
    # shard; a mesh device takes its replica's communication device's.
    self._sent_from = {c: row[0] for c, row in zip(comm, rows)}
    self._received_from = {d: c for c, row in zip(comm, rows) for d in row}

  def _move(self, tree: Any, sharding: NamedSharding, shape_of: Callable, source: Callable) -> Any:
    """Each leaf onto ``sharding`` (global shape ``shape_of(leaf)``), every target device taking
    the shard of ``source(device)``: copies between this process's own devices only."""
    def move(x):
      shards = {s.device: s.data for s in x.addressable_shards}
      arrays = [jax.device_put(shards[source(d)], d) for d in sharding.addressable_devices]
      return jax.make_array_from_single_device_arrays(shape_of(x), sharding, arrays)
    return jax.tree_util.tree_map(move, tree)

  # -- the public calls -----------------------------------------------------------------------------
  def init(self, params: Any) -> Any:
    """``tx.init(params)`` placed on the mesh (as :class:`qcomm.data_parallel`'s)."""
    layout.refuse_sharded(params, "overlap")
    if self._comm_mesh is None:
      with jax.set_mesh(self.mesh):
        self._set_devices(jax.eval_shape(self.tx.init, params))
    state = self._inner.init(params)
    self._take(state, 0)
    return state

  def state_spec(self, opt_state: Any) -> Any:
    return checked_spec(opt_state, self.axis_name)

  def step(self, params: Any, opt_state: Any, batch: Any, *extra: Any,
           key: jax.Array | None = None) -> tuple[Any, Any, jax.Array, Any]:
    """One inner step; on a synchronising call also the arrival and the next send."""
    if self._comm_mesh is None:
      raise ValueError("opt_state must come from this runner's init (dp.init(params))")
    if opt_state is not self._last:  # a state from elsewhere (a checkpoint): its own counters
      self._take(opt_state, int(opt_state.mini_step))
    params, opt_state, loss, aux = self._inner.step(params, opt_state, batch, *extra, key=key)
    self._mini += 1
    if self._mini >= opt_state.config.sync_calls:
      spec = self.state_spec(opt_state)
      opt_state = self._received(opt_state, spec)
      params, opt_state, send, sub = self._arrive_fn(_SpecKey(spec))(params, opt_state)
      rows = (self._comm_mesh.devices.size,)
      to_comm = lambda t, shape: self._move(  # noqa: E731
          t, NamedSharding(self._comm_mesh, P(self._name) if shape else P()),
          lambda x: rows + x.shape[1:] if shape else x.shape, self._sent_from.__getitem__)
      self._inflight = self._comm_fn(opt_state.config)(to_comm(send, True), to_comm(sub, False))
      self._mini = 0
    self._last = opt_state
    return params, opt_state, loss, aux

  __call__ = step

  def flush(self, opt_state: Any) -> Any:
    """``opt_state`` with the mean in flight received into its ``pending`` fields (waits for it):
    the state to checkpoint or evaluate from. Training may go on from it."""
    if opt_state is not self._last or self._inflight is None:
      return opt_state
    state = self._received(opt_state, self.state_spec(opt_state))
    self._take(state, self._mini)
    return state

  def _take(self, state: Any, mini: int) -> None:
    self._last, self._inflight, self._mini = state, None, mini

  def _received(self, state: DiLoCoState, spec: Any) -> DiLoCoState:
    """``state`` (its specs: ``spec``) with the in-flight mean and residual as its pending fields
    (no wait: the arrays are futures until the collective ends)."""
    if self._inflight is None:
      return state
    mean, lost = self._inflight
    back = self._received_from.__getitem__
    pending = self._move(mean, NamedSharding(self.mesh, P()), lambda x: x.shape, back)
    pending_lost = state.pending_lost
    if state.config.error_feedback:
      pending_lost = jax.tree_util.tree_map(
          lambda x, s, old: self._move(x, NamedSharding(self.mesh, s), lambda _: old.shape, back),
          lost, spec.pending_lost, state.pending_lost)
    replicated = NamedSharding(self.mesh, P())
    valid = jax.make_array_from_single_device_arrays(  # from this process's devices only
        (), replicated, [jax.device_put(jnp.ones((), jnp.int32), d)
                         for d in replicated.addressable_devices])
    return state._replace(pending=pending, pending_lost=pending_lost, pending_valid=valid)

  # -- the programs ---------------------------------------------------------------------------------
  @functools.lru_cache(maxsize=None)
  def _arrive_fn(self, spec: _SpecKey) -> Callable:
    tx = self.tx

    def arrive(anchor, state):
      updates, new = tx.update(anchor, state, anchor, **{PHASE_ARG: "arrive"})
      send, sub = delayed_send(state, new)
      rows = jax.tree_util.tree_map(lambda x: x[None], send)
      # The barrier: the new anchor exactly as the update made it (no add contracted into the
      # outer optimizer's multiply), the anchor the replicas moved onto.
      new_anchor = optax.apply_updates(anchor, lax.optimization_barrier(updates))
      return new_anchor, new, rows, jax.random.key_data(sub)

    send_spec = spec.spec.round_start
    return jax.jit(jax.shard_map(arrive, mesh=self.mesh, in_specs=(P(), spec.spec),
                                 out_specs=(P(), spec.spec, send_spec, P())))

  @functools.lru_cache(maxsize=None)
  def _comm_fn(self, cfg: Any) -> Callable:
    name = self._name

    def communicate(rows, key_data):
      send = jax.tree_util.tree_map(lambda x: x[0], rows)
      mean, lost = collectives.allreduce(
          send, name, cfg.codec, jax.random.wrap_key_data(key_data), "mean", policy=cfg.policy,
          comm_bucket_size=cfg.comm_bucket_size, return_residual=True, check_varying=False)
      return mean, jax.tree_util.tree_map(lambda x: x[None], lost)

    return jax.jit(jax.shard_map(communicate, mesh=self._comm_mesh, in_specs=(P(name), P()),
                                 out_specs=(P(), P(name))))
