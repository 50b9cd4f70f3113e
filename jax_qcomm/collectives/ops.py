"""Compressed collectives of arrays and pytrees, called inside ``jax.shard_map`` or ``jax.pmap``.

This module checks the arguments, packs a pytree into flat communication buffers by the leaf
policy (:mod:`jax_qcomm.collectives.packing`) and hands each buffer to its codec's reduction protocol
(:class:`jax_qcomm.Codec`: ``allreduce_flat``, ``reduce_scatter_flat``, ``all_gather_flat``). How
the values cross the wire -- a float32 ``psum``, the scatter-reduce-allgather of two
quantisations, the one ``psum`` of a summable codec -- is the codec's business; this module never
asks which kind of codec it holds. A :class:`Hierarchical` axis composes an exact reduce-scatter
over the fast axis with the codec's allreduce over the slow one.

The transport is XLA's own (NCCL on GPU, gloo or in-process on CPU).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

from jax_qcomm import _compat
from jax_qcomm.transport import _exchange, _varying
from jax_qcomm.collectives import packing
from jax_qcomm.collectives.shard_layout import REPLICA_AXES
from jax_qcomm._checks import (check_array, check_bool, check_float_dtype, check_instance,
                               check_int_or_none, check_key)
from jax_qcomm.transport.axes import AxisName, Hierarchical, axis_names, axis_size, check_axis
from jax_qcomm.codecs import DEFAULT_COMM_BUCKET, QSGD, Codec, reduce_packed
from jax_qcomm.codecs.base import nonfinite_mark

__all__ = ["DEFAULT_COMM_BUCKET", "AxisName", "Hierarchical", "allreduce", "allreduce_flat",
           "allreduce_tree", "init_codec_state", "fresh_state_key",
           "reduce_scatter", "all_gather", "cast_pmean", "axis_names", "axis_size"]

OPS = ("mean", "sum")


def _check_common(codec: Any, op: str) -> None:
  if not isinstance(codec, Codec):
    raise ValueError(f"codec must be a jax_qcomm codec (QSGD, Cast, NoCompression, Summable or "
                     f"another jax_qcomm.Codec), got {codec!r}")
  if op not in OPS:
    raise ValueError(f"op must be one of {OPS}, got {op!r}")


def _check_flat_collective(op: str, x: Any, axis_name: AxisName, key: Any, codec: Codec) -> int:
  """The checks reduce_scatter and all_gather share (one float array, a plain axis, a key where
  the codec needs one); returns the axis size."""
  check_key("key", key)
  if isinstance(axis_name, Hierarchical):
    raise ValueError(f"axis_name must be a name or tuple of names for {op}, not Hierarchical")
  check_axis(axis_name, hierarchical=False)
  d = axis_size(axis_name)
  check_array("x", x)
  packing.check_float_leaves(x)
  if codec.needs_key and key is None:
    raise ValueError("key is required for stochastic rounding: pass key=jax.random.key(...)")
  return d


# ---- flat float32 buffers ----------------------------------------------------------------------

def _hierarchical(x: jax.Array, axis_name: Hierarchical, codec: Codec, key: jax.Array | None,
                  op: str, exchange: str) -> tuple[jax.Array, jax.Array]:
  """Exact reduce-scatter over the inner axis, the codec's allreduce of each shard over the outer
  axis, all-gather over the inner axis. The residual is in the units of x, at the place where this
  device's next gradient enters the shard it reduced.

  Where ``x`` is known to be the same on every device of the inner axis (shard_map records it as
  not varying there: e.g. DiLoCo's pseudo-gradient inside a node whose devices run an exact sync),
  each device takes its slice instead of reduce-scattering (no inner traffic; the inner mean of
  equal copies is the copy) and the residual is all-gathered too, so it stays the same on every
  inner device: each device still sends only its 1/inner share across the outer axis."""
  n = x.shape[0]
  inner_names = axis_names(axis_name.inner)
  d_in = axis_size(axis_name.inner)
  m = d_in * codec.pad_multiple
  x = jnp.pad(x, (0, -n % m))
  inner_index = lax.axis_index(inner_names)
  same_inside = _varying.tracked(inner_names) and not (
      set(inner_names) & set(_compat.vma_of(x)))
  if same_inside:
    s = x.shape[0] // d_in
    shard = lax.dynamic_slice_in_dim(x, inner_index * s, s)
  else:
    shard = lax.psum_scatter(x, axis_name.inner, scatter_dimension=0, tiled=True)  # exact
    if op == "mean":  # the mean over inner x outer: the inner sum / d_in, then the outer mean
      shard = shard * jnp.float32(1.0 / d_in)
  shard_key = None if key is None else jax.random.fold_in(key, inner_index)
  shard, lost = codec.allreduce_flat(shard, axis_name.outer, shard_key, op, exchange)
  full = lax.all_gather(shard, axis_name.inner, tiled=True, to="invarying")
  if same_inside:
    return full[:n], lax.all_gather(lost, axis_name.inner, tiled=True, to="invarying")[:n]
  if op == "mean":
    lost = lost * jnp.float32(d_in)
  residual = lax.dynamic_update_slice(jnp.zeros_like(x), lost, (inner_index * shard.shape[0],))
  return full[:n], residual[:n]


def allreduce_flat(x: jax.Array, axis_name: AxisName, codec: Codec, key: jax.Array | None,
                   op: str = "mean", exchange: str = "auto") -> tuple[jax.Array, jax.Array]:
  """Allreduce of a flat float32 buffer with ``codec`` (:meth:`Codec.allreduce_flat`), over a
  name, a tuple of names or a :class:`Hierarchical` axis. Returns (result, residual)."""
  if x.shape[0] == 0:
    return x, x
  if isinstance(axis_name, Hierarchical):
    return _hierarchical(x, axis_name, codec, key, op, exchange)
  return codec.allreduce_flat(x, axis_name, key, op, exchange)


def _allreduce_leaves(parts: list[jax.Array], shapes: list[tuple[int, ...]], states: list[Any],
                      axis_name: AxisName, codec: Codec, key: jax.Array | None, op: str,
                      exchange: str
                      ) -> tuple[list[jax.Array], list[jax.Array], list[Any], jax.Array]:
  """The allreduce of one communication buffer's leaves (flat float32 each, of ``shapes``, with
  the codec's ``states``), as :meth:`Codec.allreduce_leaves_with_state`: ``(outs, residuals,
  new_states, mark)``; a :class:`Hierarchical` axis reduces their packed buffer (states
  unchanged)."""
  if sum(p.shape[0] for p in parts) == 0:
    return parts, parts, states, jnp.float32(0)
  if isinstance(axis_name, Hierarchical):
    outs, lost = reduce_packed(
        parts, codec, lambda flat: _hierarchical(flat, axis_name, codec, key, op, exchange))
    return outs, lost, states, nonfinite_mark(outs)
  return codec.allreduce_leaves_with_state(parts, shapes, states, axis_name, key, op, exchange)


def init_codec_state(tree: Any, codec: Codec, policy: packing.LeafPolicy | None,
                     key: jax.Array) -> tuple:
  """The state the codecs carry between allreduces of ``tree`` (arrays or shape structs), before
  the first: a tuple with one entry per leaf, in tree order (:meth:`Codec.init_state` of the leaf's
  codec; ``()`` for codecs without state). ``key``: a PRNG key, the same on every device."""
  leaves = jax.tree_util.tree_leaves(tree)
  codecs = packing.leaf_codecs(tree, codec, policy)
  return tuple(c.init_state(tuple(int(d) for d in jnp.shape(x)), jax.random.fold_in(key, i))
               for i, (x, c) in enumerate(zip(leaves, codecs)))


# ---- public API ----------------------------------------------------------------------------------

def allreduce(x: Any, axis_name: AxisName, codec: Codec = QSGD(), key: jax.Array | None = None,
              op: str = "mean", *, policy: packing.LeafPolicy | None = None,
              comm_bucket_size: int | None = None, return_residual: bool = False,
              check_varying: bool = True, exchange: str = "auto") -> Any:
  """Compressed allreduce of an array or a pytree of float arrays across ``axis_name``.

  Call it inside ``jax.shard_map`` / ``jax.pmap``. Returns the same structure, shapes and dtypes.
  ``x`` holds per-device values: inside ``shard_map`` every leaf must vary over ``axis_name``
  (see ``check_varying``). Every device ends with the same bits.

  Args:
    x: an array or a pytree of float32 / bfloat16 / float16 arrays (this device's values).
    axis_name: a mesh axis name, a tuple of names, or :class:`Hierarchical`.
    codec: any :class:`jax_qcomm.Codec`: ``QSGD(...)`` (scatter-reduce-allgather, each value
      quantised twice, once on the device that reduces it), ``Summable(...)`` (one ``psum`` of summable words), ``Cast(dtype)``
      (narrow floats on the wire, float32 sums) or ``NoCompression()`` (``lax.psum``).
    key: a JAX PRNG key, required where the codec rounds stochastically. Use a new key for every
      call (the device index is folded in here, so all devices may pass the same key).
    op: ``"mean"`` or ``"sum"``.
    policy: for pytrees, which leaves use ``codec`` and which travel exact (default
      ``LeafPolicy()``: leaves under 1024 elements and 1-D leaves exact). A single array is always
      sent with ``codec``.
    comm_bucket_size: most float32 elements per flat communication buffer; leaves sharing a codec
      are concatenated up to this size so that a model issues few collectives. None (default):
      the codec's own :meth:`~jax_qcomm.Codec.comm_buffer_size` (2**24 elements; Summable
      2**26).
    return_residual: also return, as a float32 pytree like ``x``, what this device's own
      quantisation lost (zeros for exact leaves), for error feedback.
    check_varying: raise ValueError if a leaf of ``x`` is the same on every device (not varying
      over ``axis_name``): that is what the gradient of a replicated parameter looks like, already
      summed across devices by autodiff. Pass False for values that are meant to be replicated.
      JAX records variation only inside ``shard_map`` with ``check_vma=True`` (the default); under
      ``jax.pmap`` or ``check_vma=False`` nothing is checked.
    exchange: the schedule of an all-to-all, where the codec uses one: ``"auto"``
      (``lax.ppermute`` rounds on CPU across processes, where gloo runs them faster;
      ``lax.all_to_all`` elsewhere), ``"rounds"`` or ``"all_to_all"``. Every schedule gives the
      same bytes (see ``_exchange``).
  """
  _check_common(codec, op)
  _exchange.check_method(exchange, "exchange")
  check_int_or_none("comm_bucket_size", comm_bucket_size)
  check_key("key", key)
  if policy is not None:
    check_instance("policy", policy, packing.LeafPolicy, "None or a qcomm.LeafPolicy")
  return_residual = check_bool("return_residual", return_residual)
  check_varying = check_bool("check_varying", check_varying)
  check_axis(axis_name)
  axis_size(axis_name)
  packing.check_float_leaves(x)
  if check_varying:
    _varying.check_per_device(x, axis_names(axis_name), "x", "qcomm.allreduce")
  result, residual, _, _ = allreduce_tree(x, axis_name, codec, key, op, policy=policy,
                                          comm_bucket_size=comm_bucket_size, exchange=exchange)
  return (result, residual) if return_residual else result


def fresh_state_key(key: jax.Array | None) -> jax.Array:
  """The key :func:`allreduce_tree` draws the codecs' state from where it is given none: the
  call's ``key`` folded with a constant of its own (``key(0)`` for a call without a key)."""
  return jax.random.key(0) if key is None else jax.random.fold_in(key, 0x7FFFFFFF)


