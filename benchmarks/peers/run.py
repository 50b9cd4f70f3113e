"""PyTorch peers and jax_qcomm on the same simulated links, in the same run.

As root, from the repository root, after ``bash benchmarks/peers/setup_torch.sh`` (the torch venv)
and, for the error column on a real gradient, ``python -m benchmarks.peers.make_gradients``::

    python -m benchmarks peers --nodes 2 --rate 1gbit --payloads resnet50 gpt2_125m \\
        --gradients resnet50=bench-results/peers/resnet50_grads.npz --repeats 5 \\
        --out notebooks/data/peers_1gbit.json

One cluster (:func:`benchmarks.cluster.run_in_cluster`: namespaces, tc-shaped links, by default
one pinned core per node) hosts, for each payload (:mod:`benchmarks.peers.payloads`) in turn:

1. the JAX side: ``python -m benchmarks allreduce --payload P`` on every node: jax_qcomm's exact
   psum (``fp32``: ``qcomm.allreduce`` with ``NoCompression``, the leaves packed into flat
   buffers), ``pmean_leaves`` (``lax.pmean`` per leaf), ``Cast(bf16)`` and QSGD 8/4/2 bits;
2. the PyTorch side: ``benchmarks.peers.torch_worker`` in the torch venv on every node: gloo
   ``all_reduce`` fp32, DDP without hook, with ``fp16_compress_hook``, ``bf16_compress_hook``
   (refused on gloo by torch: recorded as refused) and PowerSGD rank 1 and 4 (one bucket).

Both sides reduce the same inputs (:mod:`benchmarks.peers.data`) and report, per row, the bytes
each node sends, the link floor (those bytes / rate), the median time over ``--repeats`` (DDP: its
comm part, synced minus local backward), and the relative error against the exact mean. The merged
JSON (``rows`` plus ``metadata``: the cluster, both sides' metadata) is printed as markdown by
``python -m benchmarks.report peers FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Sequence

from benchmarks import _common, allreduce, cluster, report
from benchmarks.peers import data, payloads

DEFAULT_OUT = "bench-results/peers.json"
DEFAULT_TORCH_PYTHON = ".venv-torch/bin/python"
DEFAULT_PAYLOADS = ("resnet50", "gpt2_125m")
JAX_CODECS = ("fp32", "pmean_leaves", "cast_bf16", "qsgd8", "qsgd4", "qsgd2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The ``peers`` subcommand's options: the cluster's, then what to run on it."""
  cluster.add_cluster_options(parser, nodes=2)
  parser.add_argument("--payloads", type=payloads.check_name, nargs="+",
                      default=list(DEFAULT_PAYLOADS),
                      help=f"gradient payloads (default: {' '.join(DEFAULT_PAYLOADS)}; also "
                           "gpt2:<layers>x<d>x<vocab>, flat:<n>)")
  parser.add_argument("--gradients", action="append", default=[], metavar="PAYLOAD=NPZ",
                      help="real gradients for a payload (make_gradients), e.g. "
                           "resnet50=bench-results/peers/resnet50_grads.npz; others: seeded normal")
  parser.add_argument("--jax-codecs", nargs="+", default=list(JAX_CODECS),
                      help=f"jax_qcomm codecs (default: {' '.join(JAX_CODECS)}; any codec of "
                           "python -m benchmarks allreduce, e.g. sum4, the summable codec)")
  parser.add_argument("--torch-methods", type=_torch_method, nargs="+",
                      default=list(data.TORCH_METHODS),
                      help=f"torch methods (default: {' '.join(data.TORCH_METHODS)})")
  parser.add_argument("--repeats", type=int, default=5, help="timed runs per row (default: 5)")
  parser.add_argument("--warmup", type=int, default=1,
                      help="untimed runs first (default: 1; PowerSGD: at least 3)")
  parser.add_argument("--torch-python", default=DEFAULT_TORCH_PYTHON,
                      help=f"interpreter of the torch venv (default: {DEFAULT_TORCH_PYTHON}, made by "
                           "benchmarks/peers/setup_torch.sh)")
  parser.add_argument("--out", default=DEFAULT_OUT, help=f"merged JSON (default: {DEFAULT_OUT})")


