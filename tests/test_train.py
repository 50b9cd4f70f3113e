"""The example trainer: input pipelines, config validation, checkpoint/resume, multi-process."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
tfds = pytest.importorskip("tensorflow_datasets")

import jax  # noqa: E402

from configs import default, digits, imagenet_resnet50  # noqa: E402
from training import input_pipeline, models, train  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_digits(**overrides):
  config = digits.get_config()
  config.num_filters = 4
  config.batch_size = 32
  config.num_train_steps = 6
  config.warmup_epochs = 0.0
  config.eval_every_steps = 0
  config.checkpoint_every_steps = 0
  config.measure_sync_steps = 0
  config.progress_bar = False
  for k, v in overrides.items():
    config[k] = v
  return config


# ---- input pipelines -----------------------------------------------------------------------------

def _jpeg(seed: int, h: int = 40, w: int = 56) -> bytes:
  rng = np.random.default_rng(seed)
  return tf.io.encode_jpeg(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).numpy()


def _mock_imagenet(num_examples: int):
  """A tfds mock whose examples are real JPEGs labelled by index, honouring split slices like
  ``train[50%:100%]`` (tfds's default mock ignores slicing, which would hide a sharding bug)."""
  def as_dataset(self, split, decoders=None, **kwargs):
    if dataclasses.is_dataclass(split):  # tfds.even_splits's _EvenSplit
      even = dataclasses.asdict(split)
      name = even["split"]
      lo = even["index"] * num_examples // even["count"]
      hi = (even["index"] + 1) * num_examples // even["count"]
    else:
      m = re.fullmatch(r"(\w+)(?:\[(\d+)%:(\d+)%\])?", str(split))
      assert m, split
      name = m.group(1)
      lo = int(m.group(2) or 0) * num_examples // 100
      hi = int(m.group(3) or 100) * num_examples // 100
    offset = 0 if name == "train" else 10_000
    images = [_jpeg(offset + i) for i in range(lo, hi)]
    labels = np.arange(lo, hi, dtype=np.int64) + offset
    return tf.data.Dataset.from_tensor_slices({"image": images, "label": labels})

  # The mock leaves is_prepared() False, and the trainer asks it before reading anything.
  return _both(tfds.testing.mock_data(num_examples=num_examples, as_dataset_fn=as_dataset),
               mock.patch.object(tfds.core.DatasetBuilder, "is_prepared", return_value=True))


@contextlib.contextmanager
def _both(a, b):
  with a, b:
    yield


def _imagenet_config(image_size: int = 32):
  config = default.get_config()
  config.dataset = "imagenet2012"
  config.data_dir = "/nonexistent"  # the mock must be what is read
  config.image_size = image_size
  config.shuffle_buffer = 64
  return config


def test_imagenet_pipeline_on_mock_data_shapes_normalisation_and_process_shards():
  config = _imagenet_config()
  with _mock_imagenet(16):
    info = input_pipeline.dataset_info(config)
    assert info.image_shape == (32, 32, 3) and info.num_classes == 1000
    shards = []
    for p in range(2):
      it = input_pipeline.train_iterator(config, 4, process_index=p, process_count=2)
      batches = [next(it) for _ in range(2)]  # one epoch of this process's 8 examples
      for b in batches:
        assert b["image"].shape == (4, 32, 32, 3) and b["image"].dtype == np.float32
        assert b["label"].shape == (4,) and b["label"].dtype == np.int32
        assert b["mask"].all()
      images = np.concatenate([b["image"] for b in batches])
      # Normalised with ImageNet's mean/std: uniform random pixels give mean ~0.1, std ~1.
      assert abs(images.mean()) < 0.5 and 0.6 < images.std() < 1.6
      shards.append(set(np.concatenate([b["label"] for b in batches]).tolist()))
    assert shards[0] == set(range(8)) and shards[1] == set(range(8, 16))  # distinct, complete
    # Evaluation: every example once over the two processes, padding masked, same batch count.
    seen, counts = [], []
    for p in range(2):
      ev = list(input_pipeline.eval_iterator(config, 3, process_index=p, process_count=2))
      counts.append(len(ev))
      for b in ev:
        assert b["image"].shape == (3, 32, 32, 3)
        seen += b["label"][b["mask"]].tolist()
    assert counts[0] == counts[1] == 3
    assert sorted(seen) == list(range(10_000, 10_016))


def test_train_batches_are_reproducible_from_the_step():
  config = _imagenet_config()
  with _mock_imagenet(16):
    it = input_pipeline.train_iterator(config, 4)
    run = [next(it) for _ in range(5)]
    resumed = input_pipeline.train_iterator(config, 4, start_step=3)
    for want in run[3:]:
      got = next(resumed)
      np.testing.assert_array_equal(got["label"], want["label"])
      np.testing.assert_array_equal(got["image"], want["image"])  # augmentation too


def test_image_folder_reads_written_images(tmp_path):
  for split, per_class in (("train", 3), ("test", 2)):
    for c, name in enumerate(("cat", "dog")):
      folder = tmp_path / split / name
      folder.mkdir(parents=True)
      for i in range(per_class):
        (folder / f"{i}.jpg").write_bytes(_jpeg(100 * c + i, 30 + 4 * i, 50))
  config = default.get_config()
  config.dataset, config.data_dir = "image_folder", str(tmp_path)
  config.train_split, config.eval_split = "train", "test"
  config.image_size = 24
  info = input_pipeline.dataset_info(config)
  assert (info.num_classes, info.train_examples, info.eval_examples) == (2, 6, 4)
  b = next(input_pipeline.train_iterator(config, 4))
  assert b["image"].shape == (4, 24, 24, 3) and set(b["label"].tolist()) <= {0, 1}
  ev = list(input_pipeline.eval_iterator(config, 4))
  labels = np.concatenate([e["label"][e["mask"]] for e in ev])
  assert sorted(labels.tolist()) == [0, 0, 1, 1]


def test_image_folder_needs_a_data_dir():
  config = default.get_config()
  config.dataset = "image_folder"
  with pytest.raises(ValueError, match="data_dir"):
    input_pipeline.dataset_info(config)


def test_digits_split_is_fixed_and_disjoint():
  x_tr, y_tr, x_ev, y_ev = input_pipeline.load_digits_arrays()
  assert x_tr.shape[1:] == (8, 8, 1) and len(x_tr) + len(x_ev) == 1797
  assert abs(float(x_tr.mean())) < 1e-5
  rows = {r.tobytes() for r in x_tr}
  assert sum(r.tobytes() in rows for r in x_ev) < 5  # a handful of duplicate digits exist
  assert set(y_ev.tolist()) == set(range(10))


def _imagenet_r50(**overrides):
  config = imagenet_resnet50.get_config()
  for k, v in overrides.items():
    config[k] = v
  return config


def test_missing_imagenet_says_what_to_download_where_and_how_to_prepare(tmp_path, monkeypatch):
  """The headline config without prepared data: a DatasetNotFoundError naming the tars, where
  they go and the command that prepares them, raised before anything is compiled."""
  data_dir = tmp_path / "tfds"
  config = _imagenet_r50(data_dir=str(data_dir))
  monkeypatch.setattr(train, "create_train_state", lambda *a, **k: pytest.fail("compute ran"))
  with pytest.raises(input_pipeline.DatasetNotFoundError) as e:
    train.train_and_evaluate(config, None, quiet=True)
  assert isinstance(e.value, FileNotFoundError)
  message = str(e.value)
  manual = os.path.join(str(data_dir), "downloads", "manual")
  for part in ("image-net.org", "ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar", manual,
               "--config.manual_dir", "--config.dataset=synthetic",
               "--config.dataset=image_folder"):
    assert part in message, part
  # The preparation command is valid Python naming this data_dir and manual dir.
  command = re.search(r'python -c "(.*)"', message).group(1)
  compile(command, "<prepare>", "exec")
  assert f"data_dir={str(data_dir)!r}" in command and f"manual_dir={manual!r}" in command

  # A manual dir holding one of the two tars: the message names the one still missing.
  (tmp_path / "tars").mkdir()
  (tmp_path / "tars" / "ILSVRC2012_img_train.tar").write_bytes(b"")
  config = _imagenet_r50(data_dir=str(data_dir), manual_dir=str(tmp_path / "tars"))
  with pytest.raises(input_pipeline.DatasetNotFoundError, match="lacks ILSVRC2012_img_val.tar\\."):
    input_pipeline.dataset_info(config)


def test_imagenet_config_on_synthetic_data_gives_imagenet_shaped_batches():
  """--config.dataset=synthetic turns the ImageNet config into a smoke test on 224x224x3 images
  with 1000 classes (the documented command in docs/training.md); nothing is read from disk."""
  config = _imagenet_r50(dataset="synthetic")
  train.validate_config(config, 8)
  info = input_pipeline.dataset_info(config)
  assert (info.num_classes, info.image_shape) == (1000, (224, 224, 3))
  b = next(input_pipeline.train_iterator(config, 4))
  assert b["image"].shape == (4, 224, 224, 3) and b["image"].dtype == np.float32
  assert b["label"].dtype == np.int32 and 0 <= b["label"].min() and b["label"].max() < 1000
  assert b["mask"].all()
  ev = list(input_pipeline.eval_iterator(config, 4, process_index=1, process_count=2))
  assert ev and all(e["image"].shape == (4, 224, 224, 3) for e in ev)


def test_imagenet_config_trains_on_synthetic_data_with_a_small_model():
  """The ImageNet recipe (bf16, 4-bit QSGD, accumulation 2, 224x224, 1000 classes) end to end on
  synthetic batches, with a 4-filter ResNetMini standing in for ResNet50."""
  config = _imagenet_r50(dataset="synthetic", model="ResNetMini", num_filters=4, batch_size=8,
                         num_train_steps=1, measure_sync_steps=0, progress_bar=False)
  result = train.train_and_evaluate(config, None, quiet=True)
  assert result["steps"] == 1 and result["accum_steps"] == 2 and result["bits"] == 4
  assert np.isfinite(result["train_loss"]) and result["replicas_identical"]


# ---- models --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,blocks", [("ResNet18", 8), ("ResNet50", 16)])
def test_resnet_structure(name, blocks):
  model = models.create_model(name, num_classes=7, num_filters=8)
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 32, 32, 3)),
                                                train=False))
  block_names = [k for k in variables["params"] if "Block" in k]
  assert len(block_names) == blocks
  assert variables["params"]["Dense_0"]["kernel"].shape[-1] == 7


