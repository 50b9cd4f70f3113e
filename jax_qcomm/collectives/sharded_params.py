"""Parameters sharded over the data axes (ZeRO-3 / FSDP): each device keeps 1/D of every leaf, and
a layer's full parameters are gathered just before the layer runs.

The layout of a shard (:class:`ParamShard`): a parameter of ``n`` elements, flattened in row-major
order and padded with zeros to ``D * m`` elements, ``m = ceil(n / D)``; device ``i`` (its index
along the data axes, row-major over a tuple of axes) holds elements ``[i * m, (i + 1) * m)``. As a
global array the shards are ``[D, m]`` in the parameter's dtype, split over the data axes
(``PartitionSpec(..., axis, None)``); inside ``shard_map`` each device sees its ``[1, m]``. Stacked
layers (a leaf ``[L, *shape]`` run by ``lax.scan``) keep their layer axes in front: ``[L, D, m]``
globally, ``[L, 1, m]`` on a device, so that ``lax.scan`` hands each iteration one layer's ``[1, m]``
shard (``shard_params(params, D, layers=1)``). :func:`shard_params` makes the shards from full
parameters, :func:`unshard_params` gives the full parameters back (evaluation, checkpoints in the
full layout) and :func:`reshard_params` moves shards (or an optimizer state holding them) to
another device count.

:func:`gather_params` is the primitive, called inside ``shard_map`` where the parameters are used:
forward, an all-gather of the shards, compressed with ``codec`` (the weights quantised blockwise,
DeepSpeed ZeRO++'s qwZ: ``QSGD(8, rounding="nearest")`` keeps each value within half a step of
1/255 of its bucket's range); backward (a ``jax.custom_vjp``), a reduce-scatter of the gradient to
the shards, compressed with ``grad_codec``: each shard receives the devices' mean gradient (data
parallelism's average). The exact master copy stays in the shards: only the gathered copy is
quantised. With ``hpz=True`` over ``(node, gpu)`` axes (ZeRO++'s hpZ) the gather runs in two stages,
across nodes (compressed) to a secondary shard of ``1/gpu`` of the parameter, then inside the node;
under ``jax.checkpoint(..., policy=qcomm.hpz_remat_policy)`` backward re-gathers from the secondary
shard inside the node alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Iterator

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jax_qcomm import _compat
from jax_qcomm._checks import (check_array_leaves, check_axis_name, check_bool, check_instance,
                               check_key)
from jax_qcomm.codecs import Codec, NoCompression
from jax_qcomm.codecs._common import split_leaves
from jax_qcomm.collectives import packing
from jax_qcomm.transport.axes import AxisName, axis_names, axis_size, check_axis

#: The name of hpZ's secondary shards (``jax.ad_checkpoint.checkpoint_name``).
HPZ_NAME = "qcomm_hpz"
#: The remat policy that keeps hpZ's secondary shards, so that backward gathers inside the node:
#: ``jax.checkpoint(layer, policy=qcomm.hpz_remat_policy)`` (or ``nn.remat(..., policy=...)``).
hpz_remat_policy = jax.checkpoint_policies.save_only_these_names(HPZ_NAME)


@jax.tree_util.register_pytree_with_keys_class
@dataclasses.dataclass(frozen=True)
class ParamShard:
  """This device's shard of one parameter (or, outside ``shard_map``, all devices' shards).

  ``data``: ``[*layers, D, m]`` as a global array split over the data axes, ``[*layers, 1, m]``
  inside ``shard_map`` (``layers``: stacked layer axes, usually none); ``shape`` and ``dtype``: one
  full parameter's (static: the pytree's aux data), without the layer axes."""

  data: jax.Array
  shape: tuple[int, ...]
  dtype: Any

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  def tree_flatten_with_keys(self):
    return ((jax.tree_util.GetAttrKey("data"), self.data),), (self.shape,
                                                              jnp.dtype(self.dtype).name)

  def tree_flatten(self):
    return (self.data,), (self.shape, jnp.dtype(self.dtype).name)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], aux[0], jnp.dtype(aux[1]))


def is_shard(x: Any) -> bool:
  return isinstance(x, ParamShard)


def has_shards(tree: Any) -> bool:
  """Whether ``tree`` holds a :class:`ParamShard` anywhere."""
  return any(is_shard(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_shard))


def shard_size(n: int, devices: int) -> int:
  """Elements of one device's shard of an ``n``-element leaf: ``ceil(n / D)``."""
  return -(-n // devices)


def _check_devices(devices: Any) -> int:
  if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
    raise ValueError(f"devices must be a positive integer, got {devices!r}")
  return devices


def shard_params(params: Any, devices: int, *, layers: Any = 0) -> Any:
  """Full parameters -> a pytree of :class:`ParamShard` with ``data`` ``[*layer_axes, D, m]``.

  Args:
    params: a pytree of arrays.
    devices: D, the number of devices along the data axes.
    layers: how many leading axes of each leaf are stacked layers (kept in front, one shard per
      layer, for ``lax.scan``): an int for every leaf or a pytree prefix of ``params`` (as
      ``jax.vmap``'s ``in_axes``), e.g. ``{"blocks": 1, "embed": 0}``.

  Place the result with :func:`shard_specs` (``shard_map``'s in_specs), or let
  :func:`qcomm.data_parallel` place it.
  """
  _check_devices(devices)
  check_array_leaves("params", params)
  try:
    counts = jax.tree_util.tree_broadcast(layers, params) if not isinstance(layers, int) else \
        jax.tree_util.tree_map(lambda _: layers, params)
  except (ValueError, TypeError) as e:
    raise ValueError(f"layers must be an int or a pytree prefix of params, got {layers!r}: "
                     f"{e}") from None

  def one(x, k):
    x = jnp.asarray(x)
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= x.ndim:
      raise ValueError(f"layers must be an int from 0 to the leaf's rank ({x.ndim} for a leaf "
                       f"of shape {x.shape}), got {k!r}")
    lead, shape = x.shape[:k], x.shape[k:]
    n = math.prod(shape)
    m = shard_size(n, devices)
    flat = x.reshape(lead + (n,))
    flat = jnp.pad(flat, [(0, 0)] * k + [(0, devices * m - n)])
    return ParamShard(flat.reshape(lead + (devices, m)), tuple(shape), x.dtype)

  return jax.tree_util.tree_map(one, params, counts)


def unshard_params(tree: Any) -> Any:
  """Every :class:`ParamShard` in ``tree`` (global ``[*layers, D, m]`` data) -> the full
  parameter ``[*layers, *shape]``; other leaves stay as they are (an optimizer state's counts).
  ValueError for a tree without shards."""
  _check_has_shards(tree)

  def one(s):
    if not is_shard(s):
      return s
    lead = s.data.shape[:-2]
    return s.data.reshape(lead + (-1,))[..., :s.size].reshape(lead + s.shape).astype(s.dtype)

  return jax.tree_util.tree_map(one, tree, is_leaf=is_shard)


def _check_has_shards(tree: Any) -> None:
  if not has_shards(tree):
    raise ValueError(f"tree must be a pytree holding qcomm.ParamShard (from qcomm.shard_params "
                     f"or dp.shard), got a {type(tree).__name__} without any")


def reshard_params(tree: Any, devices: int) -> Any:
  """Every :class:`ParamShard` in ``tree`` moved to ``devices`` shards (the parameters, or an
  optimizer state whose moments are shards): restore a checkpoint saved at one device count and
  go on at another. Other leaves stay as they are."""
  _check_devices(devices)
  full = unshard_params(tree)
  return jax.tree_util.tree_map(
      lambda s, f: shard_params(f, devices, layers=s.data.ndim - 2) if is_shard(s) else f,
      tree, full, is_leaf=is_shard)


def shard_specs(tree: Any, axis_name: AxisName) -> Any:
  """``shard_map`` specs of a pytree holding :class:`ParamShard` s (parameters, gradients or an
  optimizer state over them): a shard's data ``P(*[None] * layers, axis, None)``, every other leaf
  replicated, ``P()``."""
  check_axis_name("axis_name", axis_name)
  if jax.tree_util.tree_leaves(tree):
    _check_has_shards(tree)
  names = axis_names(axis_name)
  dev = names[0] if len(names) == 1 else names

  def one(x):
    if is_shard(x):
      return ParamShard(P(*(None,) * (jnp.ndim(x.data) - 2), dev, None), x.shape, x.dtype)
    return P()

  return jax.tree_util.tree_map(one, tree, is_leaf=is_shard)


@dataclasses.dataclass
class _Scope:
  """What :func:`gather_params` takes from the step it runs in (:func:`gathering`)."""

  axis_name: AxisName
  codec: Codec
  grad_codec: Codec
  key: jax.Array
  hpz: bool
  policy: Any = None
  calls: int = 0
  seen: dict = dataclasses.field(default_factory=dict)


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("jax_qcomm_gather",
                                                                       default=None)


@contextlib.contextmanager
def gathering(axis_name: AxisName, codec: Codec, grad_codec: Codec, key: jax.Array,
              hpz: bool = False, policy: Any = None) -> Iterator[_Scope]:
  """While tracing a step's loss: :func:`gather_params` calls that leave ``axis_name`` out take
  these settings (the runner's shard_params mode, from its ``qcomm.sync``; ``policy``, a
  :class:`qcomm.LeafPolicy`, picks each leaf's codecs by its path inside the gathered subtree and
  its shape), each call a key of its own; a shard gathered twice is an error."""
  scope = _Scope(axis_name, codec, grad_codec, key, hpz, policy)
  token = _SCOPE.set(scope)
  try:
    yield scope
  finally:
    _SCOPE.reset(token)


def gather_params(shards: Any, axis_name: AxisName | None = None, codec: Codec | None = None,
                  grad_codec: Codec | None = None, key: jax.Array | None = None, *,
                  index: Any = None, after: Any = None, hpz: bool | None = None,
                  check_layout: bool = True) -> Any:
  """This device's shards of a subtree of parameters -> the full subtree (inside ``shard_map``).

  Inside :func:`qcomm.data_parallel`'s step with ``qcomm.sync(..., shard_params=True)``, call it
  with the shards alone, ``qcomm.gather_params(shards)``: the axes, codecs, key and ``hpz`` are
  the sync's, and each call gets a key of its own. Anywhere else, ``axis_name`` is required.

  Args:
    shards: a pytree of :class:`ParamShard` (``data`` ``[1, m]``: this device's shard of one
      layer; under ``lax.scan`` over stacked shards, the iteration's slice).
    axis_name: the data axes the shards are split over (a name or a tuple of names).
    codec: how the forward all-gather sends the weights: ``NoCompression()`` (exact, the
      default), ``QSGD(8, rounding="nearest")`` (qwZ's blockwise int8: each value within half a
      quantisation step, 1/255 of its bucket's range), ``Cast(jnp.bfloat16)``, ... A codec with
      no all-gather (``PowerSGD``) is an error.
    grad_codec: how the backward reduce-scatter sends the gradient (``QSGD(4)``: each value
      quantised once, unbiased). Each shard receives the devices' mean gradient.
    key: a PRNG key, required where a codec rounds stochastically (a new one per step).
    index: optional, an integer (or int32 scalar) folded into the key: the layer's index where
      one call gathers every layer in turn (``lax.scan`` traces its body once, so without it every
      layer would round with the same key: unbiased each, but with errors alike across layers).
    after: optional, values the gather must wait for (the layer's input activations): the
      gather is then scheduled after them, not at the start of the program. In a Python loop
      over layers, XLA would otherwise start every layer's gather at once (they depend on the
      shards alone) and hold every layer's full parameters together; ``lax.scan`` over stacked
      layers orders them by itself.
    hpz: with ``axis_name=(node, gpu)`` (two or more axes): gather across the outer axes first,
      compressed, to a secondary shard of ``1/gpu`` of the parameter (named
      ``qcomm.hpz_remat_policy`` keeps it), then exactly inside the last axis. Backward
      reduce-scatters inside the node exactly, then across nodes with ``grad_codec``. Under
      ``jax.checkpoint(..., policy=qcomm.hpz_remat_policy)`` backward's re-gather stays inside the
      node (ZeRO++'s hpZ), for ``1/gpu`` of the layer's parameters held per device.
    check_layout: raise ValueError for shards whose ``data`` is not ``[1, ceil(n / D)]``.

  Returns:
    The full parameters, the same on every device. Differentiable: its transpose reduce-scatters.
    A shard gathered twice in one traced step (inside the runner) is a ValueError: gather a layer
    once where it runs, and let ``jax.checkpoint`` gather it again in backward.
  """
  scope = _SCOPE.get()
  policy = None
  if scope is not None:
    scope.calls += 1
  if axis_name is None:
    if scope is None:
      raise ValueError("axis_name is required outside qcomm.data_parallel's step with "
                       "qcomm.sync(..., shard_params=True): pass the data axes the shards are "
                       "split over, e.g. gather_params(shards, 'data')")
    axis_name = scope.axis_name
    codec = scope.codec if codec is None else codec
    grad_codec = scope.grad_codec if grad_codec is None else grad_codec
    hpz = scope.hpz if hpz is None else hpz
    policy = scope.policy
    if key is None:
      key = jax.random.fold_in(scope.key, scope.calls)
  codec = NoCompression() if codec is None else codec
  grad_codec = NoCompression() if grad_codec is None else grad_codec
  check_axis(axis_name, hierarchical=False)
  check_instance("codec", codec, Codec, "a qcomm codec")
  check_instance("grad_codec", grad_codec, Codec, "a qcomm codec")
  check_bool("check_layout", check_layout)
  hpz = check_bool("hpz", False if hpz is None else hpz)
  check_key("key", key)
  if index is not None:
    if not (isinstance(index, int) and not isinstance(index, bool)) and not (
        hasattr(index, "dtype") and jnp.ndim(index) == 0
        and jnp.issubdtype(index.dtype, jnp.integer)):
      raise ValueError(f"index must be None, an int or an integer scalar array, got {index!r}")
  names = axis_names(axis_name)
  if hpz and len(names) < 2:
    raise ValueError(f"hpz=True needs axis_name with two or more axes (node, gpu): the secondary "
                     f"shard is gathered across all but the last, got {axis_name!r}")
  check_gather_codec("codec", codec)
  check_gather_codec("grad_codec", grad_codec, "reduce_scatter")
  leaves, treedef = jax.tree_util.tree_flatten(shards, is_leaf=is_shard)
  d = axis_size(axis_name)
  trace = _compat.current_trace()  # a shard gathered twice in one tracing (not in two branches)
  for i, s in enumerate(leaves):
    if not is_shard(s):
      raise ValueError(f"shards must be a pytree of qcomm ParamShard (qcomm.shard_params), got "
                       f"leaf {i} of type {type(s).__name__}")
    want = (1, shard_size(s.size, d))
    if check_layout and tuple(s.data.shape) != want:
      raise ValueError(
          f"shards: leaf {i} (a parameter of shape {s.shape}) has a shard of shape "
          f"{tuple(s.data.shape)} inside the step; over {d} devices it must be {want} (one "
          f"layer's shard, made by qcomm.shard_params(params, {d}) and passed with "
          f"qcomm.shard_specs(shards, {axis_name!r}) in shard_map's in_specs; stacked layers "
          f"[L, 1, m] are gathered one at a time inside lax.scan)")
    if scope is not None and (id(trace), id(s.data)) in scope.seen:
      raise ValueError(
          f"shards: leaf {i} (a parameter of shape {s.shape}) is gathered twice in one step. "
          f"Each gather holds a full copy and sends it again: gather a layer once where it runs "
          f"and use the full parameters for every use in it; to free it between forward and "
          f"backward, wrap the layer in jax.checkpoint (remat), which gathers it again in "
          f"backward by itself")
  if scope is not None:  # kept alive while the scope lasts, so that the ids stay unique
    scope.seen.update(((id(trace), id(s.data)), (trace, s.data)) for s in leaves)
  if key is None and (codec.needs_key or grad_codec.needs_key):
    raise ValueError("key is required where codec or grad_codec rounds stochastically: pass "
                     "key=jax.random.key(...) (a new one per step)")
  metas = tuple((s.shape, jnp.dtype(s.dtype).name) for s in leaves)
  codecs, grad_codecs = leaf_codecs(jax.tree_util.tree_unflatten(treedef, leaves), codec,
                                    grad_codec, policy)
  # Each device rounds its own shard with a key of its own (and each layer, given index=).
  key = jax.random.fold_in(jax.random.key(0) if key is None else key, lax.axis_index(names))
  if index is not None:
    key = jax.random.fold_in(key, index)
  datas = tuple(s.data for s in leaves)
  if after is not None:  # the shards pass a barrier with `after`: the gather waits for it
    datas, _ = lax.optimization_barrier((datas, after))
  outer, inner = (names[:-1], names[-1:]) if hpz else (names, ())
  flats = _gather_flat(tuple(s for s, _ in metas), outer, names, codecs, grad_codecs, datas,
                       key)
  if inner:  # hpZ: the secondary shards (kept under hpz_remat_policy), gathered inside the node
    flats = _inner_gather([checkpoint_name(f, HPZ_NAME) for f in flats], inner, d)
  fulls = [f[:math.prod(shape)].reshape(shape).astype(dtype)
           for f, (shape, dtype) in zip(flats, metas)]
  return jax.tree_util.tree_unflatten(treedef, fulls)


def leaf_codecs(shards: Any, codec: Codec, grad_codec: Codec,
                policy: Any = None) -> tuple[tuple, tuple]:
  """Per :class:`ParamShard` of ``shards`` (in tree order): the codec of its gathers and of its
  gradient's reduce-scatter. Without a ``policy`` (a :class:`qcomm.LeafPolicy`) every leaf gets
  ``codec`` and ``grad_codec``; with one, the leaves it sends exact (small and 1-D ones, by the
  full parameter's shape) travel exact both ways. The one decision :func:`gather_params`,
  :func:`qcomm.describe` and the benchmarks share."""
  leaves = jax.tree_util.tree_leaves(shards, is_leaf=is_shard)
  if policy is None:
    return tuple([codec] * len(leaves)), tuple([grad_codec] * len(leaves))
  shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in leaves]
  grad_codecs = tuple(packing.leaf_codecs(shapes, grad_codec, policy))
  probe = codec if codec.lossy else grad_codec  # which leaves the policy sends exact
  if not probe.lossy:
    return tuple([codec] * len(leaves)), grad_codecs
  return (tuple(codec if c.lossy else NoCompression()
                for c in packing.leaf_codecs(shapes, probe, policy)), grad_codecs)