def _torch_method(text: str) -> str:
  try:
    return data.check_torch_method(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def parse_gradients(items: Sequence[str], chosen: Sequence[str]) -> dict[str, str]:
  """``PAYLOAD=NPZ`` items -> {payload: path}; ValueError for a bad item or an unknown payload."""
  out = {}
  for item in items:
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
      raise ValueError(f"--gradients takes PAYLOAD=NPZ, got {item!r}")
    if name not in chosen:
      raise ValueError(f"--gradients {item!r}: {name!r} is not among --payloads {list(chosen)}")
    out[name] = path
  return out


def validate(args: argparse.Namespace) -> dict[str, str]:
  """Checks everything that can be checked before building the cluster; returns the gradients
  map. ValueError names the option."""
  cluster.validate_cluster(args)
  if args.repeats < 1 or args.warmup < 1:
    raise ValueError("--repeats and --warmup must be >= 1")
  bad = [c for c in args.jax_codecs if c not in allreduce.CODECS]
  if bad:
    raise ValueError(f"--jax-codecs: unknown {bad}; choose from {list(allreduce.CODECS)}")
  grads = parse_gradients(args.gradients, args.payloads)
  for name, path in grads.items():
    if not os.path.exists(path):
      raise ValueError(f"--gradients {name}={path}: no such file (python -m "
                       "benchmarks.peers.make_gradients writes it)")
    if data.gradient_ranks(path) < args.nodes:
      raise ValueError(f"--gradients {name}={path} holds {data.gradient_ranks(path)} ranks, fewer "
                       f"than --nodes {args.nodes}")
  return grads


def torch_version(python: str) -> str:
  """torch's version in the interpreter ``python``; :class:`cluster.Unavailable` if it has none."""
  if not os.path.exists(python):
    raise cluster.Unavailable(f"no torch interpreter at {python}: run "
                              "`bash benchmarks/peers/setup_torch.sh` (or pass --torch-python)")
  proc = subprocess.run([python, "-c", "import numpy, torch; print(torch.__version__)"],
                        capture_output=True, text=True)
  if proc.returncode != 0:
    raise cluster.Unavailable(f"{python} cannot import torch and numpy: "
                              f"{proc.stderr.strip().splitlines()[-1:]}")
  return proc.stdout.strip()


def _rel(path: str) -> str:
  return os.path.relpath(path) if path else path


def jax_argv(payload: str, gradients: str | None, args: argparse.Namespace, out: str) -> list[str]:
  """The JAX side's command line on each node."""
  argv = ["-m", "benchmarks", "allreduce", "--payload", payload, "--codecs", *args.jax_codecs,
          "--repeats", str(args.repeats), "--warmup", str(args.warmup),
          "--link-gbps", f"{args.rate / 1e9:g}", "--out", out]
  return argv + (["--gradients", gradients] if gradients else [])


def torch_argv(spec_path: str, args: argparse.Namespace, out: str) -> list[str]:
  """The torch side's command line on each node."""
  return ["-m", "benchmarks.peers.torch_worker", "--spec", spec_path, "--methods",
          *args.torch_methods, "--repeats", str(args.repeats), "--warmup", str(args.warmup),
          "--link-gbps", f"{args.rate / 1e9:g}", "--out", out]


_ROW_KEYS = ("payload", "framework", "method", "description", "elements", "leaves", "gradients",
             "devices", "wire_bytes_per_device", "link_floor_s", "median_s", "min_s", "max_s",
             "times_s", "time_vs_floor", "rel_error", "status")


def jax_rows(result: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
  """The allreduce benchmark's rows in the merged form (framework ``jax_qcomm``)."""
  out = []
  for r in result["rows"]:
    row = {k: r.get(k) for k in _ROW_KEYS}
    row.update(framework="jax_qcomm", method=r["codec"], payload=spec["payload"],
               elements=r["size"], status="ok", psum_wire_itemsize=r.get("psum_wire_itemsize"),
               all_reduces=r.get("all_reduces"), speedup_vs_jax_fp32=r.get("speedup_vs_fp32"))
    out.append(row)
  return out


def torch_rows(result: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
  """The torch worker's rows in the merged form (extra keys kept: DDP's local/synced times...)."""
  gradients = "real (npz)" if spec.get("gradients") else "random normal"
  return [dict({k: r.get(k) for k in _ROW_KEYS}, gradients=gradients,
               **{k: v for k, v in r.items() if k not in _ROW_KEYS}) for r in result["rows"]]


def _load(path: str) -> dict[str, Any] | None:
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def run(args: argparse.Namespace, grads: dict[str, str], command: Sequence[str],
        torch_ver: str) -> int:
  """Builds the cluster, runs both sides per payload, writes the merged JSON and the table."""
  tmpdir = tempfile.mkdtemp(prefix="qcomm-peers-")
  merged: dict[str, Any] = dict(metadata=dict(
      benchmark="peers", command=shlex.join(command), torch_version=torch_ver,
      torch_python=args.torch_python, jax={}, torch={}, failures=[],
      config=dict(payloads=args.payloads, gradients=grads, jax_codecs=args.jax_codecs,
                  torch_methods=args.torch_methods, repeats=args.repeats, warmup=args.warmup,
                  nodes=args.nodes, rate_bits_per_s=args.rate, link_gbps=args.rate / 1e9)),
      rows=[])
  meta = merged["metadata"]

  def body(session: cluster.Session) -> int:
    meta["cluster"] = session.meta
    status = 0
    for payload in args.payloads:
      spec = payloads.spec(payload, grads.get(payload))
      spec_path = os.path.join(tmpdir, f"{payload.replace(':', '_')}.spec.json")
      data.write_spec(spec_path, spec)
      jax_out = os.path.join(tmpdir, f"{payload.replace(':', '_')}.jax.json")
      torch_out = os.path.join(tmpdir, f"{payload.replace(':', '_')}.torch.json")
      argv = jax_argv(payload, grads.get(payload), args, jax_out)
      st = session.run_nodes(sys.executable, argv, label=shlex.join(["python", *argv]))
      result = _load(jax_out)
      if st == 0 and result:
        meta["jax"][payload] = result["metadata"]
        merged["rows"] += jax_rows(result, spec)
      else:
        meta["failures"].append(dict(payload=payload, framework="jax_qcomm", exit_status=st))
        status = status or st or 1
      argv = torch_argv(spec_path, args, torch_out)
      # The torch venv's interpreter must not see this one's packages.
      st = session.run_nodes(args.torch_python, argv, label=shlex.join(["python", *argv]),
                             env={"PYTHONPATH": "", "PYTHONNOUSERSITE": "1"})
      result = _load(torch_out)
      if st == 0 and result:
        meta["torch"][payload] = result["metadata"]
        merged["rows"] += torch_rows(result, spec)
      else:
        meta["failures"].append(dict(payload=payload, framework="torch", exit_status=st))
        status = status or st or 1
    path = _common.write_json(args.out, merged)
    print(report.peers_markdown(merged))
    session.cluster._log(f"wrote {path}")
    return status

  try:
    return cluster.run_in_cluster(args, body)
  finally:
    shutil.rmtree(tmpdir, ignore_errors=True)


def main(args: argparse.Namespace, command: Sequence[str]) -> int:
  """The ``peers`` subcommand: 2 on bad arguments, 69 when the machine cannot run it."""
  try:
    grads = validate(args)
  except ValueError as e:
    print(f"python -m benchmarks peers: error: {e}", file=sys.stderr)
    return cluster.EXIT_USAGE
  try:
    cluster.preflight()
    torch_ver = torch_version(args.torch_python)
  except cluster.Unavailable as e:
    print(f"python -m benchmarks peers: cannot run here: {e}", file=sys.stderr)
    return cluster.EXIT_UNAVAILABLE
  return run(args, grads, command, torch_ver)
