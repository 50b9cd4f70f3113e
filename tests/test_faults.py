"""A lost process ends a multi-process run promptly and says which one (docs/distributed.md).

Two JAX processes run cross-process psums in a loop (tests/fault_worker.py); the tests kill one
(SIGKILL), stop one (SIGSTOP), make one stall while alive or raise, or signal the launcher, and
check that every process is gone within the timeout in force, with a non-zero status and a message
naming the process, in jax's recoverability mode (the default) and without it. The timeouts are
short here (heartbeat 5 s, collective 5-10 s where it matters) so that each test takes seconds;
docs/distributed.md has the times measured with the defaults.

Also: a healthy run ends the same with and without the recoverability mode; processes started
under (faked) SLURM variables or a real ``mpirun`` join through jax's cluster detection; mutual TLS
admits a process with a certificate of the run's CA and refuses one without.

Without processes: :class:`jax_qcomm.tools.distributed.Timeouts` (the one place for the timeouts),
the checks of :func:`~jax_qcomm.tools.distributed.initialize`'s arguments, and the private jax names
that binding gloo to an interface and naming a lost process need (jax_qcomm._compat).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
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
def test_killed_process_is_named_by_the_launcher_and_the_survivor(victim):
  # The launcher gives the survivor heartbeat + 5 s + the kill grace to exit by itself; on the
  # 2-core machine with the suite's other worker compiling, 12 s was once not enough.
  grace = 15
  proc, out, pids = _launch("--heartbeat-timeout", str(HEARTBEAT), "--kill-grace", str(grace))
  try:
    os.kill(pids[victim], signal.SIGKILL)
    took = _wait_launcher(proc, out, HEARTBEAT + distributed.ASK_LIVE_WAIT_AFTER_TIMEOUT + grace
                          + MARGIN)
    print(f"rank {victim} killed: launcher exited {proc.returncode} after {took:.1f} s")
    assert proc.returncode == 128 + signal.SIGKILL, out.text[-3000:]
    assert f"[launch] process {victim} was killed by SIGKILL (signal 9)" in out.text, out.text[-3000:]
    # The launcher hosts the coordination service: process 0's death is an ordinary loss, and the
    # survivor exits by itself, naming it (no SIGABRT, not stopped by the launcher).
    survivor = 1 - victim
    line = (f"[{survivor}] jax_qcomm.tools.distributed: process {survivor} of 2 exits with status "
            f"1: lost process {victim}")
    assert line in out.text, out.text[-3000:]
    assert f"{survivor}: 1" in out.text.split("final status of each process:")[1], out.text[-3000:]
    assert "SIGABRT" not in out.text, out.text[-3000:]
    _wait_gone(pids.values(), 5)
  finally:
    _kill_leftovers(pids.values())


@multiprocess
def test_stopped_process_ends_the_others_within_the_heartbeat_timeout_without_recoverability():
  """SIGSTOP: alive but silent. Without the recoverability mode the coordination service declares
  it dead after the heartbeat timeout and ends the other process (XLA aborts it, naming the task);
  the launcher names the stopped one and kills it."""
  proc, out, pids = _launch("--heartbeat-timeout", str(HEARTBEAT), "--no-recoverable")
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
def test_stopped_process_is_named_by_the_survivor_in_the_recoverability_mode():
  """SIGSTOP in the recoverability mode: no abort; the survivor's psum times out at the collective
  timeout, by when the service has declared process 1 dead, and its line names process 1."""
  collective = 2 * HEARTBEAT
  proc, out, pids = _launch("--heartbeat-timeout", str(HEARTBEAT),
                            "--collective-timeout", str(collective))
  try:
    os.kill(pids[1], signal.SIGSTOP)
    took = _wait_launcher(proc, out, collective + MARGIN)
    print(f"rank 1 stopped, recoverable: launcher exited {proc.returncode} after {took:.1f} s")
    assert proc.returncode == distributed.FAIL_FAST_EXIT, out.text[-3000:]
    assert "[0] jax_qcomm.tools.distributed: process 0 of 2 exits with status 1: lost process 1 " \
        in out.text, out.text[-3000:]
    assert "[launch] process 1 is stopped (SIGSTOP or SIGTSTP)" in out.text, out.text[-3000:]
    assert "SIGABRT" not in out.text and "Check failure" not in out.text, out.text[-3000:]
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
    took = _wait_launcher(proc, out, collective + distributed.ASK_LIVE_WAIT_AFTER_TIMEOUT + MARGIN)
    print(f"rank 1 stalled: launcher exited {proc.returncode} after {took:.1f} s")
    assert proc.returncode == distributed.FAIL_FAST_EXIT, out.text[-3000:]
    assert "Timed out" in out.text, out.text[-3000:]
    assert ("jax_qcomm.tools.distributed: process 0 of 2 exits with status 1: no process declared "
            "lost within 5 s: a process alive by its heartbeats did not reach the collective") \
        in out.text, out.text[-3000:]
    # The launcher stops process 1, unless XLA aborted it (the coordinator on process 0 went away)
    # within the same poll: then both exits are reported together and none is left to stop.
    assert ("[launch] process 0 exited with status 1; stopping the others" in out.text
            or ("[launch] process 0 exited with status 1\n" in out.text
                and re.search(r"^\[launch\] process 1 .* too$", out.text, re.M))), out.text[-3000:]
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
      # Under load a process may see its peer end first and take its own fail-fast exit
      # (status 1, "lost process ...") before the SIGTERM reaches it: no SIGKILL either way.
      final = re.search(r"final status of each process: (.*)", out.text)
      assert final, out.text[-2000:]
      statuses = re.findall(r"\d+: (SIGTERM \(stopped by the launcher\)|\S+)", final.group(1))
      assert len(statuses) == 2 and "SIGTERM (stopped by the launcher)" in statuses, final.group(0)
      for status in statuses:
        assert status in ("SIGTERM (stopped by the launcher)", "1"), final.group(0)
        if status == "1":
          assert "exits with status 1: lost process" in out.text, out.text[-2000:]
  finally:
    _kill_leftovers(pids.values())


# -- without the launcher: the survivors end by themselves --------------------------------------------

@multiprocess
@pytest.mark.parametrize("recoverable", [True, False], ids=["recoverable", "abort"])
@pytest.mark.parametrize("victim", [1, 0])
def test_survivor_exits_by_itself_when_its_peer_is_killed(victim, recoverable):
  """No launcher to stop anyone.

  Recoverability mode (the default): the survivor's psum fails (connection reset) and, once the
  coordination service has declared the dead process lost (within the heartbeat timeout), it exits
  with status 1 and a line naming it. Process 0 runs the service: when it dies, the survivor's
  line names it at once -- unless the survivor's coordination client aborts it first (SIGABRT):
  jax hands the recoverability mode to the service only, not to the clients, and the client's
  abort on losing the service is a race with gloo's error.

  Without it: the survivor exits with status 1 (psum failed) or is aborted by XLA's coordination
  client (SIGABRT), at once for process 0, after the heartbeat timeout otherwise.
  """
  procs = _spawn_ranks(2, {distributed.ENV_HEARTBEAT_TIMEOUT: str(HEARTBEAT),
                           distributed.ENV_RECOVERABLE: "1" if recoverable else "0"})
  outs = [_Output(p) for p in procs]
  survivor = 1 - victim
  limit = HEARTBEAT + distributed.ASK_LIVE_WAIT_AFTER_TIMEOUT + MARGIN
  try:
    for p, o in zip(procs, outs):
      o.wait_for(r"^ready pid=", 1, lambda p=p: p.poll() is None, START_LIMIT)
    procs[victim].kill()
    start = time.monotonic()
    try:
      procs[survivor].wait(timeout=limit)
    except subprocess.TimeoutExpired:
      pytest.fail(f"process {survivor} still alive {limit} s after process {victim} "
                  f"was killed:\n{outs[survivor].text[-3000:]}")
    took = time.monotonic() - start
    outs[survivor].thread.join(timeout=5)
    text = outs[survivor].text
    code = procs[survivor].returncode
    print(f"rank {victim} killed, no launcher, recoverable={recoverable}: rank {survivor} exited "
          f"{code} after {took:.1f} s")
    assert code in (distributed.FAIL_FAST_EXIT, -signal.SIGABRT), text[-3000:]
    if recoverable and (victim == 1 or code == distributed.FAIL_FAST_EXIT):
      assert code == distributed.FAIL_FAST_EXIT, text[-3000:]
      line = f"jax_qcomm.tools.distributed: process {survivor} of 2 exits with status 1: lost process {victim}"
      assert line in text, text[-3000:]
    else:
      assert ("a collective across processes failed" in text
              or "Terminating process because the JAX distributed service detected fatal errors"
              in text), text[-3000:]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()


# -- healthy runs: the recoverability mode changes nothing; cluster detection; mutual TLS ----------

@multiprocess
@pytest.mark.parametrize("linger", [None, 0, 1])
def test_healthy_run_is_the_same_with_and_without_recoverability(linger):
  """Exit status 0, no wait at exit beyond the usual, bit-identical results. With ``linger``,
  that process returns 5 s after the other: in the recoverability mode jax's shutdown barrier no
  longer waits for it, and without initialize()'s own barrier process 0 stopped the coordination
  service under the other's feet (its client aborted: SIGABRT)."""
  results = {}
  extra = [] if linger is None else ["--linger-rank", str(linger)]
  for option in ("--recoverable", "--no-recoverable"):
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "jax_qcomm.tools.launch", "-n", "2", "--timeout", "120", option,
         str(WORKER), "--steps", "30", *extra], cwd=ROOT, env=_env(), capture_output=True,
        text=True, timeout=180)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = dict(re.findall(r"^\[(\d)\] result (\S+) process", proc.stdout, re.M))
    assert set(found) == {"0", "1"} and found["0"] == found["1"], proc.stdout[-2000:]
    assert f"recoverable={option == '--recoverable'}" in proc.stdout
    assert "barrier failed" not in proc.stderr and "SIGABRT" not in proc.stderr, proc.stderr[-3000:]
    if linger is not None:
      assert f"[{linger}] lingered" in proc.stdout, proc.stdout[-2000:]
    results[option] = (found["0"], took)
    print(f"{option}: result {found['0']}, launcher took {took:.1f} s")
  assert results["--recoverable"][0] == results["--no-recoverable"][0]
  assert results["--recoverable"][1] < results["--no-recoverable"][1] + 20