def check_gather_codec(name: str, codec: Codec, what: str = "all_gather") -> Codec:
  """ValueError for a codec that has no all-gather (or reduce-scatter, ``what``)."""
  try:
    codec.leaves_traffic([(2 * codec.pad_multiple,)], 2, what)
  except ValueError as e:
    raise ValueError(f"{name} {codec.name} cannot send the parameters' {what.replace('_', '-')}: "
                     f"{e}") from None
  return codec


def _inner_gather(secs: list, inner: tuple, d: int) -> list:
  """hpZ's second stage: the secondary shards ``[N * m_i]`` (outer index n) gathered exactly over
  the last axis (index g), those of one dtype in one collective, and put back in the shards'
  order, chunk ``n * G + g``. Its transpose (autodiff's) is the exact reduce-scatter inside the
  node."""
  g = _size(inner)
  n_outer = d // g
  out = [None] * len(secs)
  for dtype in dict.fromkeys(x.dtype for x in secs):
    members = [i for i, x in enumerate(secs) if x.dtype == dtype]
    sizes = [secs[i].shape[0] for i in members]
    rows = lax.all_gather(jnp.concatenate([secs[i] for i in members]), inner)  # [G, sum N*m_i]
    for i, part in zip(members, split_leaves(rows, sizes, 1)):
      m = part.shape[1] // n_outer
      out[i] = part.reshape(g, n_outer, m).transpose(1, 0, 2).reshape(-1)
  return out


