"""Allreduce benchmark: fp32 psum, cast_pmean bf16, Cast(bf16) and QSGD 8/4/2 bits, one buffer.

Runs over the host devices of one process (``--devices N``, via ``jax_num_cpu_devices``), or, when
started by the launcher, over all devices of all processes (``jax.distributed`` over gloo)::

    python -m benchmarks allreduce --devices 4 --sizes 1M
    python -m jax_qcomm.tools.launch -n 4 -m benchmarks allreduce --sizes 25600000

Each codec's allreduce of one float32[n] buffer per device (different data on every device, op
mean) is jitted under ``jax.shard_map`` over a 1-D mesh of the D devices and timed with
``block_until_ready``; across processes, call i takes the slowest process's time of call i.

Columns:

* ``wire MB``: bytes each device sends per allreduce, by the algorithm's count (not measured on
  the socket). Scatter-reduce-allgather codecs (``Cast``, ``QSGD``): the buffer is padded to whole
  buckets on every device and its payload is P bytes; each device sends D-1 of its D chunk payloads
  in the all_to_all and its reduced chunk payload to D-1 peers in the all_gather:
  2 (D-1)/D * P. ``psum`` (fp32, cast_pmean) as a ring allreduce: 2 (D-1)/D * n * itemsize, the
  itemsize being that of the all-reduce XLA actually compiled (XLA CPU promotes a bf16 all-reduce to
  f32: ``cast_pmean`` then sends 4 bytes per value; the dtype is read from the compiled HLO).
* ``busbw GB/s``: nccl-tests' bus bandwidth, algbw * 2 (D-1)/D, with algbw computed on the bytes
  actually sent (payload bytes, not float32 bytes): wire bytes / time.
* ``algbw GB/s``: effective algorithm bandwidth on the uncompressed buffer: 4 n / time.
* ``vs fp32``: fp32 psum time / this time (> 1: faster than fp32), and ``wire/fp32`` the ratio of
  wire bytes.
* ``floor ms`` (with ``--link-gbps``): wire bytes / link rate, the transfer time alone, and
  ``time/floor`` the median time over it (1.00x: the link is the only cost).

``--breakdown`` also times, on one device without any communication, the codec work a device does
inside one compressed allreduce (encode D chunks, decode-and-sum D payloads, re-encode one chunk --
or, for QSGD, the fused decode-sum-reencode kernel the allreduce runs instead -- decode D payloads),
and the transfer alone (the same exchange + all-gather of uint8 payloads as the allreduce sends
them, no codec), to
separate codec cost from transfer.

``--exchange rounds all_to_all`` times each SRA codec with both all-to-all schedules of
:mod:`jax_qcomm.transport._exchange` in the same run (rows ``qsgd4/rounds``, ``qsgd4/all_to_all``).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm.transport import _exchange
from jax_qcomm.codecs import Codec

from benchmarks import _common

DEFAULT_SIZES = (1_000_000, 25_600_000)
DEFAULT_OUT = "bench-results/allreduce.json"
EXCHANGES = _exchange.METHODS
#: codec name -> (description, kind, arguments); kind "psum", "cast_pmean", "sra", "summable"
#: (one pmax of the bucket scales + one psum of uint32 words, qcomm.Summable) or "wire16"
#: (qcomm.Wire16, what sync(bits=16) sends: the same two all-reduces, 16-bit fields) or "auto"
#: (qcomm.Auto, what sync(bits=b) sends: the "codec" column names the codec it resolved to).
CODECS = {
    "fp32": ("NoCompression: lax.pmean of float32", "psum", {}),
    "cast_pmean_bf16": ("cast_pmean(bfloat16): cast, lax.pmean, cast back", "cast_pmean", {}),
    "cast_bf16": ("Cast(bfloat16): bf16 bits on the wire, SRA", "sra", {"dtype": "bfloat16"}),
    "qsgd8": ("QSGD 8 bits maxmin, SRA", "sra", {"bits": 8}),
    "qsgd4": ("QSGD 4 bits maxmin, SRA", "sra", {"bits": 4}),
    "qsgd2": ("QSGD 2 bits maxmin, SRA", "sra", {"bits": 2}),
    "sum8": ("Summable 8 bits: pmax of scales + psum of uint32 words", "summable", {"bits": 8}),
    "sum4": ("Summable 4 bits: pmax of scales + psum of uint32 words", "summable", {"bits": 4}),
    "sum3": ("Summable 3 bits: pmax of scales + psum of uint32 words", "summable", {"bits": 3}),
    "sum2": ("Summable 2 bits: pmax of scales + psum of uint32 words", "summable", {"bits": 2}),
    "wire16": ("Wire16 (sync(bits=16)): pmax of scales + psum of 16-bit fields", "wire16", {}),
    "auto8": ("Auto 8 bits (sync(bits=8)): QSGD or Summable, as the transport decides", "auto",
              {"bits": 8}),
    "auto4": ("Auto 4 bits (sync(bits=4)): QSGD or Summable, as the transport decides", "auto",
              {"bits": 4}),
    "auto2": ("Auto 2 bits (sync(bits=2)): QSGD or Summable, as the transport decides", "auto",
              {"bits": 2}),
    "powersgd1": ("PowerSGD rank 1: two psums of the factors (--tree only)", "powersgd",
                  {"rank": 1}),
    "powersgd4": ("PowerSGD rank 4: two psums of the factors (--tree only)", "powersgd",
                  {"rank": 4}),
}
#: Timed unless --codecs says otherwise.
DEFAULT_CODECS = ("fp32", "cast_pmean_bf16", "cast_bf16", "qsgd8", "qsgd4", "qsgd2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the allreduce benchmark's options to its subcommand parser."""
  parser.add_argument("--sizes", type=_common.parse_size, nargs="+", default=list(DEFAULT_SIZES),
                      metavar="N", help="float32 elements per device (default: 1M 25.6M)")
  parser.add_argument("--codecs", nargs="+", choices=list(CODECS), default=list(DEFAULT_CODECS),
                      help=f"codecs to time (default: {' '.join(DEFAULT_CODECS)})")
  parser.add_argument("--bucket", type=int, default=None,
                      help="bucket size of the quantising codecs (default: 128; auto rows: what "
                           "sync(bits=b) holds, 64 at 1 and 2 bits)")
  parser.add_argument("--devices", type=int, default=None,
                      help=f"host devices per process (default: {_common.DEFAULT_DEVICES} in a single "
                           "process; under the launcher QCOMM_LOCAL_DEVICES, else 1)")
  parser.add_argument("--impl", choices=("auto", "ffi", "jax"), default="auto",
                      help="QSGD implementation (default: auto)")
  parser.add_argument("--link-gbps", type=float, default=None,
                      help="link rate in Gbit/s, for a 'floor' column (wire bytes / rate)")
  parser.add_argument("--exchange", nargs="+", choices=EXCHANGES, default=["auto"],
                      help="the all-to-all of the SRA codecs (jax_qcomm.transport._exchange): auto (ppermute "
                           "rounds on CPU), rounds or all_to_all; several: each is timed, the codec "
                           "named codec/method (default: auto)")
  parser.add_argument("--tree", choices=("resnet50",), default=None,
                      help="instead of flat sizes, the pytree of ResNet50's parameters (161 leaves, "
                           "25.6M float32) through qcomm.allreduce with the default LeafPolicy: what "
                           "sync(codec=...) sends; rows also give the relative error against the "
                           "exact mean")
  parser.add_argument("--sync", action="store_true",
                      help="with --tree: also time qcomm.sync(optax.sgd(0.1), codec=...)'s update "
                           "and apply of the same gradients (what a user calls), and the update "
                           "alone, in the same run")
  parser.add_argument("--comm-bucket", type=_common.parse_size, default=None, metavar="N",
                      help="with --tree: most float32 elements per communication buffer (default: "
                           "each codec's own comm_buffer_size)")
  parser.add_argument("--breakdown", action="store_true",
                      help="also time the codec work of one device without communication")
  parser.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output (default: {DEFAULT_OUT})")


