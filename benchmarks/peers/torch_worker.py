"""The PyTorch side of the peers benchmark: one process per node, in the torch venv (Python 3.11).

Started on every node of the simulated cluster by :mod:`benchmarks.peers.run` (never by the
library, its trainer or its tests)::

    .venv-torch/bin/python -m benchmarks.peers.torch_worker --spec SPEC.json --out F.json

It reads the launcher's environment (``QCOMM_COORDINATOR`` host:port, ``QCOMM_NUM_PROCESSES``,
``QCOMM_PROCESS_ID``, ``QCOMM_GLOO_INTERFACE``), joins a gloo process group on the node's link, and
times on the spec's payload (:mod:`benchmarks.peers.data`: the same bytes the JAX side reduces):

* ``allreduce_fp32``: ``dist.all_reduce`` of the whole payload as one flat float32 tensor (then
  divided by the world size), timed without the copy that refills it;
* ``ddp_fp32``, ``ddp_fp16``, ``ddp_bf16``, ``ddp_powersgd<r>``: DistributedDataParallel over a
  module holding one parameter per leaf (so DDP buckets them as it would a model's), without a
  hook, with ``fp16_compress_hook`` / ``bf16_compress_hook``, or with PowerSGD of rank r
  (``warm_start`` and error feedback on, as its docs recommend; ``start_powerSGD_iter=2``, the
  least allowed; one bucket: with several, PowerSGD over gloo aborted with a size mismatch here).

DDP's "comm part": the forward hands the payload to autograd as the gradient (an autograd
Function whose backward returns it: no model compute), and each repeat times one backward under
``no_sync()`` and one with synchronisation; comm = synced - local, per repeat, median over
repeats. Every timed call is the slowest rank's. A refused method (torch's bf16 hook on gloo) gives
a row with ``status: "refused"`` and torch's message.

Each row also has the relative error of the result on rank 0, ``||out - exact_mean|| /
||exact_mean||`` (exact mean in float64 from the spec's inputs); for PowerSGD, at its first
compressed step (error feedback still empty) and after the last timed step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.peers import data

METHODS = data.TORCH_METHODS
DESCRIPTIONS = {
    "allreduce_fp32": "torch dist.all_reduce (gloo) of one flat float32 buffer",
    "ddp_fp32": "DDP, no hook (float32 buckets, 25 MB)",
    "ddp_fp16": "DDP fp16_compress_hook (float16 buckets, 25 MB)",
    "ddp_bf16": "DDP bf16_compress_hook",
    "ddp_powersgd": "DDP PowerSGD rank {r}, warm start, error feedback, one bucket",
}
#: DDP's bucket cap for PowerSGD: larger than any payload here, so one bucket.
ONE_BUCKET_MB = 1 << 16
POWERSGD_START = 2


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m benchmarks.peers.torch_worker",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--spec", required=True, help="payload spec (JSON, benchmarks.peers.data)")
  p.add_argument("--methods", nargs="+", default=list(METHODS),
                 help=f"methods to time (default: {' '.join(METHODS)})")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--link-gbps", type=float, default=None, help="link rate, for the floor")
  p.add_argument("--out", required=True, help="JSON written by rank 0")
  args = p.parse_args(argv)
  for m in args.methods:
    try:
      data.check_torch_method(m)
    except ValueError as e:
      p.error(str(e))
  if args.repeats < 1 or args.warmup < 1:
    p.error("--repeats and --warmup must be >= 1")
  return args


# -- process group -------------------------------------------------------------------------------------

def init_group() -> tuple[int, int]:
  """Joins the gloo group from the launcher's environment; returns (rank, world size)."""
  host, port = os.environ["QCOMM_COORDINATOR"].rsplit(":", 1)
  rank = int(os.environ["QCOMM_PROCESS_ID"])
  world = int(os.environ["QCOMM_NUM_PROCESSES"])
  iface = os.environ.get("QCOMM_GLOO_INTERFACE")
  if iface:  # gloo otherwise binds to the hostname's address (loopback here)
    os.environ["GLOO_SOCKET_IFNAME"] = iface
  dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
                          timeout=datetime.timedelta(minutes=30))
  return rank, world


def slowest(times: Sequence[float]) -> list[float]:
  """Per call, the slowest rank's time (an allreduce of MAX over the ranks)."""
  t = torch.tensor(list(times), dtype=torch.float64)
  dist.all_reduce(t, op=dist.ReduceOp.MAX)
  return t.tolist()


