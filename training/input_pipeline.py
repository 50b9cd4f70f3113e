"""Input pipelines: ImageNet (tfds ``imagenet2012``), any image folder (tfds ``ImageFolder``), the
embedded ``digits`` dataset (scikit-learn's 8x8 handwritten digits, shipped inside its wheel), and
synthetic data for throughput runs. ImageNet not yet prepared in the tfds data_dir is prepared from
the two ILSVRC2012 tars in the manual dir; without them, :class:`DatasetNotFoundError` says where
to get them, where to put them and how to prepare them, before the trainer compiles anything.

Every pipeline yields *per-process* batches of numpy arrays::

    {"image": float32[local_batch, H, W, C], "label": int32[local_batch], "mask": bool[local_batch]}

Each process reads its own share of the split (``process_index`` of ``process_count``); the trainer
assembles the global batch with ``jax.make_array_from_process_local_data``.

Training batches are reproducible from the step number alone: the stream is
``shuffle(seed, per epoch) -> repeat -> skip(start_step * local_batch)``, and every random augmentation is a
*stateless* TF op seeded by the element's position in that stream. Resuming at step ``s`` therefore
sees exactly the batches an uninterrupted run sees from step ``s`` on (the checkpoint test checks
bit-identical parameters). Skipping costs reading, not decoding, the skipped records.

Evaluation batches cover the split exactly once: every process runs the same number of batches
(collectives need all processes in step), padded with ``mask=False`` examples.

The ImageNet preprocessing (random-resized crop + flip for training, center crop for evaluation,
per-channel normalisation) follows flax's ``examples/imagenet/input_pipeline.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
from typing import Any, Iterator

from absl import logging
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

# The TF runtime is only an input pipeline here: keep it off the accelerators.
tf.config.set_visible_devices([], "GPU")

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
CROP_PADDING = 32
DATASETS = ("imagenet2012", "image_folder", "digits", "synthetic")


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What the trainer needs to know about a dataset before reading it."""
  num_classes: int
  image_shape: tuple[int, int, int]  # H, W, C after preprocessing
  train_examples: int
  eval_examples: int


# ---- ImageNet-style preprocessing (encoded JPEG/PNG bytes -> float32 image) ------------------------

def _decode_and_random_crop(image_bytes: tf.Tensor, image_size: int, seed: tf.Tensor) -> tf.Tensor:
  image = tf.cond(
      tf.io.is_jpeg(image_bytes),
      lambda: _jpeg_random_crop(image_bytes, seed),
      lambda: _generic_random_crop(image_bytes, seed))
  return tf.image.resize([image], [image_size, image_size], method="bicubic")[0]


def _sample_window(shape: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
  bbox = tf.constant([0.0, 0.0, 1.0, 1.0], dtype=tf.float32, shape=[1, 1, 4])
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
      shape, bounding_boxes=bbox, seed=seed, min_object_covered=0.1,
      aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10,
      use_image_if_no_bounding_boxes=True)
  offset_y, offset_x, _ = tf.unstack(begin)
  target_h, target_w, _ = tf.unstack(size)
  return tf.stack([offset_y, offset_x, target_h, target_w])


