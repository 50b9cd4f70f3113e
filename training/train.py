"""Data-parallel ResNet training with jax_qcomm's compressed gradient synchronisation.

    python -m training.train --config configs/digits.py --workdir runs/digits [--config.bits=4 ...]

The train step is ``qcomm.data_parallel(loss_fn, tx, mesh)``, the library's short path: a
``jax.shard_map`` over a one-axis ``data`` mesh of every device of every process (not GSPMD
auto-sharding, which would insert its own uncompressed allreduce). Each device computes the
gradient of its own shard of the batch w.r.t. a varying copy of the parameters (so that autodiff
does not psum it, uncompressed); ``qcomm.sync`` averages the gradients across ``data`` (QSGD, bf16
wire or exact, every ``accum_steps`` calls) and runs SGD with Nesterov momentum. The BatchNorm
statistics go in as an extra, undifferentiated argument and come back as ``aux``; BatchNorm
averages them across the mesh itself (``bn_axis_name``). Parameters and BatchNorm statistics are
replicated and stay bit-identical on all devices; the synchroniser's accumulator and
error-feedback residual are per device (``qcomm.state_partition_spec``).

The evaluation step and the timing-only step without synchronisation are written out with
``jax.shard_map`` (neither is a synchronised train step; see their docstrings).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from absl import app, flags
import flax
from flax.metrics import tensorboard
import ml_collections
from ml_collections import config_flags
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

import jax_qcomm as qcomm
from jax_qcomm.tools import distributed
from training import input_pipeline, models
from training.replicas import params_checksum, replicas_identical
from training.sync_config import check_sync_fields, create_sync
from training.timing import median_time

AXIS = "data"


@flax.struct.dataclass
class TrainState:
  """Everything a resumed run needs. ``step`` counts train-step calls (micro-steps)."""
  step: jax.Array
  params: Any
  batch_stats: Any
  opt_state: qcomm.SyncState


# ---- configuration -------------------------------------------------------------------------------

def validate_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Raises ValueError naming the field for every bad value, before any compute (the
  synchronisation settings are checked by ``qcomm.sync`` itself: :func:`check_sync_fields`)."""
  def bad(field: str, allowed: str) -> None:
    raise ValueError(f"config.{field} must be {allowed}, got {config[field]!r}")

  if config.model not in models.MODELS:
    bad("model", f"one of {sorted(models.MODELS)}")
  if config.dataset not in input_pipeline.DATASETS:
    bad("dataset", f"one of {input_pipeline.DATASETS}")
  if config.stem not in ("imagenet", "small"):
    bad("stem", "'imagenet' or 'small'")
  check_sync_fields(config)
  for field, low in (("batch_size", 1), ("num_filters", 1), ("image_size", 8),
                     ("eval_every_steps", 0), ("log_every_steps", 1), ("checkpoint_every_steps", 0),
                     ("keep_checkpoints", 0), ("measure_sync_steps", 0), ("num_cpu_devices", 0)):
    if not isinstance(config[field], int) or isinstance(config[field], bool) or config[field] < low:
      bad(field, f"an integer >= {low}")
  if config.batch_size % num_devices:
    bad("batch_size", f"divisible by the number of devices ({num_devices})")
  if config.num_train_steps == 0 or config.num_train_steps < -1:
    bad("num_train_steps", "a positive number of optimizer steps, or -1 for num_epochs worth")
  if config.num_train_steps == -1 and not config.num_epochs > 0:
    bad("num_epochs", "> 0")
  for field in ("learning_rate", "weight_decay", "warmup_epochs"):
    if not config[field] >= 0:
      bad(field, ">= 0")
  if not 0 <= config.label_smoothing < 1:
    bad("label_smoothing", "in [0, 1)")
  if not 0 <= config.momentum < 1:
    bad("momentum", "in [0, 1)")


# ---- processes and devices -----------------------------------------------------------------------

