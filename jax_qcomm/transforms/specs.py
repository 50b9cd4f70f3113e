"""Where every part of a qcomm optimizer state lives, read from the state itself.

Each state class of the library (:class:`qcomm.SyncState`, :class:`qcomm.ShardedSyncState`,
:class:`qcomm.DiLoCoState`) is a NamedTuple that carries its transformation's settings in a
``config`` field: a static pytree node with no leaves (invisible to ``tree_map``, orbax and
``jax.jit``; kept by every optax combinator, flax ``TrainState`` and ``nnx.Optimizer``, since they
all rebuild the state through its pytree structure). A class declares the role of each field:

* ``PER_DEVICE_FIELDS``: one part per device, a leading device axis split over the state's own
  axis (``PartitionSpec(axis)``);
* ``NESTED_FIELDS``: an optimizer state inside, specified recursively (qcomm states inside it get
  their own specs, anything else is replicated);
* ``PER_DEVICE_NESTED_FIELDS``: the same, with the device axis in front of every leaf's spec (the
  inner state of a ``diloco``, one per replica, around a ``sync`` over another axis);
* ``PARAM_SHARD_FIELDS`` (optional): a pytree over the sharded parameters
  (:class:`qcomm.ParamShard` s), split like them (:func:`qcomm.shard_specs`);
* ``REPLICATED_FIELDS``: counters and keys, always present (they identify a state that a
  container turned into a mapping); every other field is replicated too.

One function, :func:`state_partition_spec`, turns any pytree holding such states into
``shard_map`` specs; the runner (:func:`qcomm.data_parallel`) and :func:`qcomm.describe` find the
transformations through the same states (:func:`find_states`), so a ``sync`` or ``diloco`` inside
``optax.chain``, ``inject_hyperparams`` or any other combinator is found.
"""

from __future__ import annotations

import collections.abc
from typing import Any

import optax

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_qcomm._checks import check_axis_name
from jax_qcomm.collectives.sharded_params import has_shards, shard_specs
from jax_qcomm.transforms import layout
from jax_qcomm.transport.axes import AxisName, Hierarchical, axis_names

_STATE_TYPES: list[type] = []


def register_state(cls: type) -> type:
  """Makes ``cls`` a qcomm state class (a decorator): it declares the roles of its fields and has
  a static ``config`` field with an ``axis_name``."""
  for attr in ("PER_DEVICE_FIELDS", "NESTED_FIELDS", "PER_DEVICE_NESTED_FIELDS",
               "REPLICATED_FIELDS"):
    if not hasattr(cls, attr):
      raise TypeError(f"{cls.__name__} must declare {attr} to be a qcomm state")
  if "config" not in cls._fields:
    raise TypeError(f"{cls.__name__} must have a static config field to be a qcomm state")
  if cls not in _STATE_TYPES:
    _STATE_TYPES.append(cls)
  return cls


def device_spec(names: tuple) -> P:
  """``PartitionSpec`` of a leading device axis split over ``names``."""
  return P(names[0] if len(names) == 1 else names)


def state_type(x: Any) -> type | None:
  """The qcomm state class of ``x``: a state itself, or a mapping with its fields (an
  ``nnx.State`` from ``nnx.state(optimizer)``, a dict restored without a target)."""
  for cls in _STATE_TYPES:
    if isinstance(x, cls):
      return cls
  if not isinstance(x, collections.abc.Mapping):
    return None
  keys = set(x.keys())
  for cls in _STATE_TYPES:
    if not getattr(cls, "MAPPING_FORM", True):  # never in an nnx.State: not guessed from keys
      continue
    if set(cls.REPLICATED_FIELDS) <= keys <= set(cls._fields):
      return cls
  return None


def is_state(x: Any) -> bool:
  return state_type(x) is not None


def find_states(tree: Any) -> list:
  """The qcomm states in ``tree`` that are not inside another qcomm state, in tree order."""
  return [n for n in jax.tree_util.tree_leaves(tree, is_leaf=is_state) if is_state(n)]


