"""Starts several local JAX processes joined by ``jax.distributed`` (gloo on CPU).

Usage::

    python -m jax_qcomm.tools.launch -n 4 [--local-devices 2] [--port P] [--host 127.0.0.1]
                               [--interface eth0] [--timeout S] [--env K=V ...]
                               [--heartbeat-timeout S] [--collective-timeout S]
                               [--no-recoverable] [--malloc reuse|glibc]
                               [--elastic [--max-restarts R] [--spare-delay S]]
                               (script.py [args...] | -m module [args...])

Starts ``n`` copies of ``sys.executable script.py args`` (or ``-m module args``), each with the
environment read by :func:`jax_qcomm.tools.distributed.initialize`:

* ``QCOMM_COORDINATOR=host:port`` (default port: a free one), ``QCOMM_NUM_PROCESSES=n``,
  ``QCOMM_PROCESS_ID=rank``, and, when given, ``QCOMM_LOCAL_DEVICES``, ``QCOMM_GLOO_INTERFACE``,
  ``QCOMM_HEARTBEAT_TIMEOUT`` and ``QCOMM_COLLECTIVE_TIMEOUT`` (see
  :class:`jax_qcomm.tools.distributed.Timeouts`), and ``QCOMM_RECOVERABLE`` (``1``, or ``0`` with
  ``--no-recoverable``: jax's recoverability mode, on by default);
* ``PYTHONUNBUFFERED=1``, so that output arrives line by line;
* with ``--malloc reuse`` (the default) glibc's malloc set to reuse large buffers' pages
  (:data:`MALLOC_REUSE_ENV`, each variable unless the environment sets it; ``--malloc glibc``
  leaves glibc's defaults). With those defaults every buffer above 32 MiB is a fresh ``mmap``, and
  so is every buffer above 64 MiB that a thread other than the main one allocates, whatever the
  threshold (secondary arenas): XLA:CPU's 100 MB buffers of a 25.6M float32 gradient then
  page-fault on each call (50k faults per allreduce). On the simulated 2-node 1 Gbit/s cluster
  reusing the pages took a Summable 4 allreduce of 25.6M values from 241 to 175 ms and the exact
  fp32 psum from 911 to 866 ms (docs/benchmarks.md). The cost: freed memory stays in the process,
  and threads share one arena's lock;
* ``QCOMM_MALLOC``: the ``--malloc`` mode, unless the environment sets it, which
  :func:`jax_qcomm.tools.distributed.initialize` applies itself with ``mallopt`` (``glibc``: not
  at all);
* ``QCOMM_LAUNCH_COMMAND``: the launcher's command line (recorded by the benchmarks).

Every line a process prints is prefixed with ``[rank]`` (stdout to stdout, stderr to stderr). The
launcher waits for all processes. When one fails it says which (its exit status or signal; a
process stopped by SIGSTOP is named too), stops the others (SIGTERM, then SIGKILL after
``--kill-grace`` seconds), prints every process's final status and exits with the failed one's
status (128 + signal number for a process killed by a signal). When several fail in the same
instant, the one killed by an outside signal is taken as the cause (the others are most likely
reacting to its loss). In the recoverability mode (the default) the launcher hosts jax's
coordination service itself (recoverable, as :mod:`jax_qcomm.tools.coordinator` does) and sets
``QCOMM_EXTERNAL_SERVICE=1`` (:func:`jax_qcomm.tools.distributed.initialize` then joins as a
client), so that the death of process 0 is an ordinary loss: without ``--elastic``, when a process
is killed by a signal, the survivors are given the heartbeat timeout plus a few seconds to exit
by themselves, each with status 1 and a line naming the lost process (``initialize``'s
``fail_fast``), before the launcher stops those still running (a process that exits with an
error status has the others stopped at once). ``--elastic`` sets ``QCOMM_ELASTIC=1`` as well.
A process that dies (any signal, any exit status but 0) is restarted with its rank, up to
``--max-restarts`` times each (default 3), while the others keep running; each loss and restart is
reported. Once a process has exited with 0 (the run is ending), a loss is no longer restarted.
The restart is made from a spare: ``--spare-delay`` seconds (default :data:`SPARE_DELAY_S`) after
each process starts, the launcher starts another of its rank with ``QCOMM_SPARE=1``, which runs
the program up to :func:`jax_qcomm.tools.distributed.initialize` (its imports and whatever
precedes that call) and waits there for a line on its standard input. When the process dies, the
launcher writes that line, and the spare joins at once instead of a new process starting from
nothing; the survivors learn of the loss when it joins (the coordination service then sees the
new incarnation). A process lost before its spare started is restarted afresh. At the end the
spares read the end of their pipe and exit with status 0.
Without ``--elastic``: SIGINT (Ctrl-C) and SIGTERM sent to the launcher are forwarded to every
process, which are killed if still alive ``--kill-grace`` seconds later; the launcher then exits
with 130 or 143. ``--timeout`` (exit status 124) stops them all the same way. Each process runs in
its own session, so stopping them also stops anything they started.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

from jax_qcomm.tools import distributed, malloc

# Launcher options that take a value (the command line is split at the first token that is not
# one of these options, or at -m / --).
_VALUE_OPTIONS = {"-n", "--num-processes", "--local-devices", "--port", "--host", "--interface",
                  "--timeout", "--env", "--kill-grace", "--heartbeat-timeout",
                  "--collective-timeout", "--malloc", "--max-restarts", "--spare-delay"}
_FLAG_OPTIONS = {"-h", "--help", "--recoverable", "--no-recoverable", "--elastic"}
#: Restarts per process under --elastic unless --max-restarts says otherwise.
DEFAULT_MAX_RESTARTS = 3
#: Seconds after a process of an ``--elastic`` run starts (or a spare takes its place) before the
#: launcher starts the next spare of its index, so that the spare's imports do not compete with
#: the start of the run or with a restarted process's compilation.
SPARE_DELAY_S = 15.0
TIMEOUT_EXIT = 124
#: glibc malloc settings under which large buffers reuse heap pages instead of fresh mmaps: one
#: arena, no mmap below 4 GiB, no trimming of the heap below 16 GiB (``--malloc reuse``).
MALLOC_REUSE_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "4294967296",
                    "MALLOC_TRIM_THRESHOLD_": "17179869184"}
MALLOC_MODES = malloc.MODES  # one definition: what initialize() also accepts
#: The launcher's own command line, for the processes' records (benchmarks' metadata).
ENV_LAUNCH_COMMAND = "QCOMM_LAUNCH_COMMAND"


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that was free on ``host`` a moment ago."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m jax_qcomm.tools.launch",
      usage="%(prog)s -n N [options] (script.py [args ...] | -m module [args ...])",
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("-n", "--num-processes", type=int, required=True,
                      help="number of processes to start")
  parser.add_argument("--local-devices", type=int, default=None,
                      help="host (CPU) devices per process (QCOMM_LOCAL_DEVICES)")
  parser.add_argument("--port", type=int, default=None,
                      help="coordinator port (default: a free port)")
  parser.add_argument("--host", default="127.0.0.1",
                      help="coordinator address (default: 127.0.0.1); the launcher hosts the service "
                           "there in the recoverability mode, process 0 does otherwise")
  parser.add_argument("--interface", default=None,
                      help="network interface gloo binds to (QCOMM_GLOO_INTERFACE), e.g. eth0")
  parser.add_argument("--timeout", type=float, default=None,
                      help="kill all processes after this many seconds (exit status 124)")
  parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                      help="extra environment variable for every process (repeatable)")
  parser.add_argument("--kill-grace", type=float, default=3.0,
                      help="seconds between SIGTERM and SIGKILL when stopping processes (default: 3)")
  parser.add_argument("--heartbeat-timeout", type=int, default=None,
                      help="seconds without heartbeat before a process is declared lost "
                           "(QCOMM_HEARTBEAT_TIMEOUT; default: 30)")
  parser.add_argument("--collective-timeout", type=int, default=None,
                      help="seconds a collective waits for a peer before it fails "
                           "(QCOMM_COLLECTIVE_TIMEOUT; default: 60)")
  parser.add_argument("--malloc", choices=MALLOC_MODES, default="reuse",
                      help="reuse (default): one malloc arena and no mmap / trim below 4 / 16 GiB, "
                           "so XLA's large buffers reuse their pages (each variable unless the "
                           "environment sets it); glibc: glibc's defaults")
  parser.add_argument("--recoverable", action=argparse.BooleanOptionalAction, default=True,
                      help="jax's recoverability mode (QCOMM_RECOVERABLE): a lost process makes "
                           "the others raise from their next collective instead of being aborted "
                           "(default: on; --no-recoverable for jax's abort)")
  parser.add_argument("--elastic", action="store_true",
                      help="host the coordination service in the launcher and restart a process "
                           "that dies, with its rank, while the others go on (QCOMM_ELASTIC=1)")
  parser.add_argument("--max-restarts", type=int, default=None,
                      help=f"--elastic: restarts per process (default: {DEFAULT_MAX_RESTARTS})")
  parser.add_argument("--spare-delay", type=float, default=None,
                      help=f"--elastic: seconds after a process starts before its spare starts "
                           f"(default: {SPARE_DELAY_S:g})")
  return parser


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """Splits the command line into (launcher options, command to run).

  The command starts at ``-m`` (the module and its arguments), after ``--``, or at the first token
  that is not a launcher option; everything after it belongs to the command.
  """
  argv = list(argv)
  i = 0
  while i < len(argv):
    tok = argv[i]
    if tok == "--":
      return argv[:i], argv[i + 1:]
    if tok == "-m":
      return argv[:i], argv[i:]
    if tok in _VALUE_OPTIONS:
      i += 2
      continue
    if tok in _FLAG_OPTIONS or (tok.startswith("--") and tok.split("=", 1)[0] in _VALUE_OPTIONS) \
        or (tok.startswith("-n") and tok[2:].isdigit()):
      i += 1
      continue
    return argv[:i], argv[i:]
  return argv, []


def _pump(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock) -> None:
  """Copies lines of a child's stream to ``out`` with ``prefix``."""
  for raw in iter(stream.readline, b""):
    line = raw.decode("utf-8", errors="replace")
    if not line.endswith("\n"):
      line += "\n"
    with lock:
      out.write(prefix + line)
      out.flush()
  stream.close()


