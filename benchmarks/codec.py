"""Codec benchmark: QSGD or Summable encode, decode and decode-and-sum, FFI kernels against pure JAX.

For each size n and each implementation (``QSGD(..., impl="ffi")`` and ``impl="jax"``) it times
three jitted functions on the default backend:

* ``encode``      float32[n] + key -> payload (throughput counts the n input elements);
* ``decode``      one payload -> float32[n] (counts the n output elements);
* ``decode_sum``  payloads[4, P] -> float32[n], the sum of 4 decodes (counts the n output
  elements, not the 4n decoded ones).

GB/s is of the float32 side: 4n bytes of input for encode, of output for the decodes. Both
implementations decode the same payloads (the format is shared). ``ffi/jax`` is the speedup of the
FFI kernel over the reference, median against median, measured in the same process.

On a GPU backend (the CUDA kernels) the default sizes are 25M and 256M, a fourth op is timed,

* ``decode_sum_reencode``  payloads[4, P] + key -> payload: the middle of the allreduce
  (decode-and-sum, scale by 1/4, re-encode; one fused kernel for ``ffi``),

and the copy bandwidth is measured in the same run on every backend: on CPU a real copy,
``numpy.copyto`` of 64M float32 (256 MB, far beyond the caches) into another buffer; on a GPU a
jitted ``x + 1`` of 256M float32 (8 bytes moved per element / time; pin the process to one core
with ``taskset -c 0`` for a one-core CPU figure). Each op's bytes moved (input read + output
written: 4n + P for encode, P + 4n for decode, 4P + 4n for decode_sum, 4P + P for
decode_sum_reencode) / time is reported as a fraction of that copy bandwidth, the physical limit.

``--codec summable`` times :class:`jax_qcomm.Summable` as its allreduce runs it, for D = 4 devices:
``encode`` is the bucket scales plus the fields (``bucket_scale`` and ``wire_encode_summable``:
two passes over x), ``decode`` one decode of summed words (``decode_summed_words``, count D: what
follows the psum; the sum itself is the all-reduce's), and there is no ``decode_sum``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import jax
import jax.numpy as jnp

import numpy as np

from jax_qcomm import QSGD, Summable

from benchmarks import _common

OPS = ("encode", "decode", "decode_sum")
GPU_OPS = OPS + ("decode_sum_reencode",)
SUMMABLE_OPS = ("encode", "decode")  # --codec summable: the sum itself is the all-reduce's
IMPLS = ("ffi", "jax")
NUM_PAYLOADS = 4  # decode_sum sums this many payloads, as a 4-worker allreduce would
DEFAULT_SIZES = (1_000_000, 25_000_000)
DEFAULT_GPU_SIZES = (25_000_000, 256_000_000)
COPY_BW_SIZE = 256_000_000  # float32 elements of the device-to-device copy measurement
CPU_COPY_BW_SIZE = 64_000_000  # on CPU: 256 MB in, 256 MB out, far beyond the caches
DEFAULT_OUT = "bench-results/codec.json"



def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the codec benchmark's options to its subcommand parser."""
  parser.add_argument("--sizes", type=_common.parse_size, nargs="+", default=None,
                      metavar="N", help="element counts (default: 1M 25M; on a GPU 25M 256M)")
  parser.add_argument("--bits", type=int, default=4, help="bits per value (default: 4)")
  parser.add_argument("--bucket", type=int, default=128, help="bucket size (default: 128)")
  parser.add_argument("--scheme", choices=("maxmin", "norm"), default="maxmin",
                      help="quantisation scheme (default: maxmin)")
  parser.add_argument("--rounding", choices=("stochastic", "nearest"), default="stochastic",
                      help="encode rounding (default: stochastic)")
  parser.add_argument("--codec", choices=("qsgd", "summable"), default="qsgd",
                      help="the codec to time (default: qsgd)")
  parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                      help="implementations to time (default: ffi jax)")
  parser.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output (default: {DEFAULT_OUT})")


def _row_label(n: int) -> str:
  return f"{n:,}"