def _jpeg_random_crop(image_bytes: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
  # Decoding only the crop window is what makes ImageNet input fast enough (flax does the same).
  window = _sample_window(tf.image.extract_jpeg_shape(image_bytes), seed)
  return tf.image.decode_and_crop_jpeg(image_bytes, window, channels=3)


def _generic_random_crop(image_bytes: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
  image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
  window = _sample_window(tf.shape(image), seed)
  return tf.slice(image, [window[0], window[1], 0], [window[2], window[3], 3])


def _decode_and_center_crop(image_bytes: tf.Tensor, image_size: int) -> tf.Tensor:
  image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
  shape = tf.shape(image)
  h, w = shape[0], shape[1]
  crop = tf.cast(image_size / (image_size + CROP_PADDING) *
                 tf.cast(tf.minimum(h, w), tf.float32), tf.int32)
  offset_h, offset_w = (h - crop + 1) // 2, (w - crop + 1) // 2
  image = tf.slice(image, [offset_h, offset_w, 0], [crop, crop, 3])
  return tf.image.resize([image], [image_size, image_size], method="bicubic")[0]


def _normalize(image: tf.Tensor) -> tf.Tensor:
  image = tf.cast(image, tf.float32)
  return (image - tf.constant(IMAGENET_MEAN, shape=[1, 1, 3])) / tf.constant(
      IMAGENET_STD, shape=[1, 1, 3])


def preprocess_train(image_bytes: tf.Tensor, image_size: int, seed: tf.Tensor) -> tf.Tensor:
  """Encoded image -> float32[image_size, image_size, 3]: random-resized crop, flip, normalise."""
  crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
  image = _decode_and_random_crop(image_bytes, image_size, crop_seed)
  image = tf.image.stateless_random_flip_left_right(image, flip_seed)
  return _normalize(image)


def preprocess_eval(image_bytes: tf.Tensor, image_size: int) -> tf.Tensor:
  """Encoded image -> float32[image_size, image_size, 3]: resize + center crop, normalise."""
  return _normalize(_decode_and_center_crop(image_bytes, image_size))


# ---- sources ------------------------------------------------------------------------------------

def _check_process(process_index: int, process_count: int) -> None:
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index must be in 0..{process_count - 1}, got {process_index}")


IMAGENET_TARS = ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar")


class DatasetNotFoundError(FileNotFoundError):
  """The configured dataset is not on disk; the message says how to get it."""


def _imagenet_builder(config: Any):
  """tfds' ``imagenet2012`` builder, prepared: as it is, or from the tars in the manual dir (a
  one-time job of hours), else :class:`DatasetNotFoundError` saying what to download and where."""
  builder = tfds.builder("imagenet2012", data_dir=config.data_dir or None)
  if builder.is_prepared():
    return builder
  root = os.fspath(builder.data_dir_root)
  manual_dir = os.path.expanduser(config.manual_dir or os.path.join(root, "downloads", "manual"))
  missing = [t for t in IMAGENET_TARS if not os.path.isfile(os.path.join(manual_dir, t))]
  if not missing:
    if not _has_importlib_resources():
      raise ModuleNotFoundError("tensorflow_datasets prepares imagenet2012 through the package "
                                "importlib_resources, which is not installed: "
                                "pip install importlib_resources")
    logging.warning("Preparing imagenet2012 in %s from the tars in %s: a one-time job of a few "
                    "hours.", root, manual_dir)
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
    return builder
  raise DatasetNotFoundError(_imagenet_missing_message(root, manual_dir, missing))


def _has_importlib_resources() -> bool:
  # tfds (4.9.10) prepares through importlib_resources but declares it for Python < 3.9 only.
  return importlib.util.find_spec("importlib_resources") is not None


def _imagenet_missing_message(root: str, manual_dir: str, missing: list[str]) -> str:
  needs = "" if _has_importlib_resources() else "pip install importlib_resources && "
  prepare = (f"{needs}python -c \"import tensorflow_datasets as tfds; "
             "tfds.builder('imagenet2012', "
             f"data_dir={root!r}).download_and_prepare(download_config="
             f"tfds.download.DownloadConfig(manual_dir={manual_dir!r}))\"")
  return f"""\
ImageNet (tfds dataset 'imagenet2012') is not prepared in {root}
(the tfds data_dir: --config.data_dir, else $TFDS_DATA_DIR, else ~/tensorflow_datasets),
and the manual download folder {manual_dir} lacks {' and '.join(missing)}.
To prepare it, once:
  1. Register at https://image-net.org/download-images and download, from its ILSVRC2012 page,
     ILSVRC2012_img_train.tar (138 GiB) and ILSVRC2012_img_val.tar (6.3 GiB): a manual
     download, tfds cannot fetch them.
  2. Put both tars in {manual_dir}/
     (or in any folder, then name it with --config.manual_dir=...).
  3. Build the tfds dataset (a few hours; roughly as much disk again, in {root}):
       {prepare}
     or rerun the trainer with the tars in place: it prepares the data before compiling anything.
No ImageNet? --config.dataset=synthetic trains on random ImageNet-shaped batches (224x224x3,
1000 classes: a smoke test of this config), and --config.dataset=image_folder
--config.data_dir=DIR reads any DIR/<split>/<class>/<image> tree (docs/training.md)."""


def _tfds_builder(config: Any):
  if config.dataset == "imagenet2012":
    return _imagenet_builder(config)
  if config.dataset == "image_folder":
    if not config.data_dir:
      raise ValueError("config.data_dir must name the image folder (data_dir/<split>/<class>/*.jpg) "
                       "when config.dataset='image_folder'")
    return tfds.ImageFolder(config.data_dir)
  raise AssertionError(config.dataset)


@functools.lru_cache(maxsize=1)
def load_digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """scikit-learn's digits (1797 8x8 grey images, 10 classes): a stratified 80/20 split, fixed.

  Returns train images, train labels, eval images, eval labels; images float32[N, 8, 8, 1]
  normalised with the training set's mean and standard deviation. Loaded once per process (every
  evaluation asks again); the arrays are read-only.
  """
  # Here, not at the top: only the digits dataset needs scikit-learn (an import of ~1 s).
  from sklearn.datasets import load_digits  # noqa: PLC0415
  from sklearn.model_selection import train_test_split  # noqa: PLC0415

  digits = load_digits()
  x = digits.images.astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  x_tr, x_ev, y_tr, y_ev = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
  mean, std = x_tr.mean(), x_tr.std()
  arrays = ((x_tr - mean) / std, y_tr, (x_ev - mean) / std, y_ev)
  for a in arrays:
    a.setflags(write=False)
  return arrays


def dataset_info(config: Any) -> DatasetInfo:
  """Shapes and sizes of ``config.dataset``, without reading its examples."""
  if config.dataset not in DATASETS:
    raise ValueError(f"config.dataset must be one of {DATASETS}, got {config.dataset!r}")
  if config.dataset == "digits":
    x_tr, _, x_ev, _ = load_digits_arrays()
    return DatasetInfo(10, (8, 8, 1), len(x_tr), len(x_ev))
  if config.dataset == "synthetic":
    # Evaluation on random data means nothing: one global batch, as a smoke test of the eval step.
    return DatasetInfo(config.num_classes, (config.image_size, config.image_size, 3),
                       config.synthetic_examples, config.batch_size)
  builder = _tfds_builder(config)
  train_split, eval_split = config.train_split, config.eval_split
  return DatasetInfo(builder.info.features["label"].num_classes,
                     (config.image_size, config.image_size, 3),
                     _num_examples(builder, train_split), _num_examples(builder, eval_split))


def _num_examples(builder, split: str) -> int:
  """The split's size from the dataset's metadata, else (mock data, custom builders) by counting."""
  try:
    return int(builder.info.splits[split].num_examples)
  except KeyError:
    ds = builder.as_dataset(split=split, decoders={"image": tfds.decode.SkipDecoding()})
    n = int(ds.cardinality())
    return n if n >= 0 else int(ds.reduce(0, lambda count, _: count + 1))


def _records(config: Any, split: str, process_index: int, process_count: int,
             shuffle_seed: int | None = None) -> tf.data.Dataset:
  """(encoded image bytes, label) of this process's share of a tfds split; the file order is
  shuffled with ``shuffle_seed`` (deterministically) or kept."""
  builder = _tfds_builder(config)
  decoders = {"image": tfds.decode.SkipDecoding()}
  if config.dataset == "image_folder":
    # ImageFolder has no sub-splits: every process lists the folder and keeps every n-th image.
    ds = builder.as_dataset(split=split, shuffle_files=False, decoders=decoders)
    ds = ds.shard(process_count, process_index)
  else:
    # Each process reads only its own files (tfds.even_splits, as flax's example does).
    sub = tfds.even_splits(split, n=process_count, drop_remainder=False)[process_index]
    ds = builder.as_dataset(split=sub, shuffle_files=shuffle_seed is not None,
                            read_config=tfds.ReadConfig(shuffle_seed=shuffle_seed),
                            decoders=decoders)
  return ds.map(lambda ex: (ex["image"], tf.cast(ex["label"], tf.int32)))


def _arrays_share(x: np.ndarray, y: np.ndarray, process_index: int, process_count: int):
  return x[process_index::process_count], y[process_index::process_count]


def train_iterator(config: Any, local_batch: int, *, start_step: int = 0, process_index: int = 0,
                   process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
  """Endless per-process training batches from step ``start_step`` on (see the module doc)."""
  _check_process(process_index, process_count)
  seed = int(config.seed)
  if config.dataset == "synthetic":
    return _synthetic(config, local_batch, process_index)
  if config.dataset == "digits":
    x, y, _, _ = load_digits_arrays()
    x, y = _arrays_share(x, y, process_index, process_count)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    ds = ds.shuffle(len(x), seed=seed + process_index, reshuffle_each_iteration=True).repeat()
    ds = ds.skip(start_step * local_batch)
  else:
    ds = _records(config, config.train_split, process_index, process_count,
                  shuffle_seed=seed + process_index)
    ds = ds.shuffle(config.shuffle_buffer, seed=seed + process_index,
                    reshuffle_each_iteration=True).repeat()
    ds = ds.skip(start_step * local_batch)
    size = config.image_size
    ds = ds.enumerate(start=start_step * local_batch).map(
        lambda i, ex: (preprocess_train(ex[0], size, tf.stack([tf.cast(seed, tf.int64), i])),
                       ex[1]),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  ds = ds.map(lambda image, label: {"image": image, "label": label,
                                    "mask": tf.ones([], tf.bool)})
  ds = ds.batch(local_batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
  return iter(tfds.as_numpy(ds))


def eval_steps(num_examples: int, local_batch: int, process_count: int) -> int:
  """Batches each process runs to cover a split of ``num_examples`` exactly once."""
  return max(1, math.ceil(math.ceil(num_examples / process_count) / local_batch))


def eval_iterator(config: Any, local_batch: int, *, process_index: int = 0,
                  process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
  """One pass over the evaluation split, padded with ``mask=False`` examples (see module doc)."""
  _check_process(process_index, process_count)
  info = dataset_info(config)
  steps = eval_steps(info.eval_examples, local_batch, process_count)
  if config.dataset == "synthetic":
    it = _synthetic(config, local_batch, process_index)
    return (next(it) for _ in range(steps))
  if config.dataset == "digits":
    _, _, x, y = load_digits_arrays()
    x, y = _arrays_share(x, y, process_index, process_count)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    blank = (np.zeros(x.shape[1:], np.float32), np.int32(0))
  else:
    size = config.image_size
    ds = _records(config, config.eval_split, process_index, process_count).map(
        lambda image, label: (preprocess_eval(image, size), label),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    blank = (np.zeros((size, size, 3), np.float32), np.int32(0))
  ds = ds.map(lambda image, label: {"image": image, "label": label, "mask": tf.ones([], tf.bool)})
  pad = tf.data.Dataset.from_tensors(
      {"image": blank[0], "label": blank[1], "mask": np.bool_(False)}).repeat()
  ds = ds.concatenate(pad).take(steps * local_batch).batch(local_batch)
  return iter(tfds.as_numpy(ds.prefetch(tf.data.AUTOTUNE)))


def _synthetic(config: Any, local_batch: int, process_index: int) -> Iterator[dict[str, np.ndarray]]:
  """The same random batch forever: measures the model and the collectives, not the input."""
  rng = np.random.default_rng(int(config.seed) + process_index)
  batch = {"image": rng.standard_normal((local_batch, config.image_size, config.image_size, 3),
                                        dtype=np.float32),
           "label": rng.integers(0, config.num_classes, local_batch, dtype=np.int32),
           "mask": np.ones(local_batch, bool)}
  while True:
    yield batch