def _exit_status(returncode: int) -> int:
  return 128 - returncode if returncode < 0 else returncode


def _signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:
    return f"signal {signum}"


def describe_status(returncode: int) -> str:
  """``exited with status 3`` or ``was killed by SIGKILL (signal 9)``."""
  if returncode < 0:
    return f"was killed by {_signal_name(-returncode)} (signal {-returncode})"
  return f"exited with status {returncode}"


def _is_stopped(pid: int) -> bool:
  """Whether ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP, ...): /proc state ``T`` (Linux)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      # "pid (comm) state ...": comm may contain spaces and parentheses, the state follows the last ")".
      return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
  except (OSError, IndexError):
    return False


def _cause_first(failed: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
  """Failures seen in the same poll, the likely cause first: killed by an outside signal, then a
  non-zero exit status, then SIGABRT (what XLA does when it learns that a peer is lost)."""
  def rank_of(item):
    rank, code = item
    if code < 0 and -code != signal.SIGABRT:
      return (0, rank)
    return (1, rank) if code > 0 else (2, rank)
  return sorted(failed, key=rank_of)


class _Stop(Exception):
  """Raised by the SIGTERM handler to stop the launcher like Ctrl-C."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


def _signal_groups(procs: Sequence[subprocess.Popen], signum: int) -> None:
  """``signum`` to the process group of every live process, then SIGCONT so that stopped ones
  act on it now rather than when (if ever) they are continued."""
  for p in procs:
    if p.poll() is None:
      for sig in (signum, signal.SIGCONT):
        try:
          os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
          pass