def test_unknown_model():
  with pytest.raises(ValueError, match="model must be one of"):
    models.create_model("ResNet9", num_classes=10)


# ---- configuration errors, before any compute ----------------------------------------------------

@pytest.mark.parametrize("field,value,match", [
    ("bits", 9, r"config\.bits must be .*got 9"),  # qcomm.sync's message, the field named
    ("batch_size", 12, r"config.batch_size must be divisible by the number of devices \(8\)"),
    ("bucket_size", 12, r"config\.bucket_size must be .*got 12"),
    ("dataset", "mnist", r"config.dataset must be one of"),
    ("accum_steps", 0, r"config\.accum_steps must be .*got 0"),
    ("scheme", "norm", r"config\.(bits|scheme) must be .*norm"),
])
def test_bad_config_fails_before_compute(field, value, match, monkeypatch):
  config = _tiny_digits()
  if field == "scheme":
    config.bits = 1
  config[field] = value
  # Nothing may be compiled or read: make both fail loudly if they happen.
  monkeypatch.setattr(train, "create_train_state", lambda *a, **k: pytest.fail("compute ran"))
  monkeypatch.setattr(input_pipeline, "dataset_info", lambda *a, **k: pytest.fail("data read"))
  with pytest.raises(ValueError, match=match):
    train.train_and_evaluate(config, None, quiet=True)


