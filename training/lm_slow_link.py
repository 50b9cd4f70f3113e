"""Time to a target loss on a slow link: the byte-level LM (training/lm.py) trained by data-parallel
``qcomm.sync`` or by ``qcomm.diloco``, one process per node, the training clock read at every
evaluation.

    python -m jax_qcomm.tools.cluster --nodes 2 --rate 10mbit --local-devices 4 \\
        --out runs/slow_link/ddp_q4.json -- -m training.lm_slow_link \\
        --config=configs/lm_bytes.py --config.bits=4 --method=ddp --target=1.568

The mesh is ``(node, data)``: one row per process (a node of the cluster), its own devices along
``data``; ``config.num_devices`` must be the number of devices of all processes. The model, data,
schedule and global batch are training/lm.py's (the tokens of every method are equal).

* ``--method=ddp``: ``qcomm.sync(clip -> AdamW, axis_name=qcomm.Hierarchical("data", "node"),
  codec=<config.bits>)``: exact inside a node, the codec across nodes, every optimizer step.
* ``--method=diloco``: training/lm_diloco.py's optimizer: an exact sync over ``data`` inside each
  node, ``qcomm.diloco(..., axis_name="node", every=H, codec=<config.bits>)`` across nodes.

Under ``python -m jax_qcomm.tools.launch --elastic`` the run survives lost processes: each
process steps its own replica on its rows of the global batch and evaluates the parameters (the
anchor) on its own devices, every step (ddp) or synchronisation (diloco) averages over the live
processes, and a restarted process takes up the group's state and step (docs/distributed.md); the
result JSON's ``replicas_per_step`` (ddp) or ``replicas_per_sync`` (diloco) lists the replicas
averaged at each, and ``stall_s`` this process's seconds lost to losses.

Every ``--eval_every`` optimizer (inner) steps the parameters (diloco: the anchor) are evaluated
on the validation windows. The training clock (``train_s``) is paused during evaluation and counts
everything else: data, steps, synchronisation; it starts after the first optimizer step, which
compiles the programs (``first_step_s``). With ``--target`` the run stops at the first
evaluation at or below it. The result JSON (written to ``--out`` by process 0, printed as the
last line) holds the curve ``[step, val_loss, train_s]`` and ``target_s``, the training seconds at
which the target was first reached (null if it was not), and ``sent_bytes_per_step``: what each
node sends across the slow link per optimizer step (``qcomm.describe`` of the codec's allreduce
between the nodes; diloco's divided by H).
"""

from __future__ import annotations

import functools
import json
import math
import time

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from absl import app, flags
from flax import nnx
from ml_collections import config_flags

import jax_qcomm as qcomm
from jax_qcomm.tools import distributed
from training import lm, lm_diloco

FLAGS = flags.FLAGS
NODE = "node"


def setup(config) -> None:
  """One process per node under the launcher (its devices from --local-devices), else
  ``config.num_devices`` host devices split into two nodes."""
  if distributed.under_launcher():
    distributed.initialize()
  else:
    lm.setup_devices(config)


def create_mesh(config, spare: bool = False):
  """The ``(node, data)`` mesh; with ``spare`` each process's last device is left out (the
  overlapped runner's communication device; one process leaves out those past
  ``config.num_devices`` in any case)."""
  if spare and jax.process_count() > 1:
    rows = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)[:-1]
            for p in range(jax.process_count())]
    mesh = jax.sharding.Mesh(np.array(rows), (NODE, lm.AXIS))
  elif jax.process_count() > 1:
    mesh = distributed.global_mesh((NODE, lm.AXIS))
  else:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:config.num_devices]).reshape(2, -1),
                             (NODE, lm.AXIS))
  if mesh.devices.size != config.num_devices:
    raise ValueError(f"config.num_devices must be the {mesh.devices.size} devices of all "
                     f"processes, got {config.num_devices}")
  return mesh


def _batch(mesh, windows: np.ndarray) -> jax.Array:
  """The global batch from this process's contiguous share of its rows."""
  n, i = jax.process_count(), jax.process_index()
  rows = len(windows) // n
  return jax.make_array_from_process_local_data(NamedSharding(mesh, P((NODE, lm.AXIS))),
                                                windows[i * rows:(i + 1) * rows])