def initialize_processes(config: ml_collections.ConfigDict) -> None:
  """Starts ``jax.distributed`` when this is one process of several; must precede any JAX use.

  Order of precedence: ``python -m jax_qcomm.tools.launch`` (its environment), explicit config fields,
  then JAX's auto-detection (SLURM, Open MPI, ...). On CPU the collectives go over gloo.
  """
  if config.num_cpu_devices:
    jax.config.update("jax_num_cpu_devices", config.num_cpu_devices)
  if distributed.under_launcher():
    distributed.initialize(interface=config.gloo_interface or None)
  elif config.coordinator_address:
    if config.num_processes < 1 or not 0 <= config.process_id < config.num_processes:
      raise ValueError("config.coordinator_address needs config.num_processes >= 1 and "
                       "config.process_id in 0..num_processes-1")
    distributed.initialize(config.coordinator_address, config.num_processes,
                                 config.process_id, interface=config.gloo_interface or None)
  elif any(v in os.environ for v in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize()


def create_mesh() -> Mesh:
  """All devices of all processes on one ``data`` axis, ordered by (process, local id)."""
  return distributed.global_mesh((AXIS,))


# ---- model, optimizer, state ---------------------------------------------------------------------

def learning_rate_schedule(config: ml_collections.ConfigDict, steps_per_epoch: int,
                           total_steps: int) -> optax.Schedule:
  """Linear warmup then cosine decay, peak ``learning_rate * examples per step / 256``."""
  peak = config.learning_rate * config.batch_size * config.accum_steps / 256.0
  warmup = min(int(config.warmup_epochs * steps_per_epoch), total_steps - 1)
  return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, total_steps)


def _kernel_mask(params: Any) -> Any:
  """Weight decay on convolution / dense kernels only (not biases nor BatchNorm scales)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) == "kernel", params)


def create_inner_optimizer(config: ml_collections.ConfigDict, schedule: optax.Schedule,
                           ) -> optax.GradientTransformation:
  """SGD with Nesterov momentum and decoupled-from-the-wire weight decay: it runs after the
  synchronisation, so the decay term is applied exactly rather than compressed with the gradient."""
  return optax.chain(
      optax.add_decayed_weights(config.weight_decay, mask=_kernel_mask),
      optax.sgd(schedule, momentum=config.momentum or None, nesterov=config.nesterov))


def create_optimizer(config: ml_collections.ConfigDict, inner: optax.GradientTransformation,
                     ) -> optax.GradientTransformation:
  """``qcomm.sync(inner)`` with every synchronisation setting taken from the config."""
  return create_sync(config, inner, AXIS)


def create_model(config: ml_collections.ConfigDict, num_classes: int, axis: str | None):
  return models.create_model(config.model, num_classes=num_classes, num_filters=config.num_filters,
                             half_precision=config.half_precision, bn_axis_name=axis,
                             stem=config.stem)


def state_spec(state: TrainState) -> TrainState:
  """shard_map specs: everything replicated but the synchroniser's per-device parts."""
  rep = lambda tree: jax.tree_util.tree_map(lambda _: P(), tree)  # noqa: E731
  return TrainState(step=P(), params=rep(state.params), batch_stats=rep(state.batch_stats),
                    opt_state=qcomm.state_partition_spec(state.opt_state, AXIS))


def create_train_state(config: ml_collections.ConfigDict, mesh: Mesh, info,
                       dp: qcomm.DataParallel) -> tuple[TrainState, TrainState]:
  """The initial state (params from ``config.seed``, optimizer state from ``dp.init``) and its
  shard_map specs."""
  # Initialised without the BatchNorm axis: the parameters are the same, and no axis is bound here.
  model = create_model(config, info.num_classes, None)
  dummy = jnp.zeros((1,) + tuple(info.image_shape), jnp.float32)

  def init(rng):
    variables = model.init(rng, dummy, train=False)
    return variables["params"], variables["batch_stats"]

  # XLA CPU compiles the partitionable threefry generator (jax's default) ~8x slower: the digits
  # ResNet's initialiser took 22 s to compile, 2.7 s with the classic one (AMD EPYC, jax 0.12).
  # The parameters are replicated, so partitioning the generator buys nothing here.
  with jax.threefry_partitionable(False):
    params, batch_stats = jax.jit(init, out_shardings=NamedSharding(mesh, P()))(
        jax.random.key(config.seed))
  opt_state = dp.init(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
  state = TrainState(step=step, params=params, batch_stats=batch_stats, opt_state=opt_state)
  return state, state_spec(state)


# ---- steps ---------------------------------------------------------------------------------------

def cross_entropy(logits: jax.Array, labels: jax.Array, smoothing: float) -> jax.Array:
  """Per-example cross entropy with label smoothing; logits [B, C], labels int [B] -> [B]."""
  targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), smoothing) \
      if smoothing else jax.nn.one_hot(labels, logits.shape[-1])
  return optax.softmax_cross_entropy(logits, targets)