def explicit_layout(tree: Any) -> tuple[list[P], tuple]:
  """The spec of each leaf of ``tree`` over the mesh axes that shard it in its type (Explicit
  axes, not manual here: a model axis of ``jax.make_mesh``'s mesh inside a ``shard_map`` manual
  over the data axes), and those axes (() if none)."""
  specs, axes = [], []
  for leaf in jax.tree_util.tree_leaves(tree):
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
      specs.append(P())
      continue
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    kept = []
    for entry in spec:
      names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
      names = tuple(n for n in names if types.get(n) == AxisType.Explicit)
      kept.append(None if not names else names[0] if len(names) == 1 else names)
      axes += [n for n in names if n not in axes]
    specs.append(P(*kept))
  return specs, tuple(axes)


def _on_shards(fn, tree: Any, specs: list[P], axes: tuple, out_specs: Any,
               *args: Any) -> Any:
  """``fn(tree, *args)`` run on each device's own shards: a ``shard_map`` manual over ``axes``
  (the leaves' Explicit axes), so that every device encodes and sends its shard, not a gathered
  whole. ``args`` (keys, states) are replicated over ``axes``; in ``out_specs``, the string
  ``"tree"`` stands for the specs of ``tree``."""
  treedef = jax.tree_util.tree_structure(tree)
  spec_tree = jax.tree_util.tree_unflatten(treedef, specs)
  outs = tuple(spec_tree if o == "tree" else o for o in out_specs)
  return jax.shard_map(fn, in_specs=(spec_tree,) + (P(),) * len(args),
                       out_specs=outs if len(outs) > 1 else outs[0],
                       axis_names=set(axes))(tree, *args)


