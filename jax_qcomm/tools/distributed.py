"""Several JAX processes on CPU: ``jax.distributed`` over gloo, a global mesh, and prompt failure.

Start the processes with the launcher, which sets the environment variables read here::

    python -m jax_qcomm.tools.launch -n 4 --local-devices 2 train.py

and in ``train.py``, before anything touches a JAX backend::

    from jax_qcomm.tools import distributed
    distributed.initialize()                  # reads QCOMM_* from the environment
    mesh = distributed.global_mesh(("data",))  # all devices of all processes

Environment variables (set by :mod:`jax_qcomm.tools.launch`):

* ``QCOMM_COORDINATOR``     ``host:port`` of the coordination service (run by process 0);
* ``QCOMM_NUM_PROCESSES``   number of processes;
* ``QCOMM_PROCESS_ID``      this process's index, 0..n-1;
* ``QCOMM_LOCAL_DEVICES``   host (CPU) devices per process (``jax_num_cpu_devices``);
* ``QCOMM_GLOO_INTERFACE``  network interface gloo binds to (e.g. ``eth0``); by default gloo binds to
  the address of the machine's hostname;
* ``QCOMM_HEARTBEAT_TIMEOUT``, ``QCOMM_COLLECTIVE_TIMEOUT``, ``QCOMM_SHUTDOWN_TIMEOUT``,
  ``QCOMM_INITIALIZATION_TIMEOUT``: the fault timeouts in seconds (:class:`Timeouts`);
* ``QCOMM_RECOVERABLE``         ``1``/``0`` (also true/false, yes/no, on/off): jax's recoverability
  mode, on by default.
* ``QCOMM_MALLOC``              ``reuse`` (default) or ``glibc``: whether :func:`initialize` sets
  glibc's malloc so that large CPU buffers reuse their pages (:mod:`jax_qcomm.tools.malloc`).
* ``QCOMM_ELASTIC``             ``1``: join a coordination service that runs outside the workers
  (the launcher's ``--elastic``, or ``python -m jax_qcomm.tools.coordinator``), so that any
  process, process 0 included, may die and be restarted (:func:`initialize`'s ``elastic``).
* ``QCOMM_EXTERNAL_SERVICE``    ``1``: join a coordination service that runs outside the workers
  without elasticity (the launcher hosts one in the recoverability mode), so that the death of
  process 0 is an ordinary loss (:func:`initialize`'s ``external_service``).

Without a coordinator (no argument, no ``QCOMM_COORDINATOR``), :func:`initialize` defers to jax's
cluster detection: SLURM (``srun``), Open MPI (``mpirun``), Kubernetes, mpi4py.

Faults (docs/distributed.md has the measured behaviour): :class:`Timeouts` is the one place where
the timeouts that end a run with a lost process are set. A process that dies or stops (SIGSTOP)
is declared dead after ``heartbeat`` seconds. In the recoverability mode (the default) the others
then learn it from their next collective, which raises in Python; without it jax's coordination
service aborts them (XLA logs ``Task N heartbeat timeout`` and raises SIGABRT). A collective that
waits longer than ``collective`` seconds for a peer raises in Python. An uncaught exception ends
the process at once with one line naming the lost process where the coordination service knows it
(:func:`initialize`'s ``fail_fast``), status 1.

Device ids: across processes, CPU device ids are ``2048 * process_index + k``, so never index
devices by id; :func:`global_mesh` orders them by (process_index, local id) and the mesh position is
the global device index.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import queue
import re
import sys
import threading
import types
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

import jax
from jax.sharding import Mesh

from jax_qcomm import _compat
from jax_qcomm.runners import elastic as elastic_core
from jax_qcomm._checks import check_bool, check_choice, check_int
from jax_qcomm.tools import malloc as malloc_tools

ENV_COORDINATOR = "QCOMM_COORDINATOR"
ENV_NUM_PROCESSES = "QCOMM_NUM_PROCESSES"
ENV_PROCESS_ID = "QCOMM_PROCESS_ID"
ENV_LOCAL_DEVICES = "QCOMM_LOCAL_DEVICES"
ENV_GLOO_INTERFACE = "QCOMM_GLOO_INTERFACE"
ENV_HEARTBEAT_TIMEOUT = "QCOMM_HEARTBEAT_TIMEOUT"
ENV_COLLECTIVE_TIMEOUT = "QCOMM_COLLECTIVE_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "QCOMM_SHUTDOWN_TIMEOUT"
ENV_INITIALIZATION_TIMEOUT = "QCOMM_INITIALIZATION_TIMEOUT"
ENV_RECOVERABLE = "QCOMM_RECOVERABLE"
ENV_MALLOC = "QCOMM_MALLOC"
ENV_ELASTIC = "QCOMM_ELASTIC"
ENV_EXTERNAL_SERVICE = "QCOMM_EXTERNAL_SERVICE"
#: Set by ``launch --elastic`` for a spare process: :func:`initialize` waits for a line on
#: standard input (the launcher's word that the spare replaces a lost process) before it joins.
ENV_SPARE = "QCOMM_SPARE"

#: XLA's timeout of one CPU collective across processes (gloo): default 30 minutes.
XLA_CPU_COLLECTIVE_TIMEOUT_FLAG = "xla_cpu_collective_timeout_seconds"
#: XLA's timeout of the NCCL clique rendezvous on GPU (default: none). NCCL kernels themselves have
#: no timeout; on GPU a lost peer is ended by the heartbeat.
XLA_GPU_NCCL_TIMEOUT_FLAG = "xla_gpu_nccl_termination_timeout_seconds"
#: Exit status of a process ended by an uncaught exception under ``fail_fast``.
FAIL_FAST_EXIT = 1
#: jax's cluster detection methods (``jax.distributed.initialize(cluster_detection_method=)``):
#: SLURM, Open MPI (before version 5), mpi4py (opt-in; any MPI, Open MPI 5), Cloud TPU VMs, and
#: "deactivate". Kubernetes is detected only automatically (method None).
CLUSTER_DETECTION_METHODS = ("slurm", "ompi", "mpi4py", "tpu", "gcetpu", "gketpu", "deactivate")
#: Seconds the fail-fast hook waits for the coordination service's list of live processes after a
#: collective timed out (a dead peer is already declared, a stalled one never is).
ASK_LIVE_WAIT_AFTER_TIMEOUT = 5

__all__ = ["initialize", "is_elastic", "global_mesh", "global_devices", "under_launcher", "process_allgather",
           "Timeouts", "ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID",
           "ENV_LOCAL_DEVICES", "ENV_GLOO_INTERFACE", "ENV_HEARTBEAT_TIMEOUT",
           "ENV_COLLECTIVE_TIMEOUT", "ENV_SHUTDOWN_TIMEOUT", "ENV_INITIALIZATION_TIMEOUT",
           "ENV_RECOVERABLE", "ENV_ELASTIC", "ENV_EXTERNAL_SERVICE", "ENV_SPARE", "CLUSTER_DETECTION_METHODS"]


_ELASTIC = False


def is_elastic() -> bool:
  """True after :func:`initialize` joined an elastic run (``elastic=True`` or ``QCOMM_ELASTIC``)."""
  return _ELASTIC


def under_launcher() -> bool:
  """True if this process was started by :mod:`jax_qcomm.tools.launch` (``QCOMM_NUM_PROCESSES`` set)."""
  return bool(os.environ.get(ENV_NUM_PROCESSES))


def _env_int(name: str, value: int | None, what: str) -> int | None:
  if value is not None:
    return value
  text = os.environ.get(name)
  if text is None or text == "":
    return None
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"{what}: environment variable {name} must be an integer, got {text!r}") from None


_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def _env_bool(name: str, value: bool | None, what: str) -> bool | None:
  if value is not None:
    return value
  text = os.environ.get(name)
  if text is None or text == "":
    return None
  word = text.strip().lower()
  if word in _TRUE_WORDS or word in _FALSE_WORDS:
    return word in _TRUE_WORDS
  raise ValueError(f"{what}: environment variable {name} must be one of "
                   f"{'/'.join(_TRUE_WORDS + _FALSE_WORDS)}, got {text!r}")


# ---- fault timeouts: the one place --------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Timeouts:
  """Every timeout that bounds how long a multi-process run outlives a lost process, in seconds.

  Attributes:
    heartbeat: a process that sends no heartbeat for this long (dead, SIGSTOPped, its host gone) is
      declared dead by jax's coordination service, which then ends every other process. Also how
      long the others wait once process 0 (which runs the service) is unreachable.
      ``jax.distributed.initialize(heartbeat_timeout_seconds=)``; jax's default is 100.
    collective: a collective across processes that waits longer than this for a peer raises in
      Python (``Gloo ... Timed out``): the case of a peer that is alive and heartbeating but does
      not reach the collective. XLA flag ``--xla_cpu_collective_timeout_seconds`` (default 30
      minutes); on GPU also ``--xla_gpu_nccl_termination_timeout_seconds`` (NCCL clique rendezvous).
      It bounds any wait inside a collective, so it must exceed the longest time processes can
      legitimately be apart between two collectives (one compiling or writing alone).
    shutdown: at exit, how long a process waits in jax's shutdown barrier for the others
      (``shutdown_timeout_seconds``; jax's default 300).
    initialization: how long processes wait for each other to join (``initialization_timeout``).

  :meth:`from_env` fills the fields not given from ``QCOMM_*_TIMEOUT`` (set by the launcher's
  ``--heartbeat-timeout`` / ``--collective-timeout``), else from these defaults.
  """

  heartbeat: int = 30
  collective: int = 60
  shutdown: int = 60
  initialization: int = 120

  #: field -> the environment variable it is read from.
  ENV: ClassVar[Mapping[str, str]] = types.MappingProxyType(
      {"heartbeat": ENV_HEARTBEAT_TIMEOUT, "collective": ENV_COLLECTIVE_TIMEOUT,
       "shutdown": ENV_SHUTDOWN_TIMEOUT, "initialization": ENV_INITIALIZATION_TIMEOUT})

  def __post_init__(self):
    for field in dataclasses.fields(self):
      check_int(f"{field.name}_timeout", getattr(self, field.name), 1)

  @classmethod
  def from_env(cls, **given: int | None) -> "Timeouts":
    """Timeouts with ``given`` fields (None: not given) over ``QCOMM_*_TIMEOUT`` over defaults."""
    unknown = set(given) - set(cls.ENV)
    if unknown:
      raise TypeError(f"Timeouts.from_env: unknown timeout(s) {sorted(unknown)}; "
                      f"known: {sorted(cls.ENV)}")
    values = {}
    for name, env in cls.ENV.items():
      value = _env_int(env, given.get(name), "jax_qcomm.tools.distributed timeouts")
      if value is not None:
        values[name] = value
    return cls(**values)

  def xla_flags(self, existing: str = "") -> str:
    """``existing`` XLA_FLAGS with the collective timeout flags set to :attr:`collective`
    (replacing any value they had there)."""
    flags = [f for f in existing.split() if not re.match(
        rf"--({XLA_CPU_COLLECTIVE_TIMEOUT_FLAG}|{XLA_GPU_NCCL_TIMEOUT_FLAG})=", f)]
    flags += [f"--{XLA_CPU_COLLECTIVE_TIMEOUT_FLAG}={self.collective}",
              f"--{XLA_GPU_NCCL_TIMEOUT_FLAG}={self.collective}"]
    return " ".join(flags)


# ---- fail fast on an uncaught exception ---------------------------------------------------------

def _is_collective_failure(exc: BaseException) -> bool:
  text = str(exc).lower()
  return "gloo" in text or "nccl" in text or "collective" in text


def _is_timeout(exc: BaseException) -> bool:
  return "timed out" in str(exc).lower() or "deadline" in str(exc).lower()


class _LiveAsker:
  """A daemon thread that asks the coordination service for the live processes, one question at
  a time, each answer awaited for at most ``wait`` seconds.

  Started by :func:`initialize` in the recoverability mode, before it is needed: the question at a
  normal exit (:func:`_shutdown_barrier`) must be bounded too, and Python 3.12 starts no thread
  during interpreter shutdown, where atexit handlers run. A question left unanswered keeps the
  thread, and later questions wait behind it within their own bound.
  """

  def __init__(self):
    self._questions: queue.Queue = queue.Queue()
    threading.Thread(target=self._serve, name="qcomm-ask-live", daemon=True).start()

  def _serve(self) -> None:
    while True:
      client, num_processes, answer = self._questions.get()
      try:
        answer.put(("live", sorted(client.get_live_nodes(list(range(num_processes))))))
      except Exception as e:  # noqa: BLE001  (the service is gone: reported, not raised)
        answer.put(("error", e))

  def ask(self, client, num_processes: int, wait: float) -> tuple[str, Any]:
    answer: queue.Queue = queue.Queue(maxsize=1)
    self._questions.put((client, num_processes, answer))
    try:
      return answer.get(timeout=wait)
    except queue.Empty:
      return "no answer", None


_ASKER: _LiveAsker | None = None


def _live_asker() -> _LiveAsker:
  """The process's one :class:`_LiveAsker`, started on first use."""
  global _ASKER
  if _ASKER is None:
    _ASKER = _LiveAsker()
  return _ASKER


def _ask_live(num_processes: int, wait: float) -> tuple[str, Any]:
  """The coordination service's list of live processes: ``("live", ids)``, ``("error", exc)`` if
  the service cannot be reached, or ``("no answer", None)`` after ``wait`` seconds.

  ``get_live_nodes`` acts as a barrier among the processes the service counts as alive (every
  survivor of a failed collective asks it too), so it answers once the lost process is declared
  dead (after the heartbeat timeout) and never while a live process stays away.
  """
  client, _, _ = _compat.distributed_state()
  if client is None:
    return "error", RuntimeError("jax.distributed is not initialized")
  return _live_asker().ask(client, num_processes, wait)


def _lost_process_text(exc: BaseException, process_id: int, num_processes: int,
                       timeouts: Timeouts, external: bool = False) -> str:
  """Which process this collective failure lost, as the coordination service knows it.

  A reset connection means a peer's process is gone: the service declares it dead within the
  heartbeat timeout, so the question waits that long. A timed-out collective either follows a
  peer already declared dead (stopped for longer than the heartbeat timeout) or a live peer that
  does not take part, which the service never declares: a short wait tells them apart.
  """
  wait = (ASK_LIVE_WAIT_AFTER_TIMEOUT if _is_timeout(exc)
          else timeouts.heartbeat + ASK_LIVE_WAIT_AFTER_TIMEOUT)
  kind, value = _ask_live(num_processes, wait)
  if kind == "live":
    lost = [i for i in range(num_processes) if i not in value]
    if lost:
      names = ", ".join(str(i) for i in lost)
      return (f"lost process{'es' if len(lost) > 1 else ''} {names} (the coordination service "
              f"no longer counts {'them' if len(lost) > 1 else 'it'} alive: dead, or stopped for "
              f"longer than the heartbeat timeout, {timeouts.heartbeat} s)")
    return "no process was declared lost (every process reached the coordination service)"
  if kind == "error":
    if process_id != 0 and not external:
      return ("lost process 0: the coordination service it runs is unreachable "
              f"({str(value).splitlines()[0][:160]})")
    return f"the coordination service did not answer ({str(value).splitlines()[0][:160]})"
  if _is_timeout(exc):
    return (f"no process declared lost within {wait} s: a process alive by its heartbeats did not "
            f"reach the collective within the collective timeout ({timeouts.collective} s)"
            + (", or process 0, which runs the coordination service, is stopped"
               if process_id != 0 else ""))
  return (f"a peer's connection was reset, and the coordination service named no lost process "
          f"within {wait} s")


def _install_fail_fast(process_id: int, num_processes: int, timeouts: Timeouts,
                       recoverable: bool, external: bool = False) -> None:
  """Makes an uncaught exception end this process at once with status 1 (130 for Ctrl-C).

  Without this, Python's exit runs jax's atexit ``jax.distributed.shutdown()``, a barrier that
  waits for every other process: with a peer dead it lasts until the heartbeat timeout and ends in
  an abort (SIGABRT); with a peer alive but elsewhere, up to the shutdown timeout. The traceback is
  printed first (by the previous hook), then one line saying what happened. In the recoverability
  mode, a collective failure first asks the coordination service which process is lost
  (:func:`_lost_process_text`), so that the line names it.
  """
  previous = sys.excepthook

  def fail_fast_hook(exc_type, exc, tb):
    previous(exc_type, exc, tb)
    status = 130 if issubclass(exc_type, KeyboardInterrupt) else FAIL_FAST_EXIT
    try:
      if _is_collective_failure(exc):
        why = (f"a collective across processes failed: another process died, stopped, or did not "
               f"reach the same collective within the collective timeout ({timeouts.collective} s)")
        if recoverable and status == FAIL_FAST_EXIT:
          sys.stderr.flush()
          why = (f"{_lost_process_text(exc, process_id, num_processes, timeouts, external)}; "
                 f"{why}")
      else:
        why = f"uncaught {exc_type.__name__}"
      sys.stderr.write(f"jax_qcomm.tools.distributed: process {process_id} of {num_processes} exits "
                       f"with status {status}: {why}; not waiting in jax.distributed's shutdown "
                       "barrier for the other processes\n")
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(status)

  sys.excepthook = fail_fast_hook


# ---- initialize ---------------------------------------------------------------------------------

def _wait_as_spare() -> None:
  """A spare started by ``launch --elastic`` (``QCOMM_SPARE=1``): everything the program did
  before :func:`initialize` (imports, setup) is done; wait here until the launcher writes a line
  (this process now replaces a lost one of its index), or exit quietly if it closes the pipe (the
  run ended without needing this spare)."""
  if not sys.stdin.readline():
    sys.exit(0)
  os.environ.pop(ENV_SPARE, None)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_count: int | None = None,
               interface: str | None = None, *, hostname: str | None = None,
               heartbeat_timeout: int | None = None, collective_timeout: int | None = None,
               shutdown_timeout: int | None = None, initialization_timeout: int | None = None,
               fail_fast: bool = True, preemption_service: bool = False,
               recoverable: bool | None = None, cluster_detection_method: str | None = None,
               coordinator_bind_address: str | None = None, mtls_cert_file: str | None = None,
               mtls_key_file: str | None = None, mtls_ca_file: str | None = None,
               mtls_peer_uri_prefix: str | None = None, malloc: str | None = None,
               elastic: bool | None = None,
               external_service: bool | None = None) -> Timeouts:
  """Joins this process to a multi-process CPU run: gloo collectives over ``jax.distributed``.

  Must be called before anything initialises a JAX backend (any computation, ``jax.devices()``,
  ``jax.device_put``, ...): it changes the CPU backend's configuration and XLA's flags, which are
  read once when the backend is created. ``jax.distributed.initialize`` raises a RuntimeError if a
  backend already exists.

  Arguments left as None come from the environment set by :mod:`jax_qcomm.tools.launch`
  (``QCOMM_COORDINATOR``, ``QCOMM_NUM_PROCESSES``, ``QCOMM_PROCESS_ID``, ``QCOMM_LOCAL_DEVICES``,
  ``QCOMM_GLOO_INTERFACE``, ``QCOMM_*_TIMEOUT``, ``QCOMM_RECOVERABLE``). When the coordinator, the
  process count or the index is still missing, jax's cluster detection supplies it: under
  SLURM (``srun``), Open MPI (``mpirun``), Kubernetes, or with ``cluster_detection_method="mpi4py"``
  any MPI; given values are kept. With all three given, detection is off. A spare process of
  ``launch --elastic`` (``QCOMM_SPARE=1``) first waits here for a line on its standard input,
  the launcher's word that it replaces a lost process, and exits with status 0 at the input's
  end.

  Args:
    coordinator_address: ``host:port`` of the coordination service, which process 0 runs.
    num_processes: number of processes.
    process_id: this process's index in 0..num_processes-1.
    local_device_count: host devices in this process (sets ``jax_num_cpu_devices``); None keeps
      JAX's default (one CPU device).
    interface: network interface for gloo's sockets (``"eth0"``, ``"lo"``, ...). By default gloo
      binds to the address of the machine's hostname. JAX has no public option for it:
      :func:`jax_qcomm._compat.register_gloo_cpu_backend` re-registers the ``"cpu"`` backend
      factory with one that passes it to jaxlib's gloo constructor.
    hostname: alternatively, the host name or address gloo binds to (jaxlib's ``hostname``).
    heartbeat_timeout, collective_timeout, shutdown_timeout, initialization_timeout: seconds; see
      :class:`Timeouts` (defaults 30, 60, 60, 120). The collective timeout is written into
      ``XLA_FLAGS`` of this process.
    fail_fast: an uncaught exception prints its traceback and a line naming this process (and,
      after a failed collective, the lost process), then exits at once with status 1 instead of
      waiting in jax's shutdown barrier.
    preemption_service: keep jax's preemption service (``jax_enable_preemption_service``). It
      turns SIGTERM into a preemption notice for ``multihost_utils.reached_preemption_sync_point``,
      so that SIGTERM no longer ends the process; off by default, so SIGTERM ends it.
    recoverable: jax's recoverability mode (``jax_enable_recoverability``, which jax hands to the
      coordination service in process 0); default True, else ``QCOMM_RECOVERABLE``. When the
      service declares a process dead, it no longer aborts the others (SIGABRT, no Python code
      runs): they raise from their next collective and, with ``fail_fast``, exit with status 1 and
      a line naming the lost process. It does not let a run continue past the loss. False restores
      jax's default (the abort after the heartbeat timeout).
    cluster_detection_method: which of jax's cluster detections supplies what is missing, one of
      :data:`CLUSTER_DETECTION_METHODS`; None tries SLURM, Open MPI, Kubernetes and Cloud TPU.
    coordinator_bind_address: ``host:port`` the coordination service (process 0) listens on;
      jax's default: every address (``[::]``) on the coordinator's port.
    mtls_cert_file, mtls_key_file, mtls_ca_file: PEM files: this process's certificate chain, its
      key, and the CA bundle that signs every process's certificate. Given together, the
      coordination service and its clients authenticate each other with mutual TLS (gloo's own
      connections stay plain TCP: docs/distributed.md). None: jax's ``jax_mtls_*`` settings.
    mtls_peer_uri_prefix: accept a peer iff a URI SAN of its certificate starts with this prefix
      (ending in ``/``), instead of checking the coordinator's host name against its certificate.
    malloc: ``"reuse"`` (default, else ``QCOMM_MALLOC``) sets glibc's malloc so that XLA's large
      CPU buffers reuse their pages instead of being mapped afresh every step
      (:func:`jax_qcomm.tools.malloc.reuse_pages`: one arena, mmap and trim thresholds of 2 GiB;
      a parameter whose ``MALLOC_*`` variable the environment sets is left to it); ``"glibc"``
      keeps glibc's defaults.
    elastic: default False, else ``QCOMM_ELASTIC``. Join as a client of a coordination service
      that runs outside the workers (``python -m jax_qcomm.tools.coordinator``, or the one
      ``launch --elastic`` hosts) instead of starting it in process 0: every process, 0 included,
      may then die and be restarted with the same index, by any supervisor, and rejoin
      (``qcomm.data_parallel(..., elastic=True)``). Needs the coordinator, the process count and
      the index (no cluster detection) and the recoverability mode; no mTLS. Each process keeps
      its compiled programs in jax's persistent compilation cache, in a directory of its own
      (:func:`jax_qcomm._compat.cache_compiled_programs_per_process`), so that an admission's
      backend rebuild and a restart read them back instead of compiling again;
      ``jax_enable_compilation_cache=False`` turns that off.
    external_service: default False, else ``QCOMM_EXTERNAL_SERVICE`` (which ``launch`` sets in the
      recoverability mode, where it hosts the service). Join the coordination service as a
      client, as ``elastic`` does, without its restarts: process 0 then runs no service, so its
      death is a loss like any other, which the survivors name when they exit (``fail_fast``).
      The same needs as ``elastic``; implied by it.

  Returns:
    The :class:`Timeouts` in force.
  """
  what = "jax_qcomm.tools.distributed.initialize"
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  num_processes = _env_int(ENV_NUM_PROCESSES, num_processes, what)
  process_id = _env_int(ENV_PROCESS_ID, process_id, what)
  local_device_count = _env_int(ENV_LOCAL_DEVICES, local_device_count, what)
  if interface is None:
    interface = os.environ.get(ENV_GLOO_INTERFACE) or None
  if recoverable is not None:
    check_bool("recoverable", recoverable)
  recoverable = _env_bool(ENV_RECOVERABLE, recoverable, what)
  recoverable = True if recoverable is None else bool(recoverable)
  if elastic is not None:
    check_bool("elastic", elastic)
  elastic = bool(_env_bool(ENV_ELASTIC, elastic, what))
  if external_service is not None:
    check_bool("external_service", external_service)
  external = elastic or bool(_env_bool(ENV_EXTERNAL_SERVICE, external_service, what))
  option = "elastic=True" if elastic else "external_service=True"
  check_bool("fail_fast", fail_fast)
  check_bool("preemption_service", preemption_service)
  if malloc is None:
    malloc = os.environ.get(ENV_MALLOC) or "reuse"
    if malloc not in malloc_tools.MODES:
      raise ValueError(f"{what}: {ENV_MALLOC} must be one of {malloc_tools.MODES}, got {malloc!r}")
  check_choice("malloc", malloc, malloc_tools.MODES)
  if coordinator_address is not None:
    _check_address("coordinator_address", coordinator_address)
  if num_processes is not None:
    check_int("num_processes", num_processes, 1)
  if process_id is not None:
    check_int("process_id", process_id, 0)
  if num_processes is not None and process_id is not None and process_id >= num_processes:
    raise ValueError(f"process_id must be in 0..{num_processes - 1}, got {process_id}")
  if local_device_count is not None:
    check_int("local_device_count", local_device_count, 1)
  _check_interface(interface)
  if hostname is not None and (not isinstance(hostname, str) or not hostname):
    raise ValueError(f"hostname must be a host name or address, got {hostname!r}")
  if cluster_detection_method is not None:
    check_choice("cluster_detection_method", cluster_detection_method, CLUSTER_DETECTION_METHODS)
  if coordinator_bind_address is not None:
    _check_address("coordinator_bind_address", coordinator_bind_address)
  mtls = _check_mtls(mtls_cert_file, mtls_key_file, mtls_ca_file, mtls_peer_uri_prefix)
  timeouts = Timeouts.from_env(heartbeat=heartbeat_timeout, collective=collective_timeout,
                               shutdown=shutdown_timeout, initialization=initialization_timeout)

  missing = [name for name, value in ((f"coordinator_address ({ENV_COORDINATOR})", coordinator_address),
                                      (f"num_processes ({ENV_NUM_PROCESSES})", num_processes),
                                      (f"process_id ({ENV_PROCESS_ID})", process_id))
             if value is None]
  if external:
    if missing:
      raise ValueError(f"{what}: {option} needs {', '.join(missing)} (the coordination "
                       "service runs outside the workers, so there is no cluster detection)")
    if not recoverable:
      raise ValueError(f"{what}: {option} needs recoverable=True (a lost process must not "
                       "end the others)")
    if any(mtls.values()):
      raise ValueError(f"{what}: {option} does not support mTLS")
  if not missing:
    detection = "deactivate"
  elif cluster_detection_method == "deactivate":
    raise ValueError(f"{what}: {', '.join(missing)} not given and not set in the environment, and "
                     "cluster_detection_method='deactivate'; pass them, or start the processes with "
                     "`python -m jax_qcomm.tools.launch -n N script.py`")
  else:
    detection = cluster_detection_method  # None: jax tries every environment it knows

  if os.environ.get(ENV_SPARE) == "1":
    _wait_as_spare()
  if malloc == "reuse":
    # Before jax.distributed starts its threads: a thread that allocates before the arena limit
    # is set gets an arena of its own, and XLA's threads would later share it.
    malloc_tools.reuse_pages()
  # Read by jax.distributed.initialize below: without the preemption service, SIGTERM ends JAX;
  # with recoverability, the coordination service does not abort the survivors of a lost process.
  jax.config.update("jax_enable_preemption_service", bool(preemption_service))
  jax.config.update("jax_enable_recoverability", recoverable)
  try:
    if external:
      client = _compat.connect_client(coordinator_address, int(process_id), int(num_processes),
                                      initialization_timeout=timeouts.initialization,
                                      heartbeat_timeout=timeouts.heartbeat,
                                      shutdown_timeout=timeouts.shutdown)
      if elastic:
        elastic_core.before_backend(client, int(process_id), int(num_processes))
        # Compiled programs outlive the backend rebuild of an admission and a restart.
        _compat.cache_compiled_programs_per_process(int(process_id))
    else:
      jax.distributed.initialize(coordinator_address=coordinator_address,
                                 num_processes=None if num_processes is None else int(num_processes),
                                 process_id=None if process_id is None else int(process_id),
                                 cluster_detection_method=detection,
                                 initialization_timeout=timeouts.initialization,
                                 heartbeat_timeout_seconds=timeouts.heartbeat,
                                 shutdown_timeout_seconds=timeouts.shutdown,
                                 coordinator_bind_address=coordinator_bind_address, **mtls)
  except ValueError as e:
    if detection == "deactivate":
      raise
    raise ValueError(
        f"{what}: {', '.join(missing)} not given, not set in the environment, and jax's cluster "
        f"detection ({cluster_detection_method or 'SLURM, Open MPI, Kubernetes, Cloud TPU'}) did "
        f"not supply them ({e}); start the processes with `python -m jax_qcomm.tools.launch -n N "
        "script.py`, under srun / mpirun, or pass them explicitly") from e
  except RuntimeError as e:
    raise RuntimeError(f"{what}: {e}") from e
  if missing:  # chosen by jax's cluster detection
    _, process_id, num_processes = _compat.distributed_state()
  # No backend exists yet (jax.distributed.initialize refuses otherwise): the settings below are
  # read when the first one is created.
  os.environ["XLA_FLAGS"] = timeouts.xla_flags(os.environ.get("XLA_FLAGS", ""))
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if local_device_count is not None:
    jax.config.update("jax_num_cpu_devices", int(local_device_count))
  if interface is not None or hostname is not None:
    _compat.register_gloo_cpu_backend(interface, hostname)
  if recoverable:
    _live_asker()  # started now: Python 3.12 starts no thread at exit
  if fail_fast:
    _install_fail_fast(int(process_id), int(num_processes), timeouts, recoverable, external)
  global _ELASTIC
  _ELASTIC = elastic
  if recoverable and not elastic:
    # Runs before jax's own atexit shutdown (registered when jax was imported; atexit is LIFO).
    atexit.register(_shutdown_barrier, timeouts.shutdown)
  return timeouts


