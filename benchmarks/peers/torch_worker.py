"""PyTorch's DDP gradient compression on ResNet-50's gradient, in torch's own layout: the peer
rows beside jax_qcomm's on the simulated cluster. One process per node, gloo, in a venv with torch
(Python 3.11 here; torch is never needed by the library, the trainer or the tests)::

    python -m jax_qcomm.tools.cluster --nodes 2 --rate 1gbit --local-devices 1 \\
        --python /work/torchenv/bin/python --out F.json -- benchmarks/peers/torch_worker.py

(``--scale 8 --repeats 2`` for a smoke run; ``--malloc glibc`` before ``--`` runs it without the
launcher's ``MALLOC_*`` tuning, as under torchrun). The venv, from the CPU wheel on this machine
(``pip install torch`` would pick 2.14.1, a CUDA build)::

    python3.11 -m venv /work/torchenv
    /work/torchenv/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl numpy

(numpy: torch's PowerSGD hook imports it when its state is made.)

It joins a gloo group from the launcher's environment (``QCOMM_COORDINATOR`` host:port of node 0,
``QCOMM_NUM_PROCESSES``, ``QCOMM_PROCESS_ID``, gloo on ``QCOMM_GLOO_INTERFACE``), or from
torchrun's (``MASTER_ADDR``, ``RANK``, ...) without them.

The gradient: the 161 parameters of torchvision's ``resnet50()`` (1000 classes; 25,557,032 values),
shapes written out below in torchvision's order and layout (conv OIHW, fc (out, in), batch-norm
weight and bias) so that torchvision is not needed; each rank's gradient is standard normal from
``torch.Generator().manual_seed(SEED + rank)``. A module holds one parameter per tensor and its
"loss" is ``sum_i (p_i * g_i).sum()``, so that backward yields exactly ``g`` for little compute.

Rows, as DDP users get them (``DistributedDataParallel``, default ``bucket_cap_mb`` but for
PowerSGD, gradients set to None before each step as ``zero_grad`` does):

* ``ddp_fp32``: no hook (DDP's built-in float32 allreduce);
* ``ddp_fp16`` / ``ddp_bf16``: ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook`` (a
  row with ``status: "refused"`` and torch's message where gloo refuses bfloat16);
* ``ddp_powersgd<r>`` (default r = 1 and 4): ``powerSGD_hook.powerSGD_hook`` with
  ``PowerSGDState(matrix_approximation_rank=r, start_powerSGD_iter=2, use_error_feedback=True,
  warm_start=True)``; 2 is the least start torch allows with error feedback or warm start (steps
  0-1 are plain allreduce), so the warm-up is at least 3 steps and every timed step compresses.
  In ONE bucket (``bucket_cap_mb`` above the gradient's size, as the removed harness did): with
  several, the hook deadlocks on gloo (torch 2.13). Its P and Q allreduces are started and
  ``.wait()``-ed inside ``Future.then`` callbacks, which run on the process group's worker threads
  (gloo has 2); with two buckets in flight both threads block in such a wait and none is left to
  run the allreduces they wait for (seen with faulthandler: one thread in
  ``unpack_uncompressed_tensors_and_allreduce_ps``, one in ``compute_qs``, backward waiting).
  One bucket starts communicating when backward has ended (no overlap; the backward is trivial).

Each step times ``loss.backward()`` alone twice: through DDP (it returns once the hook's future has
filled ``.grad``) and on the bare module (no communication, ``local``); a step's time is the
slowest rank's (an allreduce of MAX over the ranks). ``median_s`` is the median over the timed
steps of synced - local, the communication part; ``synced_median_s`` and ``local_median_s`` are
kept too. ``rel_error`` is ``||.grad - mean|| / ||mean||`` over the whole gradient on the first
timed step, the exact mean being a float32 ``all_reduce`` of the flat gradient / world size;
``rel_error_steps`` has every step's, for PowerSGD ``rel_error_first_compressed`` its first
compressed step (its error feedback and warm start improve over steps on a fixed gradient).

``powersgd_elements``: per rank r, what PowerSGD's own rule compresses. The hook views each tensor
as a matrix (shape[0], rest), takes r' = min(n, m, r) and compresses it iff
``_should_compress(n, m, r', min_compression_rate=2)``, i.e. (n + m) r' 2 < n m; 1-D tensors
(m = 1) never pass. Counted here with the hook's own ``_should_compress`` and checked against the
decisions the hook itself took on the first compressed step (its ``_should_compress`` is wrapped to
record them): the same (n, m) -> decision for every tensor, and the P and Q buffers it allocated
have the predicted sizes. ``skipped_2d`` names the tensors of rank >= 2 the rule leaves
uncompressed (none at full size).

Output: JSON (``--out``, else the last line of rank 0's stdout) ``{"metadata": {...}, "rows":
{name: {...}}, "powersgd_elements": {...}}``; a table on stderr.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

# Run as a script from any directory: the repository root holds the jax-free benchmarks._machine.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks._machine import cpu_model  # noqa: E402

SEED = 7
RESNET50_TENSORS = 161
RESNET50_VALUES = 25_557_032
ROWS = ("ddp_fp32", "ddp_fp16", "ddp_bf16", "ddp_powersgd1", "ddp_powersgd4")
POWERSGD_START = 2  # the least start_powerSGD_iter torch allows with error feedback / warm start


# -- the gradient --------------------------------------------------------------------------------------

def resnet50_shapes(scale: int = 1) -> list[tuple[str, tuple[int, ...]]]:
  """torchvision ``resnet50()``'s parameters (name, shape) in ``named_parameters()`` order; with
  ``scale`` > 1 every channel count (and the 1000 classes) divided by it, for smoke runs."""
  def c(n: int) -> int:
    return max(1, n // scale)

  def bn(name: str, n: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"{name}.weight", (c(n),)), (f"{name}.bias", (c(n),))]

  out = [("conv1.weight", (c(64), 3, 7, 7)), *bn("bn1", 64)]
  inplanes = 64
  for layer, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
    for b in range(blocks):
      p = f"layer{layer}.{b}"
      out += [(f"{p}.conv1.weight", (c(planes), c(inplanes), 1, 1)), *bn(f"{p}.bn1", planes),
              (f"{p}.conv2.weight", (c(planes), c(planes), 3, 3)), *bn(f"{p}.bn2", planes),
              (f"{p}.conv3.weight", (c(4 * planes), c(planes), 1, 1)), *bn(f"{p}.bn3", 4 * planes)]
      if b == 0:  # the projection shortcut: conv 1x1 + batch norm
        out += [(f"{p}.downsample.0.weight", (c(4 * planes), c(inplanes), 1, 1)),
                *bn(f"{p}.downsample.1", 4 * planes)]
      inplanes = 4 * planes
  out += [("fc.weight", (c(1000), c(2048))), ("fc.bias", (c(1000),))]
  if scale == 1:
    values = sum(math.prod(s) for _, s in out)
    assert (len(out), values) == (RESNET50_TENSORS, RESNET50_VALUES), (len(out), values)
  return out


class GradientModel(nn.Module):
  """One parameter per tensor; ``forward()`` is sum_i (p_i * g_i).sum(), so backward gives each
  parameter the fixed gradient g_i (a fresh tensor: DDP's copies never touch g)."""

  def __init__(self, shapes: Sequence[tuple[int, ...]], grads: Sequence[torch.Tensor]):
    super().__init__()
    self.params = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])
    self.grads = list(grads)  # a plain attribute, not buffers: DDP would broadcast buffers

  def forward(self) -> torch.Tensor:
    return sum((p * g).sum() for p, g in zip(self.params, self.grads))