def _size(names: tuple) -> int:
  return math.prod(lax.axis_size(n) for n in names)


def _groups(codecs: tuple, dtypes: tuple) -> list[list[int]]:
  """The leaves that travel together: one collective per pair of codecs (gather, gradient), and
  dtype where either is exact."""
  groups: list[tuple[Any, list[int]]] = []
  for i, (c, t) in enumerate(zip(codecs, dtypes)):
    tag = (c, t if any(x.exact for x in c) else None)
    for key, members in groups:
      if key == tag:
        members.append(i)
        break
    else:
      groups.append((tag, [i]))
  return [members for _, members in groups]


def _gather_group(xs: list, names: tuple, codec: Codec, key) -> list:
  """Shards ``[1, m_i]`` of one codec, gathered in one collective -> ``[k * m_i]`` each."""
  if codec.exact:  # XLA's own all-gather of the concatenated shards
    sizes = [x.shape[-1] for x in xs]
    rows = lax.all_gather(jnp.concatenate([x.reshape(-1) for x in xs]), names)  # [k, M]
    parts = split_leaves(rows, sizes, 1)
  else:
    parts = [r.astype(x.dtype) for r, x in zip(codec.all_gather_leaves(
        [x.reshape(-1).astype(jnp.float32) for x in xs], names, key), xs)]
  # Typed as varying, as lax.all_gather's result is: the loss's cotangent then reaches the
  # backward pass per device (an invariant result would have it summed over the devices first).
  return [_compat.make_varying(p.reshape(-1), frozenset(names)) for p in parts]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _gather_flat(sizes, names, all_names, codecs, grad_codecs, datas, key):
  """Each shard ``[1, m]`` gathered over ``names`` to ``[k * m]`` (k: the devices along
  ``names``), the shards of one codec in one collective (each padded to whole buckets)."""
  out = [None] * len(datas)
  groups = _groups(tuple(zip(codecs, grad_codecs)), tuple(x.dtype for x in datas))
  keys = jax.random.split(key, len(groups)) if groups else []
  for members, k in zip(groups, keys):
    fulls = _gather_group([datas[i] for i in members], names, codecs[members[0]], k)
    for i, f in zip(members, fulls):
      out[i] = f
  return tuple(out)