#: Name of the barrier every process passes at a normal exit in the recoverability mode.
SHUTDOWN_BARRIER = "jax_qcomm_shutdown"


def _shutdown_barrier(seconds: int) -> None:
  """At a normal exit in the recoverability mode: leave together, process 0 last.

  With recoverable tasks, jax's shutdown barrier no longer blocks (XLA: "The default shutdown
  barrier will only block non-recoverable tasks"): process 0 would stop the coordination service
  as soon as it is done, and the client of a process still working (writing a file after the last
  collective) or still disconnecting would abort on losing it. So: a barrier of every process;
  then the others disconnect (``jax.distributed.shutdown()``) while process 0 waits, in
  ``get_live_nodes`` (which returns once every process it counts as alive has asked too or left),
  until they have; then jax's own exit stops the service. Each wait is bounded by the shutdown
  timeout."""
  client, process_id, num_processes = _compat.distributed_state()
  if client is None:
    return
  try:
    client.wait_at_barrier(SHUTDOWN_BARRIER, int(seconds) * 1000)
    if process_id != 0:
      jax.distributed.shutdown()
    else:
      kind, value = _ask_live(int(num_processes), seconds)
      if kind != "live":
        raise RuntimeError(f"the other processes did not leave within {seconds} s" if value is None
                           else str(value))
  except Exception as e:  # noqa: BLE001  (a lost process: exit anyway, saying so)
    sys.stderr.write(f"jax_qcomm.tools.distributed: process {process_id}: the shutdown barrier "
                     f"failed, exiting without the others: {str(e).splitlines()[0][:200]}\n")