def _run_pair(envs: list[dict[str, str]], args=(), limit: float = 150):
  procs = [subprocess.Popen([sys.executable, str(WORKER), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for env in envs]
  try:
    return [(p.wait(timeout=limit), p.stdout.read()) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


@multiprocess
def test_processes_under_slurm_join_through_jax_cluster_detection():
  """No coordinator given: initialize() defers to jax's SLURM detection (the variables srun sets,
  faked here for two tasks on one node); the timeouts and the recoverability mode still apply."""
  port = free_port()
  envs = []
  for rank in range(2):
    env = dict(_env(), SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
               SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_STEP_NUM_NODES="1",
               JAX_COORDINATOR_PORT=str(port))
    env[distributed.ENV_HEARTBEAT_TIMEOUT] = "7"
    envs.append(env)
  results = _run_pair(envs, ["--steps", "5"])
  for rank, (code, text) in enumerate(results):
    assert code == 0, text[-3000:]
    assert re.search(rf"^result \S+ process {rank} of 2 recoverable=True$", text, re.M), text[-2000:]
    assert "heartbeat=7" in text or "result" in text


@multiprocess
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (apt-get install openmpi-bin)")
def test_processes_under_mpirun_join_through_jax_cluster_detection():
  """A real Open MPI ``mpirun``: jax's detection reads its OMPI_* variables."""
  command = ["mpirun", "-np", "2", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
             "-x", "PYTHONUNBUFFERED", sys.executable, str(WORKER), "--steps", "5"]
  proc = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
  text = proc.stdout + proc.stderr
  assert proc.returncode == 0, text[-3000:]
  for rank in range(2):  # mpirun merges the processes' lines
    assert re.search(rf"result \S+ process {rank} of 2 recoverable=True", text), text[-3000:]


def test_no_coordinator_and_no_cluster_is_a_clear_error():
  code = ("from jax_qcomm.tools import distributed\n"
          "try:\n  distributed.initialize()\nexcept ValueError as e:\n  print('ERR', e)\n")
  env = {k: v for k, v in _env().items()
         if not k.startswith(("SLURM_", "OMPI_", "PMI", "KUBERNETES_", "JAX_COORDINATOR"))}
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120)
  assert ("ERR jax_qcomm.tools.distributed.initialize: coordinator_address (QCOMM_COORDINATOR), "
          "num_processes (QCOMM_NUM_PROCESSES), process_id (QCOMM_PROCESS_ID) not given, not set in "
          "the environment, and jax's cluster detection") in proc.stdout, proc.stdout + proc.stderr


def _throwaway_ca(directory: pathlib.Path, name: str) -> None:
  """A CA and a certificate for localhost / 127.0.0.1 signed by it, in ``directory``."""
  directory.mkdir(parents=True)
  def run(*args):
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)
  run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name} CA",
      "-keyout", "ca-key.pem", "-out", "ca.pem")
  run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "key.pem",
      "-out", "req.pem")
  (directory / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                                     "extendedKeyUsage=serverAuth,clientAuth\n")
  run("x509", "-req", "-in", "req.pem", "-CA", "ca.pem", "-CAkey", "ca-key.pem",
      "-CAcreateserial", "-days", "2", "-extfile", "ext.cnf", "-out", "cert.pem")