def make_loss_fn(config, model):
  """``loss_fn(params, batch, batch_stats) -> (loss, {"accuracy", "batch_stats"})`` of one device's
  batch shard: the mean loss, the mean accuracy and the BatchNorm statistics updated by the batch
  (averaged across ``data`` by BatchNorm itself, so the same on every device)."""
  def loss_fn(params, batch, batch_stats):
    logits, new_vars = model.apply({"params": params, "batch_stats": batch_stats},
                                   batch["image"], train=True, mutable=["batch_stats"])
    loss = jnp.mean(cross_entropy(logits, batch["label"], config.label_smoothing))
    accuracy = jnp.mean((jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32))
    return loss, {"accuracy": accuracy, "batch_stats": new_vars["batch_stats"]}

  return loss_fn


def create_data_parallel(config, model, tx, mesh: Mesh) -> qcomm.DataParallel:
  """``qcomm.data_parallel`` of :func:`make_loss_fn`: the step's ``aux`` is the devices' mean
  accuracy and the new BatchNorm statistics (already the same on every device: returned as they
  are, with no second allreduce)."""
  return qcomm.data_parallel(make_loss_fn(config, model), tx, mesh, axis_name=AXIS, has_aux=True,
                             aux_reduce="mean")


def make_train_step(dp: qcomm.DataParallel):
  """jit of (state, batch) -> (state, {"loss", "accuracy"}), global batch [B, ...]: one
  ``dp.step`` with the BatchNorm statistics as its extra argument, and the call counter's
  increment, in one program (one dispatch per call)."""
  def train_step(state: TrainState, batch):
    params, opt_state, loss, aux = dp.step(state.params, state.opt_state, batch,
                                           state.batch_stats)
    return state.replace(step=state.step + 1, params=params, batch_stats=aux["batch_stats"],
                         opt_state=opt_state), {"loss": loss, "accuracy": aux["accuracy"]}

  return jax.jit(train_step)


def make_local_step(config, model, inner, mesh: Mesh, spec: TrainState):
  """The train step without synchronisation (each device applies its own gradient), for timing.

  Same compute as the train step (forward, backward, optimizer) minus the gradient collective;
  returns a per-device checksum of the new parameters so that XLA cannot drop the work. Written
  out with ``jax.shard_map`` rather than ``qcomm.data_parallel`` on purpose: data_parallel
  synchronises (its ``tx`` must contain a ``qcomm.sync``) and returns replicated parameters, while
  this step must run the bare inner optimizer with no collective and leave the replicas apart.
  """
  loss_fn = make_loss_fn(config, model)

  def step(state: TrainState, batch):
    params = lax.pcast(state.params, AXIS, to="varying")  # this device's own gradient
    grads, _ = jax.grad(loss_fn, has_aux=True)(params, batch, state.batch_stats)
    inner_state = jax.tree_util.tree_map(lambda a: lax.pcast(a, AXIS, to="varying"),
                                         state.opt_state.inner_opt_state)
    updates, _ = inner.update(grads, inner_state, params)
    new = optax.apply_updates(params, updates)
    return sum(jnp.sum(x) for x in jax.tree_util.tree_leaves(new))[None]

  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, P(AXIS)), out_specs=P(AXIS)))


def make_eval_step(model, mesh: Mesh, spec: TrainState):
  """(state, batch) -> {"correct", "count", "loss_sum"} summed over the global batch.

  A plain ``jax.shard_map``: ``qcomm.data_parallel`` is a train step (it differentiates and applies
  ``tx``); evaluation only runs the model and sums masked counts over the mesh."""
  def step(state: TrainState, batch):
    logits = model.apply({"params": state.params, "batch_stats": state.batch_stats},
                         batch["image"], train=False)
    mask = batch["mask"].astype(jnp.float32)
    correct = jnp.sum((jnp.argmax(logits, -1) == batch["label"]) * mask)
    loss = jnp.sum(cross_entropy(logits, batch["label"], 0.0) * mask)
    return lax.psum({"correct": correct, "count": jnp.sum(mask), "loss_sum": loss}, AXIS)

  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, P(AXIS)), out_specs=P()))


# ---- loop ----------------------------------------------------------------------------------------

