"""Parameters sharded over mesh axes other than the data axes ("model axes"), and the optimizer
state that follows them.

A model too large for one device is sharded inside a node (tensor parallelism, FSDP over fast
links) with ``jax.sharding``, and synchronised across nodes over the data axes. Each parameter's
layout is its ``PartitionSpec`` over the model axes; this module reads it from the arrays' own
shardings, checks it, and gives every leaf of an optimizer state the spec that follows from it:

* a state leaf that belongs to a parameter (found by its key path, which ends with the parameter's,
  and its shape: the parameter's, or the parameter's with a leading device axis for a per-device
  part such as an error-feedback residual) is sharded as that parameter;
* every other leaf (counters, keys, codec settings) is replicated over the model axes.

The result is merged with the data axes' specs of :func:`qcomm.state_partition_spec` (a
per-device part: ``PartitionSpec("data", *param_spec)``). The runner runs ``tx.init`` and
``tx.update`` inside a ``shard_map`` over the model axes with these specs, so every device holds,
encodes and sends only its own shard.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_qcomm._checks import path_str


def spec_axes(spec: P) -> set:
  """The mesh axes a ``PartitionSpec`` names."""
  out = set()
  for entry in spec:
    if entry is None:
      continue
    out.update(entry if isinstance(entry, tuple) else (entry,))
  return out


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def param_specs(params: Any, mesh: Mesh, data_axes: Sequence[str],
                param_spec: Any = None) -> Any | None:
  """The parameters' specs over the model axes of ``mesh``, or None if every parameter is
  replicated (the layout the runner has always had).

  From ``param_spec`` (a pytree of ``PartitionSpec`` with the structure of ``params``) if given,
  else from each array's own ``NamedSharding``. ValueError for a spec that names a data axis (the
  data axes hold replicas; ZeRO-style sharding over them is ``shard_state=True``), an axis the
  mesh does not have, an array placed on another mesh, or a dimension the axes do not divide."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  if param_spec is not None:
    specs = treedef.flatten_up_to(param_spec) if not _is_spec(param_spec) else \
        [param_spec] * len(leaves)
    for (path, _), s in zip(leaves, specs):
      if not _is_spec(s):
        raise ValueError(f"param_spec must be a pytree of PartitionSpec with the structure of "
                         f"params; leaf '{path_str(path) or '<root>'}' has {s!r}")
  else:
    specs = []
    for path, leaf in leaves:
      if isinstance(leaf, jax.core.Tracer):  # inside jit: an Explicit axis's sharding is typed
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        specs.append(P(*sharding.spec) if isinstance(sharding, NamedSharding) else P())
        continue
      sharding = getattr(leaf, "sharding", None)
      if isinstance(sharding, NamedSharding):
        if tuple(sharding.mesh.axis_names) != tuple(mesh.axis_names) or \
            sharding.mesh.shape != mesh.shape:
          if spec_axes(sharding.spec):
            raise ValueError(
                f"params leaf '{path_str(path) or '<root>'}' is sharded on a mesh with axes "
                f"{dict(sharding.mesh.shape)}, not the runner's {dict(mesh.shape)}: place it "
                f"on the runner's mesh (jax.device_put(x, NamedSharding(mesh, spec)))")
          specs.append(P())
        else:
          specs.append(sharding.spec)
      else:
        specs.append(P())
  data = set(data_axes)
  out = []
  for (path, leaf), s in zip(leaves, specs):
    where = path_str(path) or "<root>"
    axes = spec_axes(s)
    if axes & data:
      raise ValueError(
          f"params leaf '{where}' has PartitionSpec {s}, which shards it over the data axis "
          f"{sorted(axes & data)}: the data axes hold replicas of the model. Shard parameters "
          f"only over the other mesh axes ({[a for a in mesh.axis_names if a not in data]}); to "
          f"split the optimizer state over the data axes use qcomm.sync(..., shard_state=True)")
    missing = axes - set(mesh.axis_names)
    if missing:
      raise ValueError(f"params leaf '{where}' has PartitionSpec {s}, naming axes "
                       f"{sorted(missing)} that the mesh {mesh.axis_names} does not have")
    shape = jax.numpy.shape(leaf)
    if len(s) > len(shape):
      raise ValueError(f"params leaf '{where}' of shape {shape} has PartitionSpec {s} with more "
                       f"entries than dimensions")
    for dim, entry in enumerate(s):
      if entry is None:
        continue
      names = entry if isinstance(entry, tuple) else (entry,)
      size = 1
      for n in names:
        size *= mesh.shape[n]
      if shape[dim] % size:
        raise ValueError(
            f"params leaf '{where}' has shape {shape}, whose dimension {dim} ({shape[dim]}) the "
            f"{size} devices of {entry!r} do not divide: each device must hold an equal shard "
            f"for the per-shard encode. Pad the dimension to a multiple of {size}, or leave this "
            f"leaf replicated (PartitionSpec())")
    out.append(P(*s))
  if not any(spec_axes(s) for s in out):
    return None
  return jax.tree_util.tree_unflatten(treedef, out)


