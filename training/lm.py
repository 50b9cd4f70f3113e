"""A byte-level decoder-only transformer language model, trained data-parallel with ``qcomm.sync``.

    python -m training.lm --config=configs/lm_bytes.py --config.bits=4 [--workdir runs/lm/q4]

The second example trainer (the first, ``training/train.py``, is the ResNet one); it answers "what
does gradient compression do to my loss?" in nats per byte on held-out text
(``scripts/lm_study.py`` runs the study, ``docs/accuracy.md`` reports it).

**Data.** The CPython standard library's ``.py`` sources of the running interpreter: on every
machine, no download. A fixed list of files that exist in both Python 3.12 and 3.13
(``TRAIN_FILES``, ``VAL_FILES``), read in that order and joined with a NUL byte (absent from the
sources) as the file separator; the validation split is held out *by file*. The file contents differ
slightly between Python versions, so the output records the Python version and a SHA-256 of the
corpus. The corpus is ~3 MB, so it is read into memory and sliced with numpy: no tf.data / grain
pipeline is needed, and a training batch is a pure function of ``(seed, micro-step)`` (random window
offsets from ``np.random.default_rng((seed, call))``), which makes resuming exact without any
iterator state. Validation uses ``num_val_windows`` fixed windows evenly spaced over the held-out
split, the same for every run and seed.

**Model.** Pre-LayerNorm transformer blocks (causal multi-head attention, GELU MLP), learned
positions, output layer tied to the byte embedding; Flax NNX, split once into a graph definition and
a plain dict of parameters (``nnx.split`` / ``nnx.merge``) so that the train step is a pure function
of a params pytree.

**Parallelism.** The train step is ``qcomm.data_parallel(loss_fn, tx, mesh)``, the library's
short path: ``jax.shard_map`` over a one-axis ``data`` mesh, each device taking the gradient of its
own windows w.r.t. a varying copy of the parameters (so that autodiff does not psum it,
uncompressed); ``qcomm.sync`` averages the gradients (exact, bf16 or QSGD, every ``accum_steps``
micro-steps) and runs AdamW (warmup + cosine) on the average. ``dp.step`` and the micro-step
counter's increment are jitted together, the state donated. The evaluation step is a plain
``jax.shard_map`` (a sum of per-byte losses over the mesh; nothing to differentiate).

**Resume.** With ``--workdir``, orbax checkpoints (state + the val-loss curve so far) every
``checkpoint_every_steps`` optimizer steps, at the end and when ``time_limit_minutes`` runs out; a
restarted command resumes from the latest one and ends bit-identical to an uninterrupted run.

The last line printed is one JSON object (``bits``, ``accum_steps``, ``error_feedback``, ``steps``,
``val_loss`` in nats per byte, ``wall_s``, the val-loss curve, corpus hash, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import sys
import sysconfig
import time
from typing import Any, Callable

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flax import nnx
from absl import app, flags
import flax
import ml_collections
from ml_collections import config_flags
import optax
from tqdm import tqdm

import jax_qcomm as qcomm
from training.replicas import params_checksum, replicas_identical
from jax_qcomm.transforms.sync import config_of
from training.sync_config import check_sync_fields, create_sync

AXIS = "data"
MODEL_AXIS = "model"
VOCAB = 256
SEPARATOR = 0  # NUL: joins the files; no source file contains it

# Modules present in both 3.12 and 3.13 (checked: tests/test_lm.py); order is part of the corpus.
TRAIN_FILES = tuple(f"{m}.py" for m in (
    "argparse ast base64 bdb calendar codecs configparser contextlib csv dataclasses difflib dis "
    "enum fractions ftplib functools gettext gzip heapq imaplib inspect ipaddress locale mailbox "
    "optparse os pickle pprint random shutil smtplib socket statistics subprocess tarfile tempfile "
    "textwrap threading tokenize traceback typing weakref _pydecimal _pyio pydoc doctest").split())
VAL_FILES = tuple(f"{m}.py" for m in
                  "uuid pstats trace plistlib ntpath posixpath selectors socketserver".split())


# ---- corpus --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Corpus:
  """The train and held-out byte streams (read-only uint8 arrays) and their provenance."""
  train: np.ndarray
  val: np.ndarray
  sha256: str          # of the train stream, a NUL, then the val stream
  python: str          # e.g. "3.13.0"
  stdlib_dir: str


def _join_files(folder: str, names: tuple[str, ...]) -> bytes:
  missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
  if missing:
    raise FileNotFoundError(
        f"the LM corpus needs these standard-library sources, missing from {folder}: "
        f"{', '.join(missing)} (set config.stdlib_dir to a CPython 3.12/3.13 Lib folder)")
  parts = []
  for name in names:
    with open(os.path.join(folder, name), "rb") as f:
      parts.append(f.read())
  return bytes([SEPARATOR]).join(parts)


@functools.lru_cache(maxsize=4)
def load_corpus(stdlib_dir: str = "") -> Corpus:
  """Reads the fixed file lists from ``stdlib_dir`` (default: the running interpreter's)."""
  folder = stdlib_dir or sysconfig.get_paths()["stdlib"]
  train = np.frombuffer(_join_files(folder, TRAIN_FILES), np.uint8)
  val = np.frombuffer(_join_files(folder, VAL_FILES), np.uint8)
  digest = hashlib.sha256(train.tobytes() + bytes([SEPARATOR]) + val.tobytes()).hexdigest()
  return Corpus(train=train, val=val, sha256=digest, python=sys.version.split()[0],
                stdlib_dir=folder)


def unigram_entropy(data: np.ndarray) -> float:
  """Entropy in nats of the byte distribution of ``data``: the loss of the best model that ignores
  context (fitted to ``data`` itself, so a lower bound for any unigram model on it)."""
  counts = np.bincount(data, minlength=VOCAB).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


def train_windows(data: np.ndarray, seed: int, call: int, batch: int, seq_len: int) -> np.ndarray:
  """The global batch of micro-step ``call``: int32[batch, seq_len + 1] windows at offsets drawn
  from ``(seed, call)`` alone (so a resumed run sees the same batches)."""
  rng = np.random.default_rng((seed, call))
  offsets = rng.integers(0, len(data) - seq_len, size=batch)
  return data[offsets[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def val_windows(data: np.ndarray, num: int, seq_len: int) -> np.ndarray:
  """``num`` fixed windows int32[num, seq_len + 1], evenly spaced over ``data``."""
  if len(data) < seq_len + 1:
    raise ValueError(f"the validation split ({len(data)} bytes) is shorter than one window")
  offsets = np.linspace(0, len(data) - seq_len - 1, num).astype(np.int64)
  return data[offsets[:, None] + np.arange(seq_len + 1)].astype(np.int32)


# ---- model ---------------------------------------------------------------------------------------

class CausalSelfAttention(nnx.Module):
  """Multi-head self-attention with a causal mask (one fused q/k/v projection)."""

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.qkv = nnx.Linear(d_model, 3 * d_model, rngs=rngs)
    self.out = nnx.Linear(d_model, d_model, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * self.num_heads, d // self.num_heads), 3,
                        axis=2)
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return self.out(y.reshape(b, t, d))


class Block(nnx.Module):
  """x + attn(LN(x)), then x + MLP(LN(x))."""

  def __init__(self, d_model: int, num_heads: int, mlp_ratio: int, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = CausalSelfAttention(d_model, num_heads, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.fc = nnx.Linear(d_model, mlp_ratio * d_model, rngs=rngs)
    self.proj = nnx.Linear(mlp_ratio * d_model, d_model, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln1(x))
    return x + self.proj(jax.nn.gelu(self.fc(self.ln2(x))))


class TransformerLM(nnx.Module):
  """Bytes int[B, T] -> next-byte logits float32[B, T, 256]."""

  def __init__(self, *, d_model: int, num_layers: int, num_heads: int, mlp_ratio: int,
               seq_len: int, rngs: nnx.Rngs):
    self.num_layers = num_layers
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Embed(VOCAB, d_model, embedding_init=init, rngs=rngs)
    self.pos = nnx.Embed(seq_len, d_model, embedding_init=init, rngs=rngs)
    # Blocks as named attributes (not a list): the params dict then has string keys only
    # ('block0/attn/qkv/kernel'), which orbax and the leaf policy's path regexes handle plainly.
    for i in range(num_layers):
      setattr(self, f"block{i}", Block(d_model, num_heads, mlp_ratio, rngs=rngs))
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))
    for i in range(self.num_layers):
      x = getattr(self, f"block{i}")(x)
    return self.embed.attend(self.ln_f(x))


def create_model(config: ml_collections.ConfigDict, rngs: nnx.Rngs) -> TransformerLM:
  return TransformerLM(d_model=config.d_model, num_layers=config.num_layers,
                       num_heads=config.num_heads, mlp_ratio=config.mlp_ratio,
                       seq_len=config.seq_len, rngs=rngs)


def window_loss(graphdef: nnx.GraphDef, params: Any, windows: jax.Array) -> jax.Array:
  """Per-byte negative log-likelihood in nats, float32[B, T], of windows int[B, T + 1]."""
  logits = nnx.merge(graphdef, params)(windows[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                         windows[:, 1:])


# ---- sharded parameters (ZeRO-3) ----------------------------------------------------------------
# With config.shard_params the blocks' parameters are stacked along a leading layer axis ("blocks")
# and kept as 1/D shards ([L, D, m]); the loss gathers the embeddings and the final LayerNorm once,
# and each block's parameters inside lax.scan, under remat (gathered again in backward).

def stack_blocks(params: dict, num_layers: int) -> dict:
  """The model's params dict with ``block0 .. block{L-1}`` stacked into ``blocks`` ``[L, ...]``."""
  rest = {k: v for k, v in params.items() if not re.fullmatch(r"block\d+", k)}
  blocks = [params[f"block{i}"] for i in range(num_layers)]
  return {**rest, "blocks": jax.tree_util.tree_map(lambda *a: jnp.stack(a), *blocks)}


def unstack_blocks(params: dict, num_layers: int) -> dict:
  """:func:`stack_blocks` undone: the model's own params dict."""
  rest = {k: v for k, v in params.items() if k != "blocks"}
  return {**rest, **{f"block{i}": jax.tree_util.tree_map(lambda a, i=i: a[i], params["blocks"])
                     for i in range(num_layers)}}


def shard_layers(params: dict) -> dict:
  """``qcomm.shard_params``' ``layers``: one stacked layer axis for the blocks, none elsewhere."""
  return {k: int(k == "blocks") for k in params}


@dataclasses.dataclass(frozen=True)
class Parts:
  """The graph definitions of the modules the sharded loss merges with gathered parameters."""
  embed: nnx.GraphDef
  pos: nnx.GraphDef
  ln_f: nnx.GraphDef
  block: nnx.GraphDef


def model_parts(model: TransformerLM) -> Parts:
  return Parts(*(nnx.split(m)[0] for m in (model.embed, model.pos, model.ln_f, model.block0)))


def sharded_window_loss(parts: Parts, shards: dict, windows: jax.Array) -> jax.Array:
  """:func:`window_loss` of the sharded parameters, inside the runner's step: each block's full
  parameters exist only while it runs (``lax.scan`` + ``jax.checkpoint``)."""
  top = qcomm.gather_params({k: shards[k] for k in ("embed", "pos", "ln_f")})
  tokens = windows[:, :-1]
  embed = nnx.merge(parts.embed, top["embed"])
  x = embed(tokens) + nnx.merge(parts.pos, top["pos"])(jnp.arange(tokens.shape[1]))

  def block(x, layer):
    shard, i = layer  # i: the layer's own rounding key (the scan's body is traced once)
    return nnx.merge(parts.block, qcomm.gather_params(shard, index=i))(x), None

  # hpz_remat_policy keeps hpZ's secondary shards (a sync with hpz=True); otherwise it saves nothing.
  layers = jax.tree_util.tree_leaves(shards["blocks"])[0].shape[0]
  x, _ = lax.scan(jax.checkpoint(block, policy=qcomm.hpz_remat_policy), x,
                  (shards["blocks"], jnp.arange(layers)))
  logits = embed.attend(nnx.merge(parts.ln_f, top["ln_f"])(x))
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                         windows[:, 1:])


# ---- configuration -------------------------------------------------------------------------------

def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the field for every bad value, before any compute (the
  synchronisation settings are checked by ``qcomm.sync`` itself: :func:`check_sync_fields`)."""
  def bad(field: str, allowed: str) -> None:
    raise ValueError(f"config.{field} must be {allowed}, got {config[field]!r}")

  def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)

  for field, low in (("d_model", 8), ("num_layers", 1), ("num_heads", 1), ("mlp_ratio", 1),
                     ("seq_len", 2), ("batch_size", 1), ("num_val_windows", 1), ("num_steps", 1),
                     ("warmup_steps", 0), ("eval_every_steps", 0), ("log_every_steps", 1),
                     ("checkpoint_every_steps", 0), ("keep_checkpoints", 1), ("num_devices", 1)):
    if not is_int(config[field]) or config[field] < low:
      bad(field, f"an integer >= {low}")
  check_sync_fields(config)
  if config.d_model % config.num_heads:
    bad("num_heads", f"a divisor of d_model ({config.d_model})")
  if config.batch_size % config.num_devices:
    bad("batch_size", f"divisible by num_devices ({config.num_devices})")
  if config.num_val_windows % config.num_devices:
    bad("num_val_windows", f"divisible by num_devices ({config.num_devices})")
  if config.warmup_steps >= config.num_steps:
    bad("warmup_steps", f"smaller than num_steps ({config.num_steps})")
  m = config.model_devices
  if not is_int(m) or m < 1 or config.num_devices % m:
    bad("model_devices", f"a positive divisor of num_devices ({config.num_devices})")
  if config.d_model % m:
    bad("model_devices", f"a divisor of d_model ({config.d_model}): the weights split over it")
  if config.shard_params and m > 1:
    bad("model_devices", "1 with shard_params=True (its shards split the data axis)")
  for field in ("learning_rate", "weight_decay", "grad_clip", "time_limit_minutes", "powersgd"):
    if not config[field] >= 0:
      bad(field, ">= 0")
  for field in ("b1", "b2", "end_lr_ratio"):
    if not 0 <= config[field] < 1 + (field == "end_lr_ratio"):
      bad(field, "in [0, 1)" if field != "end_lr_ratio" else "in [0, 1]")


# Fields that do not change what a run computes: they may differ between a run and its resumption.
RUNTIME_FIELDS = ("eval_every_steps", "log_every_steps", "checkpoint_every_steps",
                  "keep_checkpoints", "progress_bar", "time_limit_minutes")


def run_settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The config fields that determine a run's result (all but ``RUNTIME_FIELDS``)."""
  settings = {k: v for k, v in config.to_dict().items() if k not in RUNTIME_FIELDS}
  if not settings.get("shard_state"):  # replicated runs keep the settings they were recorded with
    settings.pop("shard_state", None)
    settings.pop("gather_bits", None)
  if not settings.get("powersgd"):
    settings.pop("powersgd", None)
  if not settings.get("shard_params"):
    settings.pop("shard_params", None)
    settings.pop("param_gather_bits", None)
  if settings.get("model_devices", 1) == 1:  # runs recorded before the model axis existed
    settings.pop("model_devices", None)
  return settings


def check_resumable(saved: dict[str, Any], config: ml_collections.ConfigDict, where: str) -> None:
  """ValueError naming the fields whose values differ from those the checkpoint was written with
  (resuming would silently mix two runs)."""
  now = json.loads(json.dumps(run_settings(config)))  # tuples -> lists, as the JSON stored them
  diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
  if diff:
    raise ValueError(
        f"the checkpoint in {where} was written by a different run: "
        + ", ".join(f"config.{k} was {saved.get(k)!r}, now {now.get(k)!r}" for k in diff)
        + " (use another --workdir, or delete that one to start over)")


def setup_devices(config: ml_collections.ConfigDict) -> None:
  """Splits the host CPU into ``num_devices`` devices; must run before JAX starts a backend (unless
  the count is already set, e.g. by ``JAX_NUM_CPU_DEVICES``)."""
  if jax.config.jax_num_cpu_devices != config.num_devices:
    jax.config.update("jax_num_cpu_devices", config.num_devices)


def create_mesh(num_devices: int, model_devices: int = 1) -> Mesh:
  """The devices as a mesh: ``("data",)``, or ``("data", "model")`` with ``model_devices`` > 1
  (the weights sharded over "model" inside each data replica: :func:`param_partition`)."""
  devices = jax.devices()
  if len(devices) < num_devices:
    raise ValueError(
        f"config.num_devices must be at most the {len(devices)} available "
        f"{devices[0].platform} devices, got {num_devices} (on CPU the count is fixed when JAX "
        "starts: python -m training.lm sets it from config.num_devices)")
  if model_devices == 1:
    return Mesh(np.array(devices[:num_devices]), (AXIS,))
  return Mesh(np.array(devices[:num_devices]).reshape(num_devices // model_devices,
                                                       model_devices), (AXIS, MODEL_AXIS))


def param_partition(params: Any, mesh: Mesh) -> Any:
  """Megatron-style tensor parallelism over the mesh's "model" axis (replicated without one): the
  q/k/v projection and the MLP's first layer split by output columns (and their biases), the
  attention's output projection and the MLP's second layer by input rows, the embeddings by
  feature; LayerNorms and the other biases replicated."""
  if MODEL_AXIS not in mesh.axis_names:
    return jax.tree_util.tree_map(lambda _: P(), params)

  def spec(path, _):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    if re.search(r"(qkv|fc)/kernel$", name):
      return P(None, MODEL_AXIS)
    if re.search(r"(qkv|fc)/bias$", name):
      return P(MODEL_AXIS)
    if re.search(r"(attn/out|proj)/kernel$", name):
      return P(MODEL_AXIS, None)
    if re.search(r"(embed|pos)/embedding$", name):
      return P(None, MODEL_AXIS)
    return P()

  return jax.tree_util.tree_map_with_path(spec, params)


# ---- optimizer, wire bytes -----------------------------------------------------------------------

def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, config.warmup_steps, config.num_steps,
      end_value=config.learning_rate * config.end_lr_ratio)


def _matrix_mask(params: Any) -> Any:
  """Weight decay on matrices (kernels, embeddings), not on biases nor LayerNorm parameters (of
  sharded parameters: by the full parameter's shape)."""
  def matrix(p):
    if isinstance(p, qcomm.ParamShard):
      return qcomm.ParamShard(len(p.shape) >= 2, p.shape, p.dtype)
    return p.ndim >= 2
  return jax.tree_util.tree_map(matrix, params, is_leaf=lambda p: isinstance(p, qcomm.ParamShard))


def local_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """clip -> AdamW with the warmup + cosine schedule: what runs after the synchronisation."""
  return optax.chain(  # qcomm's clip: the whole model's norm also with sharded state
      qcomm.clip_by_global_norm(config.grad_clip) if config.grad_clip else optax.identity(),
      optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2,
                  weight_decay=config.weight_decay, mask=_matrix_mask))


def create_optimizer(config: ml_collections.ConfigDict,
                     axis_name: Any = AXIS) -> optax.GradientTransformation:
  """``qcomm.sync(clip -> AdamW)``: clipping and decay act on the synchronised gradient."""
  return create_sync(config, local_optimizer(config), axis_name)


def peak_bytes_per_device(train_step: Callable, state: TrainState, windows: jax.Array) -> int:
  """The compiled train step's memory on one device (``memory_analysis()``: arguments, outputs
  and temporaries, less the donated buffers the outputs reuse)."""
  m = train_step.lower(state, windows).compile().memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)


