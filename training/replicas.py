"""Checks on replicated parameters shared by the example trainers (train.py, lm.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

import jax


def params_checksum(params: Any) -> float:
  """float64 sum of every parameter of this process's first device (replicas are identical):
  equal iff two runs ended with the same parameters, in practice."""
  leaves = [np.asarray(x.addressable_shards[0].data, np.float64)
            for x in jax.tree_util.tree_leaves(params)]
  return float(sum(leaf.sum() for leaf in leaves))


def replicas_identical(params: Any) -> bool:
  """Whether every device of this process holds bit-identical copies of every parameter."""
  for x in jax.tree_util.tree_leaves(params):
    shards = [np.asarray(s.data) for s in x.addressable_shards]
    if any(s.tobytes() != shards[0].tobytes() for s in shards[1:]):
      return False
  return True
