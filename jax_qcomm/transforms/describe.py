"""``qcomm.describe(tx, params)``: what a :func:`qcomm.sync` sends, leaf by leaf.

    print(qcomm.describe(tx, params))

For every leaf of ``params``: the codec the policy picks (:func:`packing.leaf_codecs`, the same call
the allreduce makes), its element count, its payload (the codec's own ``payload_size``) and the
bytes each device sends for it per synchronisation, against exact float32. The bytes come from the
codecs' own :meth:`Codec.sent_bytes` of the communication buffers the allreduce builds
(:func:`packing.plan`), so they equal what the compiled step's collectives send.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P, use_abstract_mesh

from jax_qcomm.collectives import packing, sharded_params
from jax_qcomm._checks import (check_array_leaves, check_axis_name, check_bool, check_instance,
                               check_int)
from jax_qcomm.transport.axes import Hierarchical
from jax_qcomm.codecs import Codec, NoCompression
from jax_qcomm.collectives.shard_layout import Layout
from jax_qcomm.transport.axes import axis_names
from jax_qcomm.transforms._parts import num_devices
from jax_qcomm.transforms import layout as layout_of
from jax_qcomm.transforms.specs import find_states, state_partition_spec


@dataclasses.dataclass(frozen=True)
class LeafTraffic:
  """One leaf: ``payload_bytes`` is the codec's ``payload_size`` of the leaf as packed (whole
  buckets); ``sent_bytes`` its share (by packed elements) of what each device sends for its
  communication buffer per synchronisation."""

  path: str
  shape: tuple[int, ...]
  elements: int
  codec: Codec
  payload_bytes: int
  sent_bytes: float

  @property
  def exact(self) -> bool:
    """True if the policy sends this leaf exact (float32, ``lax.psum``)."""
    return self.codec.exact

  @property
  def ratio(self) -> float:
    """float32 bytes / payload bytes (1 for exact leaves)."""
    return 4 * self.elements / self.payload_bytes if self.payload_bytes else 1.0


def _times(fp32: float, sent: float) -> str:
  """fp32 bytes over sent bytes, as the table shows it ("1.00x" where nothing is sent)."""
  return f"{fp32 / sent:.2f}x" if sent else "1.00x"


@dataclasses.dataclass(frozen=True)
class Description:
  """What a sync sends: per-leaf :class:`LeafTraffic` and totals. ``str()`` / :meth:`table` give a
  readable table. Bytes are per device; "per sync" is per communication, "per call" divides by
  ``accum_steps``. The padding of each communication buffer to the devices' chunks is counted (in
  the leaves' shares)."""

  leaves: tuple[LeafTraffic, ...]
  devices: int
  accum_steps: int
  axis_name: Any
  default_codec: Codec
  scalar_bytes: float = 0.0
  state_bytes_per_device: int | None = None
  #: what ``default_codec`` runs at ``devices`` (:meth:`jax_qcomm.Codec.resolve`: Auto's pick)
  default_runs: Codec | None = None

  def __post_init__(self):  # made by describe(); checked for a Description made by hand
    if not (isinstance(self.leaves, tuple) and all(isinstance(x, LeafTraffic) for x in self.leaves)):
      raise ValueError(f"leaves must be a tuple of LeafTraffic, got {self.leaves!r}")
    check_int("devices", self.devices)
    check_int("accum_steps", self.accum_steps)
    check_axis_name("axis_name", self.axis_name)
    check_instance("default_codec", self.default_codec, Codec, "a jax_qcomm codec")
    if not (isinstance(self.scalar_bytes, (int, float)) and self.scalar_bytes >= 0):
      raise ValueError(f"scalar_bytes must be a non-negative number, got {self.scalar_bytes!r}")
    if self.state_bytes_per_device is not None:
      check_int("state_bytes_per_device", self.state_bytes_per_device, 0)
    if self.default_runs is not None:
      check_instance("default_runs", self.default_runs, Codec, "None or a jax_qcomm codec")

  @property
  def elements(self) -> int:
    return sum(leaf.elements for leaf in self.leaves)

  @property
  def fp32_bytes(self) -> int:
    return 4 * self.elements

  @property
  def payload_bytes(self) -> int:
    return sum(leaf.payload_bytes for leaf in self.leaves)

  @property
  def sent_bytes_per_sync(self) -> float:
    """Bytes each device sends per synchronisation: the leaves' shares of the buffers, and
    ``scalar_bytes`` (the sharded mode's one scalar psum; the scalar all-reduces of a sync's
    finite guard where a codec's mark sends one, :meth:`Codec.mark_traffic`)."""
    return sum(leaf.sent_bytes for leaf in self.leaves) + self.scalar_bytes

  @property
  def sent_bytes_per_call(self) -> float:
    return self.sent_bytes_per_sync / self.accum_steps

  @property
  def fp32_sent_bytes_per_sync(self) -> float:
    """What an exact float32 allreduce of the same leaves would send per device."""
    return NoCompression().sent_bytes(self.elements, self.devices)

  @property
  def ratio(self) -> float:
    """float32 bytes / bytes sent: the compression of the whole gradient."""
    return self.fp32_bytes / self.payload_bytes if self.payload_bytes else 1.0

  @property
  def exact_elements(self) -> int:
    return sum(leaf.elements for leaf in self.leaves if leaf.exact)

  def table(self) -> str:
    rows = [(leaf.path, "x".join(map(str, leaf.shape)) or "()", f"{leaf.elements:,}",
             leaf.codec.name, f"{leaf.payload_bytes:,}", f"{leaf.sent_bytes:,.0f}",
             f"{_times(NoCompression().sent_bytes(leaf.elements, self.devices), leaf.sent_bytes)}")
            for leaf in self.leaves]
    # "vs fp32": what an exact float32 allreduce sends over what this sync sends, per leaf and in
    # all (the same figure as the summary line's), not the payloads' ratio (.ratio).
    total = ("total", "", f"{self.elements:,}", f"{self.exact_elements:,} elements exact",
             f"{self.payload_bytes:,}", f"{self.sent_bytes_per_sync:,.0f}",
             _times(self.fp32_sent_bytes_per_sync, self.sent_bytes_per_sync))
    head = ("leaf", "shape", "elements", "codec", "payload B", "sent B/device/sync", "vs fp32")
    widths = [max(len(r[i]) for r in rows + [head, total]) for i in range(len(head))]
    right = (False, False, True, False, True, True, True)

    def line(r):
      return "  ".join(c.rjust(w) if rj else c.ljust(w) for c, w, rj in zip(r, widths, right))

    rule = "-" * len(line(head))
    state = ("" if self.state_bytes_per_device is None else
             f", optimizer state {self.state_bytes_per_device:,} B per device")
    runs = ("" if self.default_runs in (None, self.default_codec) else
            f" (here: {self.default_runs.name})")
    out = [f"synchronised over {self.axis_name!r}: {self.devices} devices, default codec "
           f"{self.default_codec.name}{runs}, accum_steps={self.accum_steps}{state}",
           line(head), rule, *map(line, rows), rule, line(total),
           f"per device: {self.sent_bytes_per_sync:,.0f} B per sync, "
           f"{self.sent_bytes_per_call:,.0f} B per call; exact fp32 would send "
           f"{self.fp32_sent_bytes_per_sync:,.0f} B per sync "
           f"({_times(self.fp32_sent_bytes_per_sync, self.sent_bytes_per_sync)} more)"]
    return "\n".join(line.rstrip() for line in out)

  __str__ = table

  def __repr__(self) -> str:
    return self.table()