def _warn_auto_axes(what: str) -> None:
  """A warning where a collective runs inside a ``shard_map`` that leaves Auto mesh axes to XLA:
  a value XLA shards over them is gathered whole before the codec's custom call (custom calls
  have no sharding rule), so every device would send the whole value's bytes."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return
  auto = [n for n, t in zip(mesh.axis_names, mesh.axis_types)
          if t == AxisType.Auto and mesh.shape[n] > 1]
  manual = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual]
  if auto and manual:
    warnings.warn(
        f"qcomm.{what} runs inside a shard_map manual over {manual} that leaves the Auto axes "
        f"{auto} to XLA: a value sharded over them is gathered whole before the encode, and "
        f"every device sends the whole value's bytes. Run the collective on each device's shard: "
        f"make those axes Explicit (jax.make_mesh's default; qcomm then works per shard), nest a "
        f"jax.shard_map(..., axis_names={set(auto)}) around it, or use qcomm.data_parallel, "
        f"which does. (Values replicated over {auto} lose nothing.)", stacklevel=3)


def _check_dim0_unsharded(what: str, spec: P) -> None:
  if len(spec) and spec[0] is not None:
    raise ValueError(
        f"qcomm.{what} works along axis 0, which this array's type shards over {spec[0]!r}: "
        f"each device's block would not be a block of the whole. Shard another dimension over "
        f"the model axes, or reshard x with axis 0 whole (jax.sharding.reshard)")


def allreduce_tree(x: Any, axis_name: AxisName, codec: Codec, key: jax.Array | None,
                   op: str = "mean", *, policy: packing.LeafPolicy | None = None,
                   comm_bucket_size: int | None = None, exchange: str = "auto",
                   codec_state: tuple | None = None) -> tuple[Any, Any, tuple, jax.Array]:
  """:func:`allreduce` of a checked pytree, with the codecs' state: ``(result, residual,
  new_codec_state, mark)``, ``mark`` the result's :func:`~jax_qcomm.codecs.base.nonfinite_mark`
  as the codecs report it (0 where every value is finite, else NaN; the same on every device).
  ``codec_state``: :func:`init_codec_state` of ``x`` or what the last call returned (the same on
  every device); None draws it afresh from ``key`` (a codec without state ignores it). What
  :func:`qcomm.sync` and :func:`qcomm.allreduce` call.

  Leaves sharded over Explicit mesh axes that are not manual here (a model axis) are reduced on
  each device's own shards (:func:`_on_shards`): nothing gathers them first."""
  specs, axes = explicit_layout(x)
  if not axes:
    _warn_auto_axes("allreduce")
  if axes:
    def per_shard(local, k, state):
      out, residual, state, mark = allreduce_tree(local, axis_name, codec, k, op, policy=policy,
                                                  comm_bucket_size=comm_bucket_size,
                                                  exchange=exchange, codec_state=state)
      # the whole tree's mark: 0 or NaN, which a sum over the shards keeps
      return out, residual, state, lax.psum(mark, axes)

    return _on_shards(per_shard, x, specs, axes, ("tree", "tree", P(), P()), key, codec_state)
  with_path, treedef = jax.tree_util.tree_flatten_with_path(x)
  leaves = [jnp.asarray(leaf) for _, leaf in with_path]
  codecs = packing.leaf_codecs(x, codec, policy)
  if key is None and any(c.needs_key for c in codecs):
    raise ValueError("key is required for stochastic rounding: pass key=jax.random.key(...) "
                     "(a new one per call)")
  if codec_state is None:
    codec_state = init_codec_state(x, codec, policy, fresh_state_key(key))
  new_state = list(codec_state)
  mark = jnp.float32(0)
  out: list[Any] = [None] * len(leaves)
  residual: list[Any] = [None] * len(leaves)
  # the devices the codec reduces over: the outer axis of a Hierarchical one
  d = axis_size(axis_name.outer if isinstance(axis_name, Hierarchical) else axis_name)
  # Leaves that vary over other manual axes than this collective's (a model axis: shards of
  # model-sharded leaves) travel apart from those that do not (replicated over it).
  own = set(axis_names(axis_name))
  kinds = [packing.vma_kind(leaf) - own for leaf in leaves]
  for i, group in enumerate(packing.plan(leaves, codecs, comm_bucket_size, d, kinds=kinds)):
    group_key = None if key is None else jax.random.fold_in(key, i)
    shard_of = sorted(set(kinds[group.leaves[0]]) - set(REPLICA_AXES.get()), key=str)
    if group_key is not None and shard_of:  # shards of larger leaves: rounding of their own
      group_key = jax.random.fold_in(group_key, lax.axis_index(tuple(shard_of)))
    parts = [leaves[j].reshape(-1).astype(jnp.float32) for j in group.leaves]
    reduced, lost, states, group_mark = _allreduce_leaves(
        parts, [leaves[j].shape for j in group.leaves], [codec_state[j] for j in group.leaves],
        axis_name, group.codec, group_key, op, exchange)
    for j, r, l, s in zip(group.leaves, reduced, lost, states):
      out[j] = r.reshape(leaves[j].shape).astype(leaves[j].dtype)
      residual[j] = l.reshape(leaves[j].shape)
      new_state[j] = s
    mark = mark + group_mark
  return (jax.tree_util.tree_unflatten(treedef, out),
          jax.tree_util.tree_unflatten(treedef, residual), tuple(new_state), mark)