# ---- training ------------------------------------------------------------------------------------

def _final_checkpoint(workdir) -> tuple[int, object]:
  """(step, train state) of the latest checkpoint in ``workdir``, restored with the shardings it
  was saved with: whatever the state's layout, every leaf comes back as one global array."""
  import orbax.checkpoint as ocp

  with ocp.CheckpointManager(os.path.join(workdir, "checkpoints")) as mngr:
    step = mngr.latest_step()
    return step, mngr.restore(step, args=ocp.args.StandardRestore())


def _assert_same_tree(got, want) -> None:
  """Same structure and every leaf bit-identical (typed PRNG keys compared by their key data)."""
  got_paths = jax.tree_util.tree_flatten_with_path(got)[0]
  want_leaves, want_def = jax.tree_util.tree_flatten(want)
  assert jax.tree_util.tree_structure(got) == want_def
  for (path, a), b in zip(got_paths, want_leaves):
    a, b = (jax.random.key_data(v) if jax.dtypes.issubdtype(getattr(v, "dtype", None),
                                                            jax.dtypes.prng_key) else v
            for v in (a, b))
    a, b = np.asarray(a), np.asarray(b)
    name = jax.tree_util.keystr(path)
    assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.dtype, b.shape)
    assert a.tobytes() == b.tobytes(), f"{name} differs after resume"


