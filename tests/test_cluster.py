"""The simulated cluster (``python -m jax_qcomm.tools.cluster``, and the benchmarks' route
``python -m benchmarks cluster``): arguments, the no-root / no-``ip``
path, and -- as root with iproute2 -- real runs on 2 namespaces joined by 100 Mbit/s links:

* the benchmark's JSON comes back with the cluster metadata, the link check measures ~the rate, and
  the fp32 allreduce takes at least (about) its bytes / rate: the shaping is effective (unshaped,
  the same transfer over veths takes a few milliseconds);
* nothing with the run's name prefix is left afterwards: after success, after the benchmark fails
  inside the nodes, and after SIGTERM in the middle of a run;
* ``--cleanup`` removes leftovers of dead runs and keeps those of live ones (unless ``--force``).

The runs use the prefix ``qct`` (not the default ``qcl``), and look only for names carrying the pid
of the run they started, so a cluster run by someone else at the same time is neither touched nor
mistaken for a leftover.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jax_qcomm.tools import cluster

from benchmarks import __main__ as bench_cli

pytestmark = pytest.mark.multiprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
PREFIX = "qct"
RATE = "100mbit"


def _parse(argv):
  parser = argparse.ArgumentParser()
  cluster.add_arguments(parser)
  return parser.parse_args(argv)


def _env():
  env = {k: v for k, v in os.environ.items() if not k.startswith("QCOMM_")}
  env.pop("XLA_FLAGS", None)  # the node processes set their own device count
  return env


def _cli(args, env=None, timeout=120):
  return subprocess.run([sys.executable, "-m", "benchmarks", "cluster", *args], cwd=ROOT,
                        env=env or _env(), capture_output=True, text=True, timeout=timeout)


# -- arguments (no root needed) -------------------------------------------------------------------

@pytest.mark.parametrize("text, bits", [("1gbit", 10**9), ("100mbit", 10**8), ("2.5gbit", 25 * 10**8),
                                        ("500kbit", 5 * 10**5), ("125mbps", 10**9)])
def test_parse_rate(text, bits):
  assert cluster.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "1 gigabit", "10", "-1gbit", "1kbit", ""])
def test_parse_rate_rejects(text):
  with pytest.raises(argparse.ArgumentTypeError, match="rate"):
    cluster.parse_rate(text)


def test_tbf_params():
  assert cluster.tc_rate(10**9) == "1gbit" and cluster.tc_rate(10**8) == "100mbit"
  p = cluster.tbf_params(10**9)
  assert p["rate"] == "1gbit" and int(p["burst"]) == 500_000  # 4 ms at 1 Gbit/s
  assert int(cluster.tbf_params(10**6)["burst"]) == 32 * 1024  # never below 32 KiB


GOOD = ["--nodes", "2", "--rate", RATE, "--", "allreduce", "--sizes", "1000"]


def test_validate_accepts_and_strips_separator():
  assert cluster.validate(_parse(GOOD)) == ["allreduce", "--sizes", "1000"]
  assert cluster.validate(_parse(["--nodes", "2", "--rate", RATE, "--", "-m", "pkg", "-x"])) == \
      ["-m", "pkg", "-x"]


def test_benchmark_route_checks_the_benchmark_and_sets_the_link_rate():
  assert bench_cli.cluster_program(_parse(GOOD)) == [
      "-m", "benchmarks", "allreduce", "--sizes", "1000", "--link-gbps", "0.1"]
  given = _parse([*GOOD, "--link-gbps=2"])
  assert bench_cli.cluster_program(given)[-1] == "--link-gbps=2"
  codec = _parse(["--nodes", "2", "--rate", RATE, "--", "codec", "--sizes", "1000"])
  assert bench_cli.cluster_program(codec) == ["-m", "benchmarks", "codec", "--sizes", "1000"]


@pytest.mark.parametrize("argv, match", [
    (["--nodes", "1", "--rate", RATE, "--", "allreduce"], "--nodes"),
    (["--nodes", "65", "--rate", RATE, "--", "allreduce"], "--nodes"),
    (["--nodes", "2", "--", "allreduce"], "--rate"),
    (["--nodes", "2", "--rate", RATE], "program"),
    (["--nodes", "2", "--rate", RATE, "--"], "program"),
    (["--nodes", "2", "--rate", RATE, "--", "nosuchbench"], "rejected"),
    (["--nodes", "2", "--rate", RATE, "--", "allreduce", "--no-such-option"], "rejected"),
    (["--nodes", "2", "--rate", RATE, "--", "cluster", "--nodes", "2"], "cannot run inside"),
    (["--nodes", "2", "--rate", RATE, "--local-devices", "0", "--", "allreduce"], "--local-devices"),
    (["--nodes", "2", "--rate", RATE, "--prefix", "Bad-1", "--", "allreduce"], "--prefix"),
    (["--nodes", "2", "--rate", RATE, "--prefix", "toolong", "--", "allreduce"], "--prefix"),
    (["--nodes", "2", "--rate", RATE, "--subnet", "8.8.8.0/24", "--", "allreduce"], "private"),
    (["--nodes", "4", "--rate", RATE, "--subnet", "10.77.0.0/30", "--", "allreduce"], "room"),
    (["--nodes", "2", "--rate", RATE, "--subnet", "10.77.0.1/24", "--", "allreduce"], "--subnet"),
    (["--nodes", "2", "--rate", RATE, "--port", "80", "--", "allreduce"], "--port"),
    (["--nodes", "2", "--rate", RATE, "--timeout", "0", "--", "allreduce"], "--timeout"),
    (["--nodes", "2", "--rate", RATE, "--force", "--", "allreduce"], "--force"),
    (["--nodes", "2", "--rate", RATE, "--python", "/no/such/python", "--", "allreduce"],
     "--python must be an executable"),
])
def test_validate_rejects(argv, match):
  with pytest.raises(ValueError, match=match):
    bench_cli.cluster_program(_parse(argv))


def test_cli_bad_arguments_exit_2_before_building_anything():
  proc = _cli(["--nodes", "2", "--rate", RATE, "--", "nosuchbench"])
  assert proc.returncode == cluster.EXIT_USAGE, proc.stderr
  assert "nosuchbench" in proc.stderr and "building" not in proc.stderr


def test_tool_cli_bad_arguments_exit_2():
  proc = subprocess.run([sys.executable, "-m", "jax_qcomm.tools.cluster", "--nodes", "1", "--rate",
                         RATE, "--", "train.py"], cwd=ROOT, env=_env(), capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == cluster.EXIT_USAGE and "--nodes" in proc.stderr, proc.stderr


def test_preflight_without_root():
  with pytest.raises(cluster.Unavailable, match="needs root"):
    cluster.preflight(euid=1000, which=lambda name: f"/usr/sbin/{name}")


def test_preflight_without_ip_and_tc():
  with pytest.raises(cluster.Unavailable, match=r"`ip`.*`tc`"):
    cluster.preflight(euid=0, which=lambda name: None)


def test_cli_without_ip_exits_unavailable(tmp_path):
  env = _env()
  env["PATH"] = str(tmp_path)  # no ip, no tc (sys.executable is an absolute path)
  proc = _cli(GOOD, env=env)
  assert proc.returncode == cluster.EXIT_UNAVAILABLE, proc.stderr
  assert "cannot build the simulated cluster" in proc.stderr and "`ip`" in proc.stderr


# -- real runs (root, ip, tc) --------------------------------------------------------------------------

def _can_build() -> str | None:
  """None if this machine can build a cluster, else why not."""
  try:
    cluster.preflight()
  except cluster.Unavailable as e:
    return str(e)
  return None


needs_root = pytest.mark.skipif(_can_build() is not None, reason=f"no simulated cluster here: "
                                f"{_can_build()}")


def _left(pid: int) -> list[str]:
  """Namespaces and links of the run with this pid that still exist."""
  found = cluster.leftovers(shutil.which("ip"), PREFIX)
  pattern = cluster._name_pattern(PREFIX)
  return [n for n in found["namespaces"] + found["links"] if pattern.fullmatch(n).group(1) == str(pid)]


def _start(args, out=None):
  extra = ["--out", str(out)] if out else []
  return subprocess.Popen([sys.executable, "-m", "benchmarks", "cluster", "--prefix", PREFIX,
                           *extra, *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(proc, timeout=150):
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    pytest.fail(f"cluster run hung:\n{out[-3000:]}\n{err[-3000:]}")
  return out, err


SIZE = 2_500_000  # fp32, 2 nodes: each sends 2 (D-1)/D * 4 n = 10 MB, 0.8 s at 100 Mbit/s


@needs_root
def test_real_run_json_rate_and_teardown(tmp_path):
  out = tmp_path / "cluster.json"
  proc = _start(["--nodes", "2", "--rate", RATE, "--", "allreduce", "--sizes", str(SIZE),
                 "--codecs", "fp32", "--repeats", "2", "--warmup", "1"], out)
  stdout, stderr = _finish(proc)
  assert proc.returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
  assert _left(proc.pid) == []
  data = json.loads(out.read_text())
  meta = data["metadata"]
  c = meta["cluster"]
  assert c["nodes"] == 2 and c["rate"] == RATE and c["rate_bits_per_s"] == 10**8
  assert c["tag"] == f"{PREFIX}{proc.pid}" and c["addresses"] == ["10.77.0.1", "10.77.0.2"]
  assert len(c["qdiscs"]) == 4 and all("tbf" in q and "100Mbit" in q for q in c["qdiscs"])
  # The upper bound is the shaping (no flow beats the rate); the lower one only catches a broken
  # link: a 6 MB flow on a busy 2-core machine has measured as low as 0.68 of the rate.
  assert 0.4 < c["link_check"]["ratio_to_rate"] < 1.15, c["link_check"]
  # Every command touched only what the run made: host-side devices and namespaces named <tag>...
  tag = c["tag"]
  for cmd in c["setup_commands"]:
    argv = cmd.split()[1:]
    if argv[0] == "-n":
      assert argv[1].startswith(tag), cmd
      continue
    if argv[:2] == ["netns", "add"]:
      assert argv[2].startswith(tag), cmd
      continue
    device = argv[argv.index("dev") + 1] if "dev" in argv else argv[2]
    assert device.startswith(tag), cmd
  assert any("addrgenmode none" in cmd and c["bridge"] in cmd for cmd in c["setup_commands"])
  assert meta["num_processes"] == 2 and meta["gloo_interface"] == "eth0"
  assert meta["config"]["link_gbps"] == pytest.approx(0.1)  # set from --rate
  (row,) = data["rows"]
  floor = row["wire_bytes_per_device"] * 8 / 1e8
  assert row["link_floor_s"] == pytest.approx(floor)
  # Shaped: at least ~the floor (tbf's burst lets a little through early); unshaped this is ~10 ms.
  assert 0.85 * floor <= row["median_s"] <= 5 * floor, (row["median_s"], floor)
  assert row["time_vs_floor"] == pytest.approx(row["median_s"] / floor)


@needs_root
def test_teardown_after_benchmark_fails():
  # Accepted by the parser, rejected by the benchmark inside every node.
  proc = _start(["--nodes", "2", "--rate", RATE, "--no-link-check", "--", "allreduce", "--sizes",
                 "1000", "--bucket", "12"])
  stdout, stderr = _finish(proc)
  assert proc.returncode != 0
  assert "bucket" in stderr and "removed" in stderr, stderr[-3000:]
  assert _left(proc.pid) == []


@needs_root
def test_teardown_after_sigterm():
  proc = _start(["--nodes", "2", "--rate", "1mbit", "--no-link-check", "--", "allreduce",
                 "--sizes", "25000000", "--codecs", "fp32"])
  deadline = time.monotonic() + 60
  while not _left(proc.pid):  # wait for the namespaces to appear
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
    time.sleep(0.1)
  time.sleep(2.0)  # the node processes are starting
  proc.send_signal(signal.SIGTERM)
  stdout, stderr = _finish(proc, timeout=60)
  assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
  assert _left(proc.pid) == []


@needs_root
def test_cleanup_removes_dead_runs_only():
  ip = shutil.which("ip")
  prefix = "qcf"  # its own prefix: --force below removes every live run with it
  dead = 4_000_000  # above any pid in use here (pid_max allows it; checked below)
  while cluster._pid_alive(dead):
    dead += 1
  alive = os.getpid()
  made = [f"{prefix}{dead}n0", f"{prefix}{alive}n0"]
  links = [f"{prefix}{dead}br", f"{prefix}{alive}br"]
  try:
    for ns in made:
      subprocess.run([ip, "netns", "add", ns], check=True)
    for br in links:
      subprocess.run([ip, "link", "add", br, "type", "bridge"], check=True)
    removed, kept = cluster.cleanup(ip, prefix, log=lambda m: None)
    assert set(removed) >= {made[0], links[0]}
    assert set(kept) >= {made[1], links[1]}
    found = cluster.leftovers(ip, prefix)
    assert made[0] not in found["namespaces"] and links[0] not in found["links"]
    assert made[1] in found["namespaces"] and links[1] in found["links"]
    # --force: also live runs (the names with our own pid).
    proc = _cli(["--cleanup", "--prefix", prefix, "--force"])
    assert proc.returncode == 0, proc.stderr
    found = cluster.leftovers(ip, prefix)
    assert not set(made) & set(found["namespaces"]) and not set(links) & set(found["links"])
  finally:
    cluster.remove(ip, made, links)