def _check_address(name: str, address) -> None:
  host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"{name} must be 'host:port' (port 1..65535), got {address!r}")


def _check_mtls(cert: str | None, key: str | None, ca: str | None,
                peer_uri_prefix: str | None) -> dict[str, str]:
  """The mTLS arguments given, checked: existing files, certificate and key together."""
  given = {}
  for name, value in (("mtls_cert_file", cert), ("mtls_key_file", key), ("mtls_ca_file", ca)):
    if value is None:
      continue
    if not isinstance(value, (str, os.PathLike)) or not os.path.isfile(value):
      raise ValueError(f"{name} must be the path of an existing PEM file, got {value!r}")
    given[name] = os.fspath(value)
  if ("mtls_cert_file" in given) != ("mtls_key_file" in given):
    raise ValueError("mtls_cert_file and mtls_key_file must be given together, got "
                     f"mtls_cert_file={cert!r}, mtls_key_file={key!r}")
  if given and "mtls_ca_file" not in given:
    raise ValueError(f"mtls_ca_file must be given with mtls_cert_file and mtls_key_file, got {ca!r}")
  if peer_uri_prefix is not None:
    if not isinstance(peer_uri_prefix, str) or not peer_uri_prefix.endswith("/") or "://" not in peer_uri_prefix:
      raise ValueError("mtls_peer_uri_prefix must be a URI prefix ending in '/' (e.g. "
                       f"'spiffe://example.org/'), got {peer_uri_prefix!r}")
    given["mtls_peer_uri_prefix"] = peer_uri_prefix
  return given


