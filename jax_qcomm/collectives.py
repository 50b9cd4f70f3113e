"""Compressed collectives, called inside ``jax.shard_map`` or ``jax.pmap``.

The compressed allreduce is scatter-reduce-allgather (SRA, as in CGX): the buffer is cut into one
chunk per device; each chunk is encoded and sent to its owner (an all-to-all: ``lax.all_to_all``,
or across processes on CPU ``lax.ppermute`` rounds that gloo runs faster, see ``_exchange``); the
owner decodes and sums the chunks it received (float32), encodes the reduced chunk once more and
every device receives every reduced chunk (``lax.all_gather``) and decodes it. Every value is
therefore quantised exactly twice whatever the number of devices, each device sends 2 (D-1)/D of
the compressed bytes, and all devices end bit-identical (they decode the same payloads, their own
chunk included).

The transport is XLA's own (NCCL on GPU, gloo or in-process on CPU); only uint8 payloads travel, so
XLA cannot promote them (it turns a bf16 all-reduce into f32 on CPU).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Hashable, Union

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm import _exchange, _varying, packing
from jax_qcomm._checks import (check_array, check_axis_name, check_bool, check_float_dtype, check_instance,
                               check_int, check_key)
from jax_qcomm.codecs import QSGD, Codec

AxisName = Union[Hashable, tuple]
OPS = ("mean", "sum")
DEFAULT_COMM_BUCKET = 1 << 24  # elements per flat communication buffer (64 MiB of float32)


@dataclasses.dataclass(frozen=True)
class Hierarchical:
  """Topology-aware axis: exact reduce-scatter over the fast ``inner`` axis, compressed allreduce
  of each shard over the slow ``outer`` axis, all-gather over ``inner``. Only compressed bytes cross
  the slow links. ``inner`` and ``outer`` are axis names (or tuples of names)."""

  inner: AxisName
  outer: AxisName

  def __post_init__(self):
    for name in ("inner", "outer"):
      check_axis_name(name, getattr(self, name))
    overlap = set(axis_names(self.inner)) & set(axis_names(self.outer))
    if overlap:
      raise ValueError(f"outer must name other axes than inner, got inner={self.inner!r} and "
                       f"outer={self.outer!r} (both name {sorted(map(repr, overlap))})")


def axis_names(axis_name: AxisName) -> tuple:
  """The mesh axis names an axis argument spans: ('data',) for 'data', ('o', 'i') for ('o', 'i')
  or Hierarchical(inner='i', outer='o')."""
  if isinstance(axis_name, Hierarchical):
    return axis_names(axis_name.inner) + axis_names(axis_name.outer)
  return tuple(axis_name) if isinstance(axis_name, tuple) else (axis_name,)


def axis_size(axis_name: AxisName) -> int:
  """Number of devices along a bound axis; ValueError naming the axis if it is not bound."""
  names = (axis_name.inner, axis_name.outer) if isinstance(axis_name, Hierarchical) else (axis_name,)
  size = 1
  for name in names:
    try:
      size *= lax.axis_size(name)
    except NameError:
      raise ValueError(
          f"axis_name must name a mesh axis bound here, got {name!r}, which is not bound: call "
          f"jax_qcomm collectives inside jax.shard_map or jax.pmap over a mesh axis of that "
          f"name") from None
  return size


def _check_axis(axis_name: Any, hierarchical: bool = True) -> None:
  if hierarchical:
    check_axis_name("axis_name", axis_name, (Hierarchical,), "qcomm.Hierarchical(inner, outer)")
  else:
    check_axis_name("axis_name", axis_name)


def _check_common(codec: Any, op: str) -> None:
  if not isinstance(codec, Codec):
    raise ValueError(f"codec must be a jax_qcomm codec (QSGD, Cast, NoCompression or another "
                     f"jax_qcomm.Codec), got {codec!r}")
  if op not in OPS:
    raise ValueError(f"op must be one of {OPS}, got {op!r}")


def _check_flat_collective(op: str, x: Any, axis_name: AxisName, key: Any) -> int:
  """The checks reduce_scatter and all_gather share (one float array, a plain axis, a key or None);
  returns the axis size."""
  check_key("key", key)
  if isinstance(axis_name, Hierarchical):
    raise ValueError(f"axis_name must be a name or tuple of names for {op}, not Hierarchical")
  _check_axis(axis_name, hierarchical=False)
  d = axis_size(axis_name)
  check_array("x", x)
  packing.check_float_leaves(x)
  return d


def _device_key(key: jax.Array | None, axis_name: AxisName, salt: int) -> jax.Array | None:
  """Distinct randomness per device and per use: fold in the device's index on the axis."""
  if key is None:
    return None
  return jax.random.fold_in(jax.random.fold_in(key, lax.axis_index(axis_name)), salt)