def timing(times: Sequence[float]) -> dict[str, Any]:
  return dict(median_s=statistics.median(times), min_s=min(times), max_s=max(times),
              times_s=list(times))


# -- methods -------------------------------------------------------------------------------------------

def bench_allreduce(leaves: list[torch.Tensor], world: int, repeats: int,
                    warmup: int) -> tuple[dict[str, Any], list[np.ndarray]]:
  """dist.all_reduce of the flat payload; returns the timing and the result's leaves."""
  flat = torch.cat([t.reshape(-1) for t in leaves])
  buf = torch.empty_like(flat)
  times = []
  for i in range(warmup + repeats):
    buf.copy_(flat)  # refill outside the timed region: the allreduce works in place
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(buf)
    buf.div_(world)
    if i >= warmup:
      times.append(time.perf_counter() - start)
  outs, offset = [], 0
  for t in leaves:
    outs.append(buf[offset:offset + t.numel()].numpy().copy())
    offset += t.numel()
  return timing(slowest(times)), outs


class _AsGradient(torch.autograd.Function):
  """Forward: a zero scalar; backward: hands the stored payload to autograd as the parameters'
  gradients. The "model" then costs nothing, and DDP reduces exactly the payload."""

  @staticmethod
  def forward(ctx, grads, *params):  # grads: a list (not an autograd input)
    ctx.grads = grads
    return params[0].new_zeros(())

  @staticmethod
  def backward(ctx, grad_out):
    return (None, *ctx.grads)


class PayloadModule(nn.Module):
  """One parameter per leaf of the payload, registered in spec order."""

  def __init__(self, shapes: Sequence[Sequence[int]]):
    super().__init__()
    self.params = nn.ParameterList([nn.Parameter(torch.zeros(tuple(s))) for s in shapes])

  def forward(self, grads: list[torch.Tensor]) -> torch.Tensor:
    return _AsGradient.apply(grads, *self.params)


def _hooked_ddp(method: str, module: PayloadModule) -> tuple[DDP, Any]:
  """DDP over ``module`` with the method's hook; (ddp, PowerSGD state or None). Raises what
  torch raises when it refuses the hook."""
  rank = data.powersgd_rank(method)
  if rank is not None:
    ddp = DDP(module, bucket_cap_mb=ONE_BUCKET_MB)
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank,
        start_powerSGD_iter=POWERSGD_START, warm_start=True, use_error_feedback=True)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp, state
  ddp = DDP(module)
  if method == "ddp_fp16":
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
  elif method == "ddp_bf16":
    ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
  elif method != "ddp_fp32":
    raise ValueError(method)
  return ddp, None


def _step(ddp: DDP, module: PayloadModule, grads: list[torch.Tensor], sync: bool) -> float:
  """One forward/backward handing ``grads`` to autograd; returns its wall time. The gradients
  are zeroed first (outside the timing) so that each step reduces exactly ``grads``."""
  for p in module.params:
    p.grad.zero_()
  dist.barrier()
  start = time.perf_counter()
  if sync:
    ddp(grads).backward()
  else:
    with ddp.no_sync():
      ddp(grads).backward()
  return time.perf_counter() - start


def bench_ddp(method: str, leaves: list[torch.Tensor], spec: dict[str, Any], world: int,
              repeats: int, warmup: int) -> dict[str, Any]:
  """Times one DDP method: local (no_sync) and synced backward per repeat, comm = the difference."""
  module = PayloadModule(data.shapes(spec))
  for p in module.params:  # pre-allocated gradients: autograd adds into them, never aliases leaves
    p.grad = torch.zeros_like(p)
  ddp, state = _hooked_ddp(method, module)
  rank = dist.get_rank()
  if state is not None:  # the first POWERSGD_START synced steps are plain allreduce
    warmup = max(warmup, POWERSGD_START + 1)
  total = warmup + repeats
  # The error is measured (on rank 0, while the others wait at the next barrier) only where it is
  # reported: after the last step, and for PowerSGD after its first compressed one.
  measure_at = {total - 1} | ({POWERSGD_START} if state is not None else set())
  errors: dict[int, float] = {}
  local, synced = [], []
  for i in range(total):
    t_local = _step(ddp, module, leaves, sync=False)
    t_sync = _step(ddp, module, leaves, sync=True)
    if rank == 0 and i in measure_at:
      errors[i] = data.relative_error((p.grad.numpy() for p in module.params), spec, world)
    if i >= warmup:
      local.append(t_local)
      synced.append(t_sync)
  local, synced = slowest(local), slowest(synced)
  comm = [s - l for s, l in zip(synced, local)]
  row = dict(timing(comm), local_median_s=statistics.median(local),
             synced_median_s=statistics.median(synced), local_times_s=local, synced_times_s=synced,
             rel_error=errors.get(total - 1), ddp_bucket_bytes=_bucket_sizes(ddp))
  if state is not None:
    row.update(rel_error_first_compressed=errors.get(POWERSGD_START),
               powersgd_start_iter=POWERSGD_START, powersgd_steps_run=total,
               bucket_cap_mb=ONE_BUCKET_MB)
  del ddp, module
  return row