def wire_bytes(params: Any, config: ml_collections.ConfigDict) -> dict[str, int]:
  """Bytes of one encoded copy of the gradient, per leaf codec as ``qcomm.sync`` chooses it
  (``qcomm.describe`` of the run's optimizer).

  Every optimizer step each device encodes its gradient into this many payload bytes (the
  scatter-reduce-allgather sends 2 (D-1)/D of it per device, whatever the codec). Returns
  ``wire_bytes`` (that payload), ``fp32_bytes`` (the same gradient as float32) and
  ``compressed_elements`` (elements travelling through the lossy codec), and
  ``sent_bytes_per_step``: what each device sends per optimizer step (``describe``, equal to the
  compiled step's collectives; with ``shard_params`` the blocks' gathers, again in backward, and
  the gradients' reduce-scatters).
  """
  regather = {k: k == "blocks" for k in params} if config.get("shard_params") else True
  described = qcomm.describe(create_optimizer(config), params, devices=config.num_devices,
                             regather=regather)
  return {"wire_bytes": described.payload_bytes, "fp32_bytes": described.fp32_bytes,
          "compressed_elements": sum(leaf.elements for leaf in described.leaves
                                     if leaf.codec.lossy),
          "sent_bytes_per_step": described.sent_bytes_per_sync}


