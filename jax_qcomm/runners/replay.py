"""Programs that outlive a CPU backend rebuild (what the elastic runners need after one).

    program = Replayed(jax.jit(jax.shard_map(f, mesh=mesh.abstract_mesh, ...)), traces, key)
    program(*args)                      # traced once into traces[key]; replayed afterwards
    program.lower(*global_shapes(...))  # load it ahead from shapes alone

A rebuild of the CPU backend (:func:`jax_qcomm._compat.reset_cpu_backend`) drops every program.
The persistent compilation cache spares their compilation, not their trace: jax runs a function's
Python again for each program it lowers on new devices, which for an optimizer with a codec takes
up to a second on a loaded CPU. :class:`Replayed` keeps the jaxpr instead; :func:`global_shapes`
gives the abstract arguments to lower it with, without building arrays.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

import jax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


class Replayed:
  """``fn`` (a jitted function whose jaxpr names no device: its ``shard_map`` over an abstract
  mesh), traced once: at its first call or ``lower`` on any backend, into ``traces[key]``, as a
  jaxpr whose constants are host arrays. The program it runs replays that jaxpr
  (``jax.jit(jaxpr_as_fun(jaxpr))``), so a backend rebuild, which needs every program anew, does
  not run ``fn``'s Python again: for an optimizer with a codec that trace takes up to a second
  on a loaded CPU, and the admitting round would wait for it. The replay is the same computation
  (bit for bit); the persistent compilation cache keeps it like any program."""

  def __init__(self, fn: Callable, traces: dict, key: Any):
    self._fn, self._traces, self._key = fn, traces, key
    self._jit: Callable | None = None

  def _program(self, args: tuple) -> Callable:
    if self._jit is None:
      avals = [(np.shape(x), np.dtype(x.dtype)) for x in jax.tree_util.tree_leaves(args)]
      entry = self._traces.get(self._key)
      if entry is None or entry[2] != avals:
        traced = self._fn.trace(*args)
        try:
          consts, keep = [np.asarray(c) for c in traced.jaxpr.consts], True
        except (TypeError, ValueError):  # a constant with no host form (a typed PRNG key):
          consts, keep = traced.jaxpr.consts, False  # replayed on this backend only
        entry = (ClosedJaxpr(traced.jaxpr.jaxpr, consts),
                 jax.tree_util.tree_structure(traced.out_info), avals)
        if keep:
          self._traces[self._key] = entry
      jaxpr, self._out_tree, _ = entry
      self._jit = jax.jit(jaxpr_as_fun(jaxpr))
    return self._jit

  def __call__(self, *args: Any) -> Any:
    out = self._program(args)(*jax.tree_util.tree_leaves(args))
    return jax.tree_util.tree_unflatten(self._out_tree, out)

  def lower(self, *args: Any) -> Any:
    return self._program(args).lower(*jax.tree_util.tree_leaves(args))


def global_shapes(tree: Any, mesh: Mesh, spec: Any) -> Any:
  """What ``multihost_utils.host_local_array_to_global_array(tree, mesh, spec)`` makes, as
  ``jax.ShapeDtypeStruct`` values: each dimension split over mesh axes is this process's times
  the processes along them. ``spec``: one ``PartitionSpec``, or a tree of them over ``tree``."""
  local = mesh.local_mesh.shape

  def one(x, s):
    shape = list(np.shape(x))
    for d, axes in enumerate(s):
      for a in (() if axes is None else axes if isinstance(axes, tuple) else (axes,)):
        shape[d] *= mesh.shape[a] // local[a]
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype, sharding=NamedSharding(mesh, s))

  if isinstance(spec, P):
    return jax.tree_util.tree_map(lambda x: one(x, spec), tree)
  return jax.tree_util.tree_map(one, tree, spec)