def _field(x: Any, name: str, default: Any = ()) -> Any:
  """A field of a qcomm state or of its mapping form."""
  return x.get(name, default) if isinstance(x, collections.abc.Mapping) else getattr(x, name, default)


def _is_special(x: Any) -> bool:
  return is_state(x) or (isinstance(x, (optax.MultiStepsState, optax.ApplyIfFiniteState))
                         and bool(find_states(x)))


def _axes_of(x: Any, axis_name: Any) -> tuple:
  """The device axes of state ``x``: its config's, checked against ``axis_name`` if given; a
  mapping form (no config) uses ``axis_name``."""
  config = None if isinstance(x, collections.abc.Mapping) else x.config
  if config is None:
    if axis_name is None:
      raise ValueError(
          f"axis_name must be given for a qcomm state in mapping form ({type(x).__name__}, as "
          f"nnx.state(optimizer) makes): it has lost its settings. Pass the optimizer's "
          f"opt_state pytree itself, or axis_name=")
    return axis_names(axis_name)
  own = axis_names(config.axis_name)
  if axis_name is not None and not set(own) <= set(axis_names(axis_name)):
    raise ValueError(f"axis_name {axis_name!r} must name the axes of every qcomm state in the "
                     f"tree; a {type(x).__name__} synchronises over {config.axis_name!r}")
  return own


def _specs(tree: Any, axis_name: Any) -> Any:
  rep = lambda t: jax.tree_util.tree_map(lambda _: P(), t)  # noqa: E731

  def prefixed(dev: P, t: Any) -> Any:
    return jax.tree_util.tree_map(lambda s: P(*dev, *s), _specs(t, axis_name),
                                  is_leaf=lambda s: isinstance(s, P))

  def field(cls, dev, name, value):
    if name in cls.PER_DEVICE_FIELDS:
      return jax.tree_util.tree_map(lambda _: dev, value)
    if name in cls.NESTED_FIELDS:
      return _specs(value, axis_name)
    if name in cls.PER_DEVICE_NESTED_FIELDS:
      return prefixed(dev, value)
    if name in getattr(cls, "PARAM_SHARD_FIELDS", ()) and has_shards(value):
      return shard_specs(value, dev[0])
    return rep(value)

  def one(x):
    cls = state_type(x)
    if cls is not None:
      dev = device_spec(_axes_of(x, axis_name))
      if isinstance(x, cls):
        return cls(*(v if name == "config" else field(cls, dev, name, v)
                     for name, v in zip(cls._fields, x)))
      return type(x)({k: field(cls, dev, k, v) for k, v in x.items()})  # the mapping form
    if isinstance(x, optax.MultiStepsState):
      raise ValueError(
          "optax.MultiSteps around qcomm.sync is not supported: MultiSteps adds up the raw "
          "per-device gradients in its own state (acc_grads), which has no replicated form, and "
          "runs sync at every micro-step, so it would communicate at every call. Use "
          "qcomm.sync(inner, accum_steps=k) instead: the same update, communicating every k-th "
          "call (or optax.MultiSteps inside sync: qcomm.sync(optax.MultiSteps(inner, k))).")
    if isinstance(x, optax.ApplyIfFiniteState):
      raise ValueError(
          "optax.apply_if_finite around qcomm.sync is not supported: it tests the gradients it "
          "receives, which around sync are each device's own, so the devices would disagree on "
          "whether to run the allreduce (and with accumulation it would restore an accumulator "
          "holding the bad gradient). Put it inside, where every device sees the same averaged "
          "gradient: qcomm.sync(optax.apply_if_finite(inner, max_consecutive_errors), ...).")
    return P()

  return jax.tree_util.tree_map(one, tree, is_leaf=_is_special)