@multiprocess
@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a throwaway CA")
def test_mutual_tls_admits_the_runs_certificates_and_refuses_others(tmp_path):
  """The coordination service with mutual TLS: two processes with certificates of the run's CA
  join and compute; a process whose certificate comes from another CA, or that has none, is
  refused (both processes then fail within the initialization timeout)."""
  _throwaway_ca(tmp_path / "run", "run")
  _throwaway_ca(tmp_path / "other", "other")

  def envs(timeout_s=15):
    port = free_port()
    out = []
    for rank in range(2):
      env = dict(_env())
      env.update({distributed.ENV_COORDINATOR: f"localhost:{port}",
                  distributed.ENV_NUM_PROCESSES: "2", distributed.ENV_PROCESS_ID: str(rank),
                  distributed.ENV_INITIALIZATION_TIMEOUT: str(timeout_s)})
      out.append(env)
    return out

  good = _run_pair(envs(), ["--steps", "3", "--mtls-dir", str(tmp_path / "run")])
  for rank, (code, text) in enumerate(good):
    assert code == 0, text[-3000:]
    assert f"process {rank} of 2" in text, text[-2000:]

  for intruder in (["--mtls-dir", str(tmp_path / "other")], []):
    env0, env1 = envs(timeout_s=8)  # both fail: the wait is the timeout
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--steps", "3", "--mtls-dir",
                               str(tmp_path / "run")], cwd=ROOT, env=env0, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True),
             subprocess.Popen([sys.executable, str(WORKER), "--steps", "3", *intruder], cwd=ROOT,
                              env=env1, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    try:
      for p in procs:
        p.wait(timeout=120)
      texts = [p.stdout.read() for p in procs]
      assert procs[1].returncode != 0, texts[1][-3000:]
      assert not any(re.search(r"^result ", t, re.M) for t in texts), texts
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


def test_initialize_rejects_bad_new_arguments_by_name(monkeypatch, tmp_path):
  """Checked before jax is touched: each bad value is a ValueError naming the parameter."""
  monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1")
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "1")
  monkeypatch.setenv(distributed.ENV_PROCESS_ID, "0")
  pem = tmp_path / "x.pem"
  pem.write_text("not used")
  cases = [
      (dict(recoverable="yes"), "recoverable must be True or False"),
      (dict(fail_fast=1), "fail_fast must be True or False"),
      (dict(cluster_detection_method="pbs"), "cluster_detection_method must be one of"),
      (dict(coordinator_bind_address="nohost"), "coordinator_bind_address must be 'host:port'"),
      (dict(coordinator_bind_address="[::]:99999"), "coordinator_bind_address must be 'host:port'"),
      (dict(coordinator_address="host"), "coordinator_address must be 'host:port'"),
      (dict(mtls_cert_file=str(tmp_path / "missing.pem"), mtls_key_file=str(pem),
            mtls_ca_file=str(pem)), "mtls_cert_file must be the path of an existing PEM file"),
      (dict(mtls_cert_file=str(pem), mtls_ca_file=str(pem)),
       "mtls_cert_file and mtls_key_file must be given together"),
      (dict(mtls_cert_file=str(pem), mtls_key_file=str(pem)), "mtls_ca_file must be given"),
      (dict(mtls_peer_uri_prefix="spiffe://example.org"), "mtls_peer_uri_prefix must be a URI prefix"),
      (dict(malloc="jemalloc"), "malloc must be one of ('reuse', 'glibc')"),
  ]
  for kwargs, message in cases:
    with pytest.raises(ValueError, match=re.escape(message)):
      distributed.initialize(**kwargs)
  monkeypatch.setenv(distributed.ENV_MALLOC, "tcmalloc")
  with pytest.raises(ValueError, match="QCOMM_MALLOC must be one of"):
    distributed.initialize()
  monkeypatch.delenv(distributed.ENV_MALLOC)
  monkeypatch.setenv(distributed.ENV_RECOVERABLE, "maybe")
  with pytest.raises(ValueError, match="QCOMM_RECOVERABLE must be one of"):
    distributed.initialize()
  monkeypatch.delenv(distributed.ENV_COORDINATOR)
  with pytest.raises(ValueError, match="cluster_detection_method='deactivate'"):
    distributed.initialize(recoverable=True, cluster_detection_method="deactivate")