def describe(tx: Any, params: Any, *, devices: int | None = None,
             regather: Any = True) -> Description:
  """Per leaf of ``params``: the codec, elements, payload and bytes sent by the sync ``tx``.

  Args:
    tx: an optimizer holding one :func:`qcomm.sync` or :func:`qcomm.diloco` (alone, or inside
      ``optax.chain`` or any other combinator: it is found through the state ``tx.init`` makes,
      which carries its settings). ValueError for none or several.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct`` s); the gradients have their
      shapes. A leaf placed with a ``NamedSharding`` over model axes counts as the shard each
      device holds, encodes and sends (:func:`qcomm.data_parallel` with model-sharded
      parameters): the bytes are per device.
    devices: the number of devices along the sync axis (default: the axis size inside
      ``shard_map``, else the current mesh's axis (``jax.set_mesh``), else
      ``jax.device_count()``).
    regather: with ``sync(..., shard_params=True)``: whether backward gathers a leaf again (its
      layer runs under ``jax.checkpoint``; with ``hpz`` and ``qcomm.hpz_remat_policy`` inside
      the node), or its gathered copy is kept from forward to backward (False). A bool for every
      leaf or a pytree prefix of ``params`` (``{"blocks": True, "embed": False}``).

  With ``shard_params`` the bytes per sync are, per leaf and per call (times ``accum_steps``):
  the forward all-gather of its shard (``param_codec``), again in backward if ``regather``, and
  the reduce-scatter of its gradient (the sync's codec); with ``hpz``, each in its two stages.
  ``params`` may be the shards (a stacked leaf ``[L, D, m]`` is L gathers; D is read from them)
  or the full parameters (one gather per leaf: pass the shards for stacked layers). Exact leaves
  count as float32, as the compiled step sends them for float32 parameters.

  Returns:
    A :class:`Description`; ``print()`` it for a table. Payloads come from the codecs'
    ``payload_size`` for the codec that ``LeafPolicy.codec_for`` picks, as the allreduce does.
    Only flat axes are described (ValueError for ``qcomm.Hierarchical``). For a
    :func:`qcomm.diloco` the bytes are those of its outer allreduce over ``devices`` replicas, per
    replica: with a ``qcomm.sync`` inside, the replica's devices each send their 1/inner share of
    the pseudo-gradient across the outer axis, which add up to this (up to the padding of each
    share to whole quantisation buckets).
  """
  check_array_leaves("params", params)
  cfg = _config(tx, params)
  if isinstance(cfg.axis_name, Hierarchical):
    raise ValueError("describe covers flat axes (a name or a tuple of names), not "
                     "qcomm.Hierarchical, whose exact and compressed parts cross different links")
  shard_d = sorted({s.data.shape[-2] for s in jax.tree_util.tree_leaves(
      params, is_leaf=sharded_params.is_shard) if sharded_params.is_shard(s)})
  if devices is None:
    devices = shard_d[0] if len(shard_d) == 1 else num_devices(cfg.axis_name)[0]
  else:
    devices = check_int("devices", devices)
  if getattr(cfg, "shard_params", False):
    return _describe_shards(tx, cfg, params, devices, regather)
  # Model-sharded parameters: what each device holds and sends (its shards).
  params, kinds = layout_of.per_device(params, axis_names(cfg.axis_name))
  with_path, _ = jax.tree_util.tree_flatten_with_path(params)
  shapes = [x for _, x in with_path]
  codecs = packing.leaf_codecs(params, cfg.codec, cfg.policy)
  sent = [0.0] * len(shapes)
  extra = 0.0
  if getattr(cfg, "shard_state", False):
    # Per buffer of rows: a reduce-scatter of the gradients with the leaves' codec, an all-gather
    # of the weight differences with the gather codec (exact leaves exact); one int32 psum of
    # the non-finite count.
    layout = Layout.of([s.shape for s in shapes], devices, codecs, cfg.comm_bucket_size, kinds)
    for group in layout.groups:
      gather = NoCompression() if group.codec.exact else cfg.gather_codec
      m = layout.row_size(group)
      total = (group.codec.sent_bytes(devices * m, devices, "reduce_scatter")
               + gather.sent_bytes(layout.row_size(_regroup(group, gather)), devices, "all_gather"))
      _share(sent, group.leaves, [layout.leaves[i].size for i in group.leaves], total)
    extra = NoCompression().sent_bytes(1, devices)
  else:
    # diloco with fragments: each fragment is its own allreduce (packed apart from the others),
    # its leaves keyed by their paths, so in the order of the sorted paths.
    fragments = getattr(cfg, "fragments", 1)
    paths = [packing.path_str(path) for path, _ in with_path]
    parts = ([sorted(g, key=paths.__getitem__)
              for g in packing.fragment_groups([s.size for s in shapes], fragments)]
             if fragments > 1 else [list(range(len(shapes)))])
    for part in parts:
      for group in packing.plan([shapes[i] for i in part], [codecs[i] for i in part],
                                cfg.comm_bucket_size, devices, kinds=[kinds[i] for i in part]):
        members = [part[j] for j in group.leaves]
        sizes = [group.codec.leaf_payload_size(shapes[i].shape) for i in members]
        _share(sent, members, sizes,
               group.codec.leaves_sent_bytes([shapes[i].shape for i in members], devices))
        if getattr(cfg, "uses_mark", False):  # sync's finite guard: what the mark sends, if any
          extra += sum(b for _, b in group.codec.mark_traffic(devices))
  leaves = []
  collective = "reduce_scatter" if getattr(cfg, "shard_state", False) else "allreduce"
  for (path, _), shape, codec, nbytes in zip(with_path, shapes, codecs, sent):
    n = shape.size
    codec = codec.resolve(devices, collective)  # what runs: Auto names its candidate
    leaves.append(LeafTraffic(
        path=packing.path_str(path) or "<root>", shape=shape.shape, elements=n, codec=codec,
        payload_bytes=codec.leaf_payload_size(shape.shape), sent_bytes=nbytes))
  return Description(leaves=tuple(leaves), devices=devices, accum_steps=cfg.accum_steps,
                     axis_name=cfg.axis_name, default_codec=cfg.codec, scalar_bytes=extra,
                     default_runs=cfg.codec.resolve(devices, collective),
                     state_bytes_per_device=_state_bytes(tx, params, cfg.axis_name, devices))


