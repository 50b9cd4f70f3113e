"""``qcomm.data_parallel``: the whole data-parallel train step for a loss function.

    dp = qcomm.data_parallel(loss_fn, qcomm.sync(optax.adam(1e-3), bits=4), mesh)
    opt_state = dp.init(params)
    params, opt_state, loss, aux = dp.step(params, opt_state, batch)

It does what the explicit form (docs/usage.md) spells out: ``jax.shard_map`` over the mesh with the
batch split over the data axis, the gradient taken with respect to a varying copy of the parameters
(so that each device holds its own gradient), ``tx.update`` (a :func:`qcomm.sync`), the optimizer
state's specs from :func:`qcomm.state_partition_spec`, per-device random keys, and the reduction of
the loss and of auxiliary outputs across devices.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import optax

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_qcomm import _compat, collectives
from jax_qcomm._checks import check_axis_name, check_bool, check_choice, check_key
from jax_qcomm.sync import holds_sync, state_partition_spec

AUX_REDUCTIONS = ("mean", "sum", "stack", "concat")


@dataclasses.dataclass(frozen=True, eq=False)
class DataParallel:
  """A data-parallel train step made by :func:`data_parallel`.

  init(params) -> opt_state: ``tx.init`` run on the mesh, the per-device parts of the state placed
    on their devices (the specs are :meth:`state_spec`).
  step(params, opt_state, batch, *extra, key=None) -> (params, opt_state, loss, aux): one call of
    the jitted step (see :func:`data_parallel`); it may be traced inside the caller's ``jax.jit``.
  state_spec(opt_state) -> the ``shard_map`` specs of the state (``qcomm.state_partition_spec``).
  """

  loss_fn: Callable[..., Any]
  tx: optax.GradientTransformation
  mesh: Mesh
  axis_name: Any = "data"
  has_aux: bool = False
  aux_reduce: str = "mean"
  batch_spec: P | None = None
  donate: bool = False

  def __post_init__(self):  # the checks of data_parallel, also for DataParallel(...) made directly
    _check(self.loss_fn, self.tx, self.mesh, self.axis_name, self.has_aux, self.aux_reduce,
           self.batch_spec, self.donate)

  # -- specs and shardings ------------------------------------------------------------------------
  @property
  def _names(self) -> tuple:
    return collectives.axis_names(self.axis_name)

  @property
  def _device_spec(self) -> P:
    names = self._names
    return P(names[0] if len(names) == 1 else names)

  def state_spec(self, opt_state: Any) -> Any:
    """``shard_map`` specs of ``opt_state`` (arrays or ``jax.ShapeDtypeStruct`` s)."""
    spec = state_partition_spec(opt_state, self.axis_name)
    _require_sync(opt_state, self.axis_name)
    return spec

  def _put(self, tree: Any, spec: Any) -> Any:
    return place(tree, spec, self.mesh)

  # -- init -----------------------------------------------------------------------------------------
  def init(self, params: Any) -> Any:
    """The optimizer state for ``params``, sharded over the mesh: replicated except the sync
    state's per-device parts, split over the data axis."""
    with jax.set_mesh(self.mesh):
      spec = self.state_spec(jax.eval_shape(self.tx.init, params))
    return self._init_fn(_SpecKey(spec))(self._put(params, P()))

  @functools.lru_cache(maxsize=None)
  def _init_fn(self, spec_key):
    return jax.jit(jax.shard_map(self.tx.init, mesh=self.mesh, in_specs=P(),
                                 out_specs=spec_key.spec))

  # -- step -----------------------------------------------------------------------------------------
  def step(self, params: Any, opt_state: Any, batch: Any, *extra: Any,
           key: jax.Array | None = None) -> tuple[Any, Any, jax.Array, Any]:
    """One train step: ``(params, opt_state, loss, aux)``; see :func:`data_parallel`."""
    check_key("key", key)
    spec = self.state_spec(opt_state)
    fn = self._step_fn(_SpecKey(spec), len(extra), key is not None)
    batch_spec = self.batch_spec if self.batch_spec is not None else self._device_spec
    args = (self._put(params, P()), self._put(opt_state, spec), self._put(batch, batch_spec),
            self._put(extra, P()))
    if key is not None:
      args += (self._put(key, P()),)
    return fn(*args)

  __call__ = step

  @functools.lru_cache(maxsize=None)
  def _step_fn(self, spec_key, n_extra: int, with_key: bool):
    names = self._names
    loss_fn, tx, has_aux, reduce = self.loss_fn, self.tx, self.has_aux, self.aux_reduce
    spec = spec_key.spec

    def local_step(params, opt_state, batch, extra, key=None):
      # A varying copy: its gradient is this device's own, not the psum autodiff would take of the
      # gradient of a replicated parameter.
      local = jax.tree_util.tree_map(lambda p: _compat.make_varying(p, frozenset(names)), params)
      kwargs = {}
      if key is not None:  # dropout etc.: different randomness on every device
        kwargs["key"] = jax.random.fold_in(key, lax.axis_index(names))
      out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(local, batch, *extra, **kwargs)
      loss, aux = out if has_aux else (out, None)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      loss = lax.pmean(_compat.make_varying(loss, frozenset(names)), names)
      return params, opt_state, loss, _reduce_aux(aux, reduce, names)

    batch_spec = self.batch_spec if self.batch_spec is not None else self._device_spec
    aux_spec = self._device_spec if reduce in ("stack", "concat") else P()
    in_specs = (P(), spec, batch_spec, P()) + ((P(),) if with_key else ())
    fn = jax.shard_map(local_step, mesh=self.mesh, in_specs=in_specs,
                       out_specs=(P(), spec, P(), aux_spec))

    def call(params, opt_state, batch, extra, *key):
      return fn(params, opt_state, batch, extra, *key)

    return jax.jit(call, donate_argnums=(0, 1) if self.donate else ())


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


