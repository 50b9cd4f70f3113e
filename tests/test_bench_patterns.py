"""The transfer-pattern benchmark runs end to end (single process, 4 host devices, tiny rows).

No timing assertions: every pattern has a row of positive finite times, the bytes-sent convention
holds, and bad patterns are refused before anything runs.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _bench(*argv: str, tmp_path: pathlib.Path) -> tuple[subprocess.CompletedProcess, pathlib.Path]:
  out = tmp_path / "patterns.json"
  env = {k: v for k, v in os.environ.items() if not k.startswith("QCOMM_")}
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-m", "benchmarks", "patterns", *argv, "--out", str(out)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  return proc, out


def test_every_pattern_is_timed(tmp_path):
  proc, out = _bench("--devices", "4", "--row-bytes", "4096", "--repeats", "2", "--warmup", "1",
                     "--link-gbps", "1", "--patterns", "all_to_all", "rounds", "all_gather",
                     "shift1", "shift2", "cycle3", "psum", tmp_path=tmp_path)
  assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
  rows = {r["pattern"]: r for r in json.loads(out.read_text())["rows"]}
  assert list(rows) == ["all_to_all", "rounds", "all_gather", "shift1", "shift2", "cycle3", "psum"]
  for name, r in rows.items():
    assert math.isfinite(r["median_s"]) and r["median_s"] > 0, name
    assert r["time_vs_floor"] > 0
  assert rows["all_to_all"]["sent_bytes_per_device"] == 3 * 4096 == rows["rounds"]["sent_bytes_per_device"]
  assert rows["all_gather"]["sent_bytes_per_device"] == 3 * 4096
  assert rows["shift1"]["sent_bytes_per_device"] == 4096
  assert rows["psum"]["sent_bytes_per_device"] == 2 * 3 / 4 * 4096  # a ring all-reduce
  assert "time/floor" in proc.stdout


def test_bad_patterns_are_refused(tmp_path):
  proc, _ = _bench("--patterns", "broadcast", tmp_path=tmp_path)
  assert proc.returncode == 2 and "expected all_to_all" in proc.stderr
  proc, _ = _bench("--devices", "4", "--patterns", "shift4", "--repeats", "1", "--warmup", "1",
                   tmp_path=tmp_path)
  assert proc.returncode != 0 and "sends nothing" in proc.stderr
