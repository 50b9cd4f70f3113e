"""Checks on replicated parameters shared by the example trainers (train.py, lm.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

import jax


def _copies(x: jax.Array) -> dict[str, list[np.ndarray]]:
  """This process's copies of each shard of ``x``, by shard index (one index for a replicated
  array; one per model shard for parameters sharded over a model axis)."""
  out: dict[str, list[np.ndarray]] = {}
  for s in x.addressable_shards:
    out.setdefault(str(s.index), []).append(np.asarray(s.data))
  return out


def params_checksum(params: Any) -> float:
  """float64 sum of every parameter (one copy of each shard; replicas are identical): equal iff
  two runs ended with the same parameters, in practice."""
  return float(sum(copies[0].astype(np.float64).sum()
                   for x in jax.tree_util.tree_leaves(params) for copies in _copies(x).values()))


def replicas_identical(params: Any) -> bool:
  """Whether every device of this process holds bit-identical copies of every parameter shard
  (of the whole parameter where it is replicated)."""
  return all(c.tobytes() == copies[0].tobytes()
             for x in jax.tree_util.tree_leaves(params)
             for copies in _copies(x).values() for c in copies[1:])
