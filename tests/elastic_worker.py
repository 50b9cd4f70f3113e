"""One process of an elastic diloco run (tests/test_elastic.py): linear regression, one replica
per process, a JSON line per synchronisation in ``<out>/rank<r>.jsonl``.

    python -m jax_qcomm.tools.launch -n 3 --elastic tests/elastic_worker.py OUT STEPS SLEEP \
        [nnx | sync [collective@RANK] [admission@RANK]]

With ``nnx`` the same model is an ``nnx.Module`` stepped by ``qcomm.nnx_data_parallel(...,
elastic=True)``; with ``sync`` the optimizer is per-step data parallelism, ``qcomm.sync`` with 4
bits and 2 accumulation steps, and a "sync" line is written at every optimizer step; the
``WHERE@RANK`` arguments make that rank die once at that point (below).
"""

import hashlib
import json
import os
import signal
import sys
import threading
import time

import numpy as np

from jax_qcomm.tools import distributed

distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jax_qcomm as qcomm  # noqa: E402

out, steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
NNX, SYNC = sys.argv[4:5] == ["nnx"], sys.argv[4:5] == ["sync"]
# WHERE@RANK (sync mode): that rank's first incarnation kills itself (SIGKILL) once, "admission":
# as it enters the transfer of the group's state to a restarted process (the others wait in it);
# "collective": just after it dispatched its 30th step's round (the others wait in the collective).
DIE = dict(arg.split("@") for arg in sys.argv[5:])
rank, n = jax.process_index(), jax.process_count()
DIM, ROWS = 37, 12  # 37 does not split over 2 or 3 replicas
w_true = np.random.default_rng(0).normal(size=(DIM,)).astype(np.float32)


def batch(step: int) -> dict:
  rng = np.random.default_rng(1000 * step + rank)
  x = rng.normal(size=(ROWS, DIM)).astype(np.float32)
  return {"x": x, "y": x @ w_true + 0.1 * rng.normal(size=(ROWS,)).astype(np.float32)}


def loss_fn(p, b):
  return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


mesh = distributed.global_mesh(("node",))
if SYNC:
  tx = qcomm.sync(optax.sgd(0.05), axis_name="node", codec=qcomm.QSGD(4), accum_steps=2)
else:
  tx = qcomm.diloco(optax.sgd(0.05), axis_name="node", every=4, codec=qcomm.QSGD(4),
                    outer=optax.sgd(1.0))
if NNX:
  from flax import nnx  # noqa: E402

  class Linear(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(np.zeros((DIM,), np.float32))
      self.b = nnx.Param(np.zeros((), np.float32))

  model = Linear()
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  ndp = qcomm.nnx_data_parallel(lambda m, b: loss_fn({"w": m.w[...], "b": m.b[...]}, b), mesh,
                                axis_name="node", elastic=True)
  ndp.join(model, opt, batch(0))
  dp = ndp.runner
  calls = lambda: ndp.calls(opt)  # noqa: E731
  current = lambda: (nnx.as_pure(nnx.state(model, nnx.Param)),  # noqa: E731
                     nnx.as_pure(opt.opt_state))

  def train_step(b):
    ndp.step(model, opt, b)
    assert int(opt.step.get_value()) == ndp.calls(opt)  # the group's count
else:
  dp = qcomm.data_parallel(loss_fn, tx, mesh, axis_name="node", elastic=True)
  params = {"w": np.zeros((DIM,), np.float32), "b": np.zeros((), np.float32)}
  state = dp.init(params)
  params, state = dp.join(params, state, batch(0))
  calls = lambda: dp.calls(state)  # noqa: E731
  current = lambda: (params, state)  # noqa: E731

  def train_step(b):
    global params, state
    params, state, _, _ = dp.step(params, state, b)
log = open(os.path.join(out, f"rank{rank}.jsonl"), "a")


def _first_time(what: str) -> bool:
  marker = os.path.join(out, f"died_{what}")
  if os.path.exists(marker):
    return False
  open(marker, "w").close()
  return True


def _die(what, method, after_calls=1, delay=None):
  """Wraps dp's ``method`` to SIGKILL this process at its ``after_calls``-th call (once per run):
  before calling it, or ``delay`` seconds after calling it (from a thread)."""
  original, count = getattr(dp, method), [0]

  def wrapped(*args, **kwargs):
    count[0] += 1
    if count[0] == after_calls and _first_time(what):
      print(f"rank {rank} kills itself in {method} ({what})", flush=True)
      if delay is None:
        os.kill(os.getpid(), signal.SIGKILL)
      threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    return original(*args, **kwargs)

  setattr(dp, method, wrapped)


if SYNC and rank == int(DIE.get("admission", -1)):
  _die("admission", "_broadcast")
if SYNC and rank == int(DIE.get("collective", -1)):
  _die("collective", "_outer", after_calls=30, delay=0.001)


def record(**kw):
  log.write(json.dumps(dict(rank=rank, pid=os.getpid(), t=time.time(), **kw)) + "\n")
  log.flush()


record(event="joined", calls=calls())
while (done := calls()) < steps:
  train_step(batch(done))
  params, state = current()
  if int(state.mini_step) == 0:  # a synchronisation
    flat = np.concatenate([np.asarray(params["w"]).ravel(), np.asarray(params["b"]).ravel()])
    rounds = state.gradient_step if SYNC else state.outer_step
    digest = hashlib.sha256(flat.tobytes())
    if not SYNC:  # the replicated fields, and the replica's parameters (the anchor, just synced)
      for x in jax.tree_util.tree_leaves((state.params, state.outer_opt_state, state.key)):
        digest.update(np.asarray(x).tobytes())
    record(event="sync", outer_step=int(rounds), calls=calls(), anchor=digest.hexdigest()[:16],
           replicas=dp.replicas_per_sync[-1] if dp.replicas_per_sync else None)
  time.sleep(pause)
params, state = current()
x_eval = np.random.default_rng(7).normal(size=(64, DIM)).astype(np.float32)
final = float(loss_fn(jax.device_get(params), {"x": x_eval, "y": x_eval @ w_true}))
record(event="done", loss=final, replicas_per_sync=dp.replicas_per_sync)
