"""python -m benchmarks.model: calibration from ingredient runs, predictions of end-to-end runs."""

from __future__ import annotations

import json

import pytest

import jax_qcomm as qcomm

from jax_qcomm.tools import efficiency as eff

from benchmarks import model


def _write(path, rows, **meta):
  path.write_text(json.dumps(dict(metadata=dict(config=dict(link_gbps=1.0), **meta), rows=rows)))
  return path


def test_calibrates_then_predicts(tmp_path, capsys):
  n = 25_600_000
  patterns = _write(tmp_path / "p.json", [
      dict(pattern="psum", devices=2, median_s=1.0, time_vs_floor=1.1),
      dict(pattern="all_to_all", devices=2, median_s=1.0, time_vs_floor=2.0),
      dict(pattern="all_gather", devices=2, median_s=1.0, time_vs_floor=1.8)])
  small = _write(tmp_path / "s.json", [dict(pattern="psum", devices=2, median_s=0.004)])
  transport = eff.Transport(allreduce=1.1, all_to_all=2.0, all_gather=1.8, latency_s=0.002)
  fp32 = eff.comm_time(n, 2, 32, 1.0, transport=transport)
  q4 = eff.comm_time(n, 2, qcomm.QSGD(4), 1.0, transport=transport, codec_elems_per_s=n / 0.2)
  breakdown = tmp_path / "b.json"
  breakdown.write_text(json.dumps(dict(
      metadata={}, breakdown=[dict(codec="qsgd4", size=n, codec_total_s=0.2)],
      rows=[dict(codec="fp32", size=n, devices=2, median_s=fp32),
            dict(codec="qsgd4", size=n, devices=2, median_s=q4 * 1.3)])))
  out = tmp_path / "check.json"
  assert model.main(["--patterns", str(patterns), "--latency", str(small), "--breakdown",
                     str(breakdown), "--crossover", str(tmp_path / "none.json"), "--peers",
                     str(tmp_path / "none.json"), "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["calibration"]["transport"] == dict(allreduce=1.1, all_to_all=2.0,
                                                    all_gather=1.8, reduce_scatter=1.0,
                                                    latency_s=0.002)
  errors = {p["label"]: p["error"] for p in result["points"]}
  assert errors["25.6M fp32"] == pytest.approx(0.0, abs=1e-9)
  assert errors["25.6M qsgd4"] == pytest.approx(1 / 1.3 - 1)
  text = capsys.readouterr().out
  assert "1 of 2 modelled points within 15%" in text
  # extrapolation: every payload x nodes x link x codec, the ideal transport never slower
  ext = result["extrapolation"]
  assert len(ext) == 2 * 6 * 4 * 2  # fp32 and the codec with a measured rate
  assert all(r["tc_ideal_s"] <= r["tc_gloo_cpu_s"] for r in ext)


def test_missing_pattern_is_an_error(tmp_path):
  patterns = _write(tmp_path / "p.json", [dict(pattern="psum", devices=2, median_s=1.0,
                                                time_vs_floor=1.0)])
  breakdown = tmp_path / "b.json"
  breakdown.write_text(json.dumps(dict(metadata={}, breakdown=[], rows=[])))
  with pytest.raises(SystemExit, match="all_to_all"):
    model.main(["--patterns", str(patterns), "--breakdown", str(breakdown), "--out",
                str(tmp_path / "o.json")])