class MetricsLog:
  """Metrics to stdout, ``workdir/metrics.jsonl`` and TensorBoard (process 0 only)."""

  def __init__(self, workdir: str | None, quiet: bool = False):
    self.enabled = jax.process_index() == 0
    self.quiet = quiet
    self.jsonl = None
    self.tb = None
    if self.enabled and workdir:
      os.makedirs(workdir, exist_ok=True)
      self.jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
      self.tb = tensorboard.SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, kind: str, values: dict[str, float], echo=print) -> None:
    if not self.enabled:
      return
    values = {k: float(v) for k, v in values.items()}
    if not self.quiet:
      echo(f"[{kind}] step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items()))
    if self.jsonl:
      self.jsonl.write(json.dumps({"step": step, "kind": kind, **values}) + "\n")
      self.jsonl.flush()
    if self.tb:
      for k, v in values.items():
        self.tb.scalar(f"{kind}/{k}", v, step)

  def close(self) -> None:
    if self.jsonl:
      self.jsonl.close()
    if self.tb:
      self.tb.flush()
      self.tb.close()


def _global_batch(mesh: Mesh, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
  sharding = NamedSharding(mesh, P(AXIS))
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def measure_sync_overhead(train_step, local_step, state, batch, config) -> dict[str, float]:
  """Median seconds per call with and without synchronisation; outputs are discarded.

  With accumulation, one timed unit is a whole cycle of ``accum_steps`` calls (one of which
  communicates), reported per call. ``scaling_efficiency`` = no-sync time / sync time.
  """
  k = config.accum_steps

  def cycle(s):
    for _ in range(k):
      s, _ = train_step(s, batch)
    return s

  calls = max(1, config.measure_sync_steps // k)
  t_sync = median_time(cycle, state, repeats=calls, warmup=1).median / k
  t_local = median_time(local_step, state, batch, repeats=calls * k, warmup=1).median
  return {"step_time_sync": t_sync, "step_time_nosync": t_local,
          "scaling_efficiency": t_local / t_sync}


def _checkpoint_manager(workdir: str | None, config):
  if not workdir or not config.keep_checkpoints:
    return None
  return ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, "checkpoints")),
      options=ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints, create=True))


def _restore(mngr, state: TrainState) -> TrainState:
  abstract = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  return mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(abstract))


