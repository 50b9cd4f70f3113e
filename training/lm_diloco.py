"""The byte-level LM (training/lm.py) trained with ``qcomm.diloco``: K replicas ("nodes"), each a
group of devices synchronised exactly every optimizer step, the replicas synchronised every H
inner steps through a codec.

    python -m training.lm_diloco --config=configs/lm_bytes.py --config.bits=4 --every=50 \\
        --replicas=2 --outer_lr=0.7 [--outer_momentum=0.9] [--results=runs/diloco.jsonl]

The model, data, inner optimizer (clip -> AdamW, warmup + cosine over the *inner* steps, never
restarted) and evaluation are training/lm.py's. The mesh is ``(node=K, data=num_devices/K)``;
``inner = qcomm.sync(clip -> AdamW, axis_name="data", codec=NoCompression(), accum_steps)``,
``tx = qcomm.diloco(inner, axis_name="node", every=H, codec=<config.bits>, outer=Nesterov SGD)``.
The global batch is training/lm.py's (``batch_size`` windows per micro-step, the same windows), split
over all devices, so each replica sees 1/K of it: the tokens equal the exact data-parallel run's.
``config.bits`` / ``bucket_size`` / ``scheme`` / ``error_feedback`` / ``min_size`` /
``compress_1d`` / ``exclude`` choose the *outer* codec and leaf policy (``config.fragments``:
``qcomm.diloco(fragments=...)``); ``config.topk`` > 0 makes
it ``qcomm.TopK(topk, bits)``. ``--outer=sparseloco`` runs SparseLoCo's rule instead of Nesterov
SGD (``qcomm.diloco(outer="sparseloco")``): ``--outer_lr`` is its alpha (default 1.0) and
``--outer_momentum`` its accumulator decay beta (default 0.95)::

    python -m training.lm_diloco --config=configs/lm_bytes.py --config.topk=0.015625 \
        --config.bits=2 --config.error_feedback=True --outer=sparseloco --every=30

The anchor is evaluated
(the params the runner returns) every ``eval_every_steps`` inner steps and at the end.

The last line printed is one JSON object (``val_loss`` in nats per byte, ``bytes_per_param_step``:
bytes each replica sends per parameter per inner optimizer step, from ``qcomm.describe``). With
``--results`` the object is also appended to that JSON-lines file.
"""

from __future__ import annotations

import json
import math
import time

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from absl import app, flags
from flax import nnx
from ml_collections import config_flags
import optax

import jax_qcomm as qcomm
from jax_qcomm.transforms import diloco
from training import lm
from training.sync_config import exclude_patterns

FLAGS = flags.FLAGS


#: ``--outer`` -> the (lr, momentum) its ``--outer_lr`` / ``--outer_momentum`` default to.
OUTER_DEFAULTS = {
    "nesterov": (diloco.DEFAULT_OUTER_LR, diloco.DEFAULT_OUTER_MOMENTUM),
    "sparseloco": (diloco.SPARSELOCO_LR, diloco.SPARSELOCO_DECAY),
}


def define_outer_flags() -> None:
  """``--outer``, ``--outer_lr`` and ``--outer_momentum`` (for the trainers that run diloco)."""
  flags.DEFINE_enum("outer", "nesterov", sorted(OUTER_DEFAULTS),
                    "the outer rule: Nesterov SGD, or SparseLoCo's (plain SGD on the mean sent, "
                    "the decayed error-feedback accumulator in place of the momentum)")
  flags.DEFINE_float("outer_lr", None,
                     "nesterov: the outer learning rate (default 0.3, qcomm.diloco's); "
                     "sparseloco: alpha (default 1.0)")
  flags.DEFINE_float("outer_momentum", None,
                     "nesterov: the outer momentum (default 0.9; 0: plain SGD); sparseloco: the "
                     "accumulator decay beta (default 0.95)")


def outer_settings(outer: str, outer_lr: float | None,
                   outer_momentum: float | None) -> tuple[float, float]:
  """``--outer_lr`` / ``--outer_momentum`` with the defaults of ``--outer`` filled in."""
  if outer not in OUTER_DEFAULTS:
    raise ValueError(f"--outer must be one of {sorted(OUTER_DEFAULTS)}, got {outer!r}")
  lr, momentum = OUTER_DEFAULTS[outer]
  return (lr if outer_lr is None else outer_lr,
          momentum if outer_momentum is None else outer_momentum)


def create_tx(config, every: int, outer_lr: float, outer_momentum: float,
              outer: str = "nesterov"):
  inner = optax.chain(
      optax.clip_by_global_norm(config.grad_clip) if config.grad_clip else optax.identity(),
      optax.adamw(lm.learning_rate_schedule(config), b1=config.b1, b2=config.b2,
                  weight_decay=config.weight_decay, mask=lm._matrix_mask))
  inner = qcomm.sync(inner, axis_name=lm.AXIS, codec=qcomm.NoCompression(),
                     accum_steps=config.accum_steps)
  if config.topk:
    codec = qcomm.TopK(config.topk, bits=config.bits)
  else:
    codec = qcomm.codec_for_bits(config.bits, config.bucket_size, config.scheme,
                                 rounding="nearest" if config.error_feedback else "stochastic")
  policy = qcomm.LeafPolicy(min_size=config.min_size, compress_1d=config.compress_1d,
                            exclude=exclude_patterns(config))
  if outer == "sparseloco":  # plain SGD at alpha; the accumulator, decayed by beta, is the momentum
    if not config.error_feedback:
      raise ValueError("--outer=sparseloco needs --config.error_feedback=True: its error-feedback "
                       "accumulator replaces the outer momentum")
    kw = dict(outer=optax.sgd(outer_lr), residual_decay=outer_momentum)
  else:
    kw = dict(outer=optax.sgd(outer_lr, momentum=outer_momentum or None,
                              nesterov=bool(outer_momentum)))
  return qcomm.diloco(inner, axis_name="node", every=every, codec=codec,
                      error_feedback=config.error_feedback, policy=policy, seed=config.seed,
                      fragments=config.fragments, delay=config.delay, **kw)