# ---- state and steps -----------------------------------------------------------------------------

@flax.struct.dataclass
class TrainState:
  """Everything a resumed run needs. ``step`` counts micro-steps (train-step calls)."""
  step: jax.Array
  params: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class Programs:
  """What one run's settings compile to: the model's graph definition, the optimizer, the
  ``qcomm.data_parallel`` train step and the jitted functions."""
  graphdef: nnx.GraphDef
  tx: optax.GradientTransformation
  dp: qcomm.DataParallel
  init: Callable[[], TrainState]          # the initial state (params from config.seed)
  train_step: Callable                    # (state, windows) -> (state, loss)
  eval_step: Callable                     # (params, windows) -> summed nats
  full_params: Callable = lambda params: params  # the state's params -> the model's params dict


def build_programs(config: ml_collections.ConfigDict, mesh: Mesh) -> Programs:
  """The model, optimizer and jitted steps of ``config`` on ``mesh`` (nothing runs yet)."""
  tx = create_optimizer(config)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: create_model(config, nnx.Rngs(0))))
  replicated = NamedSharding(mesh, P())
  make_params = lambda: nnx.state(create_model(config, nnx.Rngs(config.seed))).to_pure_dict()  # noqa: E731
  placed = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s),
                                  param_partition(jax.eval_shape(make_params), mesh),
                                  is_leaf=lambda s: isinstance(s, P))
  # One compiled program, rather than one small one per eager op of the initialisers.
  init_params = jax.jit(make_params, out_shardings=placed)
  if config.get("shard_params", False):
    return _sharded_programs(config, mesh, tx, graphdef, make_params)
  dp = create_data_parallel(graphdef, tx, mesh)

  def init() -> TrainState:
    params = init_params()
    return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), replicated), params=params,
                      opt_state=dp.init(params))

  return Programs(graphdef, tx, dp, init, make_train_step(dp), make_eval_step(graphdef, mesh))


