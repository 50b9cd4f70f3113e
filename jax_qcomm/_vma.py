"""Helpers for shard_map's varying-manual-axes (vma) types.

Inside ``jax.shard_map`` every value records the mesh axes it varies over. Two places need help:
``ffi_call`` results carry no such record, and both branches of a ``lax.cond`` must agree on it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax import lax


def vma_of(x: Any) -> frozenset:
  """Axes x varies over (empty outside shard_map)."""
  aval = jax.typeof(x) if not isinstance(x, jax.core.AbstractValue) else x
  mat = getattr(aval, "mat", None)  # jax >= 0.12: aval.mat.varying; earlier: aval.vma
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def make_varying(x: jax.Array, axes: frozenset) -> jax.Array:
  """x marked as varying over `axes` too (no data movement)."""
  missing = tuple(axes - vma_of(x))
  return lax.pcast(x, missing, to="varying") if missing else x


def cond(pred: jax.Array, branches: Sequence[Callable[[], Any]]) -> Any:
  """``lax.cond(pred, branches[0], branches[1])`` whose branches may differ in vma: every output
  is marked varying over the union of the axes either branch's output varies over."""
  jaxprs = [jax.make_jaxpr(b)() for b in branches]
  want = [frozenset().union(*(vma_of(j.out_avals[i]) for j in jaxprs))
          for i in range(len(jaxprs[0].out_avals))]

  def wrap(branch):
    def run(_):
      leaves, treedef = jax.tree_util.tree_flatten(branch())
      return jax.tree_util.tree_unflatten(treedef, [make_varying(x, w) for x, w in zip(leaves, want)])
    return run

  return lax.cond(pred, wrap(branches[0]), wrap(branches[1]), None)