def _jitted_op(codec: Any, op: str, shape: tuple[int, ...]) -> Any:
  """The jitted function of one op of one codec; see :func:`bench_size` for its arguments."""
  if op == "encode":
    return jax.jit(codec.encode)
  if op == "decode":
    return jax.jit(lambda payload: codec.decode(payload, shape))
  if op == "decode_sum_reencode":
    return jax.jit(lambda payloads, key: codec.decode_sum_reencode(payloads, shape, key,
                                                                   1.0 / NUM_PAYLOADS))
  return jax.jit(lambda payloads: codec.decode_sum(payloads, shape))


def bytes_moved(op: str, n: int, payload_bytes: int) -> int:
  """Bytes an op must read and write at least: its inputs plus its output."""
  return {"encode": 4 * n + payload_bytes,
          "decode": payload_bytes + 4 * n,
          "decode_sum": NUM_PAYLOADS * payload_bytes + 4 * n,
          "decode_sum_reencode": NUM_PAYLOADS * payload_bytes + payload_bytes}[op]


def copy_bandwidth(n: int = COPY_BW_SIZE, *, repeats: int, warmup: int) -> dict[str, Any]:
  """Copy bandwidth of the default backend, the memory limit every kernel is held to: on CPU a
  real copy (``numpy.copyto`` of n float32 into another buffer: read 4n, write 4n bytes); on
  accelerators a jitted ``x + 1`` of n float32 (the same bytes)."""
  if jax.default_backend() == "cpu":
    src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    dst = np.empty_like(src)
    t = _common.median_time(lambda a: np.copyto(dst, a), src, repeats=repeats, warmup=warmup)
    del src, dst
    return dict(op="numpy.copyto", size=n, bytes_moved=8 * n, **t.as_dict(),
                gb_per_s=8 * n / t.median / 1e9)
  x = jax.block_until_ready(jnp.zeros((n,), jnp.float32))
  t = _common.median_time(jax.jit(lambda a: a + jnp.float32(1)), x, repeats=repeats, warmup=warmup)
  del x
  return dict(op="x + 1", size=n, bytes_moved=8 * n, **t.as_dict(), gb_per_s=8 * n / t.median / 1e9)


def _set_speedup(op_rows: list[dict[str, Any]], timings: dict[str, Any]) -> None:
  """Gives the ffi row of one op its speedup over the jax row (jax median / ffi median), when
  both implementations were timed."""
  if "ffi" in timings and "jax" in timings:
    for row in op_rows:
      if row["impl"] == "ffi":
        row["speedup_ffi_over_jax"] = timings["jax"].median / timings["ffi"].median


SUMMABLE_DEVICES = 4  # the D whose fields the Summable rows use


def bench_summable(n: int, *, bits: int, bucket: int, rounding: str, impls: Sequence[str],
                   repeats: int, warmup: int, copy_gb_per_s: float) -> list[dict[str, Any]]:
  """Summable's encode (scales + fields) and decode of summed words at n elements, D = 4."""
  d = SUMMABLE_DEVICES
  x = jax.random.normal(jax.random.key(1), (n,), jnp.float32)
  ref = Summable(bits, bucket, rounding)
  shared = jax.jit(ref.bucket_scale)(x)
  words = jax.jit(lambda a, s, k: ref.wire_encode_summable(a, s, k, d))(x, shared, jax.random.key(0))
  jax.block_until_ready(words)
  rows = []
  for op in SUMMABLE_OPS:
    timings = {}
    for impl in impls:
      c = Summable(bits, bucket, rounding, impl=impl)
      if op == "encode":
        fn = jax.jit(lambda a, k, c=c: c.wire_encode_summable(a, c.bucket_scale(a), k, d))
        args = (x, jax.random.key(0))
        moved = 2 * 4 * n + 4 * int(words.shape[0])  # x read twice, the words written
      else:
        fn = jax.jit(lambda w, s, c=c: c.decode_summed_words(w, s, d, d, n))
        args = (words, shared)
        moved = 4 * int(words.shape[0]) + 4 * n
      t = _common.median_time(fn, *args, repeats=repeats, warmup=warmup)
      timings[impl] = t
      print(f"  {_row_label(n):>13} {op:<10} {impl:<3}  {1e3 * t.median:9.3f} ms",
            file=sys.stderr, flush=True)
      rows.append(dict(op=op, impl=impl, size=n, bits=bits, bucket_size=bucket, scheme="summable",
                       rounding=rounding, payload_bytes=4 * int(words.shape[0]), num_payloads=None,
                       devices=d, **t.as_dict(), elements_per_s=n / t.median,
                       gb_per_s=4 * n / t.median / 1e9, speedup_ffi_over_jax=None,
                       bytes_moved=moved, moved_gb_per_s=moved / t.median / 1e9,
                       fraction_of_copy_bw=moved / t.median / 1e9 / copy_gb_per_s))
    _set_speedup(rows[-len(impls):], timings)
  return rows