def _check_interface(interface: str | None) -> None:
  if interface is None:
    return
  if not isinstance(interface, str) or not interface:
    raise ValueError(f"interface must be a network interface name such as 'eth0', got {interface!r}")
  if os.path.isdir("/sys/class/net") and not os.path.exists(os.path.join("/sys/class/net", interface)):
    raise ValueError(f"interface {interface!r} does not exist on this machine; available: "
                     f"{sorted(os.listdir('/sys/class/net'))}")


def global_devices() -> list[jax.Device]:
  """All devices of all processes ordered by (process_index, local id).

  The position in this list is the global device index; device ids are not (they are
  ``2048 * process_index + k`` across CPU processes).
  """
  return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def global_mesh(axis_names: str | Sequence[str] = ("data",),
                shape: Sequence[int] | None = None) -> Mesh:
  """A ``jax.sharding.Mesh`` over all global devices, ordered by (process_index, local id).

  Args:
    axis_names: one name, or several (e.g. ``("proc", "local")``).
    shape: the mesh shape; default: all devices on one axis, or for two names
      (process_count, local_device_count) -- processes on the first axis, each process's own
      devices on the second (the slow and the fast axis of :class:`jax_qcomm.Hierarchical`).

  The axes are ``Auto`` (``Mesh(devices, names)``), so ``jax.shard_map`` accepts unsharded inputs;
  ``jax.make_mesh`` would make them Explicit.
  """
  if isinstance(axis_names, str):
    axis_names = (axis_names,)
  axis_names = tuple(axis_names)
  devices = global_devices()
  if shape is None:
    if len(axis_names) == 1:
      shape = (len(devices),)
    elif len(axis_names) == 2:
      shape = (jax.process_count(), jax.local_device_count())
    else:
      raise ValueError(f"shape is required for {len(axis_names)} axis names {axis_names}")
  shape = tuple(int(s) for s in shape)
  if len(shape) != len(axis_names):
    raise ValueError(f"shape {shape} needs one entry per axis name {axis_names}")
  if int(np.prod(shape)) != len(devices):
    raise ValueError(f"shape {shape} has {int(np.prod(shape))} positions but there are "
                     f"{len(devices)} devices ({jax.process_count()} processes x "
                     f"{jax.local_device_count()} local)")
  return Mesh(np.array(devices, dtype=object).reshape(shape), axis_names)


def process_allgather(tree: Any, tiled: bool = False) -> Any:
  """Numpy copies of a pytree gathered from every process (stacked on a new axis 0, or
  concatenated with ``tiled``): ``jax.experimental.multihost_utils.process_allgather``."""
  from jax.experimental import multihost_utils

  return multihost_utils.process_allgather(tree, tiled=tiled)