# -- PowerSGD's rule ------------------------------------------------------------------------------------

def powersgd_elements(names: Sequence[str], shapes: Sequence[tuple[int, ...]], rank: int,
                      min_compression_rate: float = 2) -> dict[str, Any]:
  """What ``powerSGD_hook`` compresses at ``rank`` (its own view and ``_should_compress``)."""
  out = dict(compressed=0, uncompressed=0, uncompressed_1d=0, p=0, q=0, matrices=0, skipped_2d=[],
             decisions=[])
  for name, shape in zip(names, shapes):
    n = shape[0]
    m = math.prod(shape) // n
    r = min(n, m, rank)
    ok = bool(powerSGD_hook._should_compress(n, m, r, min_compression_rate)[0])
    out["decisions"].append((n, m, ok))
    if ok:
      out.update(compressed=out["compressed"] + n * m, p=out["p"] + n * r, q=out["q"] + m * r,
                 matrices=out["matrices"] + 1)
      continue
    out["uncompressed"] += n * m
    if len(shape) >= 2:
      out["skipped_2d"].append(name)
    else:
      out["uncompressed_1d"] += n * m
  return out


class _HookDecisions:
  """Wraps ``powerSGD_hook._should_compress`` (the hook calls the module's global) to record the
  hook's own (n, m, decision) per tensor."""

  def __init__(self):
    self.original = powerSGD_hook._should_compress
    self.calls: list[tuple[int, int, bool]] = []

  def __call__(self, n, m, r, min_compression_rate):
    result = self.original(n, m, r, min_compression_rate)
    self.calls.append((int(n), int(m), bool(result[0])))
    return result

  def __enter__(self):
    powerSGD_hook._should_compress = self
    return self

  def __exit__(self, *exc):
    powerSGD_hook._should_compress = self.original