def bench_size(n: int, *, bits: int, bucket: int, scheme: str, rounding: str,
               impls: Sequence[str], repeats: int, warmup: int,
               ops: Sequence[str] = OPS, copy_gb_per_s: float | None = None) -> list[dict[str, Any]]:
  """Times every op of every impl at n elements; returns one row per (op, impl).

  With ``copy_gb_per_s`` (GPU runs) each row also gets its bytes moved / time as a fraction of it.
  """
  codecs = {impl: QSGD(bits, bucket, scheme, rounding, impl=impl) for impl in impls}
  shape = (n,)
  x = jax.random.normal(jax.random.key(1), shape, jnp.float32)
  # The payloads come from one implementation (the format is shared): both decode the same bytes.
  make = jax.jit(QSGD(bits, bucket, scheme, rounding).encode)
  payloads = jnp.stack([make(jax.random.normal(jax.random.key(2 + i), shape, jnp.float32),
                             jax.random.key(100 + i)) for i in range(NUM_PAYLOADS)])
  inputs = {"encode": (x, jax.random.key(0)), "decode": (payloads[0],), "decode_sum": (payloads,),
            "decode_sum_reencode": (payloads, jax.random.key(0))}
  num_payloads = {"encode": None, "decode": 1, "decode_sum": NUM_PAYLOADS,
                  "decode_sum_reencode": NUM_PAYLOADS}
  jax.block_until_ready(inputs)

  rows = []
  for op in ops:
    timings = {}
    for impl, codec in codecs.items():
      t = _common.median_time(_jitted_op(codec, op, shape), *inputs[op], repeats=repeats,
                              warmup=warmup)
      timings[impl] = t
      print(f"  {_row_label(n):>13} {op:<10} {impl:<3}  {1e3 * t.median:9.3f} ms",
            file=sys.stderr, flush=True)
      moved = bytes_moved(op, n, int(payloads.shape[1]))
      extra = {}
      if copy_gb_per_s is not None:
        extra = dict(bytes_moved=moved, moved_gb_per_s=moved / t.median / 1e9,
                     fraction_of_copy_bw=moved / t.median / 1e9 / copy_gb_per_s)
      rows.append(dict(
          op=op, impl=impl, size=n, bits=bits, bucket_size=bucket, scheme=scheme,
          rounding=rounding, payload_bytes=int(payloads.shape[1]), num_payloads=num_payloads[op],
          **t.as_dict(),
          elements_per_s=n / t.median,
          gb_per_s=4 * n / t.median / 1e9,
          speedup_ffi_over_jax=None,
          **extra,
      ))
    _set_speedup(rows[-len(timings):], timings)
  return rows