def state_partition_spec(tree: Any, axis_name: AxisName | None = None, *,
                         params: Any = None) -> Any:
  """``shard_map`` specs for a pytree holding qcomm states, e.g. an optimizer state.

  Every qcomm state in ``tree`` says where its parts live: the per-device parts (a sync's
  accumulator and error-feedback residual; the sharded sync's shards; a diloco replica's
  parameters, inner state and residual), arrays with a leading device axis, are split over the
  state's own axis (``PartitionSpec(axis)``); a diloco's inner state has the replica axis in front
  of the specs of the sync inside it (``PartitionSpec("node", "gpu")`` for the sync's per-device
  parts); every other leaf is replicated (``PartitionSpec()``).

  ``tree`` may be a bare state, an ``optax.chain`` tuple, an ``inject_hyperparams`` state, a flax
  ``TrainState``, the ``opt_state`` of an ``nnx.Optimizer``, or any pytree of these, of arrays or
  of ``jax.ShapeDtypeStruct`` s (``jax.eval_shape(tx.init, params)``). Only its structure is read.

  Args:
    tree: the pytree.
    axis_name: optional; the data axes of the step (a name, a tuple of names or
      ``qcomm.Hierarchical``). If given, every state's axis must be among them (ValueError
      otherwise). Required for a state in mapping form (``nnx.state(optimizer)``), which has lost
      its settings.
    params: optional, the parameters placed with their ``NamedSharding`` s over model axes (the
      mesh axes that are not data axes). Each state leaf that belongs to a parameter (its key path
      ends with the parameter's, its shape is the parameter's or has a leading device axis more)
      then also gets the parameter's spec: ``PartitionSpec("data", None, "model")`` for the
      error-feedback residual of a ``P(None, "model")`` weight, ``P(None, "model")`` for its Adam
      moments. The specs of a step written by hand around model-sharded parameters.

  Use the result for the state in both ``in_specs`` and ``out_specs``. ValueError for
  ``optax.MultiSteps(sync(...))``, ``optax.apply_if_finite(sync(...))`` and a chain in which a
  stateful transformation follows an accumulating sync or a diloco, naming the call to use
  instead.
  """
  if axis_name is not None:
    check_axis_name("axis_name", axis_name, (Hierarchical,), "qcomm.Hierarchical(inner, outer)")
  check_chains(tree)
  spec = _specs(tree, axis_name)
  if params is None:
    return spec
  leaves = jax.tree_util.tree_leaves(params)
  if not leaves or not all(hasattr(x, "shape") for x in leaves):
    raise ValueError(f"params must be a pytree of arrays (or jax.ShapeDtypeStruct s) placed with "
                     f"their NamedSharding s, got {params!r}"[:300])
  pspecs = jax.tree_util.tree_map(
      lambda x: P(*x.sharding.spec) if isinstance(getattr(x, "sharding", None), NamedSharding)
      else P(), params)
  used = set().union(*[layout.spec_axes(s) for s in jax.tree_util.tree_leaves(
      pspecs, is_leaf=lambda s: isinstance(s, P))])
  data = set(axis_names(axis_name)) if axis_name is not None else set()
  if used & data:
    raise ValueError(f"params must be sharded only over mesh axes other than the data axes "
                     f"{sorted(data)}, got a leaf sharded over {sorted(used & data)}")
  meshes = [x.sharding.mesh for x in leaves if isinstance(getattr(x, "sharding", None),
                                                           NamedSharding)]
  order = meshes[0].axis_names if meshes else sorted(used, key=str)
  model = tuple(a for a in order if a in used)  # the mesh's order, as the runner's
  return layout.merge(spec, layout.state_model_specs(tree, params, pspecs, spec, model))


# ---- what follows a sync in a chain --------------------------------------------------------------

def skips_calls(x: Any) -> bool:
  """A qcomm state whose transformation returns zero updates on some calls: a sync that
  accumulates (accum_steps > 1), or a diloco (between synchronisations)."""
  return (bool(jax.tree_util.tree_leaves(_field(x, "acc_grads")))
          or "outer_opt_state" in _fields_of(x))