def test_launcher_sets_the_recoverability_variable():
  from jax_qcomm.tools import launch
  assert launch.build_parser().parse_args(["-n", "2"]).recoverable is True
  assert launch.build_parser().parse_args(["-n", "2", "--no-recoverable"]).recoverable is False
  assert launch.split_argv(["-n", "2", "--no-recoverable", "w.py", "--no-recoverable"]) == (
      ["-n", "2", "--no-recoverable"], ["w.py", "--no-recoverable"])
  with pytest.raises(ValueError, match="recoverable must be True or False"):
    launch.launch(["w.py"], 2, recoverable="no")


@pytest.mark.parametrize("mode", [None, "reuse", "glibc"])
def test_launcher_sets_malloc_to_reuse_pages(tmp_path, monkeypatch, mode):
  """--malloc reuse (the default): one arena and no mmap / trim thresholds for the processes, a
  value already in the environment kept; --malloc glibc: none of them."""
  from jax_qcomm.tools import launch
  for name in launch.MALLOC_REUSE_ENV:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "123")
  script = tmp_path / "show.py"
  monkeypatch.delenv("QCOMM_MALLOC", raising=False)
  script.write_text("import os\nfor k in ('MALLOC_ARENA_MAX', 'MALLOC_MMAP_THRESHOLD_', "
                    "'MALLOC_TRIM_THRESHOLD_', 'QCOMM_MALLOC'):\n  print(k, os.environ.get(k, 'unset'))\n")
  parsed = launch.build_parser().parse_args(["-n", "1"] + ([] if mode is None else
                                                           ["--malloc", mode]))
  out = tmp_path / "out.txt"
  with open(out, "w") as f:
    assert launch.launch([str(script)], 1, malloc=parsed.malloc, stdout=f) == 0
  text = out.read_text()
  want = ({"MALLOC_ARENA_MAX": "unset", "MALLOC_MMAP_THRESHOLD_": "unset"} if mode == "glibc"
          else {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "4294967296"})
  want["QCOMM_MALLOC"] = mode or "reuse"  # what initialize() applies itself (tools.malloc)
  for name, value in {**want, "MALLOC_TRIM_THRESHOLD_": "123"}.items():
    assert f"[0] {name} {value}" in text, text
  with pytest.raises(ValueError, match="malloc must be one of"):
    launch.launch([str(script)], 1, malloc="jemalloc")


