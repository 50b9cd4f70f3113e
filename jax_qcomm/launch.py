"""Starts several local JAX processes joined by ``jax.distributed`` (gloo on CPU).

Usage::

    python -m jax_qcomm.launch -n 4 [--local-devices 2] [--port P] [--host 127.0.0.1]
                               [--interface eth0] [--timeout S] [--env K=V ...]
                               (script.py [args...] | -m module [args...])

Starts ``n`` copies of ``sys.executable script.py args`` (or ``-m module args``), each with the
environment read by :func:`jax_qcomm.distributed.initialize`:

* ``QCOMM_COORDINATOR=host:port`` (default port: a free one), ``QCOMM_NUM_PROCESSES=n``,
  ``QCOMM_PROCESS_ID=rank``, and, when given, ``QCOMM_LOCAL_DEVICES`` and ``QCOMM_GLOO_INTERFACE``;
* ``PYTHONUNBUFFERED=1``, so that output arrives line by line;
* ``QCOMM_LAUNCH_COMMAND``: the launcher's command line (recorded by the benchmarks).

Every line a process prints is prefixed with ``[rank]`` (stdout to stdout, stderr to stderr). The
launcher waits for all processes; if one fails it kills the others and exits with the first
non-zero exit status (128 + signal number for a process killed by a signal). Ctrl-C, SIGTERM or
``--timeout`` (exit status 124) kill them all. Each process runs in its own session, so killing
them also kills anything they started.
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

from jax_qcomm import distributed

# Launcher options that take a value (the command line is split at the first token that is not
# one of these options, or at -m / --).
_VALUE_OPTIONS = {"-n", "--num-processes", "--local-devices", "--port", "--host", "--interface",
                  "--timeout", "--env", "--kill-grace"}
_FLAG_OPTIONS = {"-h", "--help"}
TIMEOUT_EXIT = 124
#: The launcher's own command line, for the processes' records (benchmarks' metadata).
ENV_LAUNCH_COMMAND = "QCOMM_LAUNCH_COMMAND"


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that was free on ``host`` a moment ago."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m jax_qcomm.launch",
      usage="%(prog)s -n N [options] (script.py [args ...] | -m module [args ...])",
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("-n", "--num-processes", type=int, required=True,
                      help="number of processes to start")
  parser.add_argument("--local-devices", type=int, default=None,
                      help="host (CPU) devices per process (QCOMM_LOCAL_DEVICES)")
  parser.add_argument("--port", type=int, default=None,
                      help="coordinator port (default: a free port)")
  parser.add_argument("--host", default="127.0.0.1",
                      help="coordinator address, process 0 runs the service (default: 127.0.0.1)")
  parser.add_argument("--interface", default=None,
                      help="network interface gloo binds to (QCOMM_GLOO_INTERFACE), e.g. eth0")
  parser.add_argument("--timeout", type=float, default=None,
                      help="kill all processes after this many seconds (exit status 124)")
  parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                      help="extra environment variable for every process (repeatable)")
  parser.add_argument("--kill-grace", type=float, default=3.0,
                      help="seconds between SIGTERM and SIGKILL when stopping processes (default: 3)")
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


class _Stop(Exception):
  """Raised by the SIGTERM handler to stop the launcher like Ctrl-C."""


def _kill_all(procs: Sequence[subprocess.Popen], grace: float) -> None:
  """SIGTERM to every live process group, then SIGKILL to those still alive after ``grace``."""
  live = [p for p in procs if p.poll() is None]
  for p in live:
    try:
      os.killpg(p.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
      pass
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


def launch(command: Sequence[str], num_processes: int, *, local_devices: int | None = None,
           port: int | None = None, host: str = "127.0.0.1", interface: str | None = None,
           timeout: float | None = None, env: dict[str, str] | None = None,
           kill_grace: float = 3.0, stdout: IO[str] | None = None,
           stderr: IO[str] | None = None, launch_command: str | None = None) -> int:
  """Runs ``sys.executable *command`` in ``num_processes`` processes; returns the exit status.

  0 if all succeeded; else the first non-zero status (the others are killed); 124 on timeout;
  130 on Ctrl-C.
  """
  if num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if local_devices is not None and local_devices < 1:
    raise ValueError(f"local_devices must be >= 1, got {local_devices}")
  if not command:
    raise ValueError("nothing to run: give a script or -m module")
  stdout = sys.stdout if stdout is None else stdout
  stderr = sys.stderr if stderr is None else stderr
  port = free_port(host) if port is None else port
  base_env = dict(os.environ)
  base_env.update(env or {})
  base_env.update({distributed.ENV_COORDINATOR: f"{host}:{port}",
                   ENV_LAUNCH_COMMAND: launch_command or shlex.join(["python", *command]),
                   distributed.ENV_NUM_PROCESSES: str(num_processes),
                   "PYTHONUNBUFFERED": "1"})
  for name in (distributed.ENV_LOCAL_DEVICES, distributed.ENV_GLOO_INTERFACE):
    base_env.pop(name, None)
  if local_devices is not None:
    base_env[distributed.ENV_LOCAL_DEVICES] = str(local_devices)
  if interface is not None:
    base_env[distributed.ENV_GLOO_INTERFACE] = interface

  lock = threading.Lock()
  procs: list[subprocess.Popen] = []
  pumps: list[threading.Thread] = []
  width = len(str(num_processes - 1))
  previous_sigterm = signal.getsignal(signal.SIGTERM)

  def on_sigterm(signum, frame):
    raise _Stop()

  in_main_thread = threading.current_thread() is threading.main_thread()
  if in_main_thread:
    signal.signal(signal.SIGTERM, on_sigterm)
  status = 0
  try:
    for rank in range(num_processes):
      proc_env = dict(base_env)
      proc_env[distributed.ENV_PROCESS_ID] = str(rank)
      p = subprocess.Popen([sys.executable, *command], env=proc_env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
      procs.append(p)
      prefix = f"[{rank:>{width}}] "
      for stream, out in ((p.stdout, stdout), (p.stderr, stderr)):
        t = threading.Thread(target=_pump, args=(stream, out, prefix, lock), daemon=True)
        t.start()
        pumps.append(t)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      codes = [p.poll() for p in procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        rank, code = failed[0]
        status = _exit_status(code)
        if any(c is None for c in codes):
          with lock:
            stderr.write(f"[launch] process {rank} exited with status {status}; stopping the "
                         "others\n")
            stderr.flush()
        break
      if all(c == 0 for c in codes):
        break
      if deadline is not None and time.monotonic() > deadline:
        status = TIMEOUT_EXIT
        with lock:
          stderr.write(f"[launch] timeout after {timeout:g} s; killing all processes\n")
          stderr.flush()
        break
      time.sleep(0.05)
  except (KeyboardInterrupt, _Stop) as e:
    status = 130 if isinstance(e, KeyboardInterrupt) else 128 + signal.SIGTERM
    with lock:
      stderr.write("[launch] interrupted; killing all processes\n")
      stderr.flush()
  finally:
    _kill_all(procs, kill_grace)
    for t in pumps:
      t.join(timeout=5)
    if in_main_thread:
      signal.signal(signal.SIGTERM, previous_sigterm)
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
  env = {}
  for item in args.env:
    key, sep, value = item.partition("=")
    if not sep or not key:
      parser.error(f"--env takes KEY=VALUE, got {item!r}")
    env[key] = value
  return launch(command, args.num_processes, local_devices=args.local_devices, port=args.port,
                host=args.host, interface=args.interface, timeout=args.timeout, env=env,
                kill_grace=args.kill_grace,
                launch_command=shlex.join(["python", "-m", "jax_qcomm.launch", *argv]))


if __name__ == "__main__":
  sys.exit(main())
