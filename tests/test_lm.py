"""The byte-level transformer LM trainer (training/lm.py) and its study driver (scripts/lm_study.py):
corpus, config errors, quick-mode learning at fp32 and 4 bits, exact resume, the CLI's JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import lm_bytes
from training import lm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STDLIBS = {v: f"/root/.pyenv/versions/{p}/lib/python{v}" for v, p in (("3.12", "3.12.1"),
                                                                        ("3.13", "3.13.0"))}


def _quick(**overrides):
  config = lm_bytes.get_config("quick")
  config.progress_bar = False
  for k, v in overrides.items():
    config[k] = v
  return config


# ---- corpus --------------------------------------------------------------------------------------

def test_corpus_is_fixed_split_by_file_and_far_from_trivial():
  corpus = lm.load_corpus()
  assert not set(lm.TRAIN_FILES) & set(lm.VAL_FILES)
  assert corpus.train.size > 2_000_000 and corpus.val.size > 150_000
  assert corpus.python == sys.version.split()[0] and len(corpus.sha256) == 64
  # one NUL between consecutive files and none inside them
  assert int((corpus.train == lm.SEPARATOR).sum()) == len(lm.TRAIN_FILES) - 1
  h = lm.unigram_entropy(corpus.val)
  assert 2.5 < h < 4.0  # nats/byte of source code; uniform bytes would be ln 256 = 5.55
  assert lm.unigram_entropy(np.arange(256, dtype=np.uint8)) == pytest.approx(np.log(256))


@pytest.mark.parametrize("version", sorted(STDLIBS))
def test_corpus_files_exist_in_python_312_and_313(version):
  folder = STDLIBS[version]
  if not os.path.isdir(folder):
    pytest.skip(f"no Python {version} standard library at {folder}")
  for name in lm.TRAIN_FILES + lm.VAL_FILES:
    assert os.path.isfile(os.path.join(folder, name)), (version, name)


def test_missing_corpus_file_fails_clearly(tmp_path):
  (tmp_path / lm.TRAIN_FILES[0]).write_text("x = 1\n")
  with pytest.raises(FileNotFoundError, match=f"missing from {tmp_path}: {lm.TRAIN_FILES[1]}"):
    lm.load_corpus(str(tmp_path))


def test_batches_depend_on_seed_and_step_only():
  data = lm.load_corpus().train
  a = lm.train_windows(data, 0, 7, 16, 32)
  assert a.shape == (16, 33) and a.dtype == np.int32
  np.testing.assert_array_equal(a, lm.train_windows(data, 0, 7, 16, 32))
  assert not np.array_equal(a, lm.train_windows(data, 0, 8, 16, 32))
  assert not np.array_equal(a, lm.train_windows(data, 1, 7, 16, 32))
  v = lm.val_windows(lm.load_corpus().val, 64, 32)
  assert v.shape == (64, 33) and len({r.tobytes() for r in v}) == 64


def test_wire_bytes_follow_the_codec_and_the_default_policy():
  params = {"w": np.zeros((64, 256), np.float32), "b": np.zeros((256,), np.float32),
            "small": np.zeros((8, 8), np.float32)}
  config = _quick(bits=4)
  out = lm.wire_bytes(params, config)
  assert out["compressed_elements"] == 64 * 256  # the 1-D and the < 1024-element leaves go exact
  q4 = lm.qcomm.QSGD(bits=4).payload_size(64 * 256)
  assert out["wire_bytes"] == q4 + 4 * (256 + 64) and out["fp32_bytes"] == 4 * (64 * 256 + 320)
  assert lm.wire_bytes(params, _quick(bits=32))["wire_bytes"] == out["fp32_bytes"]


# ---- configuration errors, before any compute ----------------------------------------------------

@pytest.mark.parametrize("field,value,match", [
    ("bits", 9, r"config\.bits must be .*got 9"),  # qcomm.sync's message, the field named
    ("batch_size", 12, r"config.batch_size must be divisible by num_devices \(8\)"),
    ("num_heads", 3, r"config.num_heads must be a divisor of d_model \(32\)"),
    ("accum_steps", 0, r"config\.accum_steps must be .*got 0"),
    ("num_val_windows", 60, r"config.num_val_windows must be divisible by num_devices \(8\)"),
    ("time_limit_minutes", -1.0, r"config.time_limit_minutes must be >= 0"),
    ("warmup_steps", 100, r"config.warmup_steps must be smaller than num_steps \(100\)"),
    ("bucket_size", 12, r"config\.bucket_size must be .*got 12"),
])
def test_bad_config_fails_before_compute(field, value, match, monkeypatch):
  config = _quick(bits=4)  # QSGD: its bucket_size is checked (the exact codec has none)
  config[field] = value
  monkeypatch.setattr(lm, "load_corpus", lambda *a: pytest.fail("data read"))
  monkeypatch.setattr(lm, "programs_for", lambda *a: pytest.fail("compute ran"))
  with pytest.raises(ValueError, match=match):
    lm.train_and_evaluate(config, quiet=True)


def test_too_many_devices_names_the_field():
  with pytest.raises(ValueError, match="config.num_devices must be at most"):
    lm.train_and_evaluate(_quick(num_devices=64, batch_size=64, num_val_windows=64), quiet=True)


# ---- training ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quick_runs():
  """The quick mode at fp32 and at 4 bits (100 optimizer steps of accum 2), uninterrupted."""
  return {bits: lm.train_and_evaluate(_quick(bits=bits), quiet=True) for bits in (32, 4)}


def test_quick_mode_fp32_and_4_bits_both_learn_and_agree(quick_runs):
  fp32, q4 = quick_runs[32], quick_runs[4]
  for r in (fp32, q4):
    assert r["steps"] == 100 and r["accum_steps"] == 2 and r["replicas_identical"]
    assert r["curve"][0][1] == pytest.approx(np.log(256), abs=0.1)  # untrained: ~uniform
    # well below the uniform 5.55 and below the unigram entropy (~3.1): it learned context
    assert r["val_loss"] < r["unigram_entropy_val"] - 0.2, r["curve"]
  assert abs(q4["val_loss"] - fp32["val_loss"]) < 0.05 * fp32["val_loss"], (fp32["curve"],
                                                                            q4["curve"])
  assert q4["wire_bytes"] < 0.25 * fp32["wire_bytes"] and q4["compressed_elements"] > 0


def test_sharded_state_learns_like_replicated_and_resumes(quick_runs, tmp_path):
  """config.shard_state: 4-bit gradients, 4-bit weight differences, 1/8 of the optimizer state per
  device; the replicas stay identical, the loss follows the replicated 4-bit run's, and a run
  stopped by the time limit resumes to the same result."""
  sharded = lm.train_and_evaluate(_quick(bits=4, shard_state=True), quiet=True)
  assert sharded["replicas_identical"] and sharded["steps"] == 100
  q4 = quick_runs[4]
  assert abs(sharded["val_loss"] - q4["val_loss"]) < 0.05 * q4["val_loss"], (q4["curve"],
                                                                             sharded["curve"])
  config = _quick(bits=4, shard_state=True)
  part = lm.train_and_evaluate(config, str(tmp_path), quiet=True, stop_after=30)
  assert part["stopped"] and part["steps"] == 30
  resumed = lm.train_and_evaluate(config, str(tmp_path), quiet=True)
  assert resumed["params_checksum"] == sharded["params_checksum"]
  assert resumed["val_loss"] == sharded["val_loss"]


def test_sharded_parameters_learn_like_replicated_resume_and_report_bytes(quick_runs, tmp_path):
  """config.shard_params (ZeRO-3): exact gathers and gradients end at the replicated fp32 run's
  loss; 8-bit gathers and 4-bit gradients learn like it at a quarter of the exact sharded step's
  bytes and less memory than the replicated step; a stopped run resumes to the same result."""
  exact = lm.train_and_evaluate(_quick(bits=32, shard_params=True, param_gather_bits=32),
                                quiet=True)
  assert exact["val_loss"] == pytest.approx(quick_runs[32]["val_loss"], rel=1e-4)
  config = _quick(bits=4, shard_params=True, param_gather_bits=8)
  q = lm.train_and_evaluate(config, quiet=True)
  assert q["shard_params"] and q["param_gather_bits"] == 8 and q["steps"] == 100
  assert abs(q["val_loss"] - quick_runs[32]["val_loss"]) < 0.05 * quick_runs[32]["val_loss"]
  assert q["sent_bytes_per_step"] < 0.3 * exact["sent_bytes_per_step"]
  assert q["peak_bytes_per_device"] < quick_runs[32]["peak_bytes_per_device"]
  assert q["params"] == quick_runs[32]["params"]
  part = lm.train_and_evaluate(config, str(tmp_path), quiet=True, stop_after=30)
  assert part["stopped"] and part["steps"] == 30
  resumed = lm.train_and_evaluate(config, str(tmp_path), quiet=True)
  assert resumed["params_checksum"] == q["params_checksum"] and resumed["val_loss"] == q["val_loss"]


def test_resume_is_bit_identical(quick_runs, tmp_path):
  """The 4-bit quick run stopped after 30 steps, then by the time limit after 1 more, then run to
  the end: the same parameters, curve and final loss as the uninterrupted run (the sync state's
  rounding key and the AdamW moments go through the checkpoint; the compiled steps are shared)."""
  full = quick_runs[4]
  config = _quick(bits=4)
  part = lm.train_and_evaluate(config, str(tmp_path), quiet=True, stop_after=30)
  assert part["stopped"] and part["steps"] == 30 and part["val_loss"] is None
  config.time_limit_minutes = 1e-9  # stops after the first optimizer step of this piece
  more = lm.train_and_evaluate(config, str(tmp_path), quiet=True)
  assert more["stopped"] and more["steps"] == 31
  config.time_limit_minutes = 0.0
  resumed = lm.train_and_evaluate(config, str(tmp_path), quiet=True)
  assert resumed["steps"] == full["steps"] == 100 and "stopped" not in resumed
  assert resumed["params_checksum"] == full["params_checksum"]
  assert resumed["val_loss"] == full["val_loss"] and resumed["curve"] == full["curve"]
  assert [s for s, _ in full["curve"]] == [0, 50, 100]
  assert resumed["train_s"] > more["train_s"]  # seconds accumulate over the pieces
  lines = [json.loads(s) for s in open(tmp_path / "metrics.jsonl")]
  assert {r["kind"] for r in lines} == {"train", "eval"} and os.listdir(tmp_path / "tensorboard")
  # a checkpoint of a different run is refused, naming the field
  config.bits = 2
  with pytest.raises(ValueError, match="config.bits was 4, now 2"):
    lm.train_and_evaluate(config, str(tmp_path), quiet=True)


# ---- the command line and the study driver -------------------------------------------------------

def _run(args, cwd=REPO, timeout=600):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def test_study_driver_runs_skips_and_tabulates(tmp_path):
  """One tiny run through the driver (the CLI underneath: its last line is the JSON), a second
  call that skips it, then the plot and the table regenerated from the JSON."""
  out, work = tmp_path / "data", tmp_path / "runs"
  args = ["scripts/lm_study.py", "run", "--runs", "fp32", "--out", str(out), "--workdir",
          str(work), "--config", "configs/lm_bytes.py:quick", "--set", "num_steps=3",
          "--set", "warmup_steps=1", "--set", "eval_every_steps=0"]
  _run(args)
  record = json.loads((out / "fp32.json").read_text())
  for key in ("bits", "accum_steps", "error_feedback", "steps", "val_loss", "wall_s", "curve",
              "corpus_sha256", "python", "machine", "command"):
    assert key in record, key
  assert record["bits"] == 32 and record["steps"] == 3 and record["curve"][-1][0] == 3
  assert "--config.num_steps=3" in record["command"]
  assert os.listdir(work / "fp32" / "tensorboard")
  assert "skipping fp32" in _run(args)
  doc = tmp_path / "accuracy.md"
  doc.write_text("# x\n<!-- lm-table -->\nold\n<!-- /lm-table -->\nend\n")
  _run(["scripts/lm_study.py", "plot", "--out", str(out), "--img", str(tmp_path), "--doc",
        str(doc)])
  text = doc.read_text()
  assert "old" not in text and "| fp32 |" in text and text.endswith("end\n")
  assert (tmp_path / "lm_val_loss.png").stat().st_size > 1000