def test_cluster_detection_methods_are_jaxs():
  from jax._src import clusters  # the test may look at private names; the package does not
  names = {env.name for env in clusters.ClusterEnv._cluster_types if env.name}
  assert set(distributed.CLUSTER_DETECTION_METHODS) - {"deactivate"} <= names, names


_ASK_AT_EXIT = """
import atexit, threading, time
from jax_qcomm.tools import distributed

class Client:  # a coordination client whose get_live_nodes never answers, and one that does
  def __init__(self, hang):
    self.hang = hang
  def get_live_nodes(self, ids):
    if self.hang:
      threading.Event().wait()
    return ids

asker = distributed._LiveAsker()  # started before exit, as initialize starts it

def at_exit():  # Python 3.12 starts no thread here: the asker must already run
  t0 = time.monotonic()
  print(asker.ask(Client(hang=True), 2, 1.0), round(time.monotonic() - t0))
  print(asker.ask(Client(hang=False), 2, 1.0))

atexit.register(at_exit)
"""


def test_the_live_process_question_at_exit_is_bounded():
  """At a normal exit process 0 asks the coordination service whether the others have left
  (_shutdown_barrier). The question runs on a thread started before exit, so a service that never
  answers costs the shutdown timeout, not a hang, on every Python (3.12 starts no thread in atexit
  handlers); a later question waits behind the unanswered one within its own bound."""
  proc = subprocess.run([sys.executable, "-c", _ASK_AT_EXIT], capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.splitlines() == ["('no answer', None) 1", "('no answer', None)"], proc.stdout


def test_private_distributed_state_is_where_compat_expects():
  """Naming a lost process and reading the process index chosen by cluster detection read jax's
  private distributed state (jax_qcomm._compat.distributed_state)."""
  assert _compat.distributed_state_problems() == []


def test_private_names_for_gloo_on_an_interface_are_where_compat_expects():
  """Fails loudly when a jax release moves one of the private names jax_qcomm._compat uses to bind
  gloo to a network interface (no public jax API does it); update _compat then."""
  assert _compat.gloo_private_api_problems() == []


_CACHE_PROBE = """
import os, sys
import jax, jax.numpy as jnp
from jax._src import distributed
from jax_qcomm import _compat
if sys.argv[1] == "off":
  jax.config.update("jax_enable_compilation_cache", False)
path = _compat.cache_compiled_programs_per_process(2)
distributed.global_state.process_id = 2  # as in a worker: jax itself writes from process 0 only
jax.jit(lambda x: jnp.tanh(x) * 2 + 1)(jnp.ones(5)).block_until_ready()
print(path, jax.config.jax_persistent_cache_min_compile_time_secs)
print(sorted(os.listdir(path)) if path else None)
"""


@pytest.mark.parametrize("mode", ["on", "off"])
def test_every_process_writes_its_compiled_programs_to_a_cache_directory_of_its_own(tmp_path, mode):
  """The elastic mode's persistent compilation cache (jax_qcomm._compat): process 2 writes its
  programs under <jax_compilation_cache_dir>/process-2, whatever their compile time; with jax's
  cache turned off, nothing is set."""
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path))
  proc = subprocess.run([sys.executable, "-c", _CACHE_PROBE, mode], capture_output=True,
                        text=True, timeout=120, env=env)
  assert proc.returncode == 0, proc.stderr[-2000:]
  first, second = proc.stdout.splitlines()
  if mode == "off":
    assert first == "None 1.0" and second == "None", proc.stdout
    assert not (tmp_path / "process-2").exists()
  else:
    assert first == f"{tmp_path / 'process-2'} 0.0", proc.stdout
    assert any(name.startswith("jit_") for name in eval(second)), proc.stdout