def _reduce_aux(aux: Any, how: str, names: tuple) -> Any:
  axes = frozenset(names)
  if how == "stack":
    return jax.tree_util.tree_map(lambda a: _compat.make_varying(jnp.asarray(a), axes)[None], aux)
  if how == "concat":
    return jax.tree_util.tree_map(lambda a: _compat.make_varying(jnp.asarray(a), axes), aux)
  op = lax.pmean if how == "mean" else lax.psum

  def reduce(a):
    a = jnp.asarray(a)
    if how == "mean" and not _compat.vma_of(a) & axes:
      # Varies over none of the data axes (loss_fn computed it with a collective over them, as a
      # BatchNorm with axis_name does its statistics): the same on every device, so its mean is
      # itself. A second allreduce would cost a collective and could round (the sum of D equal
      # floats divided by D need not give the value back exactly).
      return a
    return op(_compat.make_varying(a, axes), names)

  return jax.tree_util.tree_map(reduce, aux)


def data_parallel(loss_fn: Callable[..., Any], tx: optax.GradientTransformation, mesh: Mesh, *,
                  axis_name: collectives.AxisName = "data", has_aux: bool = False,
                  aux_reduce: str = "mean", batch_spec: P | None = None,
                  donate: bool = False) -> DataParallel:
  """A jitted data-parallel train step for ``loss_fn``, synchronised by ``tx``.

  Args:
    loss_fn: ``loss_fn(params, batch, *extra) -> loss`` (a scalar: the mean over this device's
      share of the batch), or ``-> (loss, aux)`` with ``has_aux``. If the step is given a ``key``,
      loss_fn is called with ``key=`` a key of its own on every device (for dropout).
    tx: the optimizer, normally ``qcomm.sync(...)`` (alone or inside ``optax.chain``) with the same
      ``axis_name``; it receives each device's own gradient.
    mesh: a mesh with the data axis (``Mesh(np.array(jax.devices()), ("data",))`` or
      ``jax.make_mesh``).
    axis_name: the data axis of ``mesh`` (a name or a tuple of names).
    has_aux: loss_fn returns ``(loss, aux)``.
    aux_reduce: how the per-device ``aux`` leaves come back: ``"mean"`` (``lax.pmean``: BatchNorm
      statistics, mean metrics; a leaf that varies over none of the data axes, because loss_fn
      computed it with a collective over them as a BatchNorm with ``axis_name`` does its
      statistics, is already the same on every device and comes back as it is, with no second
      allreduce), ``"sum"`` (``lax.psum``: counts), ``"stack"`` (every leaf with
      a leading device axis of size D) or ``"concat"`` (the devices' leaves concatenated along
      their leading axis: per-example outputs such as logits, for the global batch).
    batch_spec: how the batch is split (default ``PartitionSpec(axis_name)``: leading axis).
    donate: donate the params and optimizer state buffers to the step (saves memory; the arrays
      passed in are then invalid).

  Returns:
    A :class:`DataParallel`: ``opt_state = dp.init(params)``, then
    ``params, opt_state, loss, aux = dp.step(params, opt_state, batch, *extra, key=key)``.
    ``params`` are replicated and come back replicated; ``batch`` is the global batch, its leading
    axis split over the devices; ``extra`` arguments (e.g. BatchNorm statistics) are replicated and
    not differentiated; ``key`` is folded with the device index before reaching ``loss_fn``, so use
    a new one every step. ``loss`` is the mean of the devices' losses; ``aux`` is ``None`` without
    ``has_aux``.

    ``dp.step`` may also be called inside the caller's own ``jax.jit``, to fuse it with bookkeeping
    such as a step counter into one program (one dispatch per call, rather than the step's plus one
    per eager operation): the inputs are then placed by sharding constraints inside that program,
    and ``donate`` has no effect there (donate with that jit's ``donate_argnums``).
  """
  return DataParallel(loss_fn=loss_fn, tx=tx, mesh=mesh, axis_name=axis_name, has_aux=has_aux,
                      aux_reduce=aux_reduce, batch_spec=batch_spec, donate=donate)