def _encode_rows(codec: Codec, rows: jax.Array, key: jax.Array | None) -> jax.Array:
  """float32[k, c] -> wire[k, W] (the codec's payloads as it sends them), a key per row."""
  if key is None:
    return jax.vmap(lambda r: codec.wire_encode(r, None))(rows)
  return jax.vmap(codec.wire_encode)(rows, jax.random.split(key, rows.shape[0]))


def _decode_rows(codec: Codec, wires: jax.Array, c: int) -> jax.Array:
  """wire[k, W] -> float32[k, c], each row decoded on its own."""
  return jax.vmap(lambda w: codec.wire_decode_sum(w[None], c))(wires)


def sra_padded_size(n: int, devices: int, codec: Codec) -> int:
  """Elements of a flat buffer of ``n`` after the scatter-reduce-allgather pads it: a multiple of
  ``devices * codec.pad_multiple``, so that every device's chunk is whole quantisation buckets.
  (The cost model counts bytes with this same function.)"""
  m = devices * codec.pad_multiple
  return -(-n // m) * m


# ---- flat float32 buffers ----------------------------------------------------------------------

def _sra(x: jax.Array, axis_name: AxisName, codec: Codec, key: jax.Array | None,
         scale: float, exchange: str) -> tuple[jax.Array, jax.Array]:
  """Compressed allreduce of float32[n], n a multiple of D * bucket; result times `scale`.

  Also returns this device's own quantisation residual (x minus what it sent), for error feedback;
  XLA drops it where it is unused.
  """
  d = lax.axis_size(axis_name)
  c = x.shape[0] // d
  chunks = x.reshape(d, c)
  payloads = _encode_rows(codec, chunks, _device_key(key, axis_name, 0))
  residual = (chunks - _decode_rows(codec, payloads, c)).reshape(-1)
  received = _exchange.exchange(payloads, axis_name, exchange)  # row s: my chunk from s
  mine = codec.wire_decode_sum_reencode(received, c, _device_key(key, axis_name, 1), scale)
  gathered = lax.all_gather(mine, axis_name, to="invarying")  # [D, P], the same everywhere
  return _decode_rows(codec, gathered, c).reshape(-1), residual


def _summable_allreduce(x: jax.Array, axis_name: AxisName, codec: Codec, key: jax.Array | None,
                        scale: float) -> tuple[jax.Array, jax.Array]:
  """Allreduce of float32[n] with a summable codec: one lax.pmax of the per-bucket statistic (the
  shared scales), one lax.psum of the uint32 words (XLA's all-reduce), one decode. Result times
  `scale`, the same on every device; also this device's residual (x minus its own decode)."""
  n = x.shape[0]
  d = codec.check_devices(axis_size(axis_name))
  shared = lax.pmax(codec.bucket_scale(x), axis_name)  # the same on every device
  words = codec.wire_encode_summable(x, shared, _device_key(key, axis_name, 0), d)
  total = lax.psum(words, axis_name)
  out = codec.wire_decode_summed(total, shared, d, d, n, scale)
  residual = x - codec.wire_decode_summed(words, shared, d, 1, n)
  return out, residual


def _pad_to(x: jax.Array, size: int) -> jax.Array:
  """float32[n] -> float32[size], zeros appended (size >= n)."""
  pad = size - x.shape[0]
  return jnp.pad(x, (0, pad)) if pad else x


def _hierarchical(x: jax.Array, axis_name: Hierarchical, codec: Codec, key: jax.Array | None,
                  scale: float, exchange: str) -> tuple[jax.Array, jax.Array]:
  """Exact reduce-scatter over the inner axis, the compressed allreduce of each shard over the
  outer axis (summable or SRA), all-gather over the inner axis; result times `scale`, and this
  device's residual in the units of x, where its next gradient enters that shard."""
  n = x.shape[0]
  d_in = lax.axis_size(axis_name.inner)
  if codec.summable:  # the summable decode applies the scale; shards of whole buckets suffice
    size, pre_scale = sra_padded_size(n, d_in, codec), 1.0
  else:  # the SRA cuts each shard into whole-bucket chunks of the outer axis
    size, pre_scale = sra_padded_size(n, d_in * lax.axis_size(axis_name.outer), codec), scale
  x = _pad_to(x, size)
  shard = lax.psum_scatter(x, axis_name.inner, scatter_dimension=0, tiled=True)  # exact
  if pre_scale != 1.0:
    shard = shard * jnp.float32(pre_scale)
  inner_index = lax.axis_index(axis_name.inner)
  shard_key = None if key is None else jax.random.fold_in(key, inner_index)
  if codec.summable:
    shard, lost = _summable_allreduce(shard, axis_name.outer, codec, shard_key, scale)
  else:
    shard, lost = _sra(shard, axis_name.outer, codec, shard_key, 1.0, exchange)
    lost = lost / jnp.float32(scale)
  residual = lax.dynamic_update_slice(jnp.zeros_like(x), lost, (inner_index * shard.shape[0],))
  full = lax.all_gather(shard, axis_name.inner, tiled=True, to="invarying")
  return full[:n], residual[:n]


def allreduce_flat(x: jax.Array, axis_name: AxisName, codec: Codec, key: jax.Array | None,
                   op: str, exchange: str = "auto") -> tuple[jax.Array, jax.Array]:
  """Allreduce of a flat float32 buffer (already padded to whole quantisation buckets).

  Returns (result, residual): residual[n] is what this device's first quantisation lost, in the
  units of x (zero for NoCompression), so that error feedback can add it to the next gradient.
  """
  n = x.shape[0]
  size = axis_size(axis_name)
  if n == 0:
    return x, x
  if codec.exact:
    names = (axis_name.inner, axis_name.outer) if isinstance(axis_name, Hierarchical) else axis_name
    out = lax.pmean(x, names) if op == "mean" else lax.psum(x, names)
    return out, jnp.zeros_like(x)
  scale = 1.0 / size if op == "mean" else 1.0
  if isinstance(axis_name, Hierarchical):
    return _hierarchical(x, axis_name, codec, key, scale, exchange)
  if codec.summable:
    return _summable_allreduce(x, axis_name, codec, key, scale)
  x = _pad_to(x, sra_padded_size(n, size, codec))
  out, residual = _sra(x, axis_name, codec, key, scale, exchange)
  return out[:n], residual[:n]


# ---- public API ----------------------------------------------------------------------------------

def allreduce(x: Any, axis_name: AxisName, codec: Codec = QSGD(), key: jax.Array | None = None,
              op: str = "mean", *, policy: packing.LeafPolicy | None = None,
              comm_bucket_size: int = DEFAULT_COMM_BUCKET, return_residual: bool = False,
              check_varying: bool = True, exchange: str = "auto") -> Any:
  """Compressed allreduce of an array or a pytree of float arrays across ``axis_name``.

  Call it inside ``jax.shard_map`` / ``jax.pmap``. Returns the same structure, shapes and dtypes.
  ``x`` holds per-device values: inside ``shard_map`` every leaf must vary over ``axis_name``
  (see ``check_varying``).

  Args:
    x: an array or a pytree of float32 / bfloat16 / float16 arrays (this device's values).
    axis_name: a mesh axis name, a tuple of names, or :class:`Hierarchical`.
    codec: ``QSGD(...)`` (scatter-reduce-allgather, each value quantised twice), ``Cast(dtype)``
      (narrow floats on the wire, float32 sums) or ``NoCompression()`` (``lax.psum``).
    key: a JAX PRNG key, required for stochastic rounding. Use a new key for every call (the device
      index is folded in here, so all devices may pass the same key).
    op: ``"mean"`` or ``"sum"``.
    policy: for pytrees, which leaves use ``codec`` and which travel exact (default
      ``LeafPolicy()``: leaves under 1024 elements and 1-D leaves exact). A single array is always
      sent with ``codec``.
    comm_bucket_size: most float32 elements per flat communication buffer; leaves sharing a codec
      are concatenated up to this size so that a model issues few collectives.
    return_residual: also return, as a float32 pytree like ``x``, what this device's own first
      quantisation lost (``x`` minus what it sent; zeros for exact leaves), for error feedback.
    check_varying: raise ValueError if a leaf of ``x`` is the same on every device (not varying
      over ``axis_name``): that is what the gradient of a replicated parameter looks like, already
      summed across devices by autodiff. Pass False for values that are meant to be replicated.
      JAX records variation only inside ``shard_map`` with ``check_vma=True`` (the default); under
      ``jax.pmap`` or ``check_vma=False`` nothing is checked.
    exchange: the schedule of the all-to-all of the compressed leaves: ``"auto"`` (``lax.ppermute``
      rounds on CPU across processes, where gloo runs them faster; ``lax.all_to_all`` elsewhere),
      ``"rounds"`` or ``"all_to_all"``. Every schedule gives the same bytes (see ``_exchange``).
  """
  _check_common(codec, op)
  _exchange.check_method(exchange, "exchange")
  check_int("comm_bucket_size", comm_bucket_size)
  check_key("key", key)
  if policy is not None:
    check_instance("policy", policy, packing.LeafPolicy, "None or a qcomm.LeafPolicy")
  return_residual = check_bool("return_residual", return_residual)
  check_varying = check_bool("check_varying", check_varying)
  _check_axis(axis_name)
  axis_size(axis_name)
  packing.check_float_leaves(x)
  if check_varying:
    _varying.check_per_device(x, axis_names(axis_name), "x", "qcomm.allreduce")
  with_path, treedef = jax.tree_util.tree_flatten_with_path(x)
  leaves = [jnp.asarray(leaf) for _, leaf in with_path]
  if treedef.num_leaves == 1 and treedef.num_nodes == 1:  # a bare array: the codec applies
    codecs = [codec]
  else:
    policy = packing.LeafPolicy() if policy is None else policy
    codecs = [policy.codec_for(packing.path_str(p), leaf, codec) for (p, _), leaf in zip(with_path, leaves)]
  if key is None and any(c.needs_key for c in codecs):
    raise ValueError("key is required for stochastic rounding: pass key=jax.random.key(...) "
                     "(a new one per call)")
  out: list[Any] = [None] * len(leaves)
  residual: list[Any] = [None] * len(leaves)
  for i, group in enumerate(packing.plan(leaves, codecs, comm_bucket_size)):
    group_key = None if key is None else jax.random.fold_in(key, i)
    flat = packing.pack(leaves, group)
    reduced, lost = allreduce_flat(flat, axis_name, group.codec, group_key, op, exchange)
    packing.unpack(reduced, leaves, group, out)
    packing.unpack(lost, leaves, group, residual, dtype=jnp.float32)
  result = jax.tree_util.tree_unflatten(treedef, out)
  if return_residual:
    return result, jax.tree_util.tree_unflatten(treedef, residual)
  return result


def reduce_scatter(x: jax.Array, axis_name: AxisName, codec: Codec = QSGD(),
                   key: jax.Array | None = None, op: str = "mean", *,
                   check_varying: bool = True, exchange: str = "auto") -> jax.Array:
  """Compressed reduce-scatter along axis 0 (``lax.psum_scatter(..., tiled=True)`` semantics).

  x: [D*m, ...] on every device, this device's values; returns this device's reduced block
  [m, ...] (block i goes to the device with axis index i). Each value is quantised once. For sharded
  data parallelism: reduce gradients straight into the optimizer shard. ``check_varying``: as in
  :func:`allreduce` (ValueError for an ``x`` that is the same on every device; not checked under
  ``jax.pmap``). ``exchange``: the all-to-all's schedule, as in :func:`allreduce`.
  """
  _check_common(codec, op)
  _exchange.check_method(exchange, "exchange")
  check_varying = check_bool("check_varying", check_varying)
  d = _check_flat_collective("reduce_scatter", x, axis_name, key)
  if check_varying:
    _varying.check_per_device(x, axis_names(axis_name), "x", "qcomm.reduce_scatter")
  if x.ndim == 0 or x.shape[0] % d:
    raise ValueError(f"x.shape[0] must be divisible by the axis size {d}, got shape {x.shape}")
  if codec.needs_key and key is None:
    raise ValueError("key is required for stochastic rounding: pass key=jax.random.key(...)")
  if codec.exact:
    out = lax.psum_scatter(x.astype(jnp.float32), axis_name, scatter_dimension=0, tiled=True)
    return (out / d if op == "mean" else out).astype(x.dtype)
  block = (x.shape[0] // d,) + x.shape[1:]
  m = math.prod(block)
  if codec.summable:
    # Block i's words summed onto device i: one psum_scatter of [D, W] words (whole rows), the
    # scales of every block shared by one pmax.
    codec.check_devices(d)
    rows = x.reshape(d, m).astype(jnp.float32)
    shared = lax.pmax(jax.vmap(codec.bucket_scale)(rows), axis_name)
    row_key = _device_key(key, axis_name, 0)
    keys = None if row_key is None else jax.random.split(row_key, d)
    words = jax.vmap(lambda r, sh, k: codec.wire_encode_summable(r, sh, k, d),
                     in_axes=(0, 0, None if keys is None else 0))(rows, shared, keys)
    mine = lax.psum_scatter(words, axis_name, scatter_dimension=0, tiled=True)[0]
    own = lax.dynamic_index_in_dim(shared, lax.axis_index(axis_name), keepdims=False)
    reduced = codec.wire_decode_summed(mine, own, d, d, m, 1.0 / d if op == "mean" else 1.0)
    return reduced.reshape(block).astype(x.dtype)
  payloads = _encode_rows(codec, x.reshape(d, m).astype(jnp.float32), _device_key(key, axis_name, 0))
  reduced = codec.wire_decode_sum(_exchange.exchange(payloads, axis_name, exchange), m)
  if op == "mean":
    reduced = reduced * jnp.float32(1.0 / d)
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
  d = _check_flat_collective("all_gather", x, axis_name, key)
  if codec.needs_key and key is None:
    raise ValueError("key is required for stochastic rounding: pass key=jax.random.key(...)")
  if tiled and x.ndim == 0:
    raise ValueError("x must have at least one dimension for tiled=True")
  if codec.exact:
    return lax.all_gather(x, axis_name, tiled=tiled, to="invarying")
  payload = codec.wire_encode(x.reshape(-1).astype(jnp.float32), _device_key(key, axis_name, 0))
  gathered = lax.all_gather(payload, axis_name, to="invarying")
  out = _decode_rows(codec, gathered, x.size).astype(x.dtype)
  out = out.reshape((d,) + x.shape)
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
  _check_axis(axis_name, hierarchical=False)
  axis_size(axis_name)
  packing.check_float_leaves(x)
  if check_varying:
    _varying.check_per_device(x, axis_names(axis_name), "x", "qcomm.cast_pmean")
  return jax.tree_util.tree_map(lambda v: lax.pmean(v.astype(dtype), axis_name).astype(v.dtype), x)
