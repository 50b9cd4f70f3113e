"""Every difference between the jax versions jax_qcomm supports (jax >= 0.11), in one place.

Each difference is decided once, at import time, by a feature test named and documented here; the
rest of the package calls the functions below and never looks at jax's version or its private
modules (``jax._src``).

What differs, and what does not:

* **Varying manual axes (vma).** Inside ``jax.shard_map`` every abstract value records the mesh
  axes it varies over. jax 0.11 keeps them in ``ShapedArray.vma``; jax 0.12 moved them to
  ``ShapedArray.mat.varying`` (``mat``: the manual-axis type) and dropped ``vma``. Feature test:
  whether ``jax.core.ShapedArray`` has the ``mat`` attribute (:data:`HAS_MAT`). :func:`vma_of`
  reads the right one; :func:`make_varying` adds axes with ``lax.pcast(..., to="varying")``, which
  both versions have.
* ``jax.typeof`` and ``jax.shard_map`` (top level, not ``jax.experimental``) exist in every
  supported version: no shim, call them directly.
* CPU collectives across processes (gloo bound to a network interface): see
  :mod:`jax_qcomm.distributed`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax import lax

#: Feature test, once: jax 0.12 stores the varying manual axes in ``aval.mat.varying``; jax 0.11
#: in ``aval.vma``.
HAS_MAT: bool = hasattr(jax.core.ShapedArray, "mat")


def vma_of(x: Any) -> frozenset:
  """The mesh axes ``x`` (an array, tracer or abstract value) varies over; empty outside
  ``shard_map`` and under ``shard_map(check_vma=False)`` or ``pmap``."""
  aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
  if HAS_MAT:
    mat = getattr(aval, "mat", None)  # abstract values other than arrays (tokens, keys' own) lack it
    return frozenset(mat.varying) if mat is not None else frozenset()
  return frozenset(getattr(aval, "vma", ()))


def make_varying(x: jax.Array, axes: frozenset) -> jax.Array:
  """``x`` marked as varying over ``axes`` too (a type change; no data moves).

  Needed where a value's recorded axes are fewer than its true ones: ``ffi_call`` results carry no
  record, and both branches of a ``lax.cond`` must agree on it."""
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