def cached_param_specs(seen: dict, params: Any, mesh: Mesh, data_axes: Sequence[str],
                       param_spec: Any = None) -> Any | None:
  """:func:`param_specs` for a runner, which remembers the layout of each params tree it was
  given as arrays (``seen``: treedef -> specs). Inside the caller's ``jax.jit`` an Auto axis's
  sharding is not in the traced params' type: the remembered layout is used then, and ValueError
  where there is none and the mesh has Auto axes besides the data axes (the layout unknown)."""
  treedef = jax.tree_util.tree_structure(params)
  traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(params))
  found = param_specs(params, mesh, data_axes, param_spec)
  if not traced or param_spec is not None:
    if not traced:
      seen[treedef] = found
    return found
  if found is not None:
    return found
  if treedef in seen:
    return seen[treedef]
  unknown = [n for n, t in zip(mesh.axis_names, mesh.axis_types)
             if n not in set(data_axes) and t == jax.sharding.AxisType.Auto and mesh.shape[n] > 1]
  if unknown:
    raise ValueError(
        f"the step is traced inside jax.jit on a mesh with the Auto axes {unknown} besides the "
        f"data axes, where the params' layout is not in their type, and this runner has not seen "
        f"these params placed: call dp.init(params) (or one step) outside jit first, or pass "
        f"param_spec= (PartitionSpec() leaves for replicated parameters)")
  return None


def model_axes(mesh: Mesh, data_axes: Sequence[str]) -> tuple:
  """The mesh axes that are not data axes, in mesh order."""
  return tuple(a for a in mesh.axis_names if a not in set(data_axes))


def _key_tail_matches(path: tuple, tail: tuple) -> bool:
  return len(path) >= len(tail) and tuple(map(str, path[len(path) - len(tail):])) == \
      tuple(map(str, tail))


def state_model_specs(state: Any, params: Any, pspecs: Any, data_spec: Any = None,
                      model: Sequence[str] = ()) -> Any:
  """Each leaf of ``state`` (arrays or ``jax.ShapeDtypeStruct`` s of the global state) with its
  spec over the model axes: the spec of the parameter it belongs to (its key path ends with the
  parameter's and its shape is the parameter's), shifted by one dimension for a per-device part
  (the parameter's shape after a leading device axis). A per-device part of a model-sharded
  parameter in another shape (``data_spec`` splits its leading axis over the data axes: the flat
  shards of ``shard_state=True``) is each device's own data, so its leading axis is split over
  the ``model`` axes too. ``PartitionSpec()`` for every other leaf (counters, keys, the parts of
  replicated parameters)."""
  p_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  s_leaves = jax.tree_util.tree_leaves(pspecs, is_leaf=_is_spec)
  candidates = [(path, tuple(jax.numpy.shape(p)), s) for (path, p), s in zip(p_leaves, s_leaves)]
  stacked = P(tuple(model) if len(model) > 1 else model[0]) if model else P()

  def one(path, leaf, dspec=P()):
    # the parameter whose path is the longest tail of this leaf's (``block/w``'s moments belong
    # to ``block/w``, not to a top-level ``w``)
    matches = [c for c in candidates if _key_tail_matches(path, c[0])]
    if not matches:
      return P()
    _, pshape, s = max(matches, key=lambda c: len(c[0]))
    if not spec_axes(s):
      return P()
    shape = tuple(jax.numpy.shape(leaf))
    if shape == pshape:
      return s
    if len(shape) == len(pshape) + 1 and shape[1:] == pshape:
      return P(None, *s)
    if len(dspec) and dspec[0] is not None:  # this device's flat part of a sharded parameter
      return stacked
    return P()

  if data_spec is None:
    return jax.tree_util.tree_map_with_path(one, state)
  dspecs = jax.tree_util.tree_leaves(data_spec, is_leaf=_is_spec)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  return jax.tree_util.tree_unflatten(
      treedef, [one(path, leaf, d) for (path, leaf), d in zip(leaves, dspecs)])