def run(config, *, method: str, every: int, outer_lr: float | None = None,
        outer_momentum: float | None = None, target: float | None, eval_every: int,
        overlap: bool = False, outer: str = "nesterov") -> dict:
  t_wall = time.perf_counter()
  if method not in ("ddp", "diloco"):
    raise ValueError(f"method must be 'ddp' or 'diloco', got {method!r}")
  lm.validate_config(config)
  outer_lr, outer_momentum = lm_diloco.outer_settings(outer, outer_lr, outer_momentum)
  corpus = lm.load_corpus(config.stdlib_dir)
  mesh = create_mesh(config, spare=overlap)
  k = config.accum_steps
  elastic = distributed.is_elastic()
  if overlap and (method != "diloco" or not config.delay):
    raise ValueError("--overlap runs --method=diloco with --config.delay=1")
  graphdef = nnx.split(nnx.eval_shape(lambda: lm.create_model(config, nnx.Rngs(0))))[0]
  params = jax.jit(lambda: nnx.state(lm.create_model(config, nnx.Rngs(config.seed)))
                   .to_pure_dict(), out_shardings=None if elastic else NamedSharding(mesh, P()))()

  def loss_fn(p, windows):
    return jnp.mean(lm.window_loss(graphdef, p, windows))

  if method == "ddp":
    tx = lm.create_optimizer(config, qcomm.Hierarchical(lm.AXIS, NODE))
    dp = qcomm.data_parallel(loss_fn, tx, mesh, axis_name=(NODE, lm.AXIS), elastic=elastic)
    state = dp.init(params)
    # What crosses a node's slow link per step: the codec's allreduce of the gradient between the
    # nodes (each device sends that of its 1/data shard).
    desc = qcomm.describe(lm.create_optimizer(config, NODE), params, devices=mesh.shape[NODE])
    sync_every = 1
  else:
    tx = lm_diloco.create_tx(config, every, outer_lr, outer_momentum, outer)
    dp = qcomm.data_parallel(loss_fn, tx, mesh, axis_name=(NODE, lm.AXIS), elastic=elastic,
                             overlap=overlap)
    state = dp.init(params)
    desc = qcomm.describe(tx, params, devices=mesh.shape[NODE])
    sync_every = every

  val = lm.val_windows(corpus.val, config.num_val_windows, config.seq_len)
  val_bytes = config.num_val_windows * config.seq_len
  if elastic:
    # Each process evaluates the anchor (the same in all) on every window, on its own devices,
    # and feeds its own rows of the global batch: nothing here crosses processes.
    eval_local = jax.jit(lambda p, w: jnp.sum(lm.window_loss(graphdef, p, w)))
    evaluate = lambda p: float(eval_local(p, val)) / val_bytes  # noqa: E731
    rows = config.batch_size // jax.process_count()
    batch_of = lambda w: w[jax.process_index() * rows:(jax.process_index() + 1) * rows]  # noqa: E731
    # A restarted process compiles its step on a batch of the step's shape, then takes the
    # group's anchor and state.
    example = lm.train_windows(corpus.train, config.seed, 0, config.batch_size, config.seq_len)
    params, state = dp.join(params, state, batch_of(example))
  else:
    eval_step = lm.make_eval_step(graphdef, mesh, (NODE, lm.AXIS))
    val = _batch(mesh, val)
    evaluate = lambda p: float(eval_step(p, val)) / val_bytes  # noqa: E731
    batch_of = functools.partial(_batch, mesh)

  local = params  # diloco: the anchor
  start = dp.calls(state) // k if elastic else 0
  # A process that rejoined mid-run does not evaluate first: the others wait for it at the next
  # synchronisation, and the curve is process 0's.
  curve, train_s, target_s = ([[start, evaluate(params), 0.0]] if start == 0 else []), 0.0, None
  step, first_step_s, t_first = start, 0.0, time.perf_counter()
  while step < config.num_steps:
    step += 1
    if step == start + 2:  # the clock starts after the first step, which compiles the programs
      jax.block_until_ready((local, state))
      first_step_s, train_s = time.perf_counter() - t_first, 0.0
    t0 = time.perf_counter()
    for micro in range(k):
      windows = lm.train_windows(corpus.train, config.seed, (step - 1) * k + micro,
                                 config.batch_size, config.seq_len)
      local, state, loss, _ = dp.step(local, state, batch_of(windows))
    if elastic:  # a synchronisation may have handed this process the group's counters
      step = dp.calls(state) // k
    if step % eval_every == 0 or step == config.num_steps:
      jax.block_until_ready((local, state))
      train_s += time.perf_counter() - t0
      # Overlapped: the anchor lags a round behind the replicas by design (the mean in flight is
      # applied at the next synchronisation); the evaluation does not wait for it.
      val_loss = evaluate(local)
      curve.append([step, val_loss, train_s])
      if not math.isfinite(val_loss):
        raise FloatingPointError(f"training diverged at step {step}")
      if jax.process_index() == 0:
        print(f"[eval] step {step}: val_loss={val_loss:.4f} train_s={train_s:.1f}", flush=True)
      if target is not None and val_loss <= target:
        target_s = train_s
        break
    else:
      train_s += time.perf_counter() - t0
  n = sum(x.size for x in jax.tree_util.tree_leaves(params))
  return {
      "method": method, "bits": config.bits, "error_feedback": config.error_feedback,
      "fragments": config.fragments if method == "diloco" else None,
      "delay": config.delay if method == "diloco" else None, "overlap": overlap,
      "every": sync_every, "outer": outer if method == "diloco" else None,
      "outer_lr": outer_lr if method == "diloco" else None,
      "outer_momentum": outer_momentum if method == "diloco" else None,
      "seed": config.seed, "num_steps": config.num_steps, "steps_run": step, "accum_steps": k,
      "target": target, "target_s": target_s, "val_loss": curve[-1][1], "curve": curve,
      "train_s": train_s, "first_step_s": first_step_s, "wall_s": time.perf_counter() - t_wall,
      "s_per_step": train_s / max(step - 1, 1), "params": int(n),
      "processes": jax.process_count(), "devices": int(mesh.devices.size),
      "sent_bytes_per_sync": desc.sent_bytes_per_sync,
      "elastic": elastic,
      "replicas_per_sync": (None if method != "diloco" else list(dp.replicas_per_sync) if elastic
                            else [mesh.shape[NODE]] * int(np.asarray(state.outer_step.addressable_data(0)))),
      # ddp: the replicas averaged at each optimizer step (elastic; all of them otherwise).
      "replicas_per_step": (None if method != "ddp" else list(dp.replicas_per_sync) if elastic
                            else [mesh.shape[NODE]] * (step - start)),
      "sent_bytes_per_step": desc.sent_bytes_per_sync / sync_every,
      # Elastic: this process's seconds in synchronisation attempts a lost process broke and in
      # backend rebuilds, and a record per synchronisation that ran short or admitted a process.
      "stall_s": getattr(dp, "stall_s", None) if elastic else None,
      "short_syncs": getattr(dp, "short_syncs", None) if elastic else None,
      "python": corpus.python, "jax": jax.__version__, "corpus_sha256": corpus.sha256,
  }


