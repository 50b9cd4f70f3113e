"""Axis arguments of the collectives: a mesh axis name, a tuple of names, or :class:`Hierarchical`.

Every collective takes one of these as ``axis_name``; this module says which mesh axes it spans,
how many devices that is (with an error that names the mesh's axes when it is not bound), and
derives the per-device randomness that stochastic rounding needs.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Union

import jax
from jax import lax

from jax_qcomm._checks import check_axis_name

AxisName = Union[Hashable, tuple]


@dataclasses.dataclass(frozen=True)
class Hierarchical:
  """Topology-aware axis: exact reduce-scatter over the fast ``inner`` axis, the codec's allreduce
  of each shard over the slow ``outer`` axis, all-gather over ``inner``. Only the codec's bytes
  cross the slow links. ``inner`` and ``outer`` are axis names (or tuples of names)."""

  inner: AxisName
  outer: AxisName

  def __post_init__(self):
    for name in ("inner", "outer"):
      check_axis_name(name, getattr(self, name))
    overlap = set(axis_names(self.inner)) & set(axis_names(self.outer))
    if overlap:
      raise ValueError(f"outer must name other axes than inner, got inner={self.inner!r} and "
                       f"outer={self.outer!r} (both name {sorted(map(repr, overlap))})")


def check_axis(axis_name: object, hierarchical: bool = True) -> None:
  """ValueError unless ``axis_name`` is a name, a tuple of names (or, if allowed, Hierarchical)."""
  if hierarchical:
    check_axis_name("axis_name", axis_name, (Hierarchical,), "qcomm.Hierarchical(inner, outer)")
  else:
    check_axis_name("axis_name", axis_name)


def axis_names(axis_name: AxisName) -> tuple:
  """The mesh axis names an axis argument spans: ('data',) for 'data', ('o', 'i') for ('o', 'i')
  or Hierarchical(inner='i', outer='o')."""
  if isinstance(axis_name, Hierarchical):
    return axis_names(axis_name.inner) + axis_names(axis_name.outer)
  return tuple(axis_name) if isinstance(axis_name, tuple) else (axis_name,)


def _bound_axes() -> tuple:
  """The axis names of the current mesh (``jax.set_mesh`` or the enclosing ``shard_map``)."""
  try:
    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(mesh.axis_names)
  except Exception:  # pragma: no cover - no mesh context API
    return ()


def axis_size(axis_name: AxisName) -> int:
  """Number of devices along a bound axis; ValueError naming the axis (and the mesh's axes) if it
  is not bound."""
  size = 1
  for name in axis_names(axis_name):
    try:
      size *= lax.axis_size(name)
    except NameError:
      mesh_axes = _bound_axes()
      where = (f"the mesh here has axes {mesh_axes}" if mesh_axes else
               "no mesh axis is bound here")
      raise ValueError(
          f"axis_name must name a mesh axis bound here, got {name!r}, which is not bound ({where}): "
          f"call jax_qcomm collectives inside jax.shard_map or jax.pmap over a mesh axis of that "
          f"name") from None
  return size


def device_key(key: jax.Array | None, axis_name: AxisName, salt: int) -> jax.Array | None:
  """Distinct randomness per device and per use: fold in the device's index on the axis, then
  ``salt``. None stays None (deterministic codecs)."""
  if key is None:
    return None
  return jax.random.fold_in(jax.random.fold_in(key, lax.axis_index(axis_name)), salt)