def evaluate(eval_step, state, config, mesh: Mesh, local_batch: int) -> dict[str, float]:
  totals = {"correct": 0.0, "count": 0.0, "loss_sum": 0.0}
  for batch in input_pipeline.eval_iterator(config, local_batch, process_index=jax.process_index(),
                                            process_count=jax.process_count()):
    out = jax.device_get(eval_step(state, _global_batch(mesh, batch)))
    for k in totals:
      totals[k] += float(out[k])
  return {"accuracy": totals["correct"] / max(totals["count"], 1.0),
          "loss": totals["loss_sum"] / max(totals["count"], 1.0), "examples": totals["count"]}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | None,
                       *, quiet: bool = False, stop_after: int | None = None) -> dict[str, Any]:
  """Trains per ``config``, evaluating every ``eval_every_steps`` and at the end.

  Resumes from the latest checkpoint in ``workdir`` if there is one. ``stop_after`` ends the run
  after that optimizer step as a preemption would, after writing a checkpoint (tests use it to
  check that a resumed run equals an uninterrupted one). Returns the final metrics:
  ``eval_accuracy``, ``eval_loss``, ``train_loss``, ``steps`` (optimizer steps), timing
  (``step_time_sync``, ``step_time_nosync``, ``scaling_efficiency`` when measured, ``train_seconds``)
  and ``params_checksum`` (float64 sum of every parameter, identical on every process).
  """
  mesh = create_mesh()
  validate_config(config, mesh.size)
  info = input_pipeline.dataset_info(config)
  k = config.accum_steps
  examples_per_step = config.batch_size * k
  steps_per_epoch = max(1, info.train_examples // examples_per_step)
  total_steps = (config.num_train_steps if config.num_train_steps > 0
                 else max(1, int(config.num_epochs * steps_per_epoch)))
  local_batch = config.batch_size // jax.process_count()

  schedule = learning_rate_schedule(config, steps_per_epoch, total_steps)
  inner = create_inner_optimizer(config, schedule)
  tx = create_optimizer(config, inner)
  model = create_model(config, info.num_classes, AXIS)
  dp = create_data_parallel(config, model, tx, mesh)
  state, spec = create_train_state(config, mesh, info, dp)
  train_step = make_train_step(dp)
  eval_step = make_eval_step(model, mesh, spec)

  mngr = _checkpoint_manager(workdir, config)
  if mngr is not None and mngr.latest_step() is not None:
    state = _restore(mngr, state)
  start_call = int(jax.device_get(state.step))
  start_step = start_call // k
  log = MetricsLog(workdir, quiet=quiet)
  is_main = jax.process_index() == 0
  if is_main and not quiet:
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    print(f"{config.model} ({n_params / 1e6:.2f}M parameters) on {config.dataset}: "
          f"{mesh.size} devices in {jax.process_count()} process(es), batch {config.batch_size} "
          f"x accum {k}, bits={config.bits}, {total_steps} optimizer steps"
          + (f", resuming at step {start_step}" if start_step else ""))

  batches = input_pipeline.train_iterator(config, local_batch, start_step=start_call,
                                          process_index=jax.process_index(),
                                          process_count=jax.process_count())
  result: dict[str, Any] = {}
  first = _global_batch(mesh, next(batches))
  if config.measure_sync_steps:
    local_step = make_local_step(config, model, inner, mesh, spec)
    result.update(measure_sync_overhead(train_step, local_step, state, first, config))
    log.write(start_step, "timing", result)

  bar = None
  if is_main and config.progress_bar and not quiet and sys.stdout.isatty():
    bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
  echo = bar.write if bar else print
  recent: list[float] = []
  train_loss = float("nan")
  t_start = time.perf_counter()
  batch = first
  for step in range(start_step, total_steps):
    t0 = time.perf_counter()
    for _ in range(k):
      state, metrics = train_step(state, batch)
      batch = _global_batch(mesh, next(batches))
    metrics = jax.device_get(metrics)  # waits for the step
    dt = time.perf_counter() - t0
    recent = (recent + [dt])[-20:]
    train_loss = float(metrics["loss"])
    if not np.isfinite(train_loss):
      raise FloatingPointError(f"training diverged at step {step + 1}: loss {train_loss}")
    done = step + 1
    if bar:
      med = float(np.median(recent))
      post = {"loss": f"{train_loss:.3f}", "step_s": f"{med:.3f}",
              "img/s": f"{examples_per_step / med:.0f}"}
      if "step_time_nosync" in result:
        post["eff"] = f"{min(1.0, result['step_time_nosync'] * k / med):.2f}"
      bar.set_postfix(post, refresh=False)
      bar.update(1)
    if done % config.log_every_steps == 0 or done == total_steps:
      log.write(done, "train", {"loss": train_loss, "accuracy": metrics["accuracy"],
                                "learning_rate": schedule(done - 1),
                                "step_seconds": float(np.median(recent)),
                                "images_per_second": examples_per_step / float(np.median(recent))},
                echo)
    if config.eval_every_steps and done % config.eval_every_steps == 0 and done != total_steps:
      log.write(done, "eval", evaluate(eval_step, state, config, mesh, local_batch), echo)
    if mngr is not None and config.checkpoint_every_steps and \
        done % config.checkpoint_every_steps == 0:
      _save(mngr, done * k, state)
    if stop_after is not None and done >= stop_after:
      if mngr is not None:
        _save(mngr, done * k, state)
        mngr.wait_until_finished()
      if bar:
        bar.close()
      log.close()
      return {**result, "steps": done, "params_checksum": params_checksum(state.params),
              "stopped": True}
  result["train_seconds"] = time.perf_counter() - t_start
  if bar:
    bar.close()
  if mngr is not None:
    _save(mngr, total_steps * k, state)
    mngr.wait_until_finished()
  final = evaluate(eval_step, state, config, mesh, local_batch)
  log.write(total_steps, "eval", final)
  log.close()
  result.update(eval_accuracy=final["accuracy"], eval_loss=final["loss"], train_loss=train_loss,
                steps=total_steps, bits=config.bits, accum_steps=k,
                params_checksum=params_checksum(state.params),
                replicas_identical=replicas_identical(state.params))
  return result


def _save(mngr, call: int, state: TrainState) -> None:
  if mngr.latest_step() != call:
    mngr.save(call, args=ocp.args.StandardSave(state))


def main(argv) -> None:
  del argv
  config = flags.FLAGS.config
  initialize_processes(config)
  result = train_and_evaluate(config, flags.FLAGS.workdir or None)
  # Every process reports, so that a launcher's log shows the replicas agree.
  print(json.dumps({"process_index": jax.process_index(), **result}))


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "path to a config file (configs/*.py)",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "where checkpoints, metrics.jsonl and TensorBoard logs go")
  flags.mark_flags_as_required(["config"])
  app.run(main)