def _sharded_programs(config: ml_collections.ConfigDict, mesh: Mesh, tx, graphdef,
                      make_params: Callable) -> Programs:
  """:func:`build_programs` with ``config.shard_params``: the state's params are the shards."""
  parts = model_parts(nnx.eval_shape(lambda: create_model(config, nnx.Rngs(0))))
  n = config.num_layers
  dp = qcomm.data_parallel(
      lambda shards, windows: jnp.mean(sharded_window_loss(parts, shards, windows)), tx, mesh,
      axis_name=AXIS)

  def make_shards():
    stacked = stack_blocks(make_params(), n)
    return qcomm.shard_params(stacked, config.num_devices, layers=shard_layers(stacked))

  specs = qcomm.shard_specs(jax.eval_shape(make_shards), AXIS)
  # Each device computes its own shards: the full parameters never live on one device.
  init_shards = jax.jit(make_shards, out_shardings=jax.tree_util.tree_map(
      lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)))
  replicated = NamedSharding(mesh, P())

  def init() -> TrainState:
    shards = init_shards()
    return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), replicated), params=shards,
                      opt_state=dp.init(shards))

  return Programs(graphdef, tx, dp, init, make_train_step(dp), make_eval_step(graphdef, mesh),
                  full_params=lambda shards: unstack_blocks(dp.unshard(shards), n))