def run(config, *, every: int, replicas: int, outer_lr: float | None = None,
        outer_momentum: float | None = None, outer: str = "nesterov",
        quiet: bool = False) -> dict:
  t_wall = time.perf_counter()
  lm.validate_config(config)
  outer_lr, outer_momentum = outer_settings(outer, outer_lr, outer_momentum)
  if config.num_devices % replicas:
    raise ValueError(f"--replicas must divide config.num_devices ({config.num_devices}), "
                     f"got {replicas}")
  corpus = lm.load_corpus(config.stdlib_dir)
  devices = np.array(jax.devices()[:config.num_devices]).reshape(replicas, -1)
  mesh = Mesh(devices, ("node", lm.AXIS))
  k = config.accum_steps
  tx = create_tx(config, every, outer_lr, outer_momentum, outer)
  graphdef = nnx.split(nnx.eval_shape(lambda: lm.create_model(config, nnx.Rngs(0))))[0]
  params = jax.jit(lambda: nnx.state(lm.create_model(config, nnx.Rngs(config.seed)))
                   .to_pure_dict(), out_shardings=NamedSharding(mesh, P()))()

  def loss_fn(p, windows):
    return jnp.mean(lm.window_loss(graphdef, p, windows))

  dp = qcomm.data_parallel(loss_fn, tx, mesh, axis_name=("node", lm.AXIS))
  anchor, state = params, dp.init(params)
  eval_step = lm.make_eval_step(graphdef, mesh)
  val = jax.device_put(lm.val_windows(corpus.val, config.num_val_windows, config.seq_len),
                       NamedSharding(mesh, P(lm.AXIS)))
  val_bytes = config.num_val_windows * config.seq_len
  batch_sharding = NamedSharding(mesh, P(("node", lm.AXIS)))

  def evaluate(p) -> float:
    return float(eval_step(jax.device_put(p, NamedSharding(mesh, P())), val)) / val_bytes

  curve = [[0, evaluate(anchor)]]
  t_loop = time.perf_counter()
  for step in range(config.num_steps):
    for micro in range(k):
      windows = lm.train_windows(corpus.train, config.seed, step * k + micro, config.batch_size,
                                 config.seq_len)
      anchor, state, loss, _ = dp.step(anchor, state, jax.device_put(windows, batch_sharding))
    done = step + 1
    if (config.eval_every_steps and done % config.eval_every_steps == 0) or \
        done == config.num_steps:
      curve.append([done, evaluate(anchor)])
      loss = float(np.mean(np.asarray(loss)))
      if not math.isfinite(curve[-1][1]):
        raise FloatingPointError(f"training diverged at inner step {done}")
      if not quiet:
        print(f"[eval] step {done}: val_loss={curve[-1][1]:.4f} train_loss={loss:.4f}", flush=True)
  train_s = time.perf_counter() - t_loop
  n = sum(x.size for x in jax.tree_util.tree_leaves(anchor))
  desc = qcomm.describe(tx, params, devices=replicas)
  return {
      "method": "diloco", "bits": config.bits, "topk": config.topk,
      "bucket_size": config.bucket_size,
      "error_feedback": config.error_feedback, "fragments": config.fragments,
      "delay": config.delay,
      "every": every, "replicas": replicas, "outer": outer, "outer_lr": outer_lr,
      "outer_momentum": outer_momentum, "seed": config.seed, "steps": config.num_steps,
      "accum_steps": k, "val_loss": curve[-1][1], "curve": curve,
      "outer_steps": int(state.outer_step), "total_notfinite": int(state.total_notfinite),
      "params": int(n), "sent_bytes_per_sync": desc.sent_bytes_per_sync,
      "bytes_per_param_step": desc.sent_bytes_per_sync / every / n,
      "wall_s": time.perf_counter() - t_wall, "train_s": train_s,
      "python": corpus.python, "jax": jax.__version__, "corpus_sha256": corpus.sha256,
  }


def main(argv) -> None:
  del argv
  config = FLAGS.config
  lm.setup_devices(config)
  result = run(config, every=FLAGS.every, replicas=FLAGS.replicas, outer_lr=FLAGS.outer_lr,
               outer_momentum=FLAGS.outer_momentum, outer=FLAGS.outer)
  if FLAGS.results:
    with open(FLAGS.results, "a") as f:
      f.write(json.dumps(result) + "\n")
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "configs/lm_bytes.py", lock_config=True)
  flags.DEFINE_integer("every", 50, "inner optimizer steps between outer synchronisations (H)")
  flags.DEFINE_integer("replicas", 2, "DiLoCo replicas K (nodes); must divide num_devices")
  define_outer_flags()
  flags.DEFINE_string("results", "", "append the result JSON to this JSON-lines file")
  flags.mark_flags_as_required(["config"])
  app.run(main)