def _activate(spare: subprocess.Popen | None) -> subprocess.Popen | None:
  """``spare`` told to take over (a line on its standard input); None if there is none alive."""
  if spare is None or spare.poll() is not None:
    return None
  try:
    spare.stdin.write(b"\n")
    spare.stdin.flush()
  except OSError:  # it died meanwhile
    return None
  return spare


def _close(stream: IO | None) -> None:
  try:
    if stream is not None:
      stream.close()
  except OSError:
    pass


def _kill_all(procs: Sequence[subprocess.Popen], grace: float,
              signum: int = signal.SIGTERM) -> None:
  """``signum`` to every live process group, then SIGKILL to those still alive after ``grace``."""
  live = [p for p in procs if p.poll() is None]
  _signal_groups(live, signum)
  deadline = time.monotonic() + grace
  for p in live:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
      p.wait()


class _Reporter:
  """The launcher's own lines on stderr (``[launch] ...``), under the pumps' lock."""

  def __init__(self, out: IO[str], lock: threading.Lock):
    self.out, self.lock = out, lock

  def __call__(self, text: str) -> None:
    with self.lock:
      self.out.write(f"[launch] {text}\n")
      self.out.flush()


def _wait_for(procs: Sequence[subprocess.Popen], seconds: float, deadline: float | None) -> None:
  """Until every process has exited, ``seconds`` have passed, or the ``deadline``."""
  end = time.monotonic() + seconds
  if deadline is not None:
    end = min(end, deadline)
  while any(p.poll() is None for p in procs) and time.monotonic() < end:
    time.sleep(0.05)