@functools.lru_cache(maxsize=4)
def _cached_programs(settings: str, num_devices: int) -> Programs:
  config = ml_collections.ConfigDict(json.loads(settings))
  return build_programs(config, create_mesh(num_devices, config.get("model_devices", 1)))


def programs_for(config: ml_collections.ConfigDict) -> Programs:
  """``build_programs``, shared by the runs of one process with the same settings (a resumed or
  repeated run in the same process, as in the tests, compiles nothing again)."""
  return _cached_programs(json.dumps(run_settings(config), sort_keys=True), config.num_devices)


def create_data_parallel(graphdef: nnx.GraphDef, tx, mesh: Mesh) -> qcomm.DataParallel:
  """``qcomm.data_parallel`` of the mean per-byte loss of a device's windows."""
  def loss_fn(params, windows):
    return jnp.mean(window_loss(graphdef, params, windows))

  return qcomm.data_parallel(loss_fn, tx, mesh, axis_name=AXIS)


def make_train_step(dp: qcomm.DataParallel) -> Callable:
  """jit of (state, windows[B, T+1]) -> (state, mean train loss): one ``dp.step`` and the
  micro-step counter's increment, in one program (one dispatch per call); the state is donated."""
  def train_step(state: TrainState, windows):
    params, opt_state, loss, _ = dp.step(state.params, state.opt_state, windows)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), loss

  return jax.jit(train_step, donate_argnums=0)