# -- process group and timing ---------------------------------------------------------------------------

def init_group() -> tuple[int, int]:
  """Joins gloo from the cluster launcher's environment (else torchrun's); (rank, world size)."""
  if "QCOMM_COORDINATOR" not in os.environ:
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()
  host, port = os.environ["QCOMM_COORDINATOR"].rsplit(":", 1)
  if os.environ.get("QCOMM_GLOO_INTERFACE"):  # else gloo binds the hostname's address (loopback)
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["QCOMM_GLOO_INTERFACE"]
  rank, world = int(os.environ["QCOMM_PROCESS_ID"]), int(os.environ["QCOMM_NUM_PROCESSES"])
  dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
                          timeout=datetime.timedelta(minutes=30))
  return rank, world


def slowest(times: Sequence[float]) -> list[float]:
  """Per step, the slowest rank's time."""
  t = torch.tensor(list(times), dtype=torch.float64)
  dist.all_reduce(t, op=dist.ReduceOp.MAX)
  return t.tolist()


def timed_backward(module: nn.Module, params: Sequence[nn.Parameter]) -> float:
  """Forward (untimed), then ``loss.backward()`` timed from a barrier; gradients set to None
  first."""
  for p in params:
    p.grad = None
  loss = module()
  dist.barrier()
  start = time.perf_counter()
  loss.backward()
  return time.perf_counter() - start


def rel_error(params: Sequence[nn.Parameter], mean: Sequence[torch.Tensor]) -> float:
  err2 = ref2 = 0.0
  for p, ref in zip(params, mean):
    d = p.grad.double() - ref.double()
    err2 += float(d.pow(2).sum())
    ref2 += float(ref.double().pow(2).sum())
  return math.sqrt(err2 / ref2)


# -- rows ------------------------------------------------------------------------------------------------

def powersgd_rank(row: str) -> int | None:
  tail = row.removeprefix("ddp_powersgd")
  return int(tail) if tail != row and tail.isdigit() and int(tail) >= 1 else None


def run_row(row: str, model: GradientModel, mean: Sequence[torch.Tensor],
            expected: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, Any]:
  """Times one row (see the module docstring); a refused hook gives ``status: "refused"``."""
  r = powersgd_rank(row)
  cap = args.bucket_cap_mb
  if r is not None:  # one bucket unless told otherwise (module docstring: gloo deadlocks)
    values = sum(p.numel() for p in model.params)
    cap = args.powersgd_bucket_cap_mb or math.ceil(4 * values / 2**20) + 1
  ddp = DDP(model, **({} if cap is None else dict(bucket_cap_mb=cap)))
  state = None
  if r is not None:
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=POWERSGD_START,
        use_error_feedback=True, warm_start=True)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
  elif row == "ddp_fp16":
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
  elif row == "ddp_bf16":
    try:  # DDP refuses it without NCCL (CUDA) or XCCL (XPU): gloo is neither
      ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    except (TypeError, RuntimeError) as e:
      return dict(status="refused", error=f"{type(e).__name__}: {e}", median_s=None)
  elif row != "ddp_fp32":
    raise ValueError(f"unknown row {row!r}")
  warmup = max(args.warmup, POWERSGD_START + 1) if state is not None else args.warmup
  params = list(model.params)
  local, synced, errors = [], [], []
  for step in range(warmup + args.repeats):
    t_local = timed_backward(model, params)
    with _HookDecisions() as decisions:
      t_synced = timed_backward(ddp, params)
    errors.append(rel_error(params, mean))
    if state is not None and step == POWERSGD_START:
      check_powersgd(decisions.calls, state, expected)
    if step >= warmup:
      local.append(t_local)
      synced.append(t_synced)
  buckets = _bucket_count(ddp)
  del ddp
  gc.collect()  # the next row's DDP wraps the same parameters: this one's reducer goes first
  local, synced = slowest(local), slowest(synced)
  comm = [s - l for s, l in zip(synced, local)]
  out = dict(status="ok", median_s=statistics.median(comm), times_s=comm,
             synced_median_s=statistics.median(synced), local_median_s=statistics.median(local),
             synced_times_s=synced, local_times_s=local, rel_error=errors[warmup],
             rel_error_steps=errors, warmup=warmup, repeats=args.repeats, bucket_cap_mb=cap,
             ddp_buckets=buckets)
  if state is not None:
    out.update(rel_error_first_compressed=errors[POWERSGD_START],
               start_powerSGD_iter=POWERSGD_START)
  return out


def _bucket_count(ddp: DDP) -> int | None:
  """DDP's buckets in the timed steps (rebuilt after the first), from its logging data (private:
  None where that fails)."""
  try:
    info = ddp._get_ddp_logging_data()
    sizes = info["rebuilt_bucket_sizes"] if info.get("has_rebuilt_buckets") else info["bucket_sizes"]
    return len([v for v in str(sizes).split(",") if v.strip()])
  except Exception:  # noqa: BLE001  (a note, never worth failing the run)
    return None