def format_results(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
  """The printed report: the table and its footer notes."""
  headers = ("size", "op", "impl", "median ms", "min ms", "max ms", "Melem/s", "GB/s", "ffi/jax",
             "faults")
  table = [(_row_label(r["size"]), r["op"], r["impl"], f"{1e3 * r['median_s']:.3f}",
            f"{1e3 * r['min_s']:.3f}", f"{1e3 * r['max_s']:.3f}",
            f"{r['elements_per_s'] / 1e6:.1f}", f"{r['gb_per_s']:.2f}",
            "" if r["speedup_ffi_over_jax"] is None else f"{r['speedup_ffi_over_jax']:.2f}x",
            f"{r['minor_faults_median']:.0f}")
           for r in rows]
  cfg = meta["config"]
  nproc = meta["nproc"]
  copy = meta.get("copy_bandwidth") is not None
  if copy:
    headers += ("moved GB/s", "% copy")
    table = [row + (f"{r['moved_gb_per_s']:.1f}", f"{100 * r['fraction_of_copy_bw']:.0f}%")
             for row, r in zip(table, rows)]
  lines = [
      f"{'Summable' if cfg.get('codec') == 'summable' else 'QSGD'} bits={cfg['bits']} "
      f"bucket={cfg['bucket_size']} scheme={cfg['scheme']} "
      f"rounding={cfg['rounding']}  |  {_common.machine_line(meta, isa=True)}",
      "",
      _common.format_table(headers, table, align="rll" + "r" * (len(headers) - 3)),
      "",
      _common.times_line(cfg) + "; ffi/jax = jax median / ffi median.",
      "Melem/s counts input elements (encode) or output elements (decode, decode_sum of "
      f"{NUM_PAYLOADS} payloads); GB/s is of those float32 bytes; faults: median minor page "
      "faults per call (4 KiB each).",
  ]
  if copy:
    cb = meta["copy_bandwidth"]
    lines.append(f"copy bandwidth ({cb['op']} of {cb['size']:,} float32, 8 bytes/element, median): "
                 f"{cb['gb_per_s']:.1f} GB/s; moved GB/s = (input read + output written) / time, "
                 "% copy = moved GB/s / copy bandwidth; decode_sum_reencode scales by "
                 f"1/{NUM_PAYLOADS} and re-encodes (fused kernel for ffi).")
  if meta["backend"] == "cpu":
    lines.append(f"threads: the C++ FFI kernels run on one thread, while XLA may spread the pure-JAX "
                 f"reference over up to {nproc} threads (os.cpu_count()={nproc}).")
  lines.append(_common.malloc_note(meta["malloc"]))
  return "\n".join(lines)


def main(args: argparse.Namespace, command: Sequence[str]) -> int:
  """Runs the benchmark of the parsed ``args``, prints the table, writes the JSON; returns 0."""
  try:  # the codec's own validation, before any work
    for impl in args.impls:
      if args.codec == "summable":
        Summable(args.bits, args.bucket, args.rounding, impl=impl)
      else:
        QSGD(args.bits, args.bucket, args.scheme, args.rounding, impl=impl)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  meta = _common.run_metadata(command)
  meta["benchmark"] = "codec"
  gpu = meta["backend"] == "gpu"
  sizes = args.sizes or list(DEFAULT_GPU_SIZES if gpu else DEFAULT_SIZES)
  ops = SUMMABLE_OPS if args.codec == "summable" else GPU_OPS if gpu else OPS
  if args.codec == "summable" and gpu and "ffi" in args.impls:
    print("note: Summable has no CUDA kernel; timing impl='jax' only", file=sys.stderr)
    args.impls = [i for i in args.impls if i != "ffi"] or ["jax"]
  meta["config"] = dict(codec=args.codec, sizes=sizes, ops=list(ops), bits=args.bits,
                        bucket_size=args.bucket,
                        scheme=args.scheme, rounding=args.rounding, impls=args.impls,
                        num_payloads=NUM_PAYLOADS, repeats=args.repeats, warmup=args.warmup)
  print(_common.malloc_note(meta["malloc"]), file=sys.stderr, flush=True)
  # The memory limit every kernel is held to, in the same process (on CPU: the cores this process
  # may use; pin it with taskset for a one-core figure).
  meta["copy_bandwidth"] = copy_bandwidth(COPY_BW_SIZE if gpu else CPU_COPY_BW_SIZE,
                                          repeats=args.repeats, warmup=args.warmup)
  print(f"  copy bandwidth {meta['copy_bandwidth']['gb_per_s']:.1f} GB/s", file=sys.stderr,
        flush=True)
  rows = []
  for n in sizes:
    if args.codec == "summable":
      rows += bench_summable(n, bits=args.bits, bucket=args.bucket, rounding=args.rounding,
                             impls=args.impls, repeats=args.repeats, warmup=args.warmup,
                             copy_gb_per_s=meta["copy_bandwidth"]["gb_per_s"])
      continue
    rows += bench_size(n, bits=args.bits, bucket=args.bucket, scheme=args.scheme,
                       rounding=args.rounding, impls=args.impls, repeats=args.repeats,
                       warmup=args.warmup, ops=ops,
                       copy_gb_per_s=meta["copy_bandwidth"]["gb_per_s"])
  print(format_results(rows, meta))
  path = _common.write_json(args.out, dict(metadata=meta, rows=rows))
  print(f"wrote {path}")
  return 0
