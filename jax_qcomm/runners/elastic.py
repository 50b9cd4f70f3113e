"""Elastic DiLoCo: replicas in processes that may die and come back, averaged over those alive.

    from jax_qcomm.tools import distributed
    distributed.initialize(elastic=True)           # or under `launch --elastic`
    mesh = distributed.global_mesh(("node",))      # one row per process
    tx = qcomm.diloco(optax.adamw(1e-3), axis_name="node", every=50)
    dp = qcomm.data_parallel(loss_fn, tx, mesh, axis_name="node", elastic=True)
    opt_state = dp.init(params)
    params, opt_state = dp.join(params, opt_state)  # a restarted process: the group's state
    while dp.calls(opt_state) < num_steps:
      params, opt_state, loss, aux = dp.step(params, opt_state, local_batch)

Each process holds one diloco replica (one row of ``mesh`` along diloco's ``axis_name``; the
process's own devices may form an inner ``qcomm.sync`` axis). Its inner steps are a program over
its own devices only: no collective crosses processes, and a lost peer never stalls them. Every
synchronisation is a round among the processes alive, agreed through the coordination service:

1. The live set, with each process's incarnation, comes from ``get_live_nodes`` (the barrier under
   ``jax.experimental.multihost_utils.live_devices``), called at one program point, after every
   round; the round counts as done only if nobody in it died or restarted meanwhile (atomicity as
   ``live_devices`` gives it). Otherwise every survivor retries it with the new set, from the
   same inputs: only the lost replica's pseudo-gradient is missing from the mean. A process
   restarted since the last barrier, which the service counts live but which never asks, is
   found from the incarnation it published (``INCARNATION_DIR``) and left out the same way.
2. Each process publishes how many synchronisations its state holds. The holders of the newest
   state run diloco's outer step over their own devices (a mesh of the holders only), so the mean
   is over the replicas present; the others (a restarted process, or one that fell behind) receive
   the result: the anchor, the outer optimizer's state, the counters and the rounding key, and the
   inner optimizer's state of the lowest holder (their error-feedback residual starts at zero,
   and their replica parameters are the anchor). It travels over a TCP connection of its own
   while the others go on (:meth:`_hand_over`; with ``fragments`` or ``delay``, down a chain of
   the receivers in a program every process waits for), and a receiver's first round counts no
   pseudo-gradient of its own (diloco's ``PRESENT_ARG``). After every round the anchors of all
   live replicas are bit-identical.
3. XLA:CPU caches its gloo communicators by device set, and a restarted process cannot enter a set
   it was in before (docs/distributed.md). So a process that needs the state is admitted only when
   every process is alive again: then the holders run the round over the communicators they have
   used, and all of them rebuild their CPU backend (:func:`jax_qcomm._compat.reset_cpu_backend`,
   the stale communicators' keys deleted between two barriers) before the state goes to the new
   ones; meanwhile a thread loads the next rounds' programs on the new backend. Until then the
   survivors go on without it.

Arrays made before a rebuild are invalid afterwards: use the params and state a call returns.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import sys
import threading
import time
from typing import Any, Callable

import numpy as np
import optax

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_qcomm import _compat
from jax_qcomm.runners import transfer
from jax_qcomm.runners.replay import Replayed, global_shapes
from jax_qcomm.transforms.diloco import PHASE_ARG, PRESENT_ARG, DiLoCoState, replica_rows
from jax_qcomm.transforms import layout
from jax_qcomm.transforms.specs import _SpecKey, checked_spec, place

#: Seconds to wait for a coordination-service key that every process of a round wrote before the
#: barrier it passed (present at once unless the service is failing).
KEY_TIMEOUT_S = 60
#: Coordination-service key under which the group records that it has trained (a process that
#: finds no holder of the state after that raises instead of starting over).
STARTED_KEY = "qcomm/elastic/started"
#: Key directory where a restarted process announces, under its index, the incarnation that is
#: ready to be admitted (its programs compiled).
READY_DIR = "qcomm/elastic/ready/"
#: Key directory where the group writes, under ``<index>/<incarnation>``, the live set that admits
#: a ready process at the next round.
ADMIT_DIR = "qcomm/elastic/admit/"
#: Key directory where each process publishes, under its index, its incarnation as it builds the
#: runner: a barrier that waits on a process restarted since the last round reads it.
INCARNATION_DIR = "qcomm/elastic/incarnation/"
#: Seconds between two readings of ``INCARNATION_DIR`` while a barrier of a round waits.
BARRIER_POLL_S = 1.0
#: Seconds a ready process waits to be admitted before it gives up with an error.
ADMIT_TIMEOUT_S = 3600
#: At most this many sets of lost processes have their programs compiled ahead (:func:`_loss_sets`).
COMPILE_AHEAD_SETS = 16


def before_backend(client: Any, process_id: int, num_processes: int) -> None:
  """Called when a process has joined an elastic run, before it builds a backend. In a group
  that has trained, a restarted process

  * answers, once and at once, the barrier of every process (``get_live_nodes``): the others
    may be in one that still counts this index, which waits for every live incarnation of it,
    and learn there that it restarted; a call made after they have left it out of their rounds
    stays pending until the round that admits this process, and takes part in that one;
  * if it is process 0, deletes the CPU topology its first incarnation published (XLA's process
    0 writes it once and cannot overwrite it; the others read it).
  """
  if _try_get(client, STARTED_KEY) is None:
    return
  threading.Thread(target=client.get_live_nodes, args=(list(range(num_processes)),),
                   name="qcomm-elastic-restarted", daemon=True).start()
  if process_id == 0:
    client.key_value_delete(_compat.CPU_BACKEND_KEYS[-1])


#: The threads compiling ahead, with the event that stops each: joined at exit, since a daemon
#: thread still inside XLA's compiler when the interpreter exits aborts the process.
_COMPILING_AHEAD: dict[threading.Thread, threading.Event] = {}


@atexit.register
def _stop_compiling_ahead() -> None:
  for thread, stop in list(_COMPILING_AHEAD.items()):
    stop.set()
    thread.join()


def _loss_sets(n: int) -> list[tuple[int, ...]]:
  """The sets of lost processes (of ``n``) whose programs each process compiles ahead: every set
  of one, then every set of two, at most :data:`COMPILE_AHEAD_SETS` in all; never all ``n``."""
  return [lost for k in (1, 2) if k < n
          for lost in itertools.combinations(range(n), k)][:COMPILE_AHEAD_SETS]


def _try_get(client: Any, key: str) -> str | None:
  """The value of ``key`` in the coordination service, None if it is not set."""
  try:
    return client.key_value_try_get(key)
  except Exception:  # noqa: BLE001  (NOT_FOUND)
    return None


def _appended(history: list[list[int]], replicas: int) -> list[list[int]]:
  """A run-length encoded record ``[[rounds, replicas], ...]`` with one more round."""
  history = [list(h) for h in history]
  if history and history[-1][1] == replicas:
    history[-1][0] += 1
  else:
    history.append([1, replicas])
  return history


def _fingerprint(live: dict[int, int]) -> str:
  text = ",".join(f"{p}:{i}" for p, i in sorted(live.items()))
  return hashlib.sha1(text.encode()).hexdigest()[:16]


def _log(text: str) -> None:
  sys.stderr.write(f"jax_qcomm.runners.elastic: {text}\n")
  sys.stderr.flush()


class _Changed(Exception):
  """The live processes (or an incarnation) changed during a round."""

  def __init__(self, live: dict[int, int]):
    super().__init__(f"live processes now {sorted(live)}")
    self.live = live


@dataclasses.dataclass(eq=False)
class ElasticDataParallel(transfer.Transfers):
  """The elastic runner made by ``qcomm.data_parallel(..., elastic=True)`` (module docstring).

  init(params) -> opt_state: this process's replica of the diloco state (its own devices only).
  join(params, opt_state) -> (params, opt_state): blocks until this process holds the group's
    state; a no-op once it does. ``step`` joins first if needed.
  step(params, opt_state, batch, *extra, key=None) -> (params, opt_state, loss, aux): one inner
    step on this process's share of the batch; on a synchronising call, the round.
  calls(opt_state) -> the calls the group has made (the counters a rejoined process receives).
  replicas_per_sync: the replicas averaged at each synchronisation so far (the group's record).
  stall_s: this process's seconds in synchronisation attempts that a lost process broke (run again
    without it) and in CPU backend rebuilds, so far.
  short_syncs: one record per synchronisation of this process that averaged fewer replicas than
    the group has, or admitted a restarted one: ``{"outer_step", "replicas", "missing",
    "admitted", "healing", "seconds", "stall_s"}`` (``healing``: the processes admitted at the
    last round, which count for nothing in this one's mean) and, where the state's transfer was
    timed, ``"transfer_s"``; also logged, one line each.
  """
  tx: optax.GradientTransformation
  mesh: Mesh
  axis_name: Any
  #: ``local_runner(tx, mesh)``: the non-elastic runner of ``tx`` on one process's mesh
  #: (``qcomm.data_parallel``'s, with the caller's loss and options).
  local_runner: Callable[[optax.GradientTransformation, Mesh], Any]

  def __post_init__(self):
    client, process_id, num_processes = _compat.distributed_state()
    if client is None:
      raise RuntimeError(
          "qcomm.data_parallel(elastic=True) needs jax.distributed initialised, with the "
          "coordination service outside the workers: jax_qcomm.tools.distributed.initialize("
          "elastic=True), or start the processes with `python -m jax_qcomm.tools.launch -n N "
          "--elastic`")
    self._client, self._me, self._n = client, int(process_id), int(num_processes)
    client.key_value_set(f"{INCARNATION_DIR}{self._me}",
                         str(self._get_live([self._me])[self._me]), allow_overwrite=True)
    # Devices by id (2048 * process + k): ids survive a backend rebuild, device objects do not.
    self._ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(self.mesh.devices)
    self._replica_axis = None
    self._live: dict[int, int] | None = None
    self._rounds: dict[str, int] = {}
    self._backend: str | None = None
    self._fresh = True
    self._outer_step = -1
    self._mini = 0
    self._sync_calls = None
    self._history: list[list[int]] = []  # [[rounds, replicas], ...]: run-length encoded
    self._refused: set[tuple[int, int]] = set()  # (process, incarnation) gone: never admitted
    self._ahead: threading.Thread | None = None  # compiles the rounds after a loss
    self._ahead_stop = threading.Event()  # asks it to stop after the program it compiles
    # A restarted process does not: its first life's programs are in its cache directory, and
    # while it compiled, every step of the others would wait for it.
    self._compiles_ahead = True
    self._transfer_s: float | None = 0.0  # the last transfer of the state (None: in the background)
    self._healing = False  # holds the group's state, and has not yet taken part in a round
    self._receiving: tuple | None = None  # the state this process fetches after its round
    self._loading: threading.Thread | None = None  # loads the next round's programs
    self._traces: dict = {}  # the programs' jaxprs (Replayed): they outlive backend rebuilds
    self.stall_s = 0.0
    self.short_syncs: list[dict] = []

  #: State fields a receiver does not take from the source but starts at zero.
  OWN_FIELDS = ("residual",)
  #: What one round is called in the log lines.
  ROUND = "synchronisation"

  def _param_fields(self, state: Any) -> tuple[str, ...]:
    """The state's fields that hold the parameters themselves right after a round (a receiver
    copies them from the parameters it receives): diloco's replica parameters, unless it has
    fragments or a delayed outer step (:func:`qcomm.local_params`)."""
    cfg = getattr(state, "config", None)
    if isinstance(state, DiLoCoState) and cfg.fragments == 1 and not cfg.delay:
      return ("params",)
    return ()

  def _heals(self, state: Any) -> bool:
    """Whether the state goes to restarted processes in the background (:meth:`_hand_over`):
    diloco whose replicas start from the anchor after a round (:meth:`_param_fields`), where a
    receiver takes part in the next round with no pseudo-gradient of its own."""
    return bool(self._param_fields(state))

  @property
  def replicas_per_sync(self) -> list[int]:
    """The replicas averaged at each round so far (the group's record)."""
    return [replicas for count, replicas in self._history for _ in range(count)]

  # -- meshes ---------------------------------------------------------------------------------------
  def _rows(self, state: Any) -> tuple[str, np.ndarray]:
    """The replica axis's name and the mesh's devices as rows, one per replica."""
    return replica_rows(state, self.mesh, "elastic=True")

  def _set_replica_axis(self, state: Any) -> None:
    name, devices = self._rows(state)
    axis = self.mesh.axis_names.index(name)
    rows = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(devices)
    owners = [set(r.tolist()) for r in rows]
    if any(len(o) != 1 for o in owners) or len({min(o) for o in owners}) != len(owners) \
        or len(owners) != self._n:
      raise ValueError(
          f"elastic=True needs one replica per process: every row of the mesh along "
          f"{name!r} must hold the devices of one process, and each of the {self._n} "
          f"processes one row (distributed.global_mesh(({name!r}, ...)) does); the rows' "
          f"processes are {[sorted(o) for o in owners]}")
    self._replica_axis = axis
    self._row_of = {min(o): i for i, o in enumerate(owners)}
    self._rebuild()

  def _mesh_of(self, processes) -> Mesh:
    """The mesh of the given processes' rows (in mesh order), on the current backend."""
    by_id = {d.id: d for d in jax.devices()}
    rows = sorted(self._row_of[p] for p in processes)
    ids = np.take(self._ids, rows, axis=self._replica_axis)
    return Mesh(np.vectorize(by_id.__getitem__, otypes=[object])(ids), self.mesh.axis_names)

  def _rebuild(self) -> None:
    """Meshes and the local programs on the current backend (after a rebuild: new devices)."""
    self._local_mesh = self._mesh_of([self._me])
    self._build_local()
    self._outer_fn.cache_clear()
    self._broadcast_fn.cache_clear()

  def _build_local(self) -> None:
    """The runner of the inner steps on this process's devices (diloco's ``"inner"`` phase)."""
    inner = optax.GradientTransformationExtraArgs(
        self.tx.init, functools.partial(self.tx.update, **{PHASE_ARG: "inner"}))
    self._inner = self.local_runner(inner, self._local_mesh)

  # -- the public calls -----------------------------------------------------------------------------
  def init(self, params: Any) -> Any:
    """This process's replica of ``tx.init(params)``, on its own devices."""
    layout.refuse_sharded(params, "elastic")
    if self._replica_axis is None:
      with jax.set_mesh(self.mesh):
        self._set_replica_axis(jax.eval_shape(self.tx.init, params))
    state = self._local_init(params)
    self._sync_calls = state.config.sync_calls
    return state

  def _local_init(self, params: Any) -> Any:
    return self._inner.init(params)

  def calls(self, opt_state: Any) -> int:
    """Calls of ``step`` the group's state has seen (synchronisations x calls between them, plus
    the calls since the last): after a join, where this process takes up the training."""
    return int(opt_state.outer_step) * opt_state.config.sync_calls + int(opt_state.mini_step)

  def _rounds_of(self, opt_state: Any) -> int:
    """The rounds ``opt_state`` has been through (what the holders of the newest state share)."""
    return int(opt_state.outer_step)

  def join(self, params: Any, opt_state: Any, batch: Any = None, *extra: Any,
           key: jax.Array | None = None) -> tuple[Any, Any]:
    """Until this process holds the group's state (module docstring). In a group that has
    trained, a restarted process first compiles its step on ``batch`` (any batch of the step's
    shapes; ``extra`` and ``key`` as the step's) and the round's programs over every process,
    so that the others do not wait for that, then announces that it is ready and waits to be
    admitted at a round."""
    self._need_init(opt_state)
    if self._fresh and self._live is None and _try_get(self._client, STARTED_KEY) is not None:
      self._compiles_ahead = False
      if batch is not None:
        t_prepare = time.perf_counter()
        self._prepare(params, opt_state, batch, *extra, key=key)
        # Traced now, the programs of the round after its admission are only replayed and
        # loaded then (Replayed): a restarted process has no traces of its first life.
        self._load_programs(params, opt_state)
        _log(f"process {self._me}: compiled its step and the next round's programs in "
             f"{time.perf_counter() - t_prepare:.2f} s")
      self._live = self._await_admission()
    while self._fresh or self._healing:
      params, opt_state = self._synchronise(params, opt_state)
    return params, opt_state

  def _prepare(self, params: Any, opt_state: Any, batch: Any, *extra: Any,
               key: jax.Array | None = None) -> None:
    """Compiles (and runs once, discarding the result) the inner step."""
    if getattr(self._inner, "donate", False):
      params, opt_state = jax.tree_util.tree_map(jnp.copy, (params, opt_state))
    jax.block_until_ready(self._inner.step(params, opt_state, batch, *extra, key=key))

  def _await_admission(self) -> dict[int, int]:
    """Announces this incarnation as ready; returns the live set of the round that admits it."""
    incarnation = self._get_live([self._me])[self._me]
    self._client.key_value_set(f"{READY_DIR}{self._me}", str(incarnation), allow_overwrite=True)
    t_wait = time.perf_counter()
    try:
      text = self._client.blocking_key_value_get(f"{ADMIT_DIR}{self._me}/{incarnation}",
                                                 ADMIT_TIMEOUT_S * 1000)
    except Exception as error:  # noqa: BLE001  (DEADLINE_EXCEEDED)
      raise RuntimeError(
          f"process {self._me} was not admitted within {ADMIT_TIMEOUT_S} s: the group admits a "
          f"restarted process at a round once every process is alive again (XLA:CPU rebuilds "
          f"its communicators with all of them)") from error
    self._client.key_value_delete(f"{READY_DIR}{self._me}")
    _log(f"process {self._me}: admitted after {time.perf_counter() - t_wait:.2f} s of waiting")
    return {int(p): int(i) for p, i in json.loads(text).items()}

  def _ready(self, live: dict[int, int]) -> dict[int, int]:
    """The restarted processes that announced themselves ready (not in ``live``, not refused)."""
    ready = {}
    for name, value in self._client.key_value_dir_get(READY_DIR):
      process, incarnation = int(name.rstrip("/").rsplit("/", 1)[-1]), int(value)
      if process not in live and (process, incarnation) not in self._refused:
        ready[process] = incarnation
    return ready

  def step(self, params: Any, opt_state: Any, batch: Any, *extra: Any,
           key: jax.Array | None = None) -> tuple[Any, Any, jax.Array, Any]:
    """One inner step; the round when a synchronisation is due. Returns (params, opt_state, loss,
    aux) as ``qcomm.data_parallel``'s step (loss and aux of this process's replica)."""
    params, opt_state = self.join(params, opt_state, batch, *extra, key=key)
    params, opt_state, loss, aux = self._inner.step(params, opt_state, batch, *extra, key=key)
    self._mini += 1
    if self._mini >= self._sync_calls:
      host = jax.device_get((loss, aux))
      backend = self._backend
      params, opt_state = self._synchronise(params, opt_state)
      if backend != self._backend:  # rebuilt: the loss and aux of before are gone
        loss, aux = jax.tree_util.tree_map(jnp.asarray, host)
    return params, opt_state, loss, aux

  __call__ = step

  STATE_TYPE: Any = DiLoCoState

  def _need_init(self, opt_state: Any) -> None:
    if self._replica_axis is None or not isinstance(opt_state, self.STATE_TYPE):
      raise ValueError("opt_state must come from this runner's init (dp.init(params))")

  # -- the round ------------------------------------------------------------------------------------
  def _get_live(self, processes=None, expected: dict[int, int] | None = None) -> dict[int, int]:
    """``{process: incarnation}`` of the live ones among ``processes`` (default: all), once
    every live one of them has asked (a barrier among them).

    The service counts a restarted process as live, and it does not ask: a process that died and
    came back since the caller's last barrier would hold this one up for ever. So, given the
    ``expected`` incarnations, the barrier is watched from a thread, and while it waits the
    incarnations the processes published are read (``INCARNATION_DIR``) every
    ``BARRIER_POLL_S`` seconds: a restarted one raises :class:`_Changed` without it (every process
    of the round waits in the same barrier, and reads the same keys)."""
    processes = sorted(range(self._n) if processes is None else processes)
    answer: dict = {}

    def ask():
      try:
        answer["live"] = self._client.get_live_nodes(processes)
      except Exception as error:  # noqa: BLE001  (raised in the caller's thread)
        answer["error"] = error

    asker = threading.Thread(target=ask, name="qcomm-elastic-live", daemon=True)
    asker.start()
    asker.join(None if expected is None else BARRIER_POLL_S)
    while asker.is_alive():
      restarted = self._restarted(expected)
      if restarted:  # the barrier stays open in the service; its answer is not needed
        raise _Changed({**expected, **restarted})
      asker.join(BARRIER_POLL_S)
    if "error" in answer:
      raise answer["error"]
    live = {int(p): int(i) for p, i in dict(answer["live"]).items()}
    if self._me not in live:
      raise RuntimeError(
          f"process {self._me} was declared lost by the coordination service (stopped or cut "
          f"off for longer than the heartbeat timeout) and cannot take part again in this "
          f"incarnation; restart it with the same process index to rejoin")
    return live

  def _check_live(self, live: dict[int, int]) -> None:
    """A barrier of the round's processes (``get_live_nodes`` over them: a restarted process
    outside the round never holds it up); :class:`_Changed` if one is gone or restarted. Every
    process of the round reaches the same calls in the same order and gets the same answer, so
    all of them see a change at the same point."""
    now = self._get_live(live, expected=live)
    if now != live:
      raise _Changed(now)

  def _restarted(self, expected: dict[int, int]) -> dict[int, int]:
    """``{process: incarnation}`` of the processes of ``expected`` that published another
    incarnation than the one expected (restarted since)."""
    published = {int(name.rstrip("/").rsplit("/", 1)[-1]): int(value)
                 for name, value in self._client.key_value_dir_get(INCARNATION_DIR)}
    return {p: published[p] for p in expected if published.get(p, expected[p]) != expected[p]}

  def _synchronise(self, params: Any, opt_state: Any, grads: Any = None) -> tuple[Any, Any]:
    """The round, run again over the new live set until one completes: diloco's synchronisation
    (or, with ``grads``, per-step data parallelism's update) over the holders of the newest
    state, then the state handed to the others."""
    inputs = (params, opt_state, grads)
    t_start = time.perf_counter()
    stalled = 0.0  # seconds of attempts a lost process broke
    while True:
      t_attempt = time.perf_counter()
      if self._live is None:
        self._live = self._get_live()
      live = self._live
      fp = _fingerprint(live)
      count = self._rounds.get(fp, 0)
      self._rounds[fp] = count + 1
      self._inputs = inputs  # host copies instead, once a rebuild has made the arrays invalid
      try:
        round_key = f"qcomm/elastic/{fp}/{count}"
        try:
          result = self._round(live, round_key)
          jax.block_until_ready(result[:2])  # a collective that a lost process breaks fails here
        except _Changed:
          raise
        except Exception as error:  # noqa: BLE001  (a lost peer, or an error of ours)
          self._check_live(live)  # raises _Changed if a peer was lost
          raise error
        self._check_live(live)  # every process of the round has read the others' info
        self._client.key_value_delete(f"{round_key}/info/{self._me}")
        if self._receiving is not None:  # sent in the background: no process waits for it
          result = self._receive(result)
        out = self._commit(*result[:5])
        if self._me in result[8]:  # it has taken part in a round: next time it counts
          self._healing = False
        if not self._fresh:  # a process not yet admitted has no step of its own to report
          self._report(result[5], result[6], result[2], time.perf_counter() - t_start, stalled,
                       result[8])
        if result[7]:  # ready processes: the next round admits them
          self._live = {**live, **result[7]}
          text = json.dumps({str(p): i for p, i in self._live.items()})
          for p, incarnation in result[7].items():  # every process writes it: one may die
            self._client.key_value_set(f"{ADMIT_DIR}{p}/{incarnation}", text,
                                       allow_overwrite=True)
        return out
      except _Changed as change:
        stalled += time.perf_counter() - t_attempt
        # A restarted process (a new incarnation) leaves the round; it comes back when ready.
        kept = {p: i for p, i in change.live.items() if live.get(p) == i}
        gone = sorted(p for p in live if p not in kept)
        self._refused.update((p, live[p]) for p in gone)
        _log(f"process {self._me}: lost process{'es' if len(gone) > 1 else ''} {gone}; the "
             f"{self.ROUND} runs again over {sorted(kept)}")
        self._live = kept
        inputs = self._inputs

  def _round(self, live: dict[int, int], key: str) -> tuple:
    client = self._client
    processes = sorted(live)
    fp = _fingerprint(live)
    if self._loading is not None:  # the programs this round runs
      self._loading.join()
      self._loading = None
    self._receiving = None  # an attempt that a loss broke took nothing
    mine = {"step": -1 if self._fresh else self._outer_step, "backend": self._backend,
            "history": self._history, "healing": self._healing}
    # The one reader of the ready processes; a round of every process has none to read (a ready
    # process is outside the round), which spares the step a request to the service.
    if self._me == processes[0] and len(processes) < self._n:
      mine["ready"] = {str(p): i for p, i in self._ready(live).items()}
    client.key_value_set(f"{key}/info/{self._me}", json.dumps(mine))
    self._check_live(live)  # every process of the round has written its info
    infos = {p: json.loads(client.blocking_key_value_get(f"{key}/info/{p}",
                                                         KEY_TIMEOUT_S * 1000))
             for p in processes}
    newest = max(i["step"] for i in infos.values())
    holders = [p for p in processes if newest >= 0 and infos[p]["step"] == newest]
    full = len(processes) == self._n
    if not holders:
      if _try_get(client, STARTED_KEY) is not None:
        raise RuntimeError("no live process holds the training state (every replica that held "
                           "it is gone); restart the run from a checkpoint")
      # A group starting: every backend was built with all processes present.
      if self._backend is None and full:
        self._backend = fp
    rebuild = bool(holders) and full and any(i["backend"] != fp for i in infos.values())
    receivers = [p for p in processes if p not in holders] if (full and holders) else []
    params, state, grads = self._inputs
    heals = bool(receivers) and self._heals(state)
    # Holders that took the state at the last round: no pseudo-gradient of their own yet.
    healing = [p for p in holders if infos[p]["healing"]]
    healing = healing if len(healing) < len(holders) else []
    history = (_appended(infos[holders[0]]["history"], len(holders) - len(healing))
               if holders else [])
    if self._me in holders:  # before a rebuild: over the communicators the holders have used
      params, state = self._outer(holders, params, state, grads, healing)
    if rebuild:
      t_rebuild = time.perf_counter()
      self._stop_ahead()  # no compilation on the backend being dropped
      # Host copies: the rebuild invalidates every array (the inputs serve a round run again).
      self._inputs, params, state = jax.device_get((self._inputs, params, state))
      _compat.reset_cpu_backend()
      self._check_live(live)
      if self._me == processes[0]:
        for name in _compat.CPU_BACKEND_KEYS:
          client.key_value_delete(name)
      self._check_live(live)
      self._backend = fp
      self._rebuild()
      if not receivers or (heals and self._me not in receivers):  # no relay places them
        params = place(params, P(), self._local_mesh)
        state = place(state, self._spec(state), self._local_mesh)
      self.stall_s += time.perf_counter() - t_rebuild
      _log(f"process {self._me}: CPU backend rebuilt for processes {processes} "
           f"({time.perf_counter() - t_rebuild:.2f} s)")
    loading = None
    if rebuild and receivers:  # the next round's programs load while the state travels
      loading = threading.Thread(target=self._load_programs, args=(params, state),
                                 name="qcomm-elastic-load", daemon=True)
    if heals:  # the others go on: the receivers take it, and sit out the next round's mean
      self._transfer_s = None
      if self._me == holders[0]:
        self._hand_over(key, params, state)
      if self._me in receivers:  # down the chain of them, each passing on what it takes
        self._receiving = (key, loading, receivers.index(self._me),
                           self._me == receivers[-1])
      elif loading is not None:
        self._loading = loading
        loading.start()
    elif receivers:
      t_transfer = time.perf_counter()
      params, state = self._broadcast(processes, holders[0], receivers, params, state,
                                      sending=loading)
      self._check_live(live)  # every receiver has it (the source's part ends sooner)
      self._transfer_s = time.perf_counter() - t_transfer
      if loading is not None:
        loading.join()
    admitted = not holders or self._me in holders or self._me in receivers
    missing = sorted(set(range(self._n)) - set(holders)) if holders else []
    ready = {int(p): i for p, i in infos[processes[0]].get("ready", {}).items()}
    # XLA:CPU rebuilds its communicators with every process: admit only when all are back.
    admit = ready if ready and len(processes) + len(ready) == self._n else {}
    return (params, state, history, admitted, bool(holders), missing, receivers, admit, healing)

  def _report(self, missing: list[int], admitted: list[int], history: list[int], seconds: float,
              stalled: float, healing: list[int]) -> None:
    """One log line and record for a synchronisation that ran short or admitted a process."""
    self.stall_s += stalled
    if not (missing or admitted or healing) or not history:
      return
    replicas = history[-1][1]
    record = {"outer_step": self._outer_step, "replicas": replicas, "missing": missing,
              "admitted": admitted, "healing": healing, "seconds": round(seconds, 3),
              "stall_s": round(stalled, 3)}
    transfer_s = self._transfer_s if admitted else None
    if transfer_s is not None:
      record["transfer_s"] = round(transfer_s, 3)
    self.short_syncs.append(record)
    text = (f"{self.ROUND} {self._outer_step} averaged {replicas} of {self._n} replicas"
            + (f" (missing {missing})" if missing else "")
            + (f" (without {healing}, admitted at the last one)" if healing else "")
            + (f", admitted {admitted}" if admitted else "")
            + f"; it took {seconds:.2f} s, {stalled:.2f} s of it in attempts a lost process broke"
            + (f", {transfer_s:.2f} s in the state's transfer" if transfer_s is not None else "")
            + (" (its transfer goes on behind the next steps)"
               if admitted and transfer_s is None else ""))
    _log(f"process {self._me}: {text}")

  def _commit(self, params, state, history, admitted, synchronised) -> tuple[Any, Any]:
    if admitted:
      if synchronised:
        self._history = history
      self._fresh = False
      self._outer_step = self._rounds_of(state)
      self._mini = int(state.mini_step)
      if synchronised and self._me == min(self._live):
        self._client.key_value_set(STARTED_KEY, "1", allow_overwrite=True)
    return params, state

  # -- the programs across processes ----------------------------------------------------------------
  def _spec(self, state: Any) -> Any:
    return checked_spec(state, self.axis_name)

  def _outer(self, holders: list[int], params: Any, state: Any, grads: Any = None,
             absent: list[int] = ()) -> tuple[Any, Any]:
    """The round's program over the holders' devices: diloco's synchronisation (or the update
    from this process's ``grads``, per-step data parallelism); the holders ``absent`` count for
    nothing in the mean."""
    mesh, spec, args = self._outer_args(holders, params, state, grads, absent=absent)
    out = self._outer_fn(tuple(holders), _SpecKey(spec), self._heals(state))(*args)
    new_params = multihost_utils.global_array_to_host_local_array(out[0], mesh, P())
    new_state = multihost_utils.global_array_to_host_local_array(out[1], mesh, spec)
    if len(holders) == self._n and self._ahead is None and self._compiles_ahead:
      self._ahead = threading.Thread(target=self._compile_ahead, args=(params, state, grads),
                                     name="qcomm-elastic-compile-ahead", daemon=True)
      self._ahead.start()
      _COMPILING_AHEAD[self._ahead] = self._ahead_stop
    return new_params, new_state

  def _outer_args(self, holders: list[int], params: Any, state: Any, grads: Any,
                  abstract: bool = False, absent: list[int] = ()) -> tuple:
    """(mesh, state spec, the round program's global arguments) over the holders' devices;
    ``abstract``: as ``jax.ShapeDtypeStruct`` values (no transfer; ``grads`` may be shapes).
    Where the round weighs the replicas (:meth:`_heals`), a last argument says, per row, whether
    its process counts in the mean: all but ``absent``."""
    mesh = self._mesh_of(holders)
    spec = self._spec(state)
    name = self.mesh.axis_names[self._replica_axis]
    put = global_shapes if abstract else multihost_utils.host_local_array_to_global_array
    args = (put(params, mesh, P()), put(state, mesh, spec))
    if grads is not None:  # a leading row per process
      rows = jax.tree_util.tree_map(
          lambda g: jax.ShapeDtypeStruct((1, *np.shape(g)), g.dtype) if abstract
          else jnp.asarray(g)[None], grads)
      args += (put(rows, mesh, P(name)),)
    if self._heals(state):
      present = (jax.ShapeDtypeStruct((1,), np.bool_) if abstract
                 else np.array([self._me not in absent]))
      args += (put(present, mesh, P(name)),)
    return mesh, spec, args

  def _load_programs(self, params: Any, state: Any) -> None:
    """Loads, on the current backend (the one just rebuilt, or a restarted process's before its
    admission), the programs of the next round over every process (from the persistent cache,
    else compiled), so that it does not wait for them."""
    try:
      everyone = list(range(self._n))
      _, spec, args = self._outer_args(everyone, params, state, self._grads_like(), True)
      self._outer_fn(tuple(everyone), _SpecKey(spec), self._heals(state)).lower(*args).compile()
      self._load_local_programs(params, state)
    except Exception as error:  # noqa: BLE001  (the round compiles them itself)
      _log(f"process {self._me}: could not load the next round's programs ahead: {error!r}")

  def _grads_like(self) -> Any:
    """The shapes of the round's ``grads`` argument (None: the round takes none)."""
    return None

  def _load_local_programs(self, params: Any, state: Any) -> None:
    """Loads the programs a step runs on this process's devices before its round."""

  def _stop_ahead(self) -> None:
    """Stops the thread that compiles ahead (after the program it compiles); the next round of
    every process starts it again (the programs it compiled are in the cache). One that has
    finished stays: its programs outlive the rebuild in the cache."""
    if self._ahead is not None and self._ahead.is_alive():
      self._ahead_stop.set()
      self._ahead.join()
      _COMPILING_AHEAD.pop(self._ahead, None)
      self._ahead, self._ahead_stop = None, threading.Event()

  def _compile_ahead(self, params: Any, state: Any, grads: Any) -> None:
    """Compiles, in a thread at the lowest CPU priority, this process's programs for the losses
    of :func:`_loss_sets`: the round over the holders each leaves, and the transfer program of
    the state to the lost ones when they are back (from the lowest of the others; none where it
    travels in the background); the persistent compilation cache keeps them for when that
    happens."""
    try:  # on Linux the nice value is per thread: the steps keep their priority
      os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
      pass
    everyone = list(range(self._n))
    order = sorted(everyone, key=self._row_of.__getitem__)
    rows = NamedSharding(self._mesh_of(everyone), P(self.mesh.axis_names[self._replica_axis]))
    words = transfer.packed_words(transfer.sent_leaves(
        jax.tree_util.tree_leaves((params, state)), self._plan(params, state)))
    abstract_rows = jax.ShapeDtypeStruct((self._n, words), np.uint32, sharding=rows)
    for lost in _loss_sets(self._n):
      if self._ahead_stop.is_set():
        return
      holders = [p for p in everyone if p not in lost]
      if self._me in holders:
        _, spec, args = self._outer_args(holders, params, state, grads, True)
        self._outer_fn(tuple(holders), _SpecKey(spec), self._heals(state)).lower(*args).compile()
      if not self._heals(state):
        self._broadcast_fn(tuple(everyone), order.index(holders[0]),
                           tuple(order.index(r) for r in lost)).lower(abstract_rows).compile()

  @functools.lru_cache(maxsize=None)
  def _outer_fn(self, holders: tuple, spec: _SpecKey, weighted: bool = False) -> Callable:
    """The round's program over ``holders``; ``weighted``: it takes a last argument, a flag per
    row, False where the row counts for nothing in the mean (diloco's ``PRESENT_ARG``)."""
    tx, name = self.tx, self.mesh.axis_names[self._replica_axis]

    def outer(params, state, *present):
      extra = {PHASE_ARG: "outer"}
      if present:
        extra[PRESENT_ARG] = present[0][0]
      updates, state = tx.update(None, state, params, **extra)
      return optax.apply_updates(params, updates), state

    in_specs = (P(), spec.spec) + ((P(name),) if weighted else ())
    return Replayed(
        jax.jit(jax.shard_map(outer, mesh=self._mesh_of(list(holders)).abstract_mesh,
                              in_specs=in_specs, out_specs=(P(), spec.spec))),
        self._traces, ("outer", holders, spec, weighted))

  def _receive(self, result: tuple) -> tuple:
    """A receiver's part of a background transfer (after its round: nobody waits for it), while
    a thread loads the next rounds' programs: ``result`` with the state it took, or, if the
    source is gone, not admitted (it waits for the next admission)."""
    (key, loading, index, last), self._receiving = self._receiving, None
    if loading is not None:
      loading.start()
    t_transfer = time.perf_counter()
    try:
      params, state = self._take(key, *result[:2], index, last, KEY_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001  (the source lost: admitted at a later round)
      _log(f"process {self._me}: could not take the state ({error!r}); it waits to be admitted")
      return (*result[:3], False, *result[4:])
    finally:
      if loading is not None:
        loading.join()
    self._transfer_s = time.perf_counter() - t_transfer
    self._healing = True
    return (params, state, *result[2:])