# -- setup ------------------------------------------------------------------------------------------

def make_codec(name: str, bucket: int | None = None, impl: str = "auto"):
  """The library codec of a benchmark codec name (None for cast_pmean, which is not a codec); also
  the cost model check's (benchmarks.model)."""
  _, kind, kw = CODECS[name]
  fixed = 128 if bucket is None else bucket  # the bucket of the codecs that have no rule
  if kind == "psum":
    return qcomm.NoCompression()
  if kind == "cast_pmean":
    return None
  if "dtype" in kw:
    return qcomm.Cast(getattr(jnp, kw["dtype"]))
  if kind == "summable":
    return qcomm.Summable(bits=kw["bits"], bucket_size=fixed, impl=impl)
  if kind == "wire16":
    return qcomm.Wire16()
  if kind == "auto":
    return qcomm.Auto(bits=kw["bits"], bucket_size=bucket, impl=impl)
  if kind == "powersgd":
    return qcomm.PowerSGD(kw["rank"])
  return qcomm.QSGD(bits=kw["bits"], bucket_size=fixed, scheme="maxmin", impl=impl)


def _allreduce_fn(name: str, codec, mesh, exchange: str = "auto") -> Callable:
  """jit(shard_map) of one allreduce of float32[n] per device; ``exchange``: the SRA's schedule."""
  key = jax.random.key(0)
  kind = CODECS[name][1]

  def per_device(x):  # x: [1, n] on this device
    if kind == "cast_pmean":
      return qcomm.cast_pmean(x[0], "data", jnp.bfloat16)[None]
    return qcomm.allreduce(x[0], "data", codec=codec, key=key, exchange=exchange)[None]

  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data")))


_HLO_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "u8": 1, "s8": 1}


def collective_itemsizes(compiled_text: str, op: str = "all-reduce") -> list[int]:
  """Element sizes of the results of the ``op`` instructions of a compiled HLO module's text."""
  sizes = []
  for m in re.finditer(r"=\s*\(?([a-z]+[0-9]+)\[[^\]]*\][^=]*?\s" + re.escape(op) + r"(?:-start)?\(",
                       compiled_text):
    sizes.append(_HLO_DTYPE_BYTES.get(m.group(1), 4))
  return sizes