def state_specs(state: Any, params: Any, pspecs: Any, data_spec: Any, mesh: Mesh,
                data_axes: Sequence[str]) -> tuple[Any, Any]:
  """``(model specs, full specs)`` of a runner's optimizer state around model-sharded
  parameters: :func:`state_model_specs` over the mesh's model axes, and those merged with the
  data axes' ``data_spec`` (:func:`merge`)."""
  model = state_model_specs(state, params, pspecs, data_spec, model_axes(mesh, data_axes))
  return model, merge(data_spec, model)


def merge(data_spec: Any, model_spec: Any) -> Any:
  """Two spec trees of one state merged dimension by dimension (the data axes' specs of
  :func:`qcomm.state_partition_spec` and the model axes' of :func:`state_model_specs`)."""

  def two(d: P, m: P) -> P:
    n = max(len(d), len(m))
    d = tuple(d) + (None,) * (n - len(d))
    m = tuple(m) + (None,) * (n - len(m))
    out = []
    for a, b in zip(d, m):
      if a is not None and b is not None:  # split over the data axes, then the model axes
        names = (a if isinstance(a, tuple) else (a,)) + (b if isinstance(b, tuple) else (b,))
        out.append(names)
      else:
        out.append(a if a is not None else b)
    while out and out[-1] is None:
      out.pop()
    return P(*out)

  return jax.tree_util.tree_map(two, data_spec, model_spec, is_leaf=_is_spec)


def restrict(spec: Any, axes: Sequence[str]) -> Any:
  """A spec tree with only the mesh ``axes`` kept (the others' entries become None): the specs of
  a ``shard_map`` manual over ``axes`` alone."""
  keep = set(axes)

  def one(s: P) -> P:
    out = []
    for entry in s:
      names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
      kept = tuple(n for n in names if n in keep)
      out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while out and out[-1] is None:
      out.pop()
    return P(*out)

  return jax.tree_util.tree_map(one, spec, is_leaf=_is_spec)


def per_device(params: Any, data_axes: Sequence[str] = ()) -> tuple[Any, list]:
  """``params`` as each device holds them: ``jax.ShapeDtypeStruct`` s of the shard shapes of
  leaves placed with a ``NamedSharding`` (arrays, or ``ShapeDtypeStruct`` s with a sharding), and
  per leaf the mesh axes it is sharded over (which leaves the collectives pack apart).
  ValueError for a leaf sharded over one of ``data_axes`` (the data axes hold replicas)."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  out, kinds = [], []
  for x in leaves:
    shape = tuple(int(d) for d in jax.numpy.shape(x))
    sharding = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and spec_axes(sharding.spec) & set(data_axes):
      raise ValueError(f"params leaf of shape {shape} is sharded over the data axes "
                       f"({sharding.spec}): the data axes hold replicas of the model; shard "
                       f"parameters only over the other mesh axes")
    if isinstance(sharding, NamedSharding) and spec_axes(sharding.spec):
      out.append(jax.ShapeDtypeStruct(tuple(sharding.shard_shape(shape)), jax.numpy.float32))
      kinds.append(frozenset(spec_axes(sharding.spec)))
    else:
      out.append(jax.ShapeDtypeStruct(shape, jax.numpy.float32))
      kinds.append(frozenset())
  return jax.tree_util.tree_unflatten(treedef, out), kinds


def refuse_sharded(params: Any, option: str) -> None:
  """ValueError for parameters placed sharded over mesh axes, where a runner (``option``) keeps
  them replicated: never a silent gather."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    sharding = None if isinstance(leaf, jax.core.Tracer) else getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and spec_axes(sharding.spec):
      raise ValueError(
          f"params leaf '{path_str(path) or '<root>'}' is sharded ({sharding.spec}), but "
          f"data_parallel(..., {option}=True) keeps the parameters replicated over each "
          f"replica's devices. Parameters sharded over model axes run through "
          f"qcomm.data_parallel without {option}=True; here, pass them replicated")