def _describe_shards(tx: Any, cfg: Any, params: Any, devices: int, regather: bool) -> Description:
  """:func:`describe` of ``sync(..., shard_params=True)``: per leaf and call, the gathers and
  the gradient's reduce-scatter of :func:`qcomm.gather_params` (with its codecs and leaf policy)."""
  if not sharded_params.has_shards(params):
    params = jax.eval_shape(functools.partial(sharded_params.shard_params, devices=devices),
                            params)
  with_path, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=sharded_params.is_shard)
  shards = [s for _, s in with_path]
  try:
    again_of = jax.tree_util.tree_leaves(jax.tree_util.tree_broadcast(regather, params))
  except (ValueError, TypeError) as e:
    raise ValueError(f"regather must be a bool or a pytree prefix of params, got {regather!r}: "
                     f"{e}") from None
  for r in again_of:
    check_bool("regather", r)
  exact = NoCompression()
  names = axis_names(cfg.axis_name)
  inner = 1
  if cfg.hpz:
    inner = math.prod(_axis_sizes(names, devices)[-1:])
  outer = devices // inner
  leaves, calls = [], cfg.accum_steps
  gathers, grads = sharded_params.leaf_codecs(shards, cfg.param_codec, cfg.codec, cfg.policy)
  for (path, s), regather, gather, grad in zip(with_path, again_of, gathers, grads):
    if (s.data.shape[-2], s.data.shape[-1]) != (devices, sharded_params.shard_size(s.size,
                                                                                    devices)):
      raise ValueError(f"params: the shard of '{packing.path_str(path)}' has data of shape "
                       f"{tuple(s.data.shape)}, not [..., {devices}, ceil({s.size} / {devices})]: "
                       f"shards of another device count")
    m, layers = s.data.shape[-1], math.prod(s.data.shape[:-2])
    if cfg.hpz:  # across the outer axes to the secondary shard, then inside the node
      fwd = gather.sent_bytes(m, outer, "all_gather") + exact.sent_bytes(outer * m, inner,
                                                                          "all_gather")
      again = exact.sent_bytes(outer * m, inner, "all_gather")
      back = (exact.sent_bytes(devices * m, inner, "reduce_scatter")
              + grad.sent_bytes(outer * m, outer, "reduce_scatter"))
    else:
      fwd = again = gather.sent_bytes(m, devices, "all_gather")
      back = grad.sent_bytes(devices * m, devices, "reduce_scatter")
    per_call = layers * (fwd + (again if regather else 0.0) + back)
    grad = grad.resolve(devices, "reduce_scatter")
    leaves.append(LeafTraffic(
        path=packing.path_str(path) or "<root>", shape=tuple(s.data.shape[:-2]) + s.shape,
        elements=layers * s.size, codec=grad,
        payload_bytes=layers * grad.leaf_payload_size(s.shape), sent_bytes=calls * per_call))
  return Description(leaves=tuple(leaves), devices=devices, accum_steps=cfg.accum_steps,
                     axis_name=cfg.axis_name, default_codec=cfg.codec,
                     scalar_bytes=exact.sent_bytes(1, devices),  # the finite guard's psum
                     default_runs=cfg.codec.resolve(devices, "reduce_scatter"),
                     state_bytes_per_device=_shard_state_bytes(tx, shards, params, devices))