def wire_bytes(name: str, codec, n: int, d: int, psum_itemsize: int = 4) -> tuple[int, int]:
  """(payload bytes of the whole buffer, bytes each device sends) for one allreduce of n values:
  the codec's own count (``codec.sent_bytes``); the payload is the buffer an all-reduce of the
  same bytes would carry (sent = 2 (D-1)/D of it). ``cast_pmean`` (no codec) sends
  ``psum_itemsize`` bytes per value, as read from the compiled HLO."""
  if d == 1:
    return 0, 0
  if CODECS[name][1] == "cast_pmean":
    payload = n * psum_itemsize
    return payload, (2 * (d - 1) * payload) // d
  sent = codec.sent_bytes(n, d)
  return round(sent * d / (2 * (d - 1))), round(sent)


# -- the benchmark ----------------------------------------------------------------------------------

def _variants(names: Sequence[str], exchanges: Sequence[str]) -> list[tuple[str, str, str | None]]:
  """(codec name, row label, exchange method or None) for every codec x exchange to time; psum
  codecs once (they have no all-to-all), SRA codecs once per method, labelled codec/method when
  there are several."""
  out = []
  for name in names:
    if CODECS[name][1] != "sra":
      out.append((name, name, None))
    else:
      out += [(name, name if len(exchanges) == 1 else f"{name}/{m}", m) for m in exchanges]
  return out


def bench_size(n: int, mesh, names: Sequence[str], *, bucket: int, impl: str, repeats: int,
               warmup: int, link_gbps: float | None,
               exchanges: Sequence[str] = ("auto",)) -> list[dict[str, Any]]:
  """Times every codec's allreduce of n values per device; one row per codec (and exchange)."""
  d = mesh.devices.size
  x = _common.global_input(mesh, n)
  jax.block_until_ready(x)
  rows = []
  for name, label, method in _variants(names, exchanges):
    codec = make_codec(name, bucket, impl)
    fn = _allreduce_fn(name, codec, mesh, method or "auto")
    compiled = fn.lower(x).compile()
    itemsizes = collective_itemsizes(compiled.as_text())
    psum_itemsize = max(itemsizes) if itemsizes else 4
    payload, sent = wire_bytes(name, codec, n, d, psum_itemsize)
    t = _common.collective_timing(_common.median_time(compiled, x, repeats=repeats, warmup=warmup))
    _common.log(f"  {n:>13,} {label:<16} {1e3 * t.median:10.2f} ms")
    rows.append(dict(
        codec=label, description=CODECS[name][0], exchange=method, size=n, devices=d,
        runs=codec.resolve(d).name if codec is not None else None,
        processes=jax.process_count(), bucket_size=getattr(codec, "bucket_size", None),
        psum_wire_itemsize=psum_itemsize if CODECS[name][1] != "sra" else None,
        payload_bytes=payload, wire_bytes_per_device=sent,
        **t.as_dict(),
        busbw_gb_per_s=sent / t.median / 1e9,
        algbw_gb_per_s=4 * n / t.median / 1e9,
        link_floor_s=None if link_gbps is None else sent * 8 / (link_gbps * 1e9),
        time_vs_floor=(None if link_gbps is None or not sent
                       else t.median / (sent * 8 / (link_gbps * 1e9))),
        speedup_vs_fp32=None, wire_ratio_vs_fp32=None))
    del fn, compiled
  _relative_to_fp32(rows)
  return rows


def _relative_to_fp32(rows: list[dict[str, Any]]) -> None:
  """Fills speedup_vs_fp32 and wire_ratio_vs_fp32 from the fp32 row, if there is one."""
  base = next((r for r in rows if r["codec"] == "fp32"), None)
  if base is None:
    return
  for r in rows:
    r["speedup_vs_fp32"] = base["median_s"] / r["median_s"]
    r["wire_ratio_vs_fp32"] = (r["wire_bytes_per_device"] / base["wire_bytes_per_device"]
                               if base["wire_bytes_per_device"] else None)


def _transfer_fn(mesh, exchange: str = "auto") -> Callable:
  """The SRA's communication alone, as the allreduce sends it: the library's exchange (all-to-all,
  schedule ``exchange``) of uint8[D, p] and its all-gather of uint8[p] (both in the transport's
  pieces)."""
  def per_device(a):
    rows = a[0]  # [D, p]
    received = _exchange.exchange(rows, "data", exchange)
    gathered = _exchange.gather(received[0], "data")
    return received[None], gathered[None]

  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"),
                               out_specs=(P("data"), P("data"))))