def _gather_flat_fwd(sizes, names, all_names, codecs, grad_codecs, datas, key):
  return (_gather_flat(sizes, names, all_names, codecs, grad_codecs, datas, key),
          (key, tuple(x.shape for x in datas)))


def _gather_flat_bwd(sizes, names, all_names, codecs, grad_codecs, residual, cotangents):
  key, data_shapes = residual
  k = _size(names)
  rest = _size(all_names) // k  # hpZ: the inner stage's transpose summed over the node's devices
  groups = _groups(tuple(zip(codecs, grad_codecs)), tuple(g.dtype for g in cotangents))
  keys = jax.random.split(jax.random.fold_in(key, 1), len(groups)) if groups else []
  grads = [None] * len(cotangents)
  for members, kk in zip(groups, keys):
    rows = [_compat.make_varying(cotangents[i].astype(jnp.float32), frozenset(all_names))
            .reshape(k, data_shapes[i][-1]) for i in members]
    grad_codec = grad_codecs[members[0]]
    if grad_codec.exact:  # XLA's own reduce-scatter of the rows side by side
      m = [r.shape[1] for r in rows]
      packed = lax.psum_scatter(jnp.concatenate(rows, axis=1).reshape(-1), names, tiled=True)
      parts = [p / k for p in split_leaves(packed, m, 1)]
    else:
      parts = grad_codec.reduce_scatter_leaves([r[None] for r in rows], names, kk, "mean")[0]
    for i, part in zip(members, parts):
      if rest > 1:
        part = part / rest
      m = data_shapes[i][-1]
      # The padding past the leaf's n values is no parameter: its gradient stays 0 (a stochastic
      # codec would round it away from 0, and the optimizer would move it).
      index = lax.axis_index(all_names) * m + jnp.arange(m)
      part = jnp.where(index < math.prod(sizes[i]), part, 0.0)
      grads[i] = part.reshape(data_shapes[i]).astype(cotangents[i].dtype)
  return tuple(grads), None


_gather_flat.defvjp(_gather_flat_fwd, _gather_flat_bwd)
