"""Per-leaf sharding of a pytree over D devices, and the flat rows the sharded collectives carry.

Sharded optimizer state (``qcomm.sync(..., shard_state=True)``) gives every device 1/D of every
parameter, as PyTorch FSDP2 does, each leaf split along one of its own axes so that a shard keeps
the leaf's rank. The axis (:func:`shard_axis`) is the first one whose size D divides, else the one
whose padding adds the fewest elements: dim 0 for PyTorch's layouts and for flax's ``Dense`` kernels
``(in, out)``, the channel axes for flax's convolution kernels ``(H, W, in, out)``, whose spatial
dims of 1, 3 or 7 would otherwise be padded to D rows (a 1x1 kernel would travel D times). A leaf
split along axis ``a`` of size ``n`` is padded with zeros to ``D * s`` along it, ``s = ceil(n /
D)``, and device ``j`` owns the slice ``j*s .. (j+1)*s`` of that axis. A 0-d leaf is not split:
every device holds it whole (its D copies are identical, and the all-gather takes the first).

The collectives work on ``D`` rows per leaf: row ``j`` is the leaf's shard ``j``, flattened in its
own (row-major) order, so that a shard and its row are the same memory. In the leaf itself a shard
is ``pre`` runs of ``chunk`` elements (``pre`` the product of the dims before the split axis), so
the reduce-scatter takes each leaf as ``[pre, D, chunk]`` chunks, a reshape (:meth:`Layout.chunks`),
and a codec reads them where they lie. A reduce-scatter hands device ``j`` the reduced shard ``j``
of every leaf; an all-gather of every device's rows gives every device all shards. How a codec
carries a group of leaves (one packed buffer, each segment padded to its ``pad_multiple`` so that
no quantisation bucket straddles two leaves, or a payload per leaf and chunk) is its own
:meth:`~jax_qcomm.Codec.reduce_scatter_leaves` / :meth:`~jax_qcomm.Codec.all_gather_leaves`; the
bytes are those of the packed buffer either way. Leaves are grouped by codec (and into buffers of at
most ``comm_bucket_size`` elements per row, None: the codec's ``comm_buffer_size`` for a
reduce-scatter) by :func:`jax_qcomm.collectives.packing.plan`, as the allreduce groups them.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm import _compat
from jax_qcomm.collectives import packing
from jax_qcomm.codecs import Codec
from jax_qcomm.codecs.base import _chunks_of, _rows_of


def shard_axis(shape: Sequence[int], devices: int) -> int:
  """The axis a leaf of ``shape`` is split along over ``devices``: the first one whose size
  ``devices`` divides, else the one whose padding adds the fewest elements (the first of those).
  0 for a 0-d leaf."""

  def padding(a: int) -> int:
    rest = math.prod(shape[:a]) * math.prod(shape[a + 1:])
    return (-(-shape[a] // devices) * devices - shape[a]) * rest

  return min(range(len(shape)), key=lambda a: (padding(a), a)) if shape else 0


@dataclasses.dataclass(frozen=True)
class LeafShard:
  """How one leaf is sharded over ``devices``: split along ``axis`` (:func:`shard_axis`);
  ``shard_shape`` is each device's part (the leaf's shape with ``ceil(shape[axis] / devices)`` along
  ``axis``), ``size`` its elements (the leaf's segment of a row). ``split`` is False for a 0-d leaf
  (whole everywhere)."""

  shape: tuple[int, ...]
  devices: int

  @property
  def split(self) -> bool:
    return len(self.shape) > 0

  @property
  def axis(self) -> int:
    return shard_axis(self.shape, self.devices)

  @property
  def rows_per_device(self) -> int:
    return -(-self.shape[self.axis] // self.devices) if self.split else 1

  @property
  def shard_shape(self) -> tuple[int, ...]:
    if not self.split:
      return ()
    a = self.axis
    return self.shape[:a] + (self.rows_per_device,) + self.shape[a + 1:]

  @property
  def pieces(self) -> tuple[int, int]:
    """``(pre, chunk)``: a shard is ``pre`` contiguous runs of ``chunk`` elements of the (padded)
    leaf, ``pre`` the product of the dims before the split axis (1 for a split along dim 0)."""
    if not self.split:
      return 1, 1
    a = self.axis
    return math.prod(self.shape[:a]), self.rows_per_device * math.prod(self.shape[a + 1:])

  @property
  def size(self) -> int:
    return math.prod(self.shard_shape)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The sharding of a pytree's leaves over ``devices`` and the buffers of its collectives.

  ``groups``: :class:`jax_qcomm.collectives.packing.Group` s of leaf indices sharing a codec, each carried by
  one reduce-scatter and one all-gather; a device's part of a group is its rows of those leaves,
  each padded to whole buckets (:meth:`row_size`)."""

  leaves: tuple[LeafShard, ...]
  devices: int
  groups: tuple[packing.Group, ...]

  @staticmethod
  def of(shapes: Sequence[tuple[int, ...]], devices: int, codecs: Sequence[Codec],
         comm_bucket_size: int | None, kinds: Sequence[Any] | None = None) -> "Layout":
    """``kinds``: per leaf, which leaves may share a buffer (:func:`packing.plan`; the model
    axes a leaf varies over, so that a model-sharded leaf's shard and a replicated leaf travel
    apart)."""
    leaves = tuple(LeafShard(tuple(int(d) for d in s), devices) for s in shapes)
    segments = [jax.ShapeDtypeStruct((leaf.size,), jnp.float32) for leaf in leaves]
    return Layout(leaves, devices, tuple(packing.plan(
        segments, codecs, comm_bucket_size, devices, "reduce_scatter",
        kinds=[frozenset()] * len(leaves) if kinds is None else kinds)))

  def row_size(self, group: packing.Group) -> int:
    """Elements of one row of the group's buffer (what each device owns of it)."""
    return sum(packing.padded_size(self.leaves[i].size, group.codec) for i in group.leaves)

  # -- leaves <-> rows ------------------------------------------------------------------------------
  def rows(self, x: jax.Array, i: int) -> jax.Array:
    """float32 leaf ``x`` -> float32[D, size]: row j is device j's shard (row-major). A reshape
    for a leaf split along dim 0 that D divides; otherwise a copy (the padding, the runs)."""
    return _rows_of(self.chunks(x, i))

  def unrows(self, rows: jax.Array, i: int) -> jax.Array:
    """float32[D, size] -> the leaf (its shape; padding dropped; a 0-d leaf from row 0)."""
    pre, chunk = self.leaves[i].pieces
    return self.unchunks(_chunks_of(rows, (pre, self.devices, chunk)), i)

  def chunks(self, x: jax.Array, i: int) -> jax.Array:
    """float32 leaf ``x`` -> float32[pre, D, chunk] (:attr:`LeafShard.pieces`): device j's shard
    is ``[:, j]``, in order. A reshape (and the padding, if any): what the sharded reduce-scatter
    takes (:meth:`jax_qcomm.Codec.reduce_scatter_leaves`)."""
    leaf = self.leaves[i]
    if not leaf.split:
      return jnp.broadcast_to(x.reshape(1, 1, 1), (1, self.devices, 1))
    pre, chunk = leaf.pieces
    return self._padded(x, leaf).reshape(pre, self.devices, chunk)

  def unchunks(self, chunks: jax.Array, i: int) -> jax.Array:
    """float32[pre, D, chunk] -> the leaf (its shape; padding dropped; a 0-d leaf from device 0's
    chunk)."""
    leaf = self.leaves[i]
    if not leaf.split:
      return chunks[0, 0, 0]
    a = leaf.axis
    full = chunks.reshape(leaf.shape[:a] + (self.devices * leaf.rows_per_device,)
                          + leaf.shape[a + 1:])
    return lax.slice_in_dim(full, 0, leaf.shape[a], axis=a)

  def to_shard(self, segment: jax.Array, i: int) -> jax.Array:
    """float32[*lead, size] (rows of leaf ``i``) -> float32[*lead, *shard_shape]: a reshape."""
    return segment.reshape(segment.shape[:-1] + self.leaves[i].shard_shape)

  def from_shard(self, shard: jax.Array, i: int) -> jax.Array:
    """A shard of leaf ``i`` (``shard_shape``) -> its row, float32[size]: a reshape."""
    del i
    return shard.reshape(-1)

  def _padded(self, x: jax.Array, leaf: LeafShard) -> jax.Array:
    """``x`` padded with zeros along the split axis to ``D * rows_per_device``."""
    a = leaf.axis
    pad = self.devices * leaf.rows_per_device - leaf.shape[a]
    return jnp.pad(x, [(0, pad) if k == a else (0, 0) for k in range(x.ndim)]) if pad else x

  def shard_of(self, x: jax.Array, i: int, index: jax.Array) -> jax.Array:
    """Device ``index``'s shard of leaf ``x`` (shape ``shard_shape``)."""
    leaf = self.leaves[i]
    if not leaf.split:
      return x
    s = leaf.rows_per_device
    return lax.dynamic_slice_in_dim(self._padded(x, leaf), index * s, s, axis=leaf.axis)


# While a sharded sync runs ``inner``: (axis_name, weight per leaf) -- the weight is 1 for a split
# leaf and 1/D for a 0-d leaf held whole by every device -- so that whole-model quantities
# (jax_qcomm.clip_by_global_norm) can complete a sum over all shards with one scalar psum.
SHARDED = contextvars.ContextVar("jax_qcomm_sharded", default=None)
#: The value of SHARDED while the sharded sync traces ``inner`` to look for per-shard reductions
#: (jax_qcomm.transforms.sync): whole-model sums then stand in as a constant, so that only the reductions
#: that a shard would make wrong remain in the trace.
PROBE = ("probe",)


#: The model axes of a model-sharded step while it traces ``tx.update`` on each device's shards
#: (jax_qcomm.runners.data_parallel): a leaf that varies over them is one shard of a parameter.
MODEL_AXES: contextvars.ContextVar[tuple] = contextvars.ContextVar("jax_qcomm_model_axes",
                                                                  default=())
#: The replica axes of a diloco while it traces its inner transformation (jax_qcomm.transforms.
#: diloco): values vary over them because the replicas differ, not because they are shards.
REPLICA_AXES: contextvars.ContextVar[tuple] = contextvars.ContextVar("jax_qcomm_replica_axes",
                                                                    default=())


#: The axes of the sync whose ``inner`` is being traced (jax_qcomm.transforms.sync): the values
#: ``inner`` sees are the same over them, and vary over any other axis only as shards (or as a
#: diloco's replicas).
SYNC_AXES: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("jax_qcomm_sync_axes",
                                                                         default=None)


def shard_axes(x: Any, own: Sequence[Any]) -> tuple:
  """The manual axes over which ``x`` (a value of a synchronisation over the axes ``own``) is one
  shard of a larger whole: the runner's model axes it varies over, or, in a step written by hand
  (manual over every axis, the parameters sharded by its in_specs), the axes it varies over
  besides ``own`` and a diloco's replica axes."""
  vma = _compat.vma_of(x)
  model = MODEL_AXES.get()
  if model:
    return tuple(a for a in model if a in vma)
  skip = set(own) | set(REPLICA_AXES.get())
  return tuple(sorted((a for a in vma if a not in skip), key=str))


def global_sum_of_squares(tree: Any) -> jax.Array:
  """Sum of squares of every element of ``tree``, over the whole model: inside a sharded sync's
  ``inner`` (this device's shards, then one scalar ``psum`` over the data axes), and in a
  model-sharded step (a leaf sharded over model axes: its shards' sums added over them, once)."""
  leaves = jax.tree_util.tree_leaves(tree)
  ctx = SHARDED.get()
  if ctx is PROBE:
    return jnp.float32(1.0)
  if ctx is not None:
    axis_name, weights = ctx
    if len(weights) != len(leaves):
      raise ValueError(f"inside a sharded qcomm.sync, whole-model sums need the gradients' own "
                       f"tree ({len(weights)} leaves), got {len(leaves)} leaves")
    data = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  else:
    weights, data = [1] * len(leaves), ()
  own = SYNC_AXES.get()
  parts: dict[tuple, jax.Array] = {}
  for w, x in zip(weights, leaves):
    # the axes x is one shard over: the runner's model axes, or inside a sync's inner the axes
    # it varies over besides the sync's (a step written by hand, manual over every axis)
    over = (shard_axes(x, own) if own is not None or MODEL_AXES.get()
            else ())
    term = jnp.float32(w) * jnp.sum(jnp.square(x.astype(jnp.float32)))
    parts[over] = parts[over] + term if over in parts else term
  total = jnp.float32(0)
  for over, local in parts.items():
    axes = data + over
    total = total + (lax.psum(local, axes) if axes else local)
  return total