def bench_breakdown(n: int, mesh, names: Sequence[str], *, bucket: int, impl: str, repeats: int,
                    warmup: int, exchange: str = "auto") -> list[dict[str, Any]]:
  """Where an SRA allreduce of n values over the mesh's D devices spends its time.

  * codec work of one device, without communication, on this process's first device (all
    processes at once, as in the allreduce): encode the D chunks, decode-and-sum the D received
    payloads, re-encode the reduced chunk, decode the D gathered payloads; for a codec with a
    fused ``decode_sum_reencode`` (QSGD), also that kernel, which the allreduce runs instead of the
    two middle stages (``codec_total_s`` then counts it, not them);
  * transfer alone: the same exchange (``exchange`` method) + all-gather of uint8 payload bytes
    (the library's, in the transport's pieces), no codec.
  """
  d = mesh.devices.size
  dev = jax.local_devices()[0]
  rows = []
  for name in names:
    if CODECS[name][1] == "summable":
      rows.append(_summable_breakdown(n, mesh, name, bucket=bucket, impl=impl, repeats=repeats,
                                      warmup=warmup))
      continue
    if CODECS[name][1] != "sra":
      continue
    codec = make_codec(name, bucket, impl)
    c = codec.buffer_length(n, d) // d  # chunk length per device, as the allreduce pads
    key = jax.random.key(1)
    chunks = jax.device_put(jax.random.normal(jax.random.key(2), (d, c), jnp.float32), dev)
    enc_rows = jax.jit(lambda xs, k: jax.vmap(codec.encode)(xs, jax.random.split(k, xs.shape[0])))
    payloads = jax.block_until_ready(enc_rows(chunks, key))
    stages = {
        "encode_chunks": (enc_rows, (chunks, key)),
        "decode_sum": (jax.jit(lambda p: codec.decode_sum(p, (c,))), (payloads,)),
        "encode_reduced": (jax.jit(codec.encode), (chunks[0], key)),
        "decode_chunks": (jax.jit(lambda p: jax.vmap(lambda q: codec.decode(q, (c,)))(p)),
                          (payloads,)),
    }
    # A codec that overrides the interface's composed default runs one fused kernel (QSGD).
    fused = type(codec).wire_decode_sum_reencode is not Codec.wire_decode_sum_reencode
    if fused:  # what the allreduce runs in place of decode_sum + encode_reduced
      stages["decode_sum_reencode"] = (
          jax.jit(lambda p, k: codec.decode_sum_reencode(p, (c,), k, 1.0 / d)), (payloads, key))
    row = dict(codec=name, exchange=exchange, size=n, devices=d, chunk=c, fused=fused,
               decode_sum_reencode_s=None)
    for stage, (fn, args) in stages.items():
      t = _common.collective_timing(_common.median_time(fn, *args, repeats=repeats, warmup=warmup))
      row[f"{stage}_s"] = t.median
    middle = (row["decode_sum_reencode_s"] if fused
              else row["decode_sum_s"] + row["encode_reduced_s"])
    row["codec_total_s"] = row["encode_chunks_s"] + middle + row["decode_chunks_s"]
    total = row["codec_total_s"]
    if d > 1:
      p = codec.payload_size(c)
      buf = jax.make_array_from_callback(
          (d, d, p), NamedSharding(mesh, P("data")),
          lambda idx: np.full((len(range(*idx[0].indices(d))), d, p), 7, np.uint8))
      transfer = _transfer_fn(mesh, exchange).lower(buf).compile()
      t = _common.collective_timing(_common.median_time(transfer, buf, repeats=repeats, warmup=warmup))
      row["transfer_s"] = t.median
    else:
      row["transfer_s"] = None
    _common.log(f"  {n:>13,} {name:<16} codec work {1e3 * total:10.2f} ms")
    rows.append(row)
  return rows


def _summable_breakdown(n: int, mesh, name: str, *, bucket: int, impl: str, repeats: int,
                        warmup: int) -> dict[str, Any]:
  """Where a summable allreduce of n values over D devices spends its time: the codec work of one
  device without communication (bucket scales, encode, decode of the sum; the decode of its own
  words, for the error-feedback residual, only runs with error feedback) and the transfer alone
  (pmax of int32[nb] + psum of uint32[W], no codec)."""
  d = mesh.devices.size
  dev = jax.local_devices()[0]
  codec = make_codec(name, bucket, impl)
  key = jax.random.key(1)
  x = jax.device_put(jax.random.normal(jax.random.key(2), (n,), jnp.float32), dev)
  shared = jax.block_until_ready(jax.jit(codec.bucket_scale)(x))
  words = jax.block_until_ready(jax.jit(lambda a, m, k: codec.wire_encode_summable(a, m, k, d))(
      x, shared, key))
  stages = {
      "scale": (jax.jit(codec.bucket_scale), (x,)),
      "encode": (jax.jit(lambda a, m, k: codec.wire_encode_summable(a, m, k, d)), (x, shared, key)),
      "decode": (jax.jit(lambda w, m: codec.decode_summed_words(w, m, d, d, n, 1.0 / d)),
                 (words, shared)),
      "decode_own": (jax.jit(lambda w, m: codec.decode_summed_words(w, m, d, 1, n)), (words, shared)),
  }
  row = dict(codec=name, exchange=None, size=n, devices=d, summable=True, words=int(words.shape[0]))
  for stage, (fn, args) in stages.items():
    t = _common.collective_timing(_common.median_time(fn, *args, repeats=repeats, warmup=warmup))
    row[f"{stage}_s"] = t.median
  row["codec_total_s"] = row["scale_s"] + row["encode_s"] + row["decode_s"]
  row["transfer_s"] = None
  if d > 1:
    nb, nw = int(shared.shape[0]), int(words.shape[0])
    scales = jax.make_array_from_callback((d, nb), NamedSharding(mesh, P("data")),
                                          lambda idx: np.ones((len(range(*idx[0].indices(d))), nb), np.int32))
    wbuf = jax.make_array_from_callback((d, nw), NamedSharding(mesh, P("data")),
                                        lambda idx: np.full((len(range(*idx[0].indices(d))), nw), 7, np.uint32))
    transfer = jax.jit(jax.shard_map(
        lambda m, w: (lax.pmax(m, "data"), lax.psum(w, "data")), mesh=mesh,
        in_specs=(P("data"), P("data")), out_specs=(P(), P()))).lower(scales, wbuf).compile()
    t = _common.collective_timing(_common.median_time(transfer, scales, wbuf, repeats=repeats,
                                                      warmup=warmup))
    row["transfer_s"] = t.median
  _common.log(f"  {n:>13,} {name:<16} codec work {1e3 * row['codec_total_s']:10.2f} ms")
  return row


