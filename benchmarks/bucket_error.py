"""The bucket size against the error and the bytes of QSGD's allreduce, on synthetic and real gradients.

For each bit width and bucket size: the wire bits per value (the codec's own count,
``QSGD.wire_bits``) and the relative error of the mean, ||allreduce(g) - mean(g)|| / ||mean(g)||,
of the D = 2 allreduce ``sync(bits=b)`` runs (QSGD's scatter-reduce-allgather, stochastic
rounding, the mean of ``--keys`` rounding keys), on three kinds of gradient:

* ``normal``: standard normal values, 1M per device;
* ``t3``: Student's t with 3 degrees of freedom, the same size (heavy tails);
* ``lm@S``: the byte-level transformer LM's gradient (``training/lm.py``, ``configs/lm_bytes.py``'s
  study model; its 118,784 values in matrices, the leaves ``sync`` compresses) after ``S`` Adam
  steps (3e-3) on one device, two devices holding the gradients of two different batches.

What a larger bucket saves is header bytes (8 per bucket for maxmin); what it costs is a wider
range per bucket, so a coarser step. Which way that trade goes depends on the gradient's tails, so
the real gradients decide the default::

    python -m benchmarks.bucket_error [--bits 2 4 8] [--buckets 64 128 256 512] [--lm-steps 0 100 600]
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm

from benchmarks import _common

AX = "data"


def relative_error(x: np.ndarray, codec, mesh: Mesh, keys: int) -> float:
  """Mean over ``keys`` rounding keys of the allreduce's relative error of the mean of x[D, n]."""
  exact = x.mean(axis=0)
  f = jax.jit(jax.shard_map(
      lambda v, key: qcomm.allreduce(v[0], AX, codec=codec, key=key)[None],
      mesh=mesh, in_specs=(P(AX), P()), out_specs=P(AX)))
  xs = jnp.asarray(x)
  errs = []
  for k in range(keys):
    got = np.asarray(f(xs, jax.random.key(k)))[0]
    errs.append(float(np.linalg.norm(got - exact) / np.linalg.norm(exact)))
  return float(np.mean(errs))


def lm_gradients(steps: Sequence[int]) -> dict[str, np.ndarray]:
  """``{"lm@S": float32[2, n]}``: the matrices' gradients of two batches after S Adam steps."""
  import optax  # noqa: PLC0415  (the LM's gradients only: flax and the corpus)
  from flax import nnx  # noqa: PLC0415

  from configs import lm_bytes  # noqa: PLC0415
  from training import lm  # noqa: PLC0415

  cfg = lm_bytes.get_config("study")
  corpus = lm.load_corpus()
  graphdef, params = nnx.split(lm.create_model(cfg, nnx.Rngs(0)), nnx.Param)
  tx = optax.adam(3e-3)
  opt = tx.init(params)
  loss = lambda p, w: lm.window_loss(graphdef, p, w).mean()  # noqa: E731
  grad = jax.jit(jax.grad(loss))

  @jax.jit
  def step(params, opt, w):
    u, opt = tx.update(grad(params, w), opt, params)
    return optax.apply_updates(params, u), opt

  def batch(seed, call):
    return jnp.asarray(lm.train_windows(corpus.train, seed, call, cfg.batch_size, cfg.seq_len))

  out, done = {}, 0
  for s in sorted(steps):
    for i in range(done, s):
      params, opt = step(params, opt, batch(0, i))
    done = s
    gs = [grad(params, batch(7, 10_000 + g)) for g in range(2)]
    rows = [np.concatenate([np.ravel(a) for a in jax.tree.leaves(g) if a.ndim >= 2])
            for g in gs]
    out[f"lm@{s}"] = np.stack(rows).astype(np.float32)
  return out


def run(bits: Sequence[int], buckets: Sequence[int], lm_steps: Sequence[int], size: int,
        keys: int) -> list[dict]:
  """One row per (bits, bucket): ``wire_bits`` and each gradient's error (needs 2 devices)."""
  if len(jax.devices()) < 2:
    raise ValueError(f"needs 2 devices, got {len(jax.devices())}")
  mesh = Mesh(np.array(jax.devices()[:2]), (AX,))
  rng = np.random.default_rng(0)
  grads = {"normal": rng.standard_normal((2, size)).astype(np.float32),
           "t3": rng.standard_t(3, (2, size)).astype(np.float32)}
  grads.update(lm_gradients(lm_steps) if lm_steps else {})
  rows = []
  for b in bits:
    for bucket in buckets:
      codec = qcomm.QSGD(b, bucket)
      row = dict(bits=b, bucket=bucket, wire_bits=codec.wire_bits(2))
      for name, x in grads.items():
        row[name] = relative_error(x, codec, mesh, keys)
      rows.append(row)
      _common.log("  " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                   for k, v in row.items()))
  return rows


def markdown(rows: list[dict]) -> str:
  kinds = [k for k in rows[0] if k not in ("bits", "bucket", "wire_bits")]
  lines = ["| bits | bucket | wire bits / value | " + " | ".join(kinds) + " |",
           "|--:|--:|--:|" + "--:|" * len(kinds)]
  for r in rows:
    lines.append(f"| {r['bits']} | {r['bucket']} | {r['wire_bits']:.3f} | "
                 + " | ".join(f"{r[k]:.3f}" for k in kinds) + " |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8], help="default: 2 4 8")
  ap.add_argument("--buckets", type=int, nargs="+", default=[64, 128, 256, 512],
                  help="bucket sizes, positive multiples of 8 (default: 64 128 256 512)")
  ap.add_argument("--lm-steps", type=int, nargs="*", default=[0, 100, 600],
                  help="Adam steps before each LM gradient (default: 0 100 600; none: no LM)")
  ap.add_argument("--size", type=_common.parse_size, default=1 << 20,
                  help="values per device of the synthetic gradients (default: 1048576)")
  ap.add_argument("--keys", type=int, default=3, help="rounding keys averaged (default: 3)")
  ap.add_argument("--out", default=None, help="write the rows and the run's metadata as JSON")
  args = ap.parse_args(argv)
  for b in args.buckets:
    if b < 8 or b % 8:
      ap.error(f"--buckets must be positive multiples of 8, got {b}")
  if any(s < 0 for s in args.lm_steps):
    ap.error(f"--lm-steps must be >= 0, got {args.lm_steps}")
  if args.keys < 1:
    ap.error(f"--keys must be >= 1, got {args.keys}")
  jax.config.update("jax_num_cpu_devices", 2)
  command = ["python", "-m", "benchmarks.bucket_error", *(sys.argv[1:] if argv is None else argv)]
  meta = _common.run_metadata(command)
  rows = run(args.bits, args.buckets, args.lm_steps, args.size, args.keys)
  print(markdown(rows))
  print(f"\n{_common.machine_line(meta)}  {meta['date']}")
  if args.out:
    _common.write_json(args.out, dict(metadata=meta, rows=rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