def _report_failure(procs: Sequence[subprocess.Popen], failed: Sequence[tuple[int, int]],
                    report: _Reporter, wait_s: float | None = None) -> int:
  """Reports the failures of one poll (the likely cause first) and any stopped process; returns
  the exit status of the cause. ``wait_s``: the seconds the others get to exit by themselves
  (None: they are stopped now)."""
  ordered = _cause_first(failed)
  rank, code = ordered[0]
  live = [i for i, p in enumerate(procs) if p.poll() is None]
  others = ("" if not live else "; stopping the others" if wait_s is None else
            f"; the others may take up to {wait_s:g} s to exit by themselves, then are stopped")
  report(f"process {rank} {describe_status(code)}{others}")
  for other, other_code in ordered[1:]:
    report(f"process {other} {describe_status(other_code)} too")
  for i in live:
    if _is_stopped(procs[i].pid):
      report(f"process {i} is stopped (SIGSTOP or SIGTSTP): it may be the process the others lost")
  return _exit_status(code)


def _report_final(procs: Sequence[subprocess.Popen], stopped: set[int], signals: set[int],
                  report: _Reporter) -> None:
  """One line with every process's exit status; ``stopped``: those alive when the launcher began
  stopping them with ``signals`` (a status that is one of these is marked as the launcher's)."""
  parts = []
  for i, p in enumerate(procs):
    code = p.returncode
    text = "0" if code == 0 else (_signal_name(-code) if code < 0 else str(code))
    if i in stopped and code < 0 and -code in signals:
      text += " (stopped by the launcher)"
    parts.append(f"{i}: {text}")
  report("final status of each process: " + ", ".join(parts))