def format_tree(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
  """The printed report of ``--tree``: one row per codec."""
  fp32 = next((r["median_s"] for r in rows if r["codec"] == "fp32"), None)
  headers = ["codec", "runs", "median ms", "min ms", "max ms", "wire MB", "x floor", "vs fp32",
             "rel. error"]
  table = [[r["codec"], r["runs"], f"{1e3 * r['median_s']:.1f}", f"{1e3 * r['min_s']:.1f}",
            f"{1e3 * r['max_s']:.1f}", f"{r['wire_bytes_per_device'] / 1e6:.2f}",
            "" if not r["link_floor_s"] else f"{r['median_s'] / r['link_floor_s']:.2f}x",
            "" if fp32 is None else f"{fp32 / r['median_s']:.2f}x", f"{r['rel_error']:.3g}"]
           for r in rows]
  if rows and "sync_median_s" in rows[0]:  # --sync: what the user calls, same rounds
    headers += ["update ms", "update/allreduce", "sync ms", "sync/allreduce", "sync-local ms",
                "(sync-local)/allreduce", "sync rel. error"]
    for line, r in zip(table, rows):
      line += [f"{1e3 * r['update_median_s']:.1f}", f"{r['update_over_allreduce']:.3f}x",
               f"{1e3 * r['sync_median_s']:.1f}", f"{r['sync_over_allreduce']:.3f}x",
               f"{1e3 * r['sync_comm_median_s']:.1f}", f"{r['sync_comm_over_allreduce']:.3f}x",
               f"{r['sync_rel_error']:.3g}"]
  return "\n".join([f"ResNet50 parameter pytree (161 leaves), {rows[0]['devices'] if rows else 0} "
                    f"devices  |  {_common.machine_line(meta)}", "",
                    _common.format_table(headers, table, align="ll" + "r" * (len(headers) - 2)),
                    "", _common.malloc_note(meta["malloc"])])


def format_results(rows: Sequence[dict[str, Any]], breakdown: Sequence[dict[str, Any]],
                   meta: dict[str, Any]) -> str:
  """The printed report: the table, the optional breakdown and the footer notes."""
  cfg = meta["config"]
  has_floor = cfg["link_gbps"] is not None
  headers = ["size", "codec", "median ms", "min ms", "max ms", "wire MB", "busbw GB/s",
             "algbw GB/s", "vs fp32", "wire/fp32"] + (["floor ms", "time/floor"] if has_floor
                                                      else [])
  table = []
  for r in rows:
    line = [f"{r['size']:,}", r["codec"], f"{1e3 * r['median_s']:.1f}", f"{1e3 * r['min_s']:.1f}",
            f"{1e3 * r['max_s']:.1f}", f"{r['wire_bytes_per_device'] / 1e6:.2f}",
            f"{r['busbw_gb_per_s']:.3f}", f"{r['algbw_gb_per_s']:.3f}",
            "" if r["speedup_vs_fp32"] is None else f"{r['speedup_vs_fp32']:.2f}x",
            "" if r["wire_ratio_vs_fp32"] is None else f"{r['wire_ratio_vs_fp32']:.3f}"]
    if has_floor:
      line += [f"{1e3 * r['link_floor_s']:.1f}",
               "" if r["time_vs_floor"] is None else f"{r['time_vs_floor']:.2f}x"]
    table.append(line)
  lines = [
      f"allreduce (op=mean) over D={meta['num_devices']} devices in {meta['num_processes']} "
      f"process(es)  |  {meta['backend']}  {meta['cpu_model']}  nproc={meta['nproc']}  "
      f"jax {meta['jax_version']}",
      "",
      _common.format_table(headers, table, align="rl" + "r" * (len(headers) - 2)),
      "",
      f"times: median (min, max) of {cfg['repeats']} runs after {cfg['warmup']} warmup runs"
      + ("; per call, the slowest process" if meta["num_processes"] > 1 else "") + ".",
      "wire MB: bytes each device sends, 2(D-1)/D x payload of the buffer (SRA codecs: all_to_all "
      "+ all_gather of the padded payload; psum: ring allreduce of n x itemsize of the compiled "
      "all-reduce). busbw = wire bytes / time (nccl-tests busbw on the bytes sent); algbw = 4n / "
      "time (uncompressed float32); vs fp32 = fp32 time / time.",
  ]
  if has_floor:
    lines.append(f"floor = wire bytes / link rate ({cfg['link_gbps']:g} Gbit/s): the time the bytes "
                 "each device sends take on its link alone; time/floor = median / floor.")
  summable = [r for r in breakdown if r.get("summable")]
  breakdown = [r for r in breakdown if not r.get("summable")]
  if summable:
    med = {(r["size"], r["codec"].split("/")[0]): r["median_s"] for r in rows}
    sh = ["size", "codec", "words", "scale ms", "encode ms", "decode ms", "decode own ms",
          "codec total ms", "transfer ms", "allreduce ms"]
    st = [[f"{r['size']:,}", r["codec"], f"{r['words']:,}", f"{1e3 * r['scale_s']:.1f}",
           f"{1e3 * r['encode_s']:.1f}", f"{1e3 * r['decode_s']:.1f}",
           f"{1e3 * r['decode_own_s']:.1f}", f"{1e3 * r['codec_total_s']:.1f}",
           "" if r["transfer_s"] is None else f"{1e3 * r['transfer_s']:.1f}",
           f"{1e3 * med.get((r['size'], r['codec']), float('nan')):.1f}"] for r in summable]
    lines += ["", "summable breakdown: codec work of one device without communication (scale = the "
              "per-bucket statistic, encode = the words, decode = the summed words; codec total = "
              "the three; decode own = the error-feedback residual's decode, run only with error "
              "feedback) and the transfer alone (pmax of the scales + psum of the uint32 words):",
              _common.format_table(sh, st, align="rl" + "r" * (len(sh) - 2))]
  if breakdown:
    bh = ["size", "codec", "chunk", "encode D ms", "decode_sum ms", "re-encode ms", "fused ms",
          "decode D ms", "codec total ms", "transfer ms", "allreduce ms"]
    med = {(r["size"], r["codec"].split("/")[0]): r["median_s"] for r in rows
           if r["exchange"] in (None, breakdown[0]["exchange"])}
    bt = [[f"{r['size']:,}", r["codec"], f"{r['chunk']:,}", f"{1e3 * r['encode_chunks_s']:.1f}",
           f"{1e3 * r['decode_sum_s']:.1f}", f"{1e3 * r['encode_reduced_s']:.1f}",
           "" if r["decode_sum_reencode_s"] is None else f"{1e3 * r['decode_sum_reencode_s']:.1f}",
           f"{1e3 * r['decode_chunks_s']:.1f}", f"{1e3 * r['codec_total_s']:.1f}",
           "" if r["transfer_s"] is None else f"{1e3 * r['transfer_s']:.1f}",
           f"{1e3 * med.get((r['size'], r['codec']), float('nan')):.1f}"] for r in breakdown]
    lines += ["", "breakdown: codec work per allreduce of one device of each process, without "
              "communication (processes at once), and the transfer alone (the same exchange, "
              f"method {breakdown[0]['exchange']}, + the library's all-gather of uint8 payloads, no codec); fused = decode_sum_reencode, which the "
              "allreduce runs instead of decode_sum + re-encode (codec total counts it then):",
              _common.format_table(bh, bt, align="rl" + "r" * (len(bh) - 2))]
  lines.append(_common.malloc_note(meta["malloc"]))
  return "\n".join(lines)


def bench_tree(mesh, names: Sequence[str], *, bucket: int, impl: str, repeats: int, warmup: int,
               link_gbps: float | None, comm_bucket: int | None = None,
               sync: bool = False) -> list[dict[str, Any]]:
  """Times qcomm.allreduce of ResNet50's parameter pytree (one normal array per device and leaf)
  per codec, with the default LeafPolicy as sync uses it; the bytes are describe's count and the
  error is ||result - exact mean|| / ||exact mean|| over the whole tree.

  With ``sync``, each row also times what a user calls with the same gradients: the update of
  ``qcomm.sync(optax.sgd(0.1), codec=codec)`` and ``optax.apply_updates`` inside one jitted
  ``shard_map`` (params replicated, the state as :func:`qcomm.state_partition_spec` places it,
  the state threaded from call to call, nothing donated: ``qcomm.data_parallel``'s default), in
  interleaved rounds with the bare allreduce: ``sync_median_s`` and ``sync_over_allreduce`` (the
  median of the per-round ratios); and, in the same rounds, the step without communication
  (``optax.sgd(0.1)``'s update and apply on the device's own gradient), ``local_step_median_s``,
  with ``sync_comm_median_s`` the median of sync - local per round: what communicating adds to a
  step, as the torch peer reports DDP's backward minus the plain one; and, in the same rounds,
  the sync's update alone (no apply), ``update_median_s`` and ``update_over_allreduce``."""
  from benchmarks import sharded  # noqa: PLC0415  (flax: only the tree payload needs it)
  from jax_qcomm.tools import efficiency  # noqa: PLC0415

  shapes = sharded.payload("resnet50")
  d = mesh.devices.size
  leaves, treedef = jax.tree_util.tree_flatten(shapes)
  # Device g's leaf k: standard normal from default_rng([7, g, k]), the convention of the PyTorch
  # side-by-side harness (benchmarks/peers in git history), so both reduce the same inputs.
  tree = jax.tree_util.tree_unflatten(treedef, [jax.make_array_from_callback(
      (d,) + tuple(s.shape), NamedSharding(mesh, P("data")),
      lambda idx, k=k, shape=tuple(s.shape): np.stack([
          np.random.default_rng([7, g, k]).standard_normal(shape, dtype=np.float32)
          for g in range(*idx[0].indices(d))])) for k, s in enumerate(leaves)])
  key = jax.random.key(0)
  comm = comm_bucket  # None: each codec's own comm_buffer_size

  def run(codec):
    def per_device(t):
      t = jax.tree_util.tree_map(lambda a: a[0], t)
      if codec is None:  # the exact mean, the reference of the error
        out = jax.tree_util.tree_map(lambda a: lax.pmean(a, "data"), t)
      else:
        out = qcomm.allreduce(t, "data", codec=codec, key=key, comm_bucket_size=comm)
      return jax.tree_util.tree_map(lambda a: a[None], out)
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data")))

  def flat_local(t):
    return np.concatenate([np.asarray(a.addressable_shards[0].data).reshape(-1)
                           for a in jax.tree_util.tree_leaves(t)])

  exact = flat_local(run(None)(tree))
  n = sum(math.prod(s.shape) for s in leaves)
  rows = []
  for name in names:
    codec = make_codec(name, bucket, impl)
    if codec is None:
      continue  # cast_pmean is not a codec
    compiled = run(codec).lower(tree).compile()
    got = flat_local(compiled(tree))
    err = float(np.linalg.norm(got - exact) / np.linalg.norm(exact))
    t = _common.collective_timing(_common.median_time(compiled, tree, repeats=repeats,
                                                      warmup=warmup))
    sent = efficiency.tree_allreduce_bytes(shapes, d, codec, comm_bucket_size=comm)["bytes"] \
        if d > 1 else 0.0
    _common.log(f"  resnet50 {name:<16} {1e3 * t.median:10.2f} ms  rel. error {err:.3g}")
    extra = {} if not sync else _time_sync(mesh, tree, codec, compiled, repeats=repeats,
                                           warmup=warmup, comm=comm, exact=exact,
                                           local=flat_local)
    if extra:
      _common.log(f"  resnet50 {name:<16} sync {1e3 * extra['sync_median_s']:10.2f} ms "
                  f"({extra['sync_over_allreduce']:.3f}x the allreduce, same rounds; "
                  f"{1e3 * extra['sync_comm_median_s']:.2f} ms over the local step), "
                  f"rel. error {extra['sync_rel_error']:.3g}")
    rows.append(dict(**extra, codec=name, description=CODECS[name][0], runs=codec.resolve(d).name,
                     size=n, devices=d, processes=jax.process_count(), tree="resnet50",
                     comm_bucket_size=(codec.comm_buffer_size(d) if comm is None else comm),
                     wire_bytes_per_device=sent, rel_error=err, **t.as_dict(),
                     link_floor_s=None if link_gbps is None else sent * 8 / (link_gbps * 1e9)))
  return rows


def _time_sync(mesh, grads, codec, allreduce, *, repeats: int, warmup: int,
               comm: int | None, exact: np.ndarray, local: Callable) -> dict[str, Any]:
  """The update and apply of ``qcomm.sync(optax.sgd(0.1), codec=codec)`` on ``grads`` (per
  device), against ``allreduce`` (compiled, the same gradients) in interleaved rounds. Also
  ``sync_rel_error``: ||g - exact|| / ||exact|| of the gradient ``g`` that the sync hands its
  optimizer at the call after the timed ones (with its defaults: error feedback and a warm start
  where the codec wants them, so after ``warmup + repeats`` calls on the same gradients)."""
  import optax  # noqa: PLC0415

  tx = qcomm.sync(optax.sgd(0.1), codec=codec, comm_bucket_size=comm)
  params = jax.tree_util.tree_map(
      lambda g: jax.device_put(jnp.zeros(g.shape[1:], g.dtype), NamedSharding(mesh, P())), grads)
  spec = qcomm.state_partition_spec(jax.eval_shape(tx.init, params))
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))(params)

  def per_device(g, s, p):
    g = jax.tree_util.tree_map(lambda a: a[0], g)
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  # Not donated, as qcomm.data_parallel's default: on XLA:CPU a donated state makes XLA copy
  # the old error-feedback residual before overwriting it (docs/benchmarks-log.md, the malloc
  # series of 2026-11-26).
  step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), spec, P()),
                               out_specs=(P(), spec)))

  def update_only(g, s, p):  # the sync's update alone, what the bare allreduce is held to
    updates, _ = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)
    return jax.tree_util.tree_map(lambda u: u[None], updates)

  update = jax.jit(jax.shard_map(update_only, mesh=mesh, in_specs=(P("data"), spec, P()),
                                 out_specs=P("data")))
  # The same step without communication (the plain optimizer on this device's own gradient): what
  # a step costs anyway, subtracted as the torch peer subtracts the backward without DDP.
  plain = optax.sgd(0.1)

  def no_comm(g, s, p):
    updates, s = plain.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)
    return jax.tree_util.tree_map(lambda a: a[None], optax.apply_updates(p, updates)), s

  local_state = plain.init(params)
  local_step = jax.jit(jax.shard_map(no_comm, mesh=mesh, in_specs=(P("data"), P(), P()),
                                     out_specs=(P("data"), P())))
  for _ in range(warmup):
    params, state = jax.block_until_ready(step(grads, state, params))
    jax.block_until_ready(local_step(grads, local_state, params))
    jax.block_until_ready(update(grads, state, params))
  sync_times, ar_times, local_times, update_times = [], [], [], []
  with _common.gc_paused():
    for _ in range(repeats):  # one call of each per round: a change of load hits all alike
      t0 = time.perf_counter()
      params, state = jax.block_until_ready(step(grads, state, params))
      t1 = time.perf_counter()
      jax.block_until_ready(allreduce(grads))
      t2 = time.perf_counter()
      jax.block_until_ready(local_step(grads, local_state, params))
      t3 = time.perf_counter()
      jax.block_until_ready(update(grads, state, params))
      t4 = time.perf_counter()
      sync_times.append(t1 - t0)
      ar_times.append(t2 - t1)
      local_times.append(t3 - t2)
      update_times.append(t4 - t3)
  # Across processes: round i takes the slowest process's time of round i.
  sync_times = list(_common.collective_timing(_common.Timing(tuple(sync_times))).times)
  ar_times = list(_common.collective_timing(_common.Timing(tuple(ar_times))).times)
  local_times = list(_common.collective_timing(_common.Timing(tuple(local_times))).times)
  update_times = list(_common.collective_timing(_common.Timing(tuple(update_times))).times)
  ratios = [a / b for a, b in zip(sync_times, ar_times)]
  comm = [a - b for a, b in zip(sync_times, local_times)]

  # What optax.sgd(0.1) was handed: -updates / 0.1, the update alone's result.
  got = local(update(grads, state, params)) * np.float32(-10.0)
  err = float(np.linalg.norm(got - exact) / np.linalg.norm(exact))
  return dict(sync_median_s=statistics.median(sync_times), sync_times_s=sync_times,
              sync_allreduce_times_s=ar_times, sync_over_allreduce=statistics.median(ratios),
              local_step_times_s=local_times, local_step_median_s=statistics.median(local_times),
              sync_comm_median_s=statistics.median(comm),
              update_times_s=update_times, update_median_s=statistics.median(update_times),
              update_over_allreduce=statistics.median(
                  [u / a for u, a in zip(update_times, ar_times)]),
              sync_comm_over_allreduce=statistics.median([c / a for c, a in zip(comm, ar_times)]),
              sync_rel_error=err, sync_calls_before_error=warmup + repeats)