def make_eval_step(graphdef: nnx.GraphDef, mesh: Mesh, axis: Any = AXIS) -> Callable:
  """(params, windows) -> summed nats over every byte of the global windows (split over ``axis``:
  a mesh axis name or a tuple of them). A plain ``jax.shard_map``: ``qcomm.data_parallel`` is a
  train step (it differentiates ``loss_fn`` and applies the optimizer); evaluation only sums
  losses over the mesh."""
  def step(params, windows):
    return lax.psum(jnp.sum(window_loss(graphdef, params, windows)), axis)

  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(axis)), out_specs=P()))


def _global(mesh: Mesh, windows: np.ndarray) -> jax.Array:
  """The global [B, T+1] batch from this process's share of rows (every process builds the same
  global batch; each hands over its contiguous slice)."""
  n, i = jax.process_count(), jax.process_index()
  rows = len(windows) // n
  return jax.make_array_from_process_local_data(NamedSharding(mesh, P(AXIS)),
                                                windows[i * rows:(i + 1) * rows])


# ---- checkpoints ---------------------------------------------------------------------------------

class Checkpoints:
  """Orbax checkpoints of (TrainState, metadata JSON) under ``workdir/checkpoints``, keyed by the
  optimizer step; the metadata carries the val-loss curve and the seconds trained so far."""

  def __init__(self, workdir: str, keep: int):
    import orbax.checkpoint as ocp  # noqa: PLC0415  (only runs with a workdir import it)
    self.ocp = ocp
    self.mngr = ocp.CheckpointManager(
        os.path.abspath(os.path.join(workdir, "checkpoints")), item_names=("state", "meta"),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest(self) -> int | None:
    return self.mngr.latest_step()

  def save(self, step: int, state: TrainState, meta: dict[str, Any]) -> None:
    if self.mngr.latest_step() != step:
      self.mngr.save(step, args=self.ocp.args.Composite(
          state=self.ocp.args.StandardSave(state), meta=self.ocp.args.JsonSave(meta)))
    self.mngr.wait_until_finished()

  def meta(self) -> dict[str, Any]:
    """The latest checkpoint's metadata (read first: it says whether the state fits this run)."""
    out = self.mngr.restore(self.mngr.latest_step(),
                            args=self.ocp.args.Composite(meta=self.ocp.args.JsonRestore()))
    return dict(out.meta)

  def restore(self, state: TrainState) -> TrainState:
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    out = self.mngr.restore(self.mngr.latest_step(), args=self.ocp.args.Composite(
        state=self.ocp.args.StandardRestore(abstract)))
    return out.state

  def close(self) -> None:
    self.mngr.wait_until_finished()
    self.mngr.close()


class _Log:
  """TensorBoard + metrics.jsonl (training.train.MetricsLog) with a workdir, else stdout only."""

  def __init__(self, workdir: str | None, quiet: bool):
    self.quiet = quiet
    self.inner = None
    if workdir:
      # training.train imports TensorFlow (~10 s): only runs that write TensorBoard logs pay it.
      from training.train import MetricsLog  # noqa: PLC0415
      self.inner = MetricsLog(workdir, quiet=quiet)

  def write(self, step: int, kind: str, values: dict[str, float], echo=print) -> None:
    if self.inner is not None:
      self.inner.write(step, kind, values, echo)
    elif not self.quiet:
      echo(f"[{kind}] step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items()))

  def close(self) -> None:
    if self.inner is not None:
      self.inner.close()


# ---- loop ----------------------------------------------------------------------------------------

def _progress_bar(config, start: int, quiet: bool):
  if quiet or not config.progress_bar or jax.process_index() != 0:
    return None
  # disable=None: no bar when stderr is not a terminal (logs, CI), where it would be noise.
  return tqdm(total=config.num_steps, initial=start, unit="step", dynamic_ncols=True,
              disable=None, file=sys.stderr)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | None = None, *,
                       quiet: bool = False, stop_after: int | None = None) -> dict[str, Any]:
  """Trains per ``config`` (resuming from ``workdir``'s latest checkpoint), returns the result.

  ``stop_after`` ends the run after that optimizer step as a preemption would (checkpoint first);
  so does ``config.time_limit_minutes``. A stopped run's result has ``stopped: True`` and no
  ``val_loss``.
  """
  t_wall = time.perf_counter()
  validate_config(config)
  corpus = load_corpus(config.stdlib_dir)
  mesh = create_mesh(config.num_devices, config.model_devices)
  k = config.accum_steps
  error_feedback = config_of(create_optimizer(config)).error_feedback  # in effect, not as asked
  val = _global(mesh, val_windows(corpus.val, config.num_val_windows, config.seq_len))
  val_bytes = config.num_val_windows * config.seq_len

  def evaluate(params) -> float:
    return float(eval_step(programs.full_params(params), val)) / val_bytes

  ckpt = Checkpoints(workdir, config.keep_checkpoints) if workdir else None
  meta: dict[str, Any] = {"curve": [], "train_seconds": 0.0, "wall_seconds": 0.0,
                          "config": run_settings(config)}
  resume = ckpt is not None and ckpt.latest() is not None
  if resume:
    meta = ckpt.meta()
    check_resumable(meta["config"], config, workdir)
  programs = programs_for(config)
  state, train_step, eval_step = programs.init(), programs.train_step, programs.eval_step
  if resume:
    state = ckpt.restore(state)
  start = int(jax.device_get(state.step)) // k
  log = _Log(workdir, quiet)
  is_shard = lambda x: isinstance(x, qcomm.ParamShard)  # noqa: E731
  n_params = sum(math.prod(x.data.shape[:-2]) * x.size if is_shard(x) else x.size
                 for x in jax.tree_util.tree_leaves(state.params, is_leaf=is_shard))
  peak = peak_bytes_per_device(train_step, state, _global(mesh, train_windows(
      corpus.train, config.seed, 0, config.batch_size, config.seq_len)))
  if not quiet and jax.process_index() == 0:
    print(f"byte LM, {n_params / 1e3:.0f}k parameters ({config.num_layers} x d{config.d_model}, "
          f"context {config.seq_len}), {mesh.size} devices, {config.batch_size} windows x accum "
          f"{k}, bits={config.bits}{' + error feedback' if error_feedback else ''}, "
          f"{config.num_steps} optimizer steps" + (f", resuming at step {start}" if start else ""),
          flush=True)
  if start == 0 and not meta["curve"]:
    meta["curve"].append([0, evaluate(state.params)])

  bar = _progress_bar(config, start, quiet)
  echo = bar.write if bar else print
  schedule = learning_rate_schedule(config)
  limit_s = config.time_limit_minutes * 60.0
  t_loop = time.perf_counter()
  t_first = None  # after the first (compiling) optimizer step: the steady-state rate starts there
  done, loss_sum, loss_n, stopped = start, 0.0, 0, False
  elapsed = 0.0  # training seconds of this piece: what its checkpoints and its result add on
  for step in range(start, config.num_steps):
    for micro in range(k):
      call = step * k + micro
      windows = train_windows(corpus.train, config.seed, call, config.batch_size, config.seq_len)
      state, loss = train_step(state, _global(mesh, windows))
    loss = float(loss)  # waits for the step
    if not math.isfinite(loss):
      raise FloatingPointError(f"training diverged at optimizer step {step + 1}: loss {loss}")
    done = step + 1
    t_first = t_first or (time.perf_counter(), done, time.process_time())
    loss_sum, loss_n = loss_sum + loss, loss_n + 1
    if bar:
      bar.set_postfix({"loss": f"{loss:.3f}"}, refresh=False)
      bar.update(1)
    if done % config.log_every_steps == 0 or done == config.num_steps:
      log.write(done, "train", {"loss": loss_sum / loss_n, "learning_rate": schedule(done - 1)},
                echo)
      loss_sum, loss_n = 0.0, 0
    if (config.eval_every_steps and done % config.eval_every_steps == 0) or \
        done == config.num_steps:
      meta["curve"].append([done, evaluate(state.params)])
      log.write(done, "eval", {"val_loss": meta["curve"][-1][1]}, echo)
    elapsed = time.perf_counter() - t_loop
    stopped = done < config.num_steps and (
        (stop_after is not None and done >= stop_after) or (limit_s and elapsed >= limit_s))
    if ckpt is not None and (stopped or done == config.num_steps or (
        config.checkpoint_every_steps and done % config.checkpoint_every_steps == 0)):
      ckpt.save(done, state, {**meta, "train_seconds": meta["train_seconds"] + elapsed,
                              "wall_seconds": meta["wall_seconds"] + time.perf_counter() - t_wall})
    if stopped:
      break
  if bar:
    bar.close()
  log.close()
  train_s = elapsed  # the seconds its last checkpoint added, so the pieces' seconds add up
  if ckpt is not None:
    ckpt.close()

  result: dict[str, Any] = {
      "bits": config.bits, "powersgd": config.get("powersgd", 0), "accum_steps": k,
      **({"shard_params": True, "param_gather_bits": config.param_gather_bits}
         if config.get("shard_params") else {}),
      "error_feedback": error_feedback,
      "seed": config.seed, "steps": done, "num_steps": config.num_steps,
      "val_loss": None if stopped else meta["curve"][-1][1],
      "train_loss_last": loss if done > start else None,
      "wall_s": meta["wall_seconds"] + time.perf_counter() - t_wall,
      "train_s": meta["train_seconds"] + train_s,
      # Optimizer steps per second of this process, after the first (compiling) step.
      "steps_per_s": ((done - t_first[1]) / (time.perf_counter() - t_first[0])
                      if t_first and done > t_first[1] else None),
      # CPU seconds (all threads) per optimizer step, same window: what a busy machine's wall
      # clock hides. On an idle machine with c cores the step takes between this / c and this.
      "cpu_s_per_step": ((time.process_time() - t_first[2]) / (done - t_first[1])
                         if t_first and done > t_first[1] else None),
      "curve": meta["curve"],
      "params": int(n_params), "model": {f: config[f] for f in (
          "d_model", "num_layers", "num_heads", "mlp_ratio", "seq_len")},
      "batch_size": config.batch_size, "num_devices": mesh.size,
      "tokens_per_step": config.batch_size * k * config.seq_len,
      **wire_bytes(state.params, config),
      # The compiled train step's memory per device (arguments + outputs + temporaries - aliased).
      "peak_bytes_per_device": peak,
      "unigram_entropy_val": unigram_entropy(corpus.val),
      "corpus_sha256": corpus.sha256, "corpus_bytes": [int(corpus.train.size),
                                                       int(corpus.val.size)],
      "python": corpus.python, "jax": jax.__version__, "backend": jax.default_backend(),
      "qcomm_impl": qcomm.implementation().get(
          "cuda" if jax.default_backend() == "gpu" else "cpu"),
      "params_checksum": params_checksum(state.params),
      "replicas_identical": replicas_identical(state.params),
  }
  if stopped:
    result["stopped"] = True
  return result


def main(argv) -> None:
  del argv
  config = flags.FLAGS.config
  setup_devices(config)
  result = train_and_evaluate(config, flags.FLAGS.workdir or None)
  print(json.dumps(result), flush=True)  # the last line: one JSON object


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "path to a config file (configs/lm_bytes.py)",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None,
                      "checkpoints (resumed from), metrics.jsonl and TensorBoard logs go here")
  flags.mark_flags_as_required(["config"])
  app.run(main)