def _bucket_sizes(ddp: DDP) -> list[int] | None:
  """Bytes of each DDP bucket, from DDP's logging data (a private API: None where it fails, the
  sizes are a note, never worth failing the run)."""
  try:
    info = ddp._get_ddp_logging_data()
    # DDP reduces its first step in the construction-time buckets, then rebuilds them in the order
    # gradients became ready: the timed steps use the rebuilt ones.
    text = str(info.get("rebuilt_bucket_sizes") if info.get("has_rebuilt_buckets")
               else info.get("bucket_sizes", ""))
    return [int(v) for v in text.replace(" ", "").split(",") if v]
  except Exception:
    return None


def run_method(method: str, leaves: list[torch.Tensor], spec: dict[str, Any], world: int,
               args: argparse.Namespace) -> dict[str, Any]:
  """One row: timing, wire bytes, floor and error, or the refusal."""
  shapes = data.shapes(spec)
  r = data.powersgd_rank(method)
  desc = DESCRIPTIONS[method] if r is None else DESCRIPTIONS["ddp_powersgd"].format(r=r)
  sent = data.ring_sent(data.torch_payload_bytes(method, shapes), world)
  row: dict[str, Any] = dict(framework="torch", method=method, description=desc,
                             payload=spec["payload"], elements=data.num_elements(spec),
                             leaves=len(shapes), devices=world, wire_bytes_per_device=sent,
                             link_floor_s=data.link_floor_s(sent, args.link_gbps), status="ok")
  if r is not None:
    row["powersgd_elements"] = data.powersgd_elements(shapes, r)
  try:
    if method == "allreduce_fp32":
      t, outs = bench_allreduce(leaves, world, args.repeats, args.warmup)
      row.update(t)
      if dist.get_rank() == 0:
        row["rel_error"] = data.relative_error(outs, spec, world)
    else:
      row.update(bench_ddp(method, leaves, spec, world, args.repeats, args.warmup))
  except (TypeError, RuntimeError, ValueError) as e:
    if method != "ddp_bf16":  # only the refusal is expected; anything else is a failure
      raise
    row.update(status="refused", error=f"{type(e).__name__}: {e}", median_s=None)
  if row.get("median_s") and row["link_floor_s"]:
    row["time_vs_floor"] = row["median_s"] / row["link_floor_s"]
  return row


def metadata(args: argparse.Namespace, world: int) -> dict[str, Any]:
  return dict(framework="torch", torch_version=torch.__version__, python=platform.python_version(),
              numpy_version=np.__version__, hostname=socket.gethostname(), world_size=world,
              cpus_available=sorted(os.sched_getaffinity(0)), torch_threads=torch.get_num_threads(),
              gloo_interface=os.environ.get("GLOO_SOCKET_IFNAME"),
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              command=" ".join(["python", "-m", "benchmarks.peers.torch_worker", *sys.argv[1:]]),
              config=dict(methods=args.methods, repeats=args.repeats, warmup=args.warmup,
                          link_gbps=args.link_gbps, spec=args.spec))


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  spec = data.read_spec(args.spec)
  # One intra-op thread per core this process may use (one when the node is pinned).
  torch.set_num_threads(len(os.sched_getaffinity(0)))
  rank, world = init_group()
  leaves = [torch.from_numpy(data.leaf_array(spec, rank, i)) for i in range(len(spec["leaves"]))]
  rows = []
  for method in args.methods:
    row = run_method(method, leaves, spec, world, args)
    if rank == 0:
      med = row.get("median_s")
      print(f"[torch] {spec['payload']} {method:<16} "
            + (f"{1e3 * med:9.1f} ms" if med is not None else row["status"]), file=sys.stderr,
            flush=True)
    rows.append(row)
  if rank == 0:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(dict(metadata=metadata(args, world), rows=rows), f, indent=1)
  dist.barrier()
  dist.destroy_process_group()
  return 0


if __name__ == "__main__":
  sys.exit(main())
