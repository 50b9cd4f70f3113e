"""Parameters sharded over the data axes (ZeRO-3 / FSDP): each device keeps 1/D of every leaf, and
a layer's full parameters are gathered just before the layer runs.

The layout of a shard (:class:`ParamShard`): a leaf of ``n`` elements, flattened in row-major
order and padded with zeros to ``D * m`` elements, ``m = ceil(n / D)``; device ``i`` (its index
along the data axes) holds elements ``[i * m, (i + 1) * m)``. As a global array the shards are
``float[D, m]`` (or the leaf's dtype), split over the data axes (``PartitionSpec(axis)``); inside
``shard_map`` each device sees its ``[1, m]``. :func:`shard_params` makes them from full
parameters and :func:`unshard_params` gives the full parameters back (evaluation, checkpoints in
the full layout).

:func:`gather_params` is the primitive, called inside ``shard_map`` where the
parameters are used: forward, an all-gather of the shards, compressed with ``codec`` (the weights
quantised blockwise, DeepSpeed ZeRO++'s qwZ: ``QSGD(8, rounding="nearest")`` keeps each value
within half a step of 1/255 of its bucket's range); backward (a ``jax.custom_vjp``), a
reduce-scatter of the gradient to the shards, compressed with ``grad_codec``: each shard receives
the devices' mean gradient (data parallelism's average). The exact master copy stays in the
shards: only the gathered copy is quantised.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm import _compat
from jax_qcomm._checks import check_array_leaves, check_bool, check_instance, check_key
from jax_qcomm.codecs import Codec, NoCompression
from jax_qcomm.collectives import ops
from jax_qcomm.transport.axes import AxisName, axis_names, axis_size, check_axis


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class ParamShard:
  """This device's shard of one parameter (or, outside ``shard_map``, all devices' shards).

  ``data``: ``[D, m]`` as a global array split over the data axes, ``[1, m]`` inside
  ``shard_map``; ``shape`` and ``dtype``: the full parameter's (static: the pytree's aux data)."""

  data: jax.Array
  shape: tuple[int, ...]
  dtype: Any

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  def tree_flatten(self):
    return (self.data,), (self.shape, jnp.dtype(self.dtype).name)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], aux[0], jnp.dtype(aux[1]))


def _is_shard(x: Any) -> bool:
  return isinstance(x, ParamShard)


def shard_size(n: int, devices: int) -> int:
  """Elements of one device's shard of an ``n``-element leaf: ``ceil(n / D)``."""
  return -(-n // devices)


def shard_params(params: Any, devices: int) -> Any:
  """Full parameters -> a pytree of :class:`ParamShard` with ``data`` ``[D, m]`` (row i: device
  i's shard). Place it with ``PartitionSpec(axis)`` (``shard_map``'s in_specs)."""
  if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
    raise ValueError(f"devices must be a positive integer, got {devices!r}")
  check_array_leaves("params", params)

  def one(x):
    x = jnp.asarray(x)
    m = shard_size(x.size, devices)
    flat = jnp.pad(x.reshape(-1), (0, devices * m - x.size))
    return ParamShard(flat.reshape(devices, m), tuple(x.shape), x.dtype)

  return jax.tree_util.tree_map(one, params)


def unshard_params(shards: Any) -> Any:
  """A pytree of :class:`ParamShard` (global ``[D, m]`` data) -> the full parameters."""

  def one(s):
    if not _is_shard(s):
      raise ValueError(f"shards must be a pytree of qcomm ParamShard (from qcomm.shard_params), "
                       f"got a leaf {type(s).__name__}")
    return s.data.reshape(-1)[:s.size].reshape(s.shape).astype(s.dtype)

  return jax.tree_util.tree_map(one, shards, is_leaf=_is_shard)


def gather_params(shards: Any, axis_name: AxisName, codec: Codec = NoCompression(),
                  grad_codec: Codec = NoCompression(), key: jax.Array | None = None, *,
                  after: Any = None, check_layout: bool = True) -> Any:
  """This device's shards of a subtree of parameters -> the full subtree (inside ``shard_map``).

  Args:
    shards: a pytree of :class:`ParamShard` (``data`` ``[1, m]``: this device's shard).
    axis_name: the data axes the shards are split over (a name or a tuple of names).
    codec: how the forward all-gather sends the weights: ``NoCompression()`` (exact, the
      default), ``QSGD(8, rounding="nearest")`` (qwZ's blockwise int8: each value within half a
      quantisation step, 1/255 of its bucket's range), ``Cast(jnp.bfloat16)``, ...
    grad_codec: how the backward reduce-scatter sends the gradient (``QSGD(4)``: each value
      quantised once, unbiased). Each shard receives the devices' mean gradient.
    key: a PRNG key, required where a codec rounds stochastically (a new one per step).
    after: optional, values the gather must wait for (the layer's input activations): the
      gather is then scheduled after them, not at the start of the program. In a Python loop
      over layers, XLA would otherwise start every layer's gather at once (they depend on the
      shards alone) and hold every layer's full parameters together; ``lax.scan`` over stacked
      layers orders them by itself.
    check_layout: raise ValueError for shards whose ``data`` is not ``[1, ceil(n / D)]``.

  Returns:
    The full parameters, the same on every device. Differentiable: its transpose reduce-scatters.
  """
  check_axis(axis_name, hierarchical=False)
  check_instance("codec", codec, Codec, "a qcomm codec")
  check_instance("grad_codec", grad_codec, Codec, "a qcomm codec")
  check_bool("check_layout", check_layout)
  check_key("key", key)
  leaves, treedef = jax.tree_util.tree_flatten(shards, is_leaf=_is_shard)
  d = axis_size(axis_name)
  for i, s in enumerate(leaves):
    if not _is_shard(s):
      raise ValueError(f"shards must be a pytree of qcomm ParamShard (qcomm.shard_params), got "
                       f"leaf {i} of type {type(s).__name__}")
    want = (1, shard_size(s.size, d))
    if check_layout and tuple(s.data.shape) != want:
      raise ValueError(
          f"shards: leaf {i} (a parameter of shape {s.shape}) has a shard of shape "
          f"{tuple(s.data.shape)} inside the step; over {d} devices it must be {want} (pass the "
          f"shards with PartitionSpec({axis_name!r}) in shard_map's in_specs, made by "
          f"qcomm.shard_params(params, {d}))")
  if key is None and (codec.needs_key or grad_codec.needs_key):
    raise ValueError("key is required where codec or grad_codec rounds stochastically: pass "
                     "key=jax.random.key(...) (a new one per step)")
  metas = tuple((s.shape, jnp.dtype(s.dtype).name) for s in leaves)
  key = jax.random.key(0) if key is None else key
  datas = tuple(s.data for s in leaves)
  if after is not None:  # the shards pass a barrier with `after`: the gather waits for it
    datas, _ = lax.optimization_barrier((datas, after))
  fulls = _gather(metas, axis_names(axis_name), codec, grad_codec, datas, key)
  return jax.tree_util.tree_unflatten(treedef, list(fulls))


def _gather_one(data, shape, dtype, names, codec, key):
  flat = data.reshape(-1)
  n = math.prod(shape)
  if codec.exact:
    whole = lax.all_gather(flat, names, tiled=True)
  else:
    whole = ops.all_gather(flat.astype(jnp.float32), names, codec, key, tiled=True)
  # Typed as varying, as lax.all_gather's result is: the loss's cotangent then reaches the
  # backward pass per device (an invariant result would have it summed over the devices first).
  whole = _compat.make_varying(whole, frozenset(names))
  return whole[:n].reshape(shape).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gather(metas, names, codec, grad_codec, datas, key):
  keys = jax.random.split(key, len(datas)) if datas else []
  return tuple(_gather_one(x, shape, dtype, names, codec, k)
               for x, (shape, dtype), k in zip(datas, metas, keys))


def _gather_fwd(metas, names, codec, grad_codec, datas, key):
  return _gather(metas, names, codec, grad_codec, datas, key), (key, tuple(x.shape for x in datas))


def _gather_bwd(metas, names, codec, grad_codec, residual, cotangents):
  key, data_shapes = residual
  keys = jax.random.split(jax.random.fold_in(key, 1), len(cotangents)) if cotangents else []
  d = math.prod(lax.axis_size(n) for n in names)
  grads = []
  for g, (shape, _), dshape, k in zip(cotangents, metas, data_shapes, keys):
    m = dshape[-1]
    flat = jnp.pad(g.reshape(-1).astype(jnp.float32), (0, d * m - math.prod(shape)))
    flat = _compat.make_varying(flat, frozenset(names))  # a gradient the same on every device
    if grad_codec.exact:
      part = lax.psum_scatter(flat, names, tiled=True) / d
    else:
      part = ops.reduce_scatter(flat, names, grad_codec, k, "mean", check_varying=False)
    # The padding past the leaf's n values is no parameter: its gradient stays 0 (a stochastic
    # codec would round it away from 0, and the optimizer would move it).
    index = lax.axis_index(names) * m + jnp.arange(m)
    part = jnp.where(index < math.prod(shape), part, 0.0)
    grads.append(part.reshape(dshape).astype(g.dtype))
  return tuple(grads), None


_gather.defvjp(_gather_fwd, _gather_bwd)
