"""The cost model (:mod:`jax_qcomm.tools.efficiency`) against the cluster measurements::

    python -m benchmarks.model                      # table of predicted vs measured, JSON out
    python -m benchmarks.model --out notebooks/data/model_check.json

Calibration and check use different measurements, so the check is not a fit of the points it
predicts:

* calibrated from runs that time ONE ingredient each: the raw collectives of ``benchmarks
  patterns`` (``psum``, ``all_to_all``, ``all_gather`` of uint8 rows: each one's time against its
  link floor gives :class:`~jax_qcomm.tools.efficiency.Transport`'s factors; a run with tiny rows gives
  the per-message latency) and the codec work alone (the ``--breakdown`` of ``benchmarks
  allreduce``: encode, decode-sum-reencode, decode without communication, per element);
* checked against end-to-end allreduce times measured separately: the allreduce rows of the same
  breakdown run, every size of the crossover runs, and every jax_qcomm and torch row of
  the recorded PyTorch side-by-side run (``peers_1gbit.json``) whose time is transfer-bound (PowerSGD's is not: it is reported with its
  bytes only).

It also extrapolates Tc to 2..64 nodes at 1/10/25/100 Gbit/s for ResNet50's and GPT-2 small's
gradients, with the transport measured here (gloo on CPU) and with an ideal full-duplex transport
(NCCL's rings; codec work free, as on a GPU), for the efficiency notebook's plot. Only JSON and
the library's cost model are used: no JAX computation, no cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from typing import Any, Sequence

from jax_qcomm.tools import efficiency as eff

from benchmarks import allreduce as allreduce_bench
from benchmarks import report

DATA = pathlib.Path("notebooks/data")
DEFAULTS = dict(
    patterns=DATA / "patterns_2node_1gbit.json",
    latency=DATA / "patterns_2node_1gbit_small.json",
    breakdown=DATA / "cluster_allreduce_1gbit_pinned.json",
    crossover=DATA / "crossover_1gbit.json",
    peers=DATA / "peers_1gbit.json",
    out=DATA / "model_check.json",
)
TOLERANCE = 0.15
PAYLOADS = {"resnet50": 25_557_032, "gpt2_125m": 124_439_808}
EXTRAPOLATE = dict(nodes=(2, 4, 8, 16, 32, 64), gbps=(1.0, 10.0, 25.0, 100.0))


def _load(path: pathlib.Path) -> dict[str, Any]:
  return json.loads(pathlib.Path(path).read_text())


def _codec(name: str) -> Any:
  """The library codec of a benchmark codec name (``qsgd4``, ``cast_bf16``, ``sum4``, ``fp32``)."""
  return allreduce_bench.make_codec(name)


def calibrate(patterns: dict, latency: dict | None, breakdown: dict) -> dict[str, Any]:
  """Transport factors (time / link floor of each raw collective), per-message latency (half the
  time of a tiny psum: a 2-node ring sends 2 messages) and codec throughput per codec."""
  by = {r["pattern"]: r for r in patterns["rows"]}
  missing = [p for p in ("psum", "all_to_all", "all_gather") if p not in by]
  if missing:
    raise SystemExit(f"patterns run lacks {missing}: run `benchmarks cluster ... -- patterns "
                     f"--patterns psum all_to_all all_gather`")
  lat = 0.0
  if latency is not None:
    small = {r["pattern"]: r for r in latency["rows"]}
    if "psum" in small:
      lat = small["psum"]["median_s"] / eff.messages_per_allreduce(small["psum"]["devices"])
  transport = eff.Transport(allreduce=by["psum"]["time_vs_floor"],
                            all_to_all=by["all_to_all"]["time_vs_floor"],
                            all_gather=by["all_gather"]["time_vs_floor"], latency_s=lat)
  rates = {b["codec"]: b["size"] / b["codec_total_s"] for b in breakdown.get("breakdown", [])
           if b.get("codec_total_s")}
  return dict(transport=transport, codec_elems_per_s=rates,
              link_gbps=patterns["metadata"]["config"].get("link_gbps") or 1.0)


def predict(n: int, devices: int, codec_name: str, cal: dict[str, Any],
            link_gbps: float | None = None) -> float | None:
  """Modelled seconds of one allreduce of ``n`` float32 values (None: no codec rate measured)."""
  codec = _codec(codec_name)
  if codec is None:  # cast_pmean / pmean_leaves: not a codec of the library
    return None
  rate = None if codec.exact else cal["codec_elems_per_s"].get(codec_name)
  if not codec.exact and rate is None:
    return None
  return eff.comm_time(n, devices, codec, link_gbps or cal["link_gbps"],
                       codec_elems_per_s=rate, transport=cal["transport"])


def _point(source: str, label: str, measured: float, predicted: float | None, **extra) -> dict:
  err = None if predicted is None else predicted / measured - 1
  return dict(source=source, label=label, measured_s=measured, predicted_s=predicted,
              error=err, **extra)


def check(cal: dict[str, Any], breakdown: dict, crossover: dict | None,
          peers: dict | None) -> list[dict[str, Any]]:
  """Every measured end-to-end point with its prediction."""
  points = []
  for r in breakdown["rows"]:
    points.append(_point("breakdown", f"{report.size_label(r['size'])} {r['codec']}",
                         r["median_s"], predict(r["size"], r["devices"], r["codec"], cal)))
  for r in (crossover or {}).get("rows", []):
    points.append(_point("crossover", f"{report.size_label(r['size'])} {r['codec']}",
                         r["median_s"], predict(r["size"], r["devices"], r["codec"], cal)))
  for r in (peers or {}).get("rows", []):
    if r.get("median_s") is None:
      continue
    label = f"{r['payload']} {r['framework']} {r['method']}"
    floor_model = eff.transfer_time(r["wire_bytes_per_device"], cal["link_gbps"])
    if r["framework"] == "torch":
      if r["method"].startswith("ddp_powersgd"):  # compute-bound: bytes only
        points.append(_point("peers", label, r["median_s"], None,
                             note="PowerSGD: compute-bound (matmuls, orthogonalisation); bytes "
                                  "modelled, time not", wire_bytes=r["wire_bytes_per_device"]))
        continue
      t = floor_model * cal["transport"].allreduce + 2 * cal["transport"].latency_s
      points.append(_point("peers", label, r["median_s"], t))
    elif r["method"] == "pmean_leaves":  # one psum per leaf: latency-bound leaves not modelled
      points.append(_point("peers", label, r["median_s"], None,
                           note="one pmean per leaf: not a single buffer"))
    else:
      codec = _codec(r["method"])
      rate = None if codec.exact else cal["codec_elems_per_s"].get(r["method"])
      if not codec.exact and rate is None:
        points.append(_point("peers", label, r["median_s"], None, note="no codec rate measured"))
        continue
      # The row's own bytes (a pytree: exact small leaves beside the coded ones), the transport
      # factor and latency of its collectives, as efficiency.comm_time counts them.
      factor = cal["transport"].allreduce if (codec.exact or codec.summable) else \
          (cal["transport"].all_to_all + cal["transport"].all_gather) / 2
      collectives_used = 1 if codec.exact else 2
      t = floor_model * factor + collectives_used * 2 * cal["transport"].latency_s
      t += 0.0 if codec.exact else r["elements"] / rate
      points.append(_point("peers", label, r["median_s"], t))
  return points


def extrapolate(cal: dict[str, Any], codecs: Sequence[str]) -> list[dict[str, Any]]:
  """Tc for each payload, node count, link rate and codec: with the transport and codec rates
  measured here ("gloo-cpu") and with an ideal transport and free codec work ("ideal")."""
  rows = []
  for payload, n in PAYLOADS.items():
    for d in EXTRAPOLATE["nodes"]:
      for gbps in EXTRAPOLATE["gbps"]:
        for name in codecs:
          codec = _codec(name)
          measured = predict(n, d, name, cal, gbps)
          ideal = eff.comm_time(n, d, codec, gbps)
          rows.append(dict(payload=payload, nodes=d, link_gbps=gbps, codec=name,
                           wire_bytes=eff.allreduce_bytes(n, d, codec),
                           tc_gloo_cpu_s=measured, tc_ideal_s=ideal))
  return rows


def markdown(cal: dict[str, Any], points: list[dict[str, Any]]) -> str:
  t = cal["transport"]
  head = (f"**The cost model against the measurements** (calibrated: all-reduce {t.allreduce:.2f}x, "
          f"all_to_all {t.all_to_all:.2f}x, all_gather {t.all_gather:.2f}x the link floor, "
          f"{1e3 * t.latency_s:.2f} ms per message; codec work "
          + ", ".join(f"{k} {v / 1e6:.0f} M elem/s" for k, v in sorted(cal["codec_elems_per_s"].items()))
          + ")")
  rows = [[p["source"], p["label"], report.ms(p["measured_s"], 2),
           report.ms(p["predicted_s"], 2),
           "" if p["error"] is None else f"{100 * p['error']:+.0f}%",
           "" if p["error"] is None else ("yes" if abs(p["error"]) <= TOLERANCE else "no"),
           p.get("note", "")] for p in points]
  checked = [p for p in points if p["error"] is not None]
  ok = sum(abs(p["error"]) <= TOLERANCE for p in checked)
  big = [p for p in checked if p["measured_s"] >= 0.05]
  ok_big = sum(abs(p["error"]) <= TOLERANCE for p in big)
  summary = (f"{ok} of {len(checked)} modelled points within {TOLERANCE:.0%}; "
             f"{ok_big} of {len(big)} of those taking >= 50 ms.")
  return "\n".join([head, "", report.markdown_table(
      ["source", "point", "measured ms", "model ms", "error", f"within {TOLERANCE:.0%}", "note"],
      rows), "", summary])


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.model", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  for name, default in DEFAULTS.items():
    parser.add_argument(f"--{name}", type=pathlib.Path, default=default,
                        help=f"(default: {default})")
  args = parser.parse_args(argv)
  for name in ("patterns", "breakdown"):
    if not getattr(args, name).exists():
      raise SystemExit(f"--{name} {getattr(args, name)} does not exist (see docs/benchmarks.md)")
  opt = lambda p: _load(p) if p.exists() else None
  breakdown = _load(args.breakdown)
  cal = calibrate(_load(args.patterns), opt(args.latency), breakdown)
  points = check(cal, breakdown, opt(args.crossover), opt(args.peers))
  codecs = ["fp32"] + [c for c in ("cast_bf16", "qsgd4", "sum4") if c in cal["codec_elems_per_s"]]
  calibrated = {k: v for k, v in dataclasses.asdict(cal["transport"]).items()
                if k not in ("own_operand", "message_bytes")}  # the factors and the latency: what
  # the patterns measure (own_operand and the pieces' bound are not calibrated here)
  out = dict(calibration=dict(transport=calibrated,
                              codec_elems_per_s=cal["codec_elems_per_s"], link_gbps=cal["link_gbps"],
                              sources={k: str(getattr(args, k)) for k in DEFAULTS if k != "out"}),
             tolerance=TOLERANCE, points=points, extrapolation=extrapolate(cal, codecs))
  args.out.write_text(json.dumps(out, indent=1) + "\n")
  print(markdown(cal, points))
  print(f"\nwrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