def check_chains(tree: Any) -> None:
  """ValueError for ``optax.chain(sync(..., accum_steps > 1), <stateful>)`` (or a diloco before a
  stateful transformation): the calls that do not communicate return zero updates, which a
  stateful transformation after it would take for gradients. A chain's state is a tuple of its
  parts' states, in order."""
  def visit(node: Any) -> None:
    if is_state(node):
      cls = state_type(node)
      for name in cls.NESTED_FIELDS + cls.PER_DEVICE_NESTED_FIELDS:
        visit(_field(node, name, None))
      return
    if isinstance(node, collections.abc.Mapping) and _int_keyed(node.get("opt_state")):
      # nnx.state(optimizer): the optimizer's chain turned into a mapping {0: ..., 1: ...}.
      opt = node["opt_state"]
      node = dict(node, opt_state=tuple(opt[i] for i in range(len(opt))))
    children = node if isinstance(node, (tuple, list)) and not hasattr(node, "_fields") else None
    if children is not None:
      seen = False
      for child in children:
        if seen and jax.tree_util.tree_leaves(child):
          raise ValueError(
              "a stateful transformation follows a qcomm.sync with accum_steps > 1 (or a "
              "qcomm.diloco) in a chain: the calls that do not communicate return zero updates, "
              "and it would take them for gradients (Adam's moments would decay, schedules would "
              "advance at every call). Move it inside, where it runs once per optimizer step: "
              "qcomm.sync(optax.chain(..., optimizer), accum_steps=k) instead of "
              "optax.chain(qcomm.sync(optax.identity(), accum_steps=k), optimizer).")
        seen = seen or any(skips_calls(n) for n in find_states(child))
    if isinstance(node, (str, bytes)) or _is_special(node):
      return
    for child in _children(node):
      visit(child)

  visit(tree)


def _int_keyed(x: Any) -> bool:
  return (isinstance(x, collections.abc.Mapping) and len(x) > 0
          and set(x.keys()) == set(range(len(x))))


def _children(node: Any) -> list:
  """The direct children of a pytree node ([] for a leaf)."""
  leaves, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
  if treedef.num_nodes == 1 and treedef.num_leaves == 1 and leaves and leaves[0] is node:
    return []
  return leaves


# ---- what the runner reads from the state ----------------------------------------------------------

def communicated(opt_state: Any) -> jax.Array | None:
  """Inside the step, after ``tx.update``: True on a call where every qcomm transformation at the
  top of ``opt_state`` communicated (None if all of them communicate on every call). The calls in
  between return zero updates, which a transformation chained after them may still turn into a
  change (``optax.add_decayed_weights``); the runner applies updates only on these calls."""
  flags = [_field(s, "mini_step") == 0 for s in find_states(opt_state) if skips_calls(s)]
  if not flags:
    return None
  return jnp.all(jnp.stack(flags))



def apply_update(tx: optax.GradientTransformation, grads: Any, opt_state: Any,
                 params: Any) -> tuple[Any, Any]:
  """``tx.update`` then ``optax.apply_updates``, the updates applied only on calls where every
  qcomm transformation communicated (:func:`jax_qcomm.transforms.specs.communicated`), so that a
  transformation chained after an accumulating sync acts once per optimizer step."""
  updates, opt_state = tx.update(grads, opt_state, params)
  new = optax.apply_updates(params, updates)
  gate = communicated(opt_state)
  if gate is not None:
    new = jax.tree_util.tree_map(lambda n, p: jnp.where(gate, n, p), new, params)
  return new, opt_state

def local_params(opt_state: Any, params: Any) -> Any:
  """The parameters this device takes its gradient at, inside the step: for a
  :func:`qcomm.diloco` state in ``opt_state``, this replica's own parameters (which move between
  synchronisations; ``params`` is the anchor, and right after a synchronisation, ``mini_step ==
  0``, they are ``params`` itself, bit for bit); for every other transformation ``params``."""
  found = diloco_states(opt_state)
  if not found:
    return params
  if len(found) > 1:
    raise ValueError(f"opt_state must hold at most one qcomm.DiLoCoState, found {len(found)}")
  state = found[0]
  local = _field(state, "params")
  if jax.tree_util.tree_structure(local) != jax.tree_util.tree_structure(params):
    raise ValueError(f"params must have the structure of the diloco replicas' parameters, got "
                     f"{jax.tree_util.tree_structure(params)} vs "
                     f"{jax.tree_util.tree_structure(local)}")
  config = _field(state, "config")
  if getattr(config, "fragments", 1) > 1 or getattr(config, "delay", 0):
    # Fragments: right after a synchronisation only one fragment is the anchor; the replica's
    # parameters hold it, made as the caller's optax.apply_updates makes the anchor. Delayed
    # outer updates: the replica goes on from its own parameters.
    return jax.tree_util.tree_map(lambda a: a[0], local)
  synced = _field(state, "mini_step") == 0
  return jax.tree_util.tree_map(lambda a, p: jnp.where(synced, p, a[0]), local, params)


