"""The allreduce benchmark runs end to end (single process, 4 host devices, a tiny size).

No timing assertions: only that every codec has a row of positive finite numbers, that the wire-byte
convention holds, and that the metadata is recorded.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CODECS = ("fp32", "cast_pmean_bf16", "cast_bf16", "qsgd8", "qsgd4", "qsgd2")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  return _run(tmp_path_factory.mktemp("bench") / "allreduce.json", "--devices", "4", "--sizes",
              "5000", "--repeats", "2", "--warmup", "1", "--breakdown", "--link-gbps", "1")


def _bench_env() -> dict[str, str]:
  """The environment of a benchmark run: not under a launcher, no forced device count."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("QCOMM_")}
  env.pop("XLA_FLAGS", None)
  return env


def _run(out, *args: str, timeout: int = 300) -> tuple[dict, str]:
  """``python -m benchmarks allreduce *args --out out``, which must succeed: (its JSON, stdout)."""
  proc = subprocess.run([sys.executable, "-m", "benchmarks", "allreduce", *args, "--out", str(out)],
                        cwd=ROOT, env=_bench_env(), capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
  return json.loads(out.read_text()), proc.stdout


def _positive_finite(v):
  return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_rows_have_positive_finite_numbers(result):
  data, _ = result
  rows = {r["codec"]: r for r in data["rows"]}
  assert set(rows) == set(CODECS)
  for name, r in rows.items():
    assert r["size"] == 5000 and r["devices"] == 4 and r["processes"] == 1
    for field in ("median_s", "min_s", "max_s", "wire_bytes_per_device", "payload_bytes",
                  "busbw_gb_per_s", "algbw_gb_per_s", "speedup_vs_fp32", "wire_ratio_vs_fp32",
                  "link_floor_s", "time_vs_floor"):
      assert _positive_finite(r[field]), (name, field, r[field])
    assert r["min_s"] <= r["median_s"] <= r["max_s"]
    assert r["time_vs_floor"] == pytest.approx(r["median_s"] / r["link_floor_s"])
    assert len(r["times_s"]) == 2


def test_wire_bytes_convention(result):
  data, _ = result
  rows = {r["codec"]: r for r in data["rows"]}
  d, n = 4, 5000
  assert rows["fp32"]["wire_bytes_per_device"] == 2 * (d - 1) * 4 * n // d
  # XLA CPU promotes the bf16 all-reduce to f32: cast_pmean sends fp32 bytes (read from the HLO).
  assert rows["cast_pmean_bf16"]["psum_wire_itemsize"] == 4
  assert rows["cast_bf16"]["wire_ratio_vs_fp32"] == pytest.approx(0.5)
  # QSGD 4 bits, bucket 128: 64 code bytes + 8 scale bytes per bucket, buffer padded to D*128.
  n_pad = -(-n // (d * 128)) * d * 128
  assert rows["qsgd4"]["payload_bytes"] == n_pad // 128 * 72
  assert rows["qsgd2"]["wire_bytes_per_device"] < rows["qsgd4"]["wire_bytes_per_device"] \
      < rows["qsgd8"]["wire_bytes_per_device"] < rows["cast_bf16"]["wire_bytes_per_device"]


def test_breakdown_and_metadata(result):
  data, stdout = result
  assert {r["codec"] for r in data["breakdown"]} == {"cast_bf16", "qsgd8", "qsgd4", "qsgd2"}
  for r in data["breakdown"]:
    assert _positive_finite(r["codec_total_s"]) and _positive_finite(r["transfer_s"])
    middle = (r["decode_sum_reencode_s"] if r["fused"]
              else r["decode_sum_s"] + r["encode_reduced_s"])
    assert r["codec_total_s"] == pytest.approx(r["encode_chunks_s"] + middle + r["decode_chunks_s"])
  fused = {r["codec"]: r["fused"] for r in data["breakdown"]}
  assert not fused["cast_bf16"] and fused["qsgd4"]  # QSGD's allreduce runs the fused kernel
  meta = data["metadata"]
  assert meta["benchmark"] == "allreduce" and meta["num_devices"] == 4
  assert meta["num_processes"] == 1 and not meta["launcher"]
  for key in ("date", "hostname", "cpu_model", "jax_version", "command", "malloc"):
    assert meta[key], key
  assert "allreduce" in meta["command"]
  assert "qsgd4" in stdout and "busbw" in stdout and "time/floor" in stdout


def test_exchange_variants_are_timed_side_by_side(tmp_path):
  """--exchange rounds all_to_all: one row per SRA codec and schedule, psum codecs once; the
  compiled programs really differ (the rows record the method)."""
  data, _ = _run(tmp_path / "x.json", "--devices", "4", "--sizes", "4096", "--codecs", "fp32",
                 "qsgd4", "--exchange", "rounds", "all_to_all", "--repeats", "1", "--warmup", "1")
  rows = {r["codec"]: r for r in data["rows"]}
  assert set(rows) == {"fp32", "qsgd4/rounds", "qsgd4/all_to_all"}
  assert rows["fp32"]["exchange"] is None
  assert rows["qsgd4/rounds"]["exchange"] == "rounds"
  assert rows["qsgd4/all_to_all"]["exchange"] == "all_to_all"
  assert rows["qsgd4/rounds"]["wire_bytes_per_device"] == rows["qsgd4/all_to_all"]["wire_bytes_per_device"]
  assert _positive_finite(rows["qsgd4/rounds"]["speedup_vs_fp32"])


def test_tree_mode_counts_describes_bytes_and_the_error(tmp_path):
  """--tree resnet50: ResNet50's parameter pytree per codec, the codec Auto runs named, the bytes
  of the cost model's tree count (describe's), and an error against the exact mean that is 0 for
  fp32 and that of a 4-bit codec for auto4."""
  import jax_qcomm as qcomm
  from jax_qcomm.tools import efficiency
  from benchmarks import sharded
  data, _ = _run(tmp_path / "t.json", "--devices", "2", "--tree", "resnet50", "--codecs", "fp32",
                 "auto4", "--repeats", "1", "--warmup", "1", "--sync", timeout=600)
  rows = {r["codec"]: r for r in data["rows"]}
  for r in rows.values():  # --sync: sync's update timed beside the allreduce, round by round
    assert len(r["sync_times_s"]) == len(r["sync_allreduce_times_s"]) == 1
    assert _positive_finite(r["sync_median_s"]) and _positive_finite(r["sync_over_allreduce"])
    # the step without communication, in the same rounds, and sync minus it per round
    assert len(r["local_step_times_s"]) == 1 and _positive_finite(r["local_step_median_s"])
    assert r["sync_comm_median_s"] == r["sync_times_s"][0] - r["local_step_times_s"][0]
    # the update alone (no apply), in the same rounds, held to the bare allreduce
    assert len(r["update_times_s"]) == 1
    assert r["update_over_allreduce"] == r["update_times_s"][0] / r["sync_allreduce_times_s"][0]
  assert rows["fp32"]["rel_error"] == 0 and rows["auto4"]["runs"] == "QSGD 4b/128 maxmin"
  assert 0.05 < rows["auto4"]["rel_error"] < 0.5
  # what sync handed its optimizer: the exact mean at 32 bits, a 4-bit error at 4
  assert rows["fp32"]["sync_rel_error"] < 1e-6 and 0.05 < rows["auto4"]["sync_rel_error"] < 0.5
  shapes = sharded.payload("resnet50")
  assert rows["auto4"]["wire_bytes_per_device"] == efficiency.tree_allreduce_bytes(
      shapes, 2, qcomm.QSGD(4))["bytes"]
  assert rows["fp32"]["size"] == 25_557_032
