"""The benchmark command line runs end to end at a tiny size and writes well-formed JSON.

No timing is asserted: only the shape of the output and that every number is positive and finite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import pytest

from jax_qcomm.native import _ffi, wire
from benchmarks import _common, codec

_NUMBERS = ("median_s", "min_s", "max_s", "elements_per_s", "gb_per_s")


def _run_codec_bench(tmp_path, *extra: str) -> dict:
  out = tmp_path / "codec.json"
  env = {k: v for k, v in os.environ.items()
         if not (k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")}
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks", "codec", "--sizes", "4096", "1000",
       "--repeats", "2", "--warmup", "1", "--out", str(out), *extra],
      env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "decode_sum" in proc.stdout and "malloc:" in proc.stdout
  return json.loads(out.read_text())


@pytest.mark.skipif(not _ffi.has_cpu_kernels(), reason="needs the compiled CPU kernels")
@pytest.mark.parametrize("raw", [False, True], ids=["tuned", "raw"])
def test_codec_bench_json(tmp_path, raw):
  result = _run_codec_bench(tmp_path, *(["--raw-malloc"] if raw else []))
  meta, rows = result["metadata"], result["rows"]

  assert meta["benchmark"] == "codec"
  assert meta["nproc"] == os.cpu_count()
  assert meta["cpu_isa"] == _ffi.cpu_isa()
  assert meta["command"].startswith("python -m benchmarks codec --sizes 4096 1000")
  for key in ("date", "hostname", "cpu_model", "jax_version", "backend"):
    assert meta[key], key
  if raw:
    assert meta["malloc"] == dict(mode="raw", source=None, env={}, mallopt={})
  else:
    assert meta["malloc"]["mode"] == "tuned" and meta["malloc"]["source"] == "re-exec"
    assert meta["malloc"]["env"] == _common.MALLOC_ENV

  assert [(r["size"], r["op"], r["impl"]) for r in rows] == [
      (n, op, impl) for n in (4096, 1000) for op in codec.OPS for impl in codec.IMPLS]
  for r in rows:
    for key in _NUMBERS:
      assert math.isfinite(r[key]) and r[key] > 0, (r, key)
    assert r["min_s"] <= r["median_s"] <= r["max_s"]
    assert len(r["times_s"]) == 2
    assert r["elements_per_s"] == pytest.approx(r["size"] / r["median_s"])
    assert r["payload_bytes"] == wire.qsgd_payload_bytes(r["size"], 4, 128, "maxmin")
    speedup = r["speedup_ffi_over_jax"]
    if r["impl"] == "ffi":
      assert math.isfinite(speedup) and speedup > 0
    else:
      assert speedup is None
    assert r["num_payloads"] == {"encode": None, "decode": 1, "decode_sum": 4}[r["op"]]


def test_parse_size():
  assert [_common.parse_size(s) for s in ("4096", "25_000_000", "2.5e7", "25M", "10k", "1G")] == [
      4096, 25_000_000, 25_000_000, 25_000_000, 10_000, 10**9]
  for bad in ("0", "-5", "1.5", "abc", "3x"):
    with pytest.raises(argparse.ArgumentTypeError):
      _common.parse_size(bad)


def test_median_time_and_table():
  t = _common.median_time(lambda: 1, repeats=3, warmup=1)
  assert len(t.times) == 3 and len(t.faults) == 3
  assert t.min <= t.median <= t.max
  with pytest.raises(ValueError):
    _common.median_time(lambda: 1, repeats=0)
  table = _common.format_table(("a", "bb"), [("x", 1), ("yyy", 22)], align="lr")
  assert table.splitlines() == ["a    bb", "---  --", "x     1", "yyy  22"]


def test_sharded_bench_json(tmp_path):
  """`benchmarks sharded` times sync's defaults (bits=4, the default gather codec) at a tiny
  size, with every sync's buffers bounded by --comm-bucket, and names the codecs each mode
  resolved to; a bound below 1 is refused."""
  out = tmp_path / "sharded.json"
  cmd = [sys.executable, "-m", "benchmarks", "sharded", "--payload", "mlp:20000", "--repeats", "2",
         "--warmup", "1", "--out", str(out)]
  bad = subprocess.run(cmd + ["--comm-bucket", "0"], capture_output=True, text=True, timeout=300)
  assert bad.returncode != 0 and "argument --comm-bucket: size must be a positive integer, got '0'" \
      in bad.stderr
  proc = subprocess.run(cmd + ["--comm-bucket", "4096"], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "buffers 4096;" in proc.stdout
  r = json.loads(out.read_text())["result"]
  assert r["bits"] == 4 and r["devices"] == 2 and r["comm_bucket_size"] == 4096
  assert r["codecs"]["sharded"].endswith("all-gather")
  assert "reduce-scatter" in r["codecs"]["sharded"]
  assert r["codecs"]["replicated"].endswith("allreduce")
  for mode in ("replicated", "sharded", "same_codec"):
    for key in ("update_s", "optimizer_s", "sent_bytes_per_device"):
      assert math.isfinite(r[key][mode]) and r[key][mode] > 0, (key, mode)
    # A difference of two medians: its sign at this tiny size is noise, its definition is not.
    assert r["comm_s"][mode] == pytest.approx(r["update_s"][mode] - r["optimizer_s"][mode])
  assert r["state_bytes_per_device"]["sharded"] < r["state_bytes_per_device"]["replicated"]


def test_exact_path_bench_runs(tmp_path):
  """In one process and across two (the launcher, one device each): every row is printed with a
  positive finite time, and across processes every threshold's result is the pmean's, bit for bit
  (the benchmark asserts it before timing)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  one = subprocess.run([sys.executable, "-m", "benchmarks.exact_path", "--trees", "small",
                        "--rounds", "1"], env=env, capture_output=True, text=True, timeout=300)
  assert one.returncode == 0, one.stdout + one.stderr
  ratio = float(one.stdout.split("median ratio")[1].split()[0])
  assert math.isfinite(ratio) and ratio > 0, one.stdout
  two = subprocess.run([sys.executable, "-m", "jax_qcomm.tools.launch", "-n", "2",
                        "--local-devices", "1", "--timeout", "240", "-m", "benchmarks.exact_path",
                        "--processes", "--trees", "small", "--rounds", "1"],
                       env=env, capture_output=True, text=True, timeout=300)
  assert two.returncode == 0, two.stdout + two.stderr
  rows = [line for line in two.stdout.splitlines() if " median " in line]
  assert len(rows) == 8, two.stdout  # the transport's rule, 6 thresholds, the per-leaf pmean
  for line in rows:
    ms = float(line.split(" median ")[1].split()[0])
    assert math.isfinite(ms) and ms > 0, line
