"""The overlap benchmark runs end to end (one process, 2 host devices, tiny sizes); its overlap
fraction is right on hand-made times. No timing assertions."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from benchmarks import overlap

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_overlap_fraction():
  rows = [dict(name="comm", median_s=1.0), dict(name="codec", median_s=0.5),
          dict(name="both", median_s=1.5), dict(name="pipelined", median_s=1.0)]
  assert overlap.overlap(rows) == pytest.approx(dict(both=0.0, pipelined=1.0))


def test_runs(tmp_path):
  out = tmp_path / "overlap.json"
  env = {k: v for k, v in os.environ.items() if not k.startswith("QCOMM_")}
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-m", "benchmarks", "overlap", "--devices", "2", "--size",
                         "4096", "--chunks", "2", "--repeats", "2", "--warmup", "1", "--out",
                         str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
  result = json.loads(out.read_text())
  assert [r["name"] for r in result["rows"]] == ["comm", "codec", "both", "pipelined"]
  assert all(math.isfinite(r["median_s"]) and r["median_s"] > 0 for r in result["rows"])
  assert set(result["metadata"]["overlap"]) == {"both", "pipelined"}
