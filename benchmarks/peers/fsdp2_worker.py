"""PyTorch FSDP2 (``fully_shard``) training the byte LM's shapes on the simulated cluster: the peer
row of the sharded-parameter table (benchmarks/zero3_step.py). One process per node, gloo, in the
venv with torch (see benchmarks/peers/torch_worker.py for the venv)::

    python -m jax_qcomm.tools.cluster --nodes 2 --rate 1gbit --local-devices 1 \\
        --python /work/torchenv/bin/python --out F.json -- benchmarks/peers/fsdp2_worker.py \\
        --d-model 512 --layers 4 --batch 8 --seq-len 32 --steps 8

The model has the shapes of ``training/lm.py``'s transformer (byte embedding 256 x d tied to the
output, learned positions, pre-LayerNorm blocks of a fused q/k/v projection, causal attention, an
output projection and a 4x MLP, a final LayerNorm), written in torch's own layout (``nn.Linear``
``(out, in)``). As FSDP2's users shard a transformer: ``fully_shard`` on every block, then on the
root, with the default ``reshard_after_forward=True`` (each block's parameters gathered in forward,
freed, gathered again in backward; gradients reduce-scattered), AdamW on the sharded parameters.
Rows: ``fsdp2_fp32`` (float32 everywhere) and ``fsdp2_bf16`` (``MixedPrecisionPolicy(param_dtype=
bfloat16, reduce_dtype=float32)``: the gathers in bfloat16; a row with ``status: "refused"`` and
torch's message where gloo refuses it). A step is forward, loss, backward, ``optimizer.step()``
and ``zero_grad()``; its time is the slowest rank's; the median over ``--steps`` after 3 warm-up
steps. Output: JSON (``--out`` or the last line of rank 0's stdout).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks._lm_step import add_shape_args  # noqa: E402
from benchmarks._machine import cpu_model  # noqa: E402
from benchmarks.peers.torch_worker import init_group, slowest  # noqa: E402


class Block(nn.Module):
  def __init__(self, d: int, heads: int):
    super().__init__()
    self.heads = heads
    self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
    self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
    self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

  def forward(self, x):
    b, t, d = x.shape
    q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
    y = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                   v.transpose(1, 2), is_causal=True)
    x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
    return x + self.proj(nn.functional.gelu(self.fc(self.ln2(x))))


class LM(nn.Module):
  def __init__(self, d: int, layers: int, heads: int, seq_len: int):
    super().__init__()
    self.embed, self.pos = nn.Embedding(256, d), nn.Embedding(seq_len, d)
    self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
    self.ln_f = nn.LayerNorm(d)
    for table in (self.embed, self.pos):  # lm.py's initialiser: normal(0.02)
      nn.init.normal_(table.weight, std=0.02)

  def forward(self, tokens):
    x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
    for block in self.blocks:
      x = block(x)
    return self.ln_f(x) @ self.embed.weight.T


def run_row(name: str, args, rank: int, world: int) -> dict:
  torch.manual_seed(0)
  model = LM(args.d_model, args.layers, 4, args.seq_len)
  kw = {}
  if name == "fsdp2_bf16":
    kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
  for block in model.blocks:
    fully_shard(block, **kw)
  fully_shard(model, **kw)
  opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
  gen = torch.Generator().manual_seed(rank)
  rows = args.batch // world
  tokens = torch.randint(0, 256, (rows, args.seq_len + 1), generator=gen)
  times = []
  for i in range(args.steps + 3):
    t0 = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, 256), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    if i >= 3:
      times.append(time.perf_counter() - t0)
  times = slowest(times)
  params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the global one's
  return {"row": name, "step_s_median": statistics.median(times), "step_s": times,
          "loss": float(loss), "parameters": params}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_shape_args(ap)
  ap.add_argument("--rows", default="fsdp2_fp32,fsdp2_bf16")
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  torch.set_num_threads(len(os.sched_getaffinity(0)))
  rank, world = init_group()
  result = {"metadata": {
      "command": "benchmarks/peers/fsdp2_worker.py " + " ".join(argv or sys.argv[1:]),
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "cpu": cpu_model(), "torch": torch.__version__, "python": platform.python_version(),
      "world": world, "threads": torch.get_num_threads()}, "rows": {}}
  for name in args.rows.split(","):
    try:
      row = run_row(name, args, rank, world)
    except RuntimeError as e:  # gloo refusing a dtype
      row = {"row": name, "status": "refused", "error": str(e)[:500]}
    result["rows"][name] = row
    if rank == 0:
      print(json.dumps({k: v for k, v in row.items() if k != "step_s"}), file=sys.stderr,
            flush=True)
  if rank == 0:
    text = json.dumps(result)
    if args.out:
      with open(args.out, "w") as f:
        f.write(text)
    print(text, flush=True)
  dist.barrier()  # every rank done before the group goes (gloo aborted a rank leaving early)
  dist.destroy_process_group()
  return 0


if __name__ == "__main__":
  sys.exit(main())