@pytest.mark.parametrize("bits,error_feedback", [(32, False), (4, False), (4, True)],
                         ids=["exact", "4bit", "4bit-error-feedback"])
def test_checkpoint_resume_is_bit_identical(tmp_path, bits, error_feedback):
  """Stopped after optimizer step 2 of 4 and resumed from its orbax checkpoint, a run ends in the
  same train state as an uninterrupted one, bit for bit: parameters, batch statistics, optimizer
  state and the synchroniser's state (its PRNG key, accumulator, error-feedback residual)."""
  config = _tiny_digits(bits=bits, error_feedback=error_feedback, accum_steps=2,
                        num_train_steps=4, checkpoint_every_steps=0, keep_checkpoints=2)
  full = train.train_and_evaluate(config, str(tmp_path / "full"), quiet=True)
  part = train.train_and_evaluate(config, str(tmp_path / "cut"), quiet=True, stop_after=2)
  assert part["stopped"] and part["steps"] == 2
  resumed = train.train_and_evaluate(config, str(tmp_path / "cut"), quiet=True)
  assert resumed["steps"] == full["steps"] == 4
  full_step, full_state = _final_checkpoint(tmp_path / "full")
  cut_step, cut_state = _final_checkpoint(tmp_path / "cut")
  assert full_step == cut_step == 4 * 2  # checkpoints count accumulation calls
  _assert_same_tree(cut_state, full_state)
  assert resumed["params_checksum"] == full["params_checksum"]
  assert resumed["eval_accuracy"] == full["eval_accuracy"]
  assert full["replicas_identical"] and resumed["replicas_identical"]
  if bits == 4:  # the rest needs checking once only
    return
  lines = [json.loads(s) for s in open(tmp_path / "full" / "metrics.jsonl")]
  assert any(r["kind"] == "eval" for r in lines) and any(r["kind"] == "train" for r in lines)
  assert os.listdir(tmp_path / "full" / "tensorboard")


def test_digits_learns_quickly():
  # 30 optimizer steps of a 4-filter ResNet at 4 bits: far above chance (10%) on held-out digits.
  config = _tiny_digits(bits=4, num_train_steps=30, num_filters=8, measure_sync_steps=2,
                        learning_rate=1.6)  # peak 0.2 for the 32-example steps
  result = train.train_and_evaluate(config, None, quiet=True)
  assert result["eval_accuracy"] > 0.6, result
  assert result["step_time_sync"] > 0 and result["step_time_nosync"] > 0
  assert result["replicas_identical"]


def test_resnet50_train_step_compiles_and_runs_on_synthetic_data():
  config = default.get_config()
  config.dataset = "synthetic"
  config.image_size = 64  # 224 runs too (see docs/training.md); 64 keeps the suite fast
  config.num_classes = 10
  config.synthetic_examples = 64
  config.batch_size = 8
  config.num_train_steps = 1
  config.accum_steps = 1
  config.eval_every_steps = config.checkpoint_every_steps = config.measure_sync_steps = 0
  config.progress_bar = False
  result = train.train_and_evaluate(config, None, quiet=True)
  assert np.isfinite(result["train_loss"]) and result["replicas_identical"]


@pytest.mark.multiprocess
def test_two_processes_train_and_agree(tmp_path):
  cmd = [sys.executable, "-m", "jax_qcomm.tools.launch", "-n", "2", "--local-devices", "2",
         "--timeout", "600", "-m", "training.train", "--config", "configs/digits.py",
         "--config.num_cpu_devices=0", "--config.num_filters=4", "--config.batch_size=32",
         "--config.num_train_steps=4", "--config.eval_every_steps=0",
         "--config.measure_sync_steps=0", "--config.progress_bar=False",
         f"--workdir={tmp_path}"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("XLA_FLAGS", None)
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=700)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  results = {}
  for line in out.stdout.splitlines():
    m = re.match(r"\[(\d)\] (\{.*\})$", line)
    if m:
      results[int(m.group(1))] = json.loads(m.group(2))
  assert set(results) == {0, 1}, out.stdout[-3000:]
  assert results[0]["params_checksum"] == results[1]["params_checksum"]
  assert results[0]["replicas_identical"] and results[1]["replicas_identical"]
  assert results[0]["steps"] == 4 and np.isfinite(results[0]["train_loss"])