_REUSE_PROBE = """
import ctypes, resource, sys
from jax_qcomm.tools import malloc
if sys.argv[1] == "reuse":
  print(malloc.reuse_pages())
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(5):  # 100 MB malloc'ed, written and freed, as XLA:CPU does with its buffers
  f = faults(); p = libc.malloc(100_000_000); ctypes.memset(p, 1, 100_000_000); libc.free(p)
  counts.append(faults() - f)
print("faults", counts[-1])
"""


@pytest.mark.parametrize("mode", ["reuse", "glibc"])
def test_reuse_pages_makes_large_buffers_reuse_their_pages(mode):
  """tools.malloc.reuse_pages (what initialize() applies by default): a 100 MB buffer allocated
  again after it was freed takes its pages from the heap (no page faults); under glibc's defaults
  it is a fresh mmap, 24k faults of 4 KiB. A MALLOC_* variable in the environment wins."""
  import platform
  import subprocess
  import sys
  if platform.libc_ver()[0] != "glibc":
    pytest.skip("glibc only")
  env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
  env["MALLOC_ARENA_MAX"] = "2"
  out = subprocess.run([sys.executable, "-c", _REUSE_PROBE, mode], env=env, capture_output=True,
                       text=True, timeout=120, check=True).stdout
  faults = int(out.split("faults")[1])
  if mode == "reuse":
    assert "'M_MMAP_THRESHOLD': 'set'" in out and "'M_ARENA_MAX': 'env'" in out, out
    assert faults < 1000, out
  else:
    assert faults > 20000, out