def diloco_states(tree: Any) -> list:
  """The diloco states at the top of ``tree`` (those with replicas' parameters)."""
  return [s for s in find_states(tree) if "outer_opt_state" in _fields_of(s)]


def replica_axes(opt_state: Any) -> tuple:
  """The axes of the diloco replicas in ``opt_state`` (() without a diloco): the runner reduces
  the loss only over the other data axes, so that the calls between synchronisations run no
  collective across replicas."""
  axes = ()
  for s in diloco_states(opt_state):
    config = getattr(s, "config", None)
    if config is not None:
      axes += tuple(n for n in axis_names(config.axis_name) if n not in axes)
  return axes


def _fields_of(x: Any) -> tuple:
  return tuple(x.keys()) if isinstance(x, collections.abc.Mapping) else type(x)._fields


def checked_spec(opt_state: Any, axis_name: Any) -> Any:
  """:func:`qcomm.state_partition_spec` of ``opt_state``, with ValueError unless its qcomm
  transformations synchronise over exactly the data axes ``axis_name``."""
  spec = state_partition_spec(opt_state, axis_name)
  states = find_states(opt_state)
  if not states:
    raise ValueError(
        f"tx must contain a qcomm transformation over {axis_name!r}: the optimizer state holds "
        f"none, so each device would step with its own gradient. Wrap the optimizer: "
        f"qcomm.sync(tx, axis_name={axis_name!r}) (compressed, 4 bits), qcomm.sync(tx, "
        f"axis_name={axis_name!r}, codec=qcomm.NoCompression()) for exact data parallelism, or "
        f"qcomm.diloco(tx, axis_name=..., every=H).")
  covered = set()
  for s in states:
    cfg = getattr(s, "config", None)
    if cfg is not None:
      covered |= set(axis_names(cfg.axis_name))
      if getattr(cfg, "inner_axis_name", None) is not None:
        covered |= set(axis_names(cfg.inner_axis_name))
    else:  # the mapping form carries no settings: it synchronises over axis_name
      covered |= set(axis_names(axis_name))
  missing = [n for n in axis_names(axis_name) if n not in covered]
  if missing:
    raise ValueError(
        f"axis_name {axis_name!r} names data axes {missing} that no qcomm transformation in tx "
        f"synchronises over: the devices along them would step apart. Synchronise them (a "
        f"qcomm.sync over {missing[0]!r} inside the diloco: qcomm.diloco(qcomm.sync(inner, "
        f"axis_name={missing[0]!r}), ...)) or leave them out of axis_name.")
  return spec


def place(tree: Any, spec: Any, mesh: Mesh) -> Any:
  """``tree`` placed on ``mesh`` as the spec tree says (a no-op for arrays already there). Needed
  for meshes with Explicit axes (jax.make_mesh's default), whose shard_map rejects inputs placed
  otherwise. Shared by the step helpers (data_parallel, diloco, flax_nnx)."""
  shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), spec,
                                     is_leaf=lambda s: isinstance(s, P))
  return jax.device_put(tree, shardings)


class _SpecKey:
  """A spec tree as a cache key (PartitionSpec trees are not hashable as pytrees)."""

  def __init__(self, spec: Any):
    self.spec = spec
    leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=lambda s: isinstance(s, P))
    self._key = (treedef, tuple(leaves))

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, _SpecKey) and self._key == other._key