def check_powersgd(calls: list[tuple[int, int, bool]], state, expected: dict[str, Any]) -> None:
  """The hook's own decisions on its first compressed step are the predicted ones, and its P / Q
  buffers have the predicted sizes (every tensor the rule does not skip was compressed)."""
  assert sorted(calls) == sorted(expected["decisions"]), "PowerSGD decided otherwise than predicted"
  p = sum(t.numel() for t in state.p_memory_dict.values())
  q = sum(t.numel() for t in state.q_memory_dict.values())
  assert (p, q) == (expected["p"], expected["q"]), ((p, q), (expected["p"], expected["q"]))


# -- command line ------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="torch_worker.py", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rows", nargs="+", default=list(ROWS),
                 help=f"rows to time, ddp_powersgd<r> for any rank r (default: {' '.join(ROWS)})")
  p.add_argument("--repeats", type=int, default=7, help="timed steps per row (default: 7)")
  p.add_argument("--warmup", type=int, default=3,
                 help=f"untimed steps first (default: 3; PowerSGD: at least {POWERSGD_START + 1})")
  p.add_argument("--bucket-cap-mb", type=float, default=None,
                 help="DDP's bucket_cap_mb (default: DDP's own, 25)")
  p.add_argument("--powersgd-bucket-cap-mb", type=float, default=None,
                 help="bucket_cap_mb of the PowerSGD rows (default: the whole gradient in one "
                      "bucket; several deadlock on gloo, see above)")
  p.add_argument("--scale", type=int, default=1,
                 help="smoke runs only: divide every channel count by this (default: 1, ResNet-50)")
  p.add_argument("--out", default=None, help="JSON written by rank 0 (default: its stdout)")
  args = p.parse_args(argv)
  for row in args.rows:
    if row not in ROWS and powersgd_rank(row) is None:
      p.error(f"unknown row {row!r}")
  if args.repeats < 1 or args.warmup < 0 or args.scale < 1:
    p.error("--repeats and --scale must be >= 1, --warmup >= 0")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  torch.set_num_threads(len(os.sched_getaffinity(0)))  # one thread per core this node may use
  rank, world = init_group()
  named = resnet50_shapes(args.scale)
  names, shapes = [n for n, _ in named], [s for _, s in named]
  gen = torch.Generator().manual_seed(SEED + rank)
  grads = [torch.randn(s, generator=gen) for s in shapes]
  flat = torch.cat([g.reshape(-1) for g in grads])  # the exact mean: fp32 all_reduce / world
  dist.all_reduce(flat)
  flat.div_(world)
  mean = [t.view(s) for t, s in zip(torch.split(flat, [math.prod(s) for s in shapes]), shapes)]
  model = GradientModel(shapes, grads)
  elements = {f"rank{r}": powersgd_elements(names, shapes, r)
              for r in sorted({powersgd_rank(row) for row in args.rows} - {None})}
  rows = {}
  for row in args.rows:
    r = powersgd_rank(row)
    rows[row] = run_row(row, model, mean, elements.get(f"rank{r}"), args)
    if rank == 0:
      med = rows[row]["median_s"]
      print(f"[torch] {row:<15} " + (f"comm {1e3 * med:8.1f} ms (synced "
            f"{1e3 * rows[row]['synced_median_s']:.1f}, local {1e3 * rows[row]['local_median_s']:.1f})"
            f"  rel_error {rows[row]['rel_error']:.3g}" if med is not None else rows[row]["status"]),
            file=sys.stderr, flush=True)
  for e in elements.values():
    del e["decisions"]
  if rank == 0:
    meta = dict(benchmark="peers.torch_worker", torch_version=torch.__version__,
                python=platform.python_version(), world_size=world, scale=args.scale,
                tensors=len(shapes), values=sum(math.prod(s) for s in shapes),
                bucket_cap_mb=args.bucket_cap_mb, torch_threads=torch.get_num_threads(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                hostname=socket.gethostname(), cpu_model=cpu_model(),
                gloo_interface=os.environ.get("GLOO_SOCKET_IFNAME"),
                malloc_env={k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
                command=" ".join(["torch_worker.py", *sys.argv[1:]]),
                config=dict(rows=args.rows, repeats=args.repeats, warmup=args.warmup, seed=SEED))
    text = json.dumps(dict(metadata=meta, rows=rows, powersgd_elements=elements))
    if args.out:
      with open(args.out, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    else:
      print(text, flush=True)
  dist.barrier()
  dist.destroy_process_group()
  return 0


if __name__ == "__main__":
  sys.exit(main())
