"""Bytes each device sends, read from a compiled HLO module, by the mesh axes each collective runs
over (``replica_groups=mesh[...] {axes}``): what ``qcomm.describe`` is checked against, split into
the collectives that cross a given axis (the nodes' slow links) and the rest."""

from __future__ import annotations

import math
import re

_ITEMSIZE = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "u16": 2, "s16": 2, "u8": 1,
             "s8": 1, "pred": 1, "f64": 8, "s64": 8, "u64": 8}
_OP = re.compile(r"=\s*(\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+(all-reduce|all-gather|"
                 r"all-to-all|reduce-scatter|collective-permute)\(.*?replica_groups=mesh\[([^\]]*)\]"
                 r" \{([^}]*)\}")


def _shape_bytes(shape: str) -> int:
  return sum(_ITEMSIZE[t] * math.prod(int(v) for v in dims.split(",") if v)
             for t, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", shape))


def sent_bytes(text: str, across: str = "node") -> tuple[float, float]:
  """(bytes each device sends, of which over collectives whose group spans the axis ``across``).

  Per collective over ``k`` devices: all-reduce 2 (k-1)/k x size, all-gather and all-to-all
  (k-1)/k x output, reduce-scatter (k-1) x output, collective-permute 1 x size. A collective in a
  loop body counts once (unroll or count the trips yourself)."""
  total = cross = 0.0
  for line in text.splitlines():
    m = _OP.search(line)
    if not m:
      continue
    shape, op, sizes, axes = m.groups()
    sizes = {a.strip("'"): int(v) for a, v in (x.split("=") for x in sizes.split(","))}
    names = [a.strip().strip("'") for a in axes.split(",")]
    k = math.prod(sizes[a] for a in names)
    f = {"all-reduce": 2 * (k - 1) / k, "all-gather": (k - 1) / k, "all-to-all": (k - 1) / k,
         "reduce-scatter": k - 1, "collective-permute": 1}[op]
    nbytes = f * _shape_bytes(shape)
    total += nbytes
    cross += nbytes if across in names else 0.0
  return total, cross
