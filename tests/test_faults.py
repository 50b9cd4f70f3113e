"""A lost process ends a multi-process run promptly and says which one (docs/distributed.md).

Two JAX processes run cross-process psums in a loop (tests/fault_worker.py); the tests kill one
(SIGKILL), stop one (SIGSTOP), make one stall while alive or raise, or signal the launcher, and
check that every process is gone within the timeout in force, with a non-zero status and a message
naming the process. The timeouts are short here (heartbeat 5 s, collective 5 s where it matters) so
that each test takes seconds; docs/distributed.md has the times measured with the defaults.

Also, without processes: :class:`jax_qcomm.tools.distributed.Timeouts` (the one place for the timeouts)
and the private jax names that binding gloo to an interface needs (jax_qcomm._compat).
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from jax_qcomm import _compat
from jax_qcomm.tools import distributed
from jax_qcomm.tools.launch import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "fault_worker.py"
HEARTBEAT = 5      # seconds: the tests' heartbeat timeout
START_LIMIT = 120  # seconds the processes may take to start and run their first psum (busy machine)
MARGIN = 15        # seconds allowed on top of a timeout for the processes to notice and exit

multiprocess = pytest.mark.multiprocess


def _env() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith("QCOMM_")}
  env.pop("XLA_FLAGS", None)  # the workers run with one CPU device each
  env["PYTHONUNBUFFERED"] = "1"
  return env


class _Output:
  """Collects a process's merged output lines in a thread, with the time each arrived."""

  def __init__(self, proc: subprocess.Popen):
    self.lines: list[tuple[float, str]] = []
    self.thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
    self.thread.start()

  def _pump(self, proc):
    for line in proc.stdout:
      self.lines.append((time.monotonic(), line.rstrip("\n")))

  @property
  def text(self) -> str:
    return "\n".join(line for _, line in self.lines)

  def wait_for(self, pattern: str, count: int, proc_alive, limit: float) -> list[re.Match]:
    """The first ``count`` matches of ``pattern``, waiting up to ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
      found = [m for _, line in list(self.lines) if (m := re.search(pattern, line))]
      if len(found) >= count:
        return found[:count]
      if not proc_alive():
        break
      time.sleep(0.1)
    pytest.fail(f"no {count} x {pattern!r} within {limit} s:\n{self.text[-4000:]}")


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def _kill_leftovers(pids):
  for pid in pids:
    if _alive(pid):
      os.kill(pid, signal.SIGKILL)


def _wait_gone(pids, limit: float) -> None:
  deadline = time.monotonic() + limit
  while any(_alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not any(_alive(p) for p in pids), f"processes {pids} still alive after {limit} s"


def _launch(*options: str, worker_args=()) -> tuple[subprocess.Popen, _Output, dict[int, int]]:
  """The launcher with 2 workers; returns it, its output and {rank: pid} once both are ready."""
  proc = subprocess.Popen(
      [sys.executable, "-m", "jax_qcomm.tools.launch", "-n", "2", "--kill-grace", "2",
       "--timeout", "300", *options, str(WORKER), *worker_args],
      cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  out = _Output(proc)
  ready = out.wait_for(r"^\[(\d)\] ready pid=(\d+)", 2, lambda: proc.poll() is None, START_LIMIT)
  return proc, out, {int(m.group(1)): int(m.group(2)) for m in ready}


def _wait_launcher(proc, out, limit: float) -> float:
  """Seconds until the launcher exits (fails the test past ``limit``)."""
  start = time.monotonic()
  try:
    proc.wait(timeout=limit)
  except subprocess.TimeoutExpired:
    proc.kill()
    pytest.fail(f"launcher still running {limit} s after the fault:\n{out.text[-4000:]}")
  out.thread.join(timeout=5)
  return time.monotonic() - start


def _spawn_ranks(n: int, env_extra: dict[str, str]) -> list[subprocess.Popen]:
  """n workers started directly (no launcher), with the environment the launcher would set."""
  port = free_port()
  procs = []
  for rank in range(n):
    env = dict(_env(), **env_extra)
    env.update({distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
                distributed.ENV_NUM_PROCESSES: str(n), distributed.ENV_PROCESS_ID: str(rank)})
    procs.append(subprocess.Popen([sys.executable, str(WORKER)], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  return procs


# -- with the launcher: it names the failed process and stops the others -----------------------------

@multiprocess
@pytest.mark.parametrize("victim", [1, 0])
def test_killed_process_is_named_and_the_others_stopped(victim):
  proc, out, pids = _launch("--heartbeat-timeout", str(HEARTBEAT))
  try:
    os.kill(pids[victim], signal.SIGKILL)
    took = _wait_launcher(proc, out, HEARTBEAT + MARGIN)
    print(f"rank {victim} killed: launcher exited {proc.returncode} after {took:.1f} s")
    assert proc.returncode == 128 + signal.SIGKILL, out.text[-3000:]
    assert f"[launch] process {victim} was killed by SIGKILL (signal 9)" in out.text, out.text[-3000:]
    assert "[launch] final status of each process:" in out.text
    _wait_gone(pids.values(), 5)
  finally:
    _kill_leftovers(pids.values())


@multiprocess
def test_stopped_process_ends_the_others_within_the_heartbeat_timeout():
  """SIGSTOP: alive but silent. The coordination service declares it dead after the heartbeat
  timeout and ends the other process (XLA aborts it, naming the task); the launcher names the
  stopped one and kills it."""
  proc, out, pids = _launch("--heartbeat-timeout", str(HEARTBEAT))
  try:
    os.kill(pids[1], signal.SIGSTOP)
    took = _wait_launcher(proc, out, HEARTBEAT + MARGIN)
    print(f"rank 1 stopped: launcher exited {proc.returncode} after {took:.1f} s")
    assert proc.returncode != 0
    assert "[launch] process 1 is stopped (SIGSTOP or SIGTSTP)" in out.text, out.text[-3000:]
    # XLA's message on the survivor names the lost task.
    assert re.search(r"stopped sending heartbeats\):\s*\n\[0\] 1\b|Task 1 heartbeat timeout",
                     out.text), out.text[-3000:]
    _wait_gone(pids.values(), 5)
  finally:
    _kill_leftovers(pids.values())


@multiprocess
def test_alive_process_that_skips_a_collective_hits_the_collective_timeout():
  """Process 1 sleeps instead of joining the psum (heartbeats go on): process 0's psum fails after
  the collective timeout (the XLA flag reached the backend), it exits with status 1 at once, and
  the launcher stops process 1."""
  collective = 5
  proc, out, pids = _launch("--heartbeat-timeout", "60", "--collective-timeout", str(collective),
                            worker_args=["--stall-rank", "1"])
  try:
    out.wait_for(r"^\[1\] stalling", 1, lambda: proc.poll() is None, 60)
    took = _wait_launcher(proc, out, collective + MARGIN)
    print(f"rank 1 stalled: launcher exited {proc.returncode} after {took:.1f} s")
    assert proc.returncode == distributed.FAIL_FAST_EXIT, out.text[-3000:]
    assert "Timed out" in out.text, out.text[-3000:]
    assert ("jax_qcomm.tools.distributed: process 0 of 2 exits with status 1: a collective across "
            "processes failed") in out.text
    assert "[launch] process 0 exited with status 1; stopping the others" in out.text
    _wait_gone(pids.values(), 5)
  finally:
    _kill_leftovers(pids.values())


@multiprocess
def test_exception_on_one_process_fails_fast():
  proc, out, pids = _launch("--heartbeat-timeout", str(HEARTBEAT), worker_args=["--raise-rank", "1"])
  try:
    took = _wait_launcher(proc, out, MARGIN)
    print(f"rank 1 raised: launcher exited {proc.returncode} after {took:.1f} s")
    assert proc.returncode == distributed.FAIL_FAST_EXIT, out.text[-3000:]
    assert "RuntimeError: a bug on process 1" in out.text
    assert "process 1 of 2 exits with status 1: uncaught RuntimeError" in out.text
    assert "[launch] process 1 exited with status 1" in out.text
  finally:
    _kill_leftovers(pids.values())


@multiprocess
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_launcher_forwards_sigterm_and_sigint(signum):
  """JAX processes end on SIGTERM (jax's preemption service, which would swallow it, is off)."""
  proc, out, pids = _launch("--heartbeat-timeout", str(HEARTBEAT))
  try:
    proc.send_signal(signum)
    took = _wait_launcher(proc, out, MARGIN)
    print(f"launcher {signal.Signals(signum).name}: exited {proc.returncode} after {took:.1f} s")
    assert proc.returncode == 128 + signum, out.text[-3000:]
    assert f"[launch] received {signal.Signals(signum).name}; forwarding it" in out.text
    _wait_gone(pids.values(), 2)
    if signum == signal.SIGTERM:  # ended by the signal itself, not by the launcher's SIGKILL
      assert "0: SIGTERM (stopped by the launcher), 1: SIGTERM" in out.text, out.text[-2000:]
  finally:
    _kill_leftovers(pids.values())


# -- without the launcher: the survivors end by themselves --------------------------------------------

@multiprocess
@pytest.mark.parametrize("victim", [1, 0])
def test_survivor_exits_by_itself_when_its_peer_is_killed(victim):
  """No launcher to stop anyone: the survivor's psum fails (connection reset) and it exits with
  status 1 at once, or -- if it was not inside a psum, or the dead process ran the coordination
  service (process 0) -- XLA's coordination client aborts it, at once for process 0, after the
  heartbeat timeout otherwise. Either way non-zero within the heartbeat timeout."""
  procs = _spawn_ranks(2, {distributed.ENV_HEARTBEAT_TIMEOUT: str(HEARTBEAT)})
  outs = [_Output(p) for p in procs]
  survivor = 1 - victim
  try:
    for p, o in zip(procs, outs):
      o.wait_for(r"^ready pid=", 1, lambda p=p: p.poll() is None, START_LIMIT)
    procs[victim].kill()
    start = time.monotonic()
    try:
      procs[survivor].wait(timeout=HEARTBEAT + MARGIN)
    except subprocess.TimeoutExpired:
      pytest.fail(f"process {survivor} still alive {HEARTBEAT + MARGIN} s after process {victim} "
                  f"was killed:\n{outs[survivor].text[-3000:]}")
    took = time.monotonic() - start
    outs[survivor].thread.join(timeout=5)
    text = outs[survivor].text
    print(f"rank {victim} killed, no launcher: rank {survivor} exited "
          f"{procs[survivor].returncode} after {took:.1f} s")
    assert procs[survivor].returncode in (distributed.FAIL_FAST_EXIT, -signal.SIGABRT), text[-3000:]
    assert ("a collective across processes failed" in text
            or "Terminating process because the JAX distributed service detected fatal errors"
            in text), text[-3000:]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()


# -- no processes -------------------------------------------------------------------------------------

def test_timeouts_defaults_environment_and_arguments(monkeypatch):
  for name in distributed.Timeouts.ENV.values():
    monkeypatch.delenv(name, raising=False)
  assert distributed.Timeouts.from_env() == distributed.Timeouts(30, 60, 60, 120)
  assert max(distributed.Timeouts().heartbeat, distributed.Timeouts().collective) <= 60
  monkeypatch.setenv(distributed.ENV_HEARTBEAT_TIMEOUT, "7")
  monkeypatch.setenv(distributed.ENV_COLLECTIVE_TIMEOUT, "9")
  got = distributed.Timeouts.from_env(collective=11)
  assert (got.heartbeat, got.collective, got.shutdown) == (7, 11, 60)  # argument > env > default
  monkeypatch.setenv(distributed.ENV_SHUTDOWN_TIMEOUT, "soon")
  with pytest.raises(ValueError, match="QCOMM_SHUTDOWN_TIMEOUT must be an integer"):
    distributed.Timeouts.from_env()
  with pytest.raises(ValueError, match="heartbeat_timeout must be a positive integer"):
    distributed.Timeouts(heartbeat=0)
  with pytest.raises(TypeError, match="unknown timeout"):
    distributed.Timeouts.from_env(barrier=3)


def test_timeouts_set_the_collective_flags_in_xla_flags():
  flags = distributed.Timeouts(collective=42).xla_flags(
      "--xla_force_host_platform_device_count=2 --xla_cpu_collective_timeout_seconds=1800")
  assert flags.split() == ["--xla_force_host_platform_device_count=2",
                           "--xla_cpu_collective_timeout_seconds=42",
                           "--xla_gpu_nccl_termination_timeout_seconds=42"]


def test_xla_accepts_the_collective_timeout_flags():
  """XLA dies on an unknown flag in XLA_FLAGS: if jaxlib renamed one, every run would fail."""
  code = "import jax; print(jax.devices()[0].platform)"
  env = dict(_env(), XLA_FLAGS=distributed.Timeouts().xla_flags())
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0 and proc.stdout.strip() == "cpu", proc.stderr[-2000:]


def test_private_names_for_gloo_on_an_interface_are_where_compat_expects():
  """Fails loudly when a jax release moves one of the private names jax_qcomm._compat uses to bind
  gloo to a network interface (no public jax API does it); update _compat then."""
  assert _compat.gloo_private_api_problems() == []