def launch(command: Sequence[str], num_processes: int, *, local_devices: int | None = None,
           port: int | None = None, host: str = "127.0.0.1", interface: str | None = None,
           timeout: float | None = None, env: dict[str, str] | None = None,
           kill_grace: float = 3.0, stdout: IO[str] | None = None,
           stderr: IO[str] | None = None, launch_command: str | None = None,
           heartbeat_timeout: int | None = None, collective_timeout: int | None = None,
           recoverable: bool = True, malloc: str = "reuse", elastic: bool = False,
           max_restarts: int | None = None, service: bool = True,
           spare_delay: float | None = None) -> int:
  """Runs ``sys.executable *command`` in ``num_processes`` processes; returns the exit status.

  ``malloc``: ``"reuse"`` sets :data:`MALLOC_REUSE_ENV` for the processes (each variable unless
  the environment or ``env`` sets it); ``"glibc"`` leaves glibc's defaults (module docstring).

  ``elastic``: host the coordination service here and restart a process that dies, up to
  ``max_restarts`` times each, from a spare started ``spare_delay`` seconds (default
  :data:`SPARE_DELAY_S`) after the process it would replace (module docstring); with
  ``service=False`` the service runs elsewhere already (``python -m jax_qcomm.tools.coordinator``
  at ``host:port``).

  0 if all succeeded; else the failed process's status (the others are stopped); 124 on timeout;
  130 on SIGINT (Ctrl-C), 143 on SIGTERM (both forwarded to the processes).
  """
  if num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if local_devices is not None and local_devices < 1:
    raise ValueError(f"local_devices must be >= 1, got {local_devices}")
  for name, value in (("heartbeat_timeout", heartbeat_timeout),
                      ("collective_timeout", collective_timeout)):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
      raise ValueError(f"{name} must be a positive integer (seconds), got {value!r}")
  if not isinstance(recoverable, bool):
    raise ValueError(f"recoverable must be True or False, got {recoverable!r}")
  if malloc not in MALLOC_MODES:
    raise ValueError(f"malloc must be one of {MALLOC_MODES}, got {malloc!r}")
  if not isinstance(elastic, bool):
    raise ValueError(f"elastic must be True or False, got {elastic!r}")
  if max_restarts is not None:
    if not elastic:
      raise ValueError("max_restarts needs elastic=True (only an elastic run restarts processes)")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
      raise ValueError(f"max_restarts must be a non-negative integer, got {max_restarts!r}")
  if spare_delay is not None:
    if not elastic:
      raise ValueError("spare_delay needs elastic=True (only an elastic run restarts processes)")
    if isinstance(spare_delay, bool) or not isinstance(spare_delay, (int, float)) \
        or not spare_delay >= 0:
      raise ValueError(f"spare_delay must be a number of seconds >= 0, got {spare_delay!r}")
  spare_delay = SPARE_DELAY_S if spare_delay is None else float(spare_delay)
  if elastic and not recoverable:
    raise ValueError("elastic=True needs recoverable=True (a lost process must not end the others)")
  max_restarts = DEFAULT_MAX_RESTARTS if max_restarts is None else max_restarts
  if not command:
    raise ValueError("nothing to run: give a script or -m module")
  stdout = sys.stdout if stdout is None else stdout
  stderr = sys.stderr if stderr is None else stderr
  port = free_port(host) if port is None else port
  base_env = dict(os.environ)
  base_env.update(env or {})
  if malloc == "reuse":
    for name, value in MALLOC_REUSE_ENV.items():
      base_env.setdefault(name, value)
  base_env.setdefault(distributed.ENV_MALLOC, malloc)  # what initialize() applies itself
  base_env.update({distributed.ENV_COORDINATOR: f"{host}:{port}",
                   ENV_LAUNCH_COMMAND: launch_command or shlex.join(["python", *command]),
                   distributed.ENV_NUM_PROCESSES: str(num_processes),
                   distributed.ENV_RECOVERABLE: "1" if recoverable else "0",
                   distributed.ENV_ELASTIC: "1" if elastic else "0",
                   distributed.ENV_EXTERNAL_SERVICE: "1" if recoverable else "0",
                   "PYTHONUNBUFFERED": "1"})
  for name in (distributed.ENV_LOCAL_DEVICES, distributed.ENV_GLOO_INTERFACE):
    base_env.pop(name, None)
  for name, value in ((distributed.ENV_LOCAL_DEVICES, local_devices),
                      (distributed.ENV_GLOO_INTERFACE, interface),
                      (distributed.ENV_HEARTBEAT_TIMEOUT, heartbeat_timeout),
                      (distributed.ENV_COLLECTIVE_TIMEOUT, collective_timeout)):
    if value is not None:
      base_env[name] = str(value)

  lock = threading.Lock()
  report = _Reporter(stderr, lock)
  procs: list[subprocess.Popen] = []
  pumps: list[threading.Thread] = []
  width = len(str(num_processes - 1))
  previous_sigterm = signal.getsignal(signal.SIGTERM)
  previous_sigint = signal.getsignal(signal.SIGINT)

  def on_sigterm(signum, frame):
    raise _Stop(signum)

  in_main_thread = threading.current_thread() is threading.main_thread()
  if in_main_thread:
    signal.signal(signal.SIGTERM, on_sigterm)
    # A process started in the background by a shell inherits SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler: a SIGINT sent to the launcher must still stop it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
  status = 0
  stop_signal = signal.SIGTERM
  hosted = None  # the coordination service this launcher hosts (recoverability mode)
  restarts = [0] * num_processes
  # Seconds the survivors of a loss get to exit by themselves: the service declares the lost
  # process within the heartbeat timeout, and each survivor's fail-fast line names it.
  survivor_wait = (distributed.Timeouts.from_env(heartbeat=heartbeat_timeout).heartbeat
                   + distributed.ASK_LIVE_WAIT_AFTER_TIMEOUT + kill_grace)

  # elastic: per rank, a spare process started ahead, waiting in initialize() (ENV_SPARE) until
  # it replaces a lost process of that rank; and when the next spare is due to start.
  spares: dict[int, subprocess.Popen] = {}
  spare_due = {rank: time.monotonic() + spare_delay for rank in range(num_processes)}

  def spawn(rank: int, spare: bool = False) -> subprocess.Popen:
    proc_env = dict(base_env)
    proc_env[distributed.ENV_PROCESS_ID] = str(rank)
    if spare:
      proc_env[distributed.ENV_SPARE] = "1"
    p = subprocess.Popen([sys.executable, *command], env=proc_env,
                         stdin=subprocess.PIPE if spare else subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    prefix = f"[{rank:>{width}}] "
    for stream, out in ((p.stdout, stdout), (p.stderr, stderr)):
      t = threading.Thread(target=_pump, args=(stream, out, prefix, lock), daemon=True)
      t.start()
      pumps.append(t)
    return p

  try:
    if recoverable and service:
      from jax_qcomm.tools import coordinator  # imports jax's service only when needed

      hosted = coordinator.start(port, num_processes, heartbeat_timeout=heartbeat_timeout)
    for rank in range(num_processes):
      procs.append(spawn(rank))
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      codes = [p.poll() for p in procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if elastic and failed and 0 not in codes:
        exhausted = []  # a process that dies meanwhile is seen at the next poll
        for rank, code in failed:
          if restarts[rank] < max_restarts:
            restarts[rank] += 1
            spare = _activate(spares.pop(rank, None))
            report(f"process {rank} lost ({describe_status(code)}); restarting it with rank "
                   f"{rank} (restart {restarts[rank]} of {max_restarts}"
                   + (", a spare started ahead" if spare else "") + ")")
            procs[rank] = spare or spawn(rank)
            spare_due[rank] = time.monotonic() + spare_delay
          else:
            exhausted.append((rank, code))
        failed = exhausted
      if failed:
        # A process killed by a signal is lost: with the service hosted here, the survivors name
        # it and exit by themselves. One that exited with an error is stopped with the others.
        lost = hosted is not None and _cause_first(failed)[0][1] < 0
        status = _report_failure(procs, failed, report, wait_s=survivor_wait if lost else None)
        if lost:
          _wait_for(procs, survivor_wait, deadline)
        break
      if all(c == 0 for c in codes):
        break
      if elastic:
        for rank, due in list(spare_due.items()):
          # none for a rank out of restarts, or whose process has finished (the run is ending)
          if (time.monotonic() >= due and restarts[rank] < max_restarts
              and procs[rank].poll() is None):
            del spare_due[rank]
            spares[rank] = spawn(rank, spare=True)
      if deadline is not None and time.monotonic() > deadline:
        status = TIMEOUT_EXIT
        report(f"timeout after {timeout:g} s; stopping all processes")
        break
      time.sleep(0.05)
  except (KeyboardInterrupt, _Stop) as e:
    stop_signal = signal.SIGINT if isinstance(e, KeyboardInterrupt) else e.signum
    status = 128 + stop_signal
    report(f"received {_signal_name(stop_signal)}; forwarding it to all processes")
  finally:
    live = {i for i, p in enumerate(procs) if p.poll() is None}
    for p in spares.values():  # a spare that reads the end of its pipe exits with status 0
      _close(p.stdin)
    _kill_all([*procs, *spares.values()], kill_grace, stop_signal)
    for t in pumps:
      t.join(timeout=5)
    if status != 0 and procs:
      _report_final(procs, live, {stop_signal, signal.SIGKILL}, report)
    if hosted is not None:
      hosted.shutdown()
    if in_main_thread:
      signal.signal(signal.SIGTERM, previous_sigterm)
      signal.signal(signal.SIGINT, previous_sigint)
  return status


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  options, command = split_argv(argv)
  parser = build_parser()
  args = parser.parse_args(options)
  if not command:
    parser.error("give a script to run (script.py [args ...]) or a module (-m module [args ...])")
  if command[0] == "-m" and len(command) < 2:
    parser.error("-m needs a module name")
  if args.num_processes < 1:
    parser.error(f"-n must be >= 1, got {args.num_processes}")
  if args.local_devices is not None and args.local_devices < 1:
    parser.error(f"--local-devices must be >= 1, got {args.local_devices}")
  for option, value in (("--heartbeat-timeout", args.heartbeat_timeout),
                        ("--collective-timeout", args.collective_timeout)):
    if value is not None and value < 1:
      parser.error(f"{option} must be >= 1 (seconds), got {value}")
  if args.max_restarts is not None and not args.elastic:
    parser.error("--max-restarts needs --elastic")
  if args.max_restarts is not None and args.max_restarts < 0:
    parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
  if args.spare_delay is not None and not args.elastic:
    parser.error("--spare-delay needs --elastic")
  if args.spare_delay is not None and not args.spare_delay >= 0:
    parser.error(f"--spare-delay must be >= 0 (seconds), got {args.spare_delay}")
  if args.elastic and not args.recoverable:
    parser.error("--elastic needs the recoverability mode (drop --no-recoverable)")
  env = {}
  for item in args.env:
    key, sep, value = item.partition("=")
    if not sep or not key:
      parser.error(f"--env takes KEY=VALUE, got {item!r}")
    env[key] = value
  return launch(command, args.num_processes, local_devices=args.local_devices, port=args.port,
                host=args.host, interface=args.interface, timeout=args.timeout, env=env,
                kill_grace=args.kill_grace,
                launch_command=shlex.join(["python", "-m", "jax_qcomm.tools.launch", *argv]),
                heartbeat_timeout=args.heartbeat_timeout,
                collective_timeout=args.collective_timeout, recoverable=args.recoverable,
                malloc=args.malloc, elastic=args.elastic, max_restarts=args.max_restarts,
                spare_delay=args.spare_delay)


if __name__ == "__main__":
  _status = main()
  sys.stdout.flush()
  sys.stderr.flush()
  # The processes are all gone and waited for; what remains is the interpreter's teardown of the
  # jax that ``import jax_qcomm`` brought in, seconds on a busy machine, which would delay the
  # launcher's exit after a failure for nothing.
  os._exit(_status)