def main(args: argparse.Namespace, command: Sequence[str]) -> int:
  """Runs the benchmark of the parsed ``args``; process 0 prints the table and writes the JSON."""
  if args.bucket is not None and (args.bucket < 8 or args.bucket % 8):
    raise SystemExit(f"--bucket must be a positive multiple of 8, got {args.bucket}")
  low_rank = [c for c in args.codecs if CODECS[c][1] == "powersgd"]
  if low_rank and not args.tree:
    raise SystemExit(f"--codecs {' '.join(low_rank)} need --tree: PowerSGD reduces each leaf as "
                     f"a matrix, not a flat buffer")
  _common.init_devices(args.devices)

  mesh, meta = _common.mesh_and_metadata("allreduce", command)
  d = mesh.devices.size
  meta["config"] = dict(sizes=args.sizes, codecs=args.codecs, bucket_size=args.bucket,
                        impl=args.impl, repeats=args.repeats, warmup=args.warmup,
                        link_gbps=args.link_gbps, breakdown=args.breakdown, op="mean",
                        exchange=args.exchange)
  _common.log(_common.malloc_note(meta["malloc"]))
  if d == 1:
    _common.log("warning: one device only: nothing is communicated")
  rows, breakdown = [], []
  if args.tree:
    rows = bench_tree(mesh, args.codecs, bucket=args.bucket, impl=args.impl, repeats=args.repeats,
                      warmup=args.warmup, link_gbps=args.link_gbps, comm_bucket=args.comm_bucket,
                      sync=args.sync)
    if jax.process_index() == 0:
      print(format_tree(rows, meta))
      path = _common.write_json(args.out, dict(metadata=meta, rows=rows, breakdown=[]))
      print(f"wrote {path}")
    return 0
  for n in args.sizes:
    rows += bench_size(n, mesh, args.codecs, bucket=args.bucket, impl=args.impl,
                       repeats=args.repeats, warmup=args.warmup, link_gbps=args.link_gbps,
                       exchanges=args.exchange)
    if args.breakdown:
      breakdown += bench_breakdown(n, mesh, args.codecs, bucket=args.bucket, impl=args.impl,
                                   repeats=args.repeats, warmup=args.warmup,
                                   exchange=args.exchange[0])
  if jax.process_index() == 0:
    print(format_results(rows, breakdown, meta))
    path = _common.write_json(args.out, dict(metadata=meta, rows=rows, breakdown=breakdown))
    print(f"wrote {path}")
  return 0