def main(argv) -> None:
  del argv
  config = FLAGS.config
  setup(config)
  result = run(config, method=FLAGS.method, every=FLAGS.every, outer_lr=FLAGS.outer_lr,
               outer_momentum=FLAGS.outer_momentum, target=FLAGS.target,
               eval_every=FLAGS.eval_every, overlap=FLAGS.overlap, outer=FLAGS.outer)
  if jax.process_index() == 0:
    if FLAGS.out:
      with open(FLAGS.out, "w") as f:
        json.dump(result, f)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "configs/lm_bytes.py", lock_config=True)
  flags.DEFINE_enum("method", "ddp", ["ddp", "diloco"], "data-parallel sync or diloco")
  flags.DEFINE_integer("every", 50, "diloco: inner optimizer steps between synchronisations (H)")
  lm_diloco.define_outer_flags()
  flags.DEFINE_float("target", None, "stop at the first evaluation at or below this val loss")
  flags.DEFINE_integer("eval_every", 50, "optimizer steps between evaluations")
  flags.DEFINE_bool("overlap", False, "diloco with --config.delay=1: the synchronisation's "
                    "collective on each process's last device, which the mesh leaves out "
                    "(start the nodes with one device more), while the next round computes")
  flags.DEFINE_string("out", "", "write the result JSON here (process 0)")
  flags.mark_flags_as_required(["config"])
  app.run(main)