def _check(loss_fn, tx, mesh, axis_name, has_aux, aux_reduce, batch_spec, donate,
           check_tx: bool = True) -> None:
  """ValueError naming the first bad argument of :func:`data_parallel` / :class:`DataParallel`."""
  if not callable(loss_fn):
    raise ValueError(f"loss_fn must be callable, got {loss_fn!r}")
  if check_tx and not (hasattr(tx, "init") and hasattr(tx, "update")):
    raise ValueError(f"tx must be an optax.GradientTransformation, got {tx!r}")
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}")
  check_axis_name("axis_name", axis_name, (collectives.Hierarchical,),
                  "qcomm.Hierarchical(inner, outer)")
  missing = [n for n in collectives.axis_names(axis_name) if n not in mesh.axis_names]
  if missing:
    raise ValueError(f"axis_name {axis_name!r} must name axes of the mesh {mesh.axis_names}; "
                     f"missing {missing}")
  check_choice("aux_reduce", aux_reduce, AUX_REDUCTIONS)
  check_bool("has_aux", has_aux)
  if batch_spec is not None and not isinstance(batch_spec, P):
    raise ValueError(f"batch_spec must be None or a PartitionSpec, got {batch_spec!r}")
  check_bool("donate", donate)


def _require_sync(opt_state: Any, axis_name: Any) -> None:
  """ValueError for an optimizer state with no qcomm.sync state in it: a plain optax optimizer
  would step on each device's own gradient and the replicas would drift apart."""
  if not holds_sync(opt_state):
    raise ValueError(
        f"tx must contain a qcomm.sync over {axis_name!r}: the optimizer state holds none, so each "
        f"device would step with its own gradient. Wrap the optimizer: qcomm.sync(tx, "
        f"axis_name={axis_name!r}) (compressed, QSGD 4 bits), or qcomm.sync(tx, "
        f"axis_name={axis_name!r}, codec=qcomm.NoCompression()) for exact data parallelism.")