def reduce_scatter(x: jax.Array, axis_name: AxisName, codec: Codec = QSGD(),
                   key: jax.Array | None = None, op: str = "mean", *,
                   check_varying: bool = True, exchange: str = "auto") -> jax.Array:
  """Compressed reduce-scatter along axis 0 (``lax.psum_scatter(..., tiled=True)`` semantics).

  x: [D*m, ...] on every device, this device's values; returns this device's reduced block
  [m, ...] (block i goes to the device with axis index i), in x's dtype. Lossy codecs quantise each
  value once. For sharded data parallelism: reduce gradients straight into the optimizer shard.
  ``check_varying``: as in :func:`allreduce` (ValueError for an ``x`` that is the same on every
  device; not checked under ``jax.pmap``). ``exchange``: the all-to-all's schedule, as in
  :func:`allreduce`.
  """
  _check_common(codec, op)
  _exchange.check_method(exchange, "exchange")
  check_varying = check_bool("check_varying", check_varying)
  d = _check_flat_collective("reduce_scatter", x, axis_name, key, codec)
  if check_varying:
    _varying.check_per_device(x, axis_names(axis_name), "x", "qcomm.reduce_scatter")
  if x.ndim == 0 or x.shape[0] % d:
    raise ValueError(f"x.shape[0] must be divisible by the axis size {d}, got shape {x.shape}")
  specs, axes = explicit_layout(x)
  if axes:  # sharded over a model axis: each device reduces its own shard
    _check_dim0_unsharded("reduce_scatter", specs[0])
    return _on_shards(lambda local, k: reduce_scatter(local, axis_name, codec, k, op,
                                                      check_varying=False, exchange=exchange),
                      x, specs, axes, ("tree",), key)
  _warn_auto_axes("reduce_scatter")
  block = (x.shape[0] // d,) + x.shape[1:]
  flat = x.reshape(-1).astype(jnp.float32)
  reduced, _ = codec.reduce_scatter_flat(flat, axis_name, key, op, exchange)
  return reduced.reshape(block).astype(x.dtype)


def all_gather(x: jax.Array, axis_name: AxisName,
               codec: Codec = QSGD(bits=8, rounding="nearest"), key: jax.Array | None = None,
               tiled: bool = False) -> jax.Array:
  """Compressed all-gather (``lax.all_gather`` semantics along a new or, if tiled, the first axis).

  Every device (itself included) sees the decoded payloads, so all end with identical arrays. The
  default codec, 8-bit nearest rounding, suits weights (FSDP parameter gathering).
  """
  _check_common(codec, "mean")
  tiled = check_bool("tiled", tiled)
  d = _check_flat_collective("all_gather", x, axis_name, key, codec)
  if tiled and x.ndim == 0:
    raise ValueError("x must have at least one dimension for tiled=True")
  specs, axes = explicit_layout(x)
  if axes:  # sharded over a model axis: each device gathers its own shard's rows
    if tiled:
      _check_dim0_unsharded("all_gather(tiled=True)", specs[0])
    return _on_shards(lambda local, k: all_gather(local, axis_name, codec, k, tiled),
                      x, specs, axes, (specs[0] if tiled else P(None, *specs[0]),), key)
  _warn_auto_axes("all_gather")
  rows = codec.all_gather_flat(x.reshape(-1), axis_name, key)
  out = rows.astype(x.dtype).reshape((d,) + x.shape)
  return out.reshape((d * x.shape[0],) + x.shape[1:]) if tiled else out


def cast_pmean(x: Any, axis_name: AxisName, dtype: Any = jnp.bfloat16, *,
               check_varying: bool = True) -> Any:
  """The seed recipe, kept as a baseline: cast -> ``lax.pmean`` -> cast back, per leaf.

  Note that XLA on CPU promotes a bf16 all-reduce to float32, so this sends float32 bytes there;
  ``allreduce(x, axis, codec=Cast(jnp.bfloat16))`` really halves them. ``check_varying``: as in
  :func:`allreduce` (ValueError for a leaf that is the same on every device; not checked under
  ``jax.pmap``).
  """
  dtype = check_float_dtype("dtype", dtype)
  check_varying = check_bool("check_varying", check_varying)
  check_axis(axis_name, hierarchical=False)
  axis_size(axis_name)
  packing.check_float_leaves(x)
  if check_varying:
    _varying.check_per_device(x, axis_names(axis_name), "x", "qcomm.cast_pmean")
  return jax.tree_util.tree_map(lambda v: lax.pmean(v.astype(dtype), axis_name).astype(v.dtype), x)
