"""The rule ``qcomm.Auto`` (``sync(bits=b)``) follows, tabulated from the codecs' own byte counts.

For each bit width and device count: Summable's and QSGD's bytes per value sent by each device in
one allreduce, each collective weighted by the transport's factor (:mod:`jax_qcomm.transport`),
their ratio and the codec :meth:`qcomm.Auto.resolve` picks, on gloo (CPU processes: ``GLOO_PAIR``
at two, ``GLOO`` from three) and on the ideal transport (NCCL on paper). Then the hierarchical
composition: ``Hierarchical(inner, outer)`` sums over the ``outer`` nodes only, so a summable
codec's fields grow with log2(nodes), not log2(devices)::

    python -m benchmarks.auto_rule [--bits 3 4 8] [--devices 2 3 4 8 16 32 64]
"""

from __future__ import annotations

import argparse
from typing import Sequence

import jax_qcomm as qcomm
from jax_qcomm import transport as T
from jax_qcomm.tools import efficiency as eff

N = 1 << 24  # elements of the reference buffer (one comm bucket)


def gloo(devices: int) -> T.Transport:
  """The measured gloo transport for ``devices`` processes."""
  return T.GLOO_PAIR if devices == 2 else T.GLOO


def rows(bits: Sequence[int], devices: Sequence[int]) -> list[dict]:
  out = []
  for b in bits:
    auto = qcomm.Auto(b)
    for d in devices:
      for name, t in (("gloo", gloo(d)), ("ideal", T.IDEAL)):
        cost = {type(c).__name__: t.weighted_bytes(c.traffic(N, d)) * 8 / N
                for c in auto.candidates}
        out.append(dict(bits=b, devices=d, transport=name, summable=cost.get("Summable"),
                        qsgd=cost["QSGD"], picks=type(auto.resolve(d, transport=t)).__name__))
  return out


def hierarchical_rows(bits: int, inner: int, nodes: Sequence[int]) -> list[dict]:
  """Bits per value on the slow links for Summable over ``nodes`` x ``inner`` devices: flat (fields
  for every device) and hierarchical (fields for the nodes; the exact fast-link part aside)."""
  out = []
  for k in nodes:
    flat = qcomm.Summable(bits).sent_bytes(N, k * inner) * 8 / N
    hier = eff.hierarchical_allreduce_bytes(N, inner, k, qcomm.Summable(bits))["outer"] * 8 / N
    out.append(dict(bits=bits, inner=inner, nodes=k, flat=flat, hierarchical=hier,
                    field_flat=qcomm.Summable(bits).wire_bits(k * inner),
                    field_hier=qcomm.Summable(bits).wire_bits(k)))
  return out


def markdown(table: list[dict], hier: list[dict]) -> str:
  lines = ["| bits | D | transport | Summable bits/value (weighted) | QSGD bits/value (weighted) | "
           "Summable / QSGD | Auto picks |", "|--:|--:|---|--:|--:|--:|---|"]
  for r in table:
    s = "" if r["summable"] is None else f"{r['summable']:.2f}"
    ratio = "" if r["summable"] is None else f"{r['summable'] / r['qsgd']:.2f}"
    lines.append(f"| {r['bits']} | {r['devices']} | {r['transport']} | {s} | {r['qsgd']:.2f} | "
                 f"{ratio} | {r['picks']} |")
  lines += ["", "| bits | nodes x devices | Summable flat: wire bits/value, sent bits/value | "
            "hierarchical: wire bits/value, sent bits/value (slow links) |", "|--:|---|--:|--:|"]
  for r in hier:
    lines.append(f"| {r['bits']} | {r['nodes']} x {r['inner']} | {r['field_flat']:.2f}, "
                 f"{r['flat']:.2f} | {r['field_hier']:.2f}, {r['hierarchical']:.2f} |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.auto_rule", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--bits", type=int, nargs="+", default=[3, 4, 8])
  parser.add_argument("--devices", type=int, nargs="+", default=[2, 3, 4, 8, 16, 32, 64])
  parser.add_argument("--inner", type=int, default=8, help="devices per node (hierarchical)")
  args = parser.parse_args(argv)
  print(markdown(rows(args.bits, args.devices),
                 hierarchical_rows(4, args.inner, [2, 4, 8])))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