def _axis_sizes(names: tuple, devices: int) -> tuple:
  """The sizes of ``names`` in the current mesh (``jax.set_mesh``), ValueError if unknown."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not all(n in mesh.axis_names for n in names):
    raise ValueError(f"describe of an hpz sync needs the mesh of its axes {names}: call it "
                     f"under jax.set_mesh(mesh)")
  sizes = tuple(mesh.shape[n] for n in names)
  if math.prod(sizes) != devices:
    raise ValueError(f"devices ({devices}) must equal the mesh's {names} ({sizes})")
  return sizes


def _shard_state_bytes(tx: Any, shards: list, params: Any, devices: int) -> int:
  """Bytes of the optimizer state per device with sharded parameters: a shard's data / D."""
  state = jax.eval_shape(tx.init, params)
  total = 0
  for leaf in jax.tree_util.tree_leaves(state, is_leaf=sharded_params.is_shard):
    if sharded_params.is_shard(leaf):
      total += math.prod(leaf.data.shape) * jnp.dtype(leaf.data.dtype).itemsize // devices
    else:
      total += math.prod(jnp.shape(leaf)) * jnp.dtype(leaf.dtype).itemsize
  return total


def _config(tx: Any, params: Any) -> Any:
  """The settings of the one qcomm transformation in ``tx``, read from its abstract state."""
  if not (hasattr(tx, "init") and hasattr(tx, "update")):
    raise ValueError(f"tx must be an optax.GradientTransformation holding a qcomm.sync or "
                     f"qcomm.diloco, got {tx!r}")
  shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                                  params)
  states = find_states(jax.eval_shape(tx.init, shapes))
  if len(states) != 1:
    raise ValueError(f"tx must hold exactly one qcomm.sync or qcomm.diloco (at its top level), "
                     f"found {len(states)}")
  return states[0].config


