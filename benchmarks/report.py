"""Markdown tables from the benchmarks' JSON, one command per table::

    python -m benchmarks.report peers notebooks/data/peers_1gbit.json
    python -m benchmarks.report breakdown notebooks/data/cluster_allreduce_1gbit_pinned.json
    python -m benchmarks.report crossover notebooks/data/crossover_1gbit.json \\
        notebooks/data/crossover_10gbit.json

* ``peers`` (the recorded PyTorch side-by-side run, ``notebooks/data/peers_1gbit.json``): per payload, every jax_qcomm codec and torch method
  with its wire bytes per node, link floor, median time, time/floor, speed against torch's gloo
  fp32 all_reduce, and relative error against the exact mean;
* ``breakdown`` (``python -m benchmarks cluster ... -- allreduce --breakdown``): the allreduce
  rows against the floor, then where a compressed allreduce spends its time (encode, exchange,
  decode-sum-reencode, decode, and the transfer alone of the same bytes);
* ``crossover`` (allreduce runs over ``--sizes``, one JSON per link rate): time against size for
  each codec, and from which size on each compressed codec beats exact fp32.

Only the JSON is read: no jax, no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Iterable, Sequence

# -- formatting ----------------------------------------------------------------------------------------


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
  """A GitHub markdown table; the first two columns (labels) left-aligned, the rest right."""
  rows = [[("" if c is None else str(c)) for c in r] for r in rows]
  align = [":--" if i < 2 else "--:" for i in range(len(headers))]
  lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(lines)


def ms(seconds: float | None, digits: int = 1) -> str:
  return "" if seconds is None else f"{1e3 * seconds:.{digits}f}"


def ratio(x: float | None, digits: int = 2) -> str:
  return "" if x is None else f"{x:.{digits}f}x"


def mb(nbytes: int | None) -> str:
  return "" if nbytes is None else f"{nbytes / 1e6:.2f}"


def bytes_label(nbytes: int) -> str:
  """4096 -> 4.1 kB, 4194304 -> 4.19 MB, 1073741824 -> 1.07 GB (decimal units)."""
  for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
    if nbytes >= scale:
      return f"{nbytes / scale:.3g} {unit}"
  return f"{nbytes} B"


def size_label(n: int) -> str:
  """Powers-of-two sizes as K/M/G (1024 -> 1K, 2**28 -> 256M), others in decimal (25.6M)."""
  for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
    if n >= scale and n % scale == 0 and (n < scale << 10 or unit == "G"):
      return f"{n // scale}{unit}"
  if n >= 10**6:
    return f"{n / 1e6:g}M"
  return f"{n:,}"


def _cluster_line(meta: dict[str, Any]) -> str:
  """One line on where it ran: nodes, rate, placement, link check, date, load."""
  c = meta.get("cluster") or {}
  if not c:
    return "no simulated cluster (local processes)"
  check = c.get("link_check")
  parts = [f"{c.get('nodes')} nodes, links {c.get('rate')} each way",
           c.get("placement", "placement not recorded")]
  if check:
    parts.append(f"link check {check['min_bits_per_s'] / 1e6:.0f}-"
                 f"{check['max_bits_per_s'] / 1e6:.0f} Mbit/s per flow")
  runs = c.get("runs") or []
  if runs:
    loads = [r["load_average_before"][0] for r in runs if r.get("load_average_before")]
    if loads:
      parts.append(f"load before runs {min(loads):.2f}-{max(loads):.2f}")
  return "; ".join(parts)


def _heading(title: str, meta: dict[str, Any], *details: str) -> list[str]:
  """A table's heading: the bold title, then where it ran and the run's details in parentheses;
  and a blank line."""
  return [f"**{title}** ({'; '.join([_cluster_line(meta), *details])})", ""]


# -- peers ---------------------------------------------------------------------------------------------

def _peer_note(r: dict[str, Any]) -> str:
  if r.get("status") == "refused":
    return f"refused by torch: {r.get('error', '')}"
  notes = []
  if r["framework"] == "torch" and r["method"].startswith("ddp"):
    notes.append("comm part (synced - local backward)")
    if r.get("ddp_bucket_bytes"):
      notes.append(f"{len(r['ddp_bucket_bytes'])} bucket(s)")
  if r.get("rel_error_first_compressed") is not None:
    notes.append(f"error at 1st compressed step {r['rel_error_first_compressed']:.3g}")
  if r["framework"] == "jax_qcomm" and r.get("all_reduces"):
    notes.append(f"{r['all_reduces']} all-reduce(s) compiled")
  return "; ".join(notes)


def peers_markdown(merged: dict[str, Any]) -> str:
  """The peers table(s), one per payload, with a header saying where and how it ran."""
  meta = merged["metadata"]
  cfg = meta["config"]
  out = _heading("Peers on the same links", meta,
                 f"torch {meta.get('torch_version')}, {cfg['repeats']} timed runs after "
                 f"{cfg['warmup']} warmup, median; per call the slowest node")
  for payload in cfg["payloads"]:
    rows = [r for r in merged["rows"] if r["payload"] == payload]
    if not rows:
      out += [f"{payload}: no rows (failed: see metadata.failures)", ""]
      continue
    gloo = next((r for r in rows if r["method"] == "allreduce_fp32" and r.get("median_s")), None)
    first = rows[0]
    out.append(f"*{payload}*: {first['elements']:,} float32 values in {first['leaves']} leaf(s), "
               f"{first['gradients']} gradients")
    out.append("")
    table = []
    for r in rows:
      med = r.get("median_s")
      vs = gloo["median_s"] / med if gloo and med else None
      table.append([r["framework"], r["method"], mb(r.get("wire_bytes_per_device")),
                    ms(r.get("link_floor_s")), ms(med),
                    "" if med is None else f"{ms(r.get('min_s'))}-{ms(r.get('max_s'))}",
                    ratio(r.get("time_vs_floor")), ratio(vs),
                    "" if r.get("rel_error") is None else f"{r['rel_error']:.3g}", _peer_note(r)])
    out.append(markdown_table(
        ["framework", "method", "wire MB/node", "floor ms", "median ms", "min-max ms",
         "time/floor", "vs gloo fp32", "rel. error", "note"], table))
    out.append("")
  out.append("wire MB/node: bytes each node sends, 2(n-1)/n x the buffers allreduced (fp16 hook: 2 "
             "bytes/value; PowerSGD: P and Q of each compressed matrix + the uncompressed tensors, "
             "float32; qcomm: the codecs' payload_size, exact leaves float32); floor = those bytes / "
             "link rate. rel. error = ||out - exact mean|| / ||exact mean|| (PowerSGD: after the last "
             "timed step, with error feedback; its first compressed step in the note).")
  if meta.get("failures"):
    out.append(f"failures: {meta['failures']}")
  return "\n".join(out)


# -- breakdown -----------------------------------------------------------------------------------------

def breakdown_markdown(result: dict[str, Any]) -> str:
  """The allreduce rows against the floor, then the breakdown of each compressed codec."""
  meta = result["metadata"]
  cfg = meta["config"]
  out = _heading(f"Allreduce, {meta['num_devices']} devices in {meta['num_processes']} processes",
                 meta, f"link {cfg.get('link_gbps')} Gbit/s", f"median of {cfg['repeats']}")
  out.append(markdown_table(
      ["size", "codec", "median ms", "wire MB/node", "floor ms", "time/floor", "vs fp32"],
      [[size_label(r["size"]), r["codec"], ms(r["median_s"]), mb(r["wire_bytes_per_device"]),
        ms(r.get("link_floor_s")), ratio(r.get("time_vs_floor")), ratio(r.get("speedup_vs_fp32"))]
       for r in result["rows"]]))
  bd = result.get("breakdown") or []
  if bd:
    med = {(r["size"], r["codec"].split("/")[0]): r for r in result["rows"]}
    table = []
    for b in bd:
      full = med.get((b["size"], b["codec"]))
      parts = b["codec_total_s"] + (b["transfer_s"] or 0)
      if b.get("summable"):  # scale + encode, no middle step, one decode of the summed words
        encode, middle, decode = b["scale_s"] + b["encode_s"], None, b["decode_s"]
      else:
        encode, decode = b["encode_chunks_s"], b["decode_chunks_s"]
        middle = (b["decode_sum_reencode_s"] if b.get("fused")
                  else b["decode_sum_s"] + b["encode_reduced_s"])
      floor = full.get("link_floor_s") if full else None
      table.append([size_label(b["size"]), b["codec"], ms(encode), ms(middle),
                    ms(decode), ms(b["codec_total_s"]), ms(b.get("transfer_s")),
                    ratio(b["transfer_s"] / floor if floor and b.get("transfer_s") else None),
                    ms(parts), ms(full["median_s"] if full else None), ms(floor),
                    ratio(full["median_s"] / floor if full and floor else None)])
    out += ["", "Where the time goes (codec work of one device without communication, all "
            "processes at once; transfer = the same exchange + all_gather of the payload bytes, no "
            "codec; summable codecs: encode = bucket scales + words, transfer = pmax + psum):", "",
            markdown_table(["size", "codec", "encode ms", "decode-sum-reencode ms", "decode ms",
                            "codec total ms", "transfer ms", "transfer/floor",
                            "codec + transfer ms", "allreduce ms", "floor ms", "allreduce/floor"],
                           table)]
  return "\n".join(out)


# -- crossover -----------------------------------------------------------------------------------------

def crossover_size(points: dict[int, tuple[float, float]]) -> int | None:
  """The smallest size from which the codec is faster than fp32 at every larger measured size.

  ``points``: size -> (fp32 seconds, codec seconds). None if it is not faster at the largest.
  """
  best = None
  for n in sorted(points, reverse=True):
    t_fp32, t_codec = points[n]
    if t_codec < t_fp32:
      best = n
    else:
      break
  return best


def _rate_label(result: dict[str, Any]) -> str:
  c = result["metadata"].get("cluster") or {}
  gbps = result["metadata"]["config"].get("link_gbps")
  label = c.get("rate") or (f"{gbps:g} Gbit/s" if gbps else "no link")
  if gbps and gbps > 3:
    label += " (not simulable on 2 cores: veth path CPU-bound ~3 Gbit/s)"
  return label


def crossover_markdown(results: Sequence[dict[str, Any]]) -> str:
  """Per file (link rate): time against size per codec; then where compression starts to pay."""
  out = []
  summary = []
  for result in results:
    rows = result["rows"]
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    sizes = sorted({r["size"] for r in rows})
    by = {(r["size"], r["codec"]): r for r in rows}
    label = _rate_label(result)
    out += _heading(f"Allreduce time against size, {label}", result["metadata"])
    headers = ["size", "bytes fp32"] + [f"{c} ms" for c in codecs] + \
        [f"{c} vs fp32" for c in codecs if c != "fp32"] + ["fp32 time/floor"]
    table = []
    for n in sizes:
      line = [size_label(n), bytes_label(4 * n)]
      line += [ms(by[(n, c)]["median_s"], 2) if (n, c) in by else "" for c in codecs]
      line += [ratio(by[(n, c)].get("speedup_vs_fp32")) if (n, c) in by else ""
               for c in codecs if c != "fp32"]
      line.append(ratio(by[(n, "fp32")].get("time_vs_floor")) if (n, "fp32") in by else "")
      table.append(line)
    out += [markdown_table(headers, table), ""]
    for c in codecs:
      if c == "fp32":
        continue
      points = {n: (by[(n, "fp32")]["median_s"], by[(n, c)]["median_s"]) for n in sizes
                if (n, "fp32") in by and (n, c) in by}
      x = crossover_size(points)
      largest = max(points) if points else None
      summary.append([label, c, "never (up to " + size_label(largest) + ")" if x is None and largest
                      else size_label(x) if x else "",
                      ratio(by[(x, c)]["speedup_vs_fp32"]) if x else "",
                      ratio(by[(largest, c)]["speedup_vs_fp32"]) if largest else ""])
  out += ["**Where compression starts to pay** (smallest size from which the codec beats exact "
          "fp32 at every larger size measured):", "",
          markdown_table(["link", "codec", "pays from", "speedup there", "speedup at the largest"],
                         summary)]
  return "\n".join(out)


# -- command line --------------------------------------------------------------------------------------

def _load(path: str) -> dict[str, Any]:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("table", choices=("peers", "breakdown", "crossover"))
  parser.add_argument("files", nargs="+", help="the JSON file(s)")
  args = parser.parse_args(argv)
  results = [_load(p) for p in args.files]
  if args.table == "crossover":
    print(crossover_markdown(results))
    return 0
  for result in results:
    print(peers_markdown(result) if args.table == "peers" else breakdown_markdown(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
