"""The step and partial benchmarks run end to end (one process, 8 host devices, tiny sizes).

No timing assertions: rows of positive finite numbers, the per-optimizer-step bookkeeping
(Tc = Tstep - Ts, eta = Ts / Tstep), the model columns, and the metadata.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from jax_qcomm.tools import efficiency
from benchmarks import __main__ as bench_main
from benchmarks import partial

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(args, out):
  env = {k: v for k, v in os.environ.items() if not k.startswith("QCOMM_")}  # not under a launcher
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-m", "benchmarks", *args, "--out", str(out)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
  return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def step_result(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench") / "step.json"
  return _run(["step", "--devices", "8", "--hidden", "64", "--in-dim", "32", "--out-dim", "16",
               "--batch", "2", "--codecs", "fp32,bf16,qsgd4", "--accum", "1,2", "--repeats", "2",
               "--warmup", "1", "--link-gbps", "1"], out)


@pytest.fixture(scope="module")
def partial_result(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench") / "partial.json"
  return _run(["partial", "--devices", "8", "--size", "4096", "--gammas", "1,2,4", "--repeats", "2",
               "--warmup", "1", "--link-gbps", "1"], out)


def _pos(v):
  return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_step_rows(step_result):
  data, stdout = step_result
  rows = {(r["codec"], r["accum_steps"]): r for r in data["rows"]}
  assert set(rows) == {(c, k) for c in ("fp32", "bf16", "qsgd4") for k in (1, 2)}
  params = 32 * 64 + 64 + 64 * 16 + 16
  for (name, k), r in rows.items():
    assert r["devices"] == 8 and r["processes"] == 1 and r["parameters"] == params
    for field in ("ts_s", "ts_micro_s", "tstep_s", "eta", "wire_bytes_per_device",
                  "model_tc_s", "model_tstep_s", "model_eta", "model_transfer_s"):
      assert _pos(r[field]), (name, k, field, r[field])
    assert math.isfinite(r["tc_s"])
    assert r["tc_s"] == pytest.approx(r["tstep_s"] - r["ts_s"])
    assert r["eta"] == pytest.approx(r["ts_s"] / r["tstep_s"])
    assert r["ts_micro_s"] == pytest.approx(r["ts_s"] / k)
    assert len(r["tstep_timing"]["times_s"]) == 2
    # the model: Tstep = k * ts + Tc_model, eta = ts / (ts + Tc_model / k)
    assert r["model_tstep_s"] == pytest.approx(k * r["ts_micro_s"] + r["model_tc_s"])
    assert r["model_eta"] == pytest.approx(
        efficiency.scaling_efficiency(r["ts_micro_s"], r["model_tc_s"], k))
    assert r["model_tc_overlap_s"] <= r["model_tc_s"] + 1e-12
    assert r["model_eta_overlap"] >= r["model_eta"] - 1e-12
  # wire bytes: the library's leaf policy (1-D biases exact; the 32x64 and 64x16 kernels, >= 1024
  # elements, compressed) -> exactly efficiency.tree_allreduce_bytes
  assert rows[("fp32", 1)]["wire_bytes_per_device"] == pytest.approx(
      efficiency.ring_allreduce_bytes(params, 8))
  assert rows[("qsgd4", 1)]["coded_elements"] == 32 * 64 + 64 * 16
  assert (rows[("qsgd4", 1)]["wire_bytes_per_device"] < rows[("bf16", 1)]["wire_bytes_per_device"]
          < rows[("fp32", 1)]["wire_bytes_per_device"])
  assert _pos(rows[("qsgd4", 1)]["codec_elems_per_s"]) and rows[("fp32", 1)]["codec_work_s"] is None
  # model link as given: the transfer part is bytes / 1 Gbit/s
  r = rows[("fp32", 1)]
  assert r["model_transfer_s"] == pytest.approx(r["wire_bytes_per_device"] * 8 / 1e9)
  meta = data["metadata"]
  assert meta["benchmark"] == "step" and meta["num_devices"] == 8 and not meta["launcher"]
  assert meta["model"]["model_link_gbps"] == 1.0 and meta["model"]["model_link_source"] == "given"
  for key in ("date", "hostname", "cpu_model", "jax_version", "command", "malloc"):
    assert meta[key], key
  assert "eta" in stdout and "qsgd4" in stdout


def test_partial_rows(partial_result):
  data, stdout = partial_result
  rows = data["rows"]
  assert [r["gamma"] for r in rows] == [1, 2, 4]
  assert [r["elements"] for r in rows] == [4096, 2048, 1024]
  for r in rows:
    for field in ("median_s", "busbw_gb_per_s", "speedup_vs_first", "efficiency", "link_floor_s"):
      assert _pos(r[field]), (r["gamma"], field)
    assert r["wire_bytes_per_device"] == pytest.approx(2 * 7 / 8 * 4 * r["elements"])
    assert r["ideal_speedup"] == r["gamma"]
  assert rows[0]["marginal_gain"] is None and _pos(rows[1]["marginal_gain"])
  assert data["metadata"]["benchmark"] == "partial"
  assert "knee_gamma" in data["metadata"] and "gamma" in stdout


def test_find_knee():
  mk = lambda ts: [dict(gamma=2 ** i, median_s=t) for i, t in enumerate(ts)]  # noqa: E731
  assert partial.find_knee(mk([8, 4, 2, 1]), 1.25) is None            # bandwidth-bound throughout
  assert partial.find_knee(mk([8, 4, 2, 1.9, 1.95]), 1.25) == 4       # flat from gamma 4
  assert partial.find_knee(mk([8, 4, 5, 2, 1.9]), 1.25) == 8          # one noisy point ignored


@pytest.mark.parametrize("argv", [
    ["step", "--codecs", "fp32,qsgd3x"], ["step", "--accum", "0"], ["step", "--hidden", "a,b"],
    ["partial", "--gammas", "1,0"],
])
def test_bad_arguments(argv, capsys):
  with pytest.raises(SystemExit) as e:
    bench_main.build_parser().parse_args(argv)
  assert e.value.code == 2