def _state_bytes(tx: Any, params: Any, axis_name: Any, devices: int) -> int:
  """Bytes of the optimizer state one device holds, counted from the arrays ``tx.init`` makes on
  ``devices`` devices: a replicated leaf whole, a per-device leaf (split over the axis) / D."""
  names = axis_names(axis_name)
  mesh = AbstractMesh((devices,) + (1,) * (len(names) - 1), names,
                      axis_types=(AxisType.Auto,) * len(names))
  shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                                  params)
  with use_abstract_mesh(mesh):
    state = jax.eval_shape(tx.init, shapes)
  specs = state_partition_spec(state)
  total = 0
  for leaf, spec in zip(jax.tree_util.tree_leaves(state),
                        jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))):
    nbytes = math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
    total += nbytes if spec == P() else nbytes // leaf.shape[0]
  return total


def _share(sent: list, indices, sizes, total: float) -> None:
  """Splits a buffer's bytes among its leaves by their elements in it."""
  whole = sum(sizes)
  for i, size in zip(indices, sizes):
    sent[i] = total * size / whole if whole else 0.0


def _regroup(group: packing.Group, codec: Codec) -> packing.Group:
  """The same leaves padded to another codec's buckets (the gather's rows)."""
  return packing.Group(codec, group.leaves)
