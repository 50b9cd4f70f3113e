"""``qcomm.data_parallel``: the one runner, the whole train step for every qcomm transformation.

    dp = qcomm.data_parallel(loss_fn, qcomm.sync(optax.adam(1e-3), bits=4), mesh)
    opt_state = dp.init(params)
    params, opt_state, loss, aux = dp.step(params, opt_state, batch)

``tx`` may hold a :func:`qcomm.sync` (replicated or sharded), a :func:`qcomm.diloco` around an
optax optimizer, or a diloco around a sync over another mesh axis (``axis_name`` then names both
data axes); the calling convention is the same, and for diloco ``params`` are the anchor. It does
what the explicit form (docs/usage.md) spells out: ``jax.shard_map`` over the mesh with the batch
split over the data axes, the gradient taken with respect to a varying copy of the parameters (so
that each device holds its own gradient; for diloco, of the replica's own parameters), ``tx.update``,
the optimizer state's specs from :func:`qcomm.state_partition_spec`, per-device random keys, and
the reduction of the loss and of auxiliary outputs across devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable

import optax

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jax_qcomm import _compat
from jax_qcomm.collectives import ops as collectives, packing
from jax_qcomm._checks import (check_array_leaves, check_axis_name, check_bool, check_choice,
                               check_key)
from jax_qcomm.transport.axes import axis_names
from jax_qcomm.runners.elastic import ElasticDataParallel
from jax_qcomm.runners.elastic_sync import ElasticSyncDataParallel
from jax_qcomm.runners.overlap import OverlappedDataParallel
from jax_qcomm.collectives.shard_layout import MODEL_AXES
from jax_qcomm.collectives import sharded_params
from jax_qcomm.transforms import layout, param_shards
from jax_qcomm.transforms.specs import (_SpecKey, apply_update, checked_spec, device_spec,
                                        local_params, place, replica_axes)

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
  param_spec: Any = None

  def __post_init__(self):  # the checks of data_parallel, also for DataParallel(...) made directly
    object.__setattr__(self, "_layouts", {})  # params treedef -> the layout seen (model specs)
    _check(self.loss_fn, self.tx, self.mesh, self.axis_name, self.has_aux, self.aux_reduce,
           self.batch_spec, self.donate)
    _check_param_spec(self.param_spec, self.mesh, self.axis_name)

  def _param_specs(self, params: Any) -> Any | None:
    """The parameters' specs over the model axes (None: replicated, the plain layout). Inside the
    caller's ``jax.jit`` an Auto axis's sharding is not in the traced params' type: the layout
    this runner last saw for the same tree (at ``init``) is used then."""
    return layout.cached_param_specs(self._layouts, params, self.mesh, self._names,
                                     self.param_spec)

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
    return checked_spec(opt_state, self.axis_name)

  def _put(self, tree: Any, spec: Any) -> Any:
    return place(tree, spec, self.mesh)

  # -- init -----------------------------------------------------------------------------------------
  def init(self, params: Any) -> Any:
    """The optimizer state for ``params``, placed on the mesh: replicated except the per-device
    parts of the qcomm states (a sync's accumulator, the sharded sync's shards, a diloco replica's
    parameters), split over their axes; with parameters sharded over model axes, every part that
    belongs to a parameter sharded like it (``tx.init`` runs on each device's shards)."""
    check_array_leaves("params", params)
    with jax.set_mesh(self.mesh):
      abstract = jax.eval_shape(self.tx.init, params)
    if param_shards.sharded_params_config(abstract) is not None:
      return self._init_sharded_params(params)
    pspecs = self._param_specs(params)
    with jax.set_mesh(self.mesh):
      spec = self.state_spec(abstract)
    if pspecs is None:
      return self._init_fn(_SpecKey(spec))(self._put(params, P()))
    _, spec = layout.state_specs(abstract, params, pspecs, spec, self.mesh, self._names)
    fn = self._sharded_init_fn(_SpecKey(spec), _SpecKey(pspecs))
    with _shard_errors("init"):
      return fn(self._put(params, pspecs))

  # -- sharded parameters (sync(..., shard_params=True)) -------------------------------------------
  @property
  def devices(self) -> int:
    """D, the number of devices along the data axes."""
    return math.prod(self.mesh.shape[n] for n in self._names)

  def shard(self, params: Any, *, layers: Any = 0) -> Any:
    """Full parameters -> their shards over the data axes, placed on the mesh
    (:func:`qcomm.shard_params`; ``layers``: stacked layer axes per leaf, an int or a pytree
    prefix). What ``step`` takes with ``qcomm.sync(..., shard_params=True)``."""
    check_array_leaves("params", params)
    shards = jax.jit(functools.partial(sharded_params.shard_params, devices=self.devices,
                                       layers=layers))(params)
    return self._put(shards, sharded_params.shard_specs(shards, self.axis_name))

  def unshard(self, shards: Any) -> Any:
    """The shards (or any pytree holding them, such as the optimizer state) -> the full
    parameters (:func:`qcomm.unshard_params`), replicated on the mesh: for evaluation and
    checkpoints in the full layout."""
    full = jax.jit(sharded_params.unshard_params)(shards)
    return self._put(full, jax.tree_util.tree_map(lambda _: P(), full))

  def _init_sharded_params(self, params: Any) -> Any:
    if self.param_spec is not None:
      raise ValueError("param_spec (parameters sharded over model axes) cannot be combined with "
                       "qcomm.sync(..., shard_params=True), whose shards split the data axes")
    shards = params if sharded_params.has_shards(params) else self.shard(params)
    pspecs = sharded_params.shard_specs(shards, self.axis_name)
    with jax.set_mesh(self.mesh):
      spec = self.state_spec(jax.eval_shape(self.tx.init, shards))
    fn = self._sharded_init_fn(_SpecKey(spec), _SpecKey(pspecs))
    return fn(self._put(shards, pspecs))

  @functools.lru_cache(maxsize=None)
  def _init_fn(self, spec_key):
    return jax.jit(jax.shard_map(self.tx.init, mesh=self.mesh, in_specs=P(),
                                 out_specs=spec_key.spec))

  @functools.lru_cache(maxsize=None)
  def _sharded_init_fn(self, spec_key, pspec_key):
    # Manual over every mesh axis: tx.init sees this device's shard of each parameter.
    return jax.jit(jax.shard_map(self.tx.init, mesh=self.mesh, in_specs=(pspec_key.spec,),
                                 out_specs=spec_key.spec))

  # -- step -----------------------------------------------------------------------------------------
  def step(self, params: Any, opt_state: Any, batch: Any, *extra: Any,
           key: jax.Array | None = None) -> tuple[Any, Any, jax.Array, Any]:
    """One train step: ``(params, opt_state, loss, aux)``; see :func:`data_parallel`."""
    check_key("key", key)
    spec = self.state_spec(opt_state)
    check_batch(batch, self.mesh, self.axis_name, self.batch_spec)
    replicas = replica_axes(opt_state)
    shard_cfg = param_shards.sharded_params_config(opt_state)
    pspecs = None if shard_cfg is not None else self._param_specs(params)
    if shard_cfg is not None:
      if not sharded_params.has_shards(params):
        raise ValueError("params must be the shards with qcomm.sync(..., shard_params=True): "
                         "dp.shard(params) (a pytree of qcomm.ParamShard), not the full "
                         "parameters")
      pspecs = sharded_params.shard_specs(params, self.axis_name)
      fn = self._step_fn(_SpecKey(spec), replicas, len(extra), key is not None,
                         shard_pspec_key=_SpecKey(pspecs))
    elif pspecs is None:
      fn = self._step_fn(_SpecKey(spec), replicas, len(extra), key is not None)
      pspecs = P()
    else:
      _check_shard_reductions(self.tx)
      mspec, full = layout.state_specs(opt_state, params, pspecs, spec, self.mesh, self._names)
      fn = self._step_fn(_SpecKey(spec), replicas, len(extra), key is not None, _SpecKey(mspec),
                         _SpecKey(pspecs))
      spec = full
    batch_spec = self.batch_spec if self.batch_spec is not None else self._device_spec
    args = (self._put(params, pspecs), self._put(opt_state, spec), self._put(batch, batch_spec),
            self._put(extra, P()))
    if key is not None:
      args += (self._put(key, P()),)
    with _shard_errors("step"):
      return fn(*args)

  __call__ = step

  @functools.lru_cache(maxsize=None)
  def _step_fn(self, spec_key, replicas: tuple, n_extra: int, with_key: bool,
               mspec_key=None, pspec_key=None, shard_pspec_key=None):
    """The jitted step. With ``pspec_key`` (parameters sharded over model axes), ``shard_map`` is
    manual over the data axes only and the update runs per shard (:func:`per_shard_update`).
    With ``shard_pspec_key`` the parameters are shards over the data axes (``shard_params``)."""
    names = self._names
    loss_fn, tx, has_aux, reduce = self.loss_fn, self.tx, self.has_aux, self.aux_reduce
    sharded = pspec_key is not None
    update = (per_shard_update(tx, self.mesh, names, pspec_key.spec, mspec_key.spec)
              if sharded else None)

    def step(params, opt_state, batch, extra, key=None):
      params, opt_state, loss, aux = local_step(loss_fn, tx, names, has_aux, params, opt_state,
                                                batch, extra, key, update=update)
      return (params, opt_state, _reduce_aux(loss, "mean", names, replicas),
              _reduce_aux(aux, reduce, names, replicas))

    batch_spec = self.batch_spec if self.batch_spec is not None else self._device_spec
    param_in = shard_pspec_key.spec if shard_pspec_key is not None else P()
    in_specs = (param_in, spec_key.spec, batch_spec, P()) + ((P(),) if with_key else ())
    fn = jax.shard_map(step, mesh=self.mesh, in_specs=in_specs,
                       out_specs=(param_in, spec_key.spec, out_specs_of("mean", names, replicas),
                                  out_specs_of(reduce, names, replicas)),
                       **({"axis_names": set(names)} if sharded else {}))
    keep = (keep_layout(self.mesh, pspec_key.spec, layout.merge(spec_key.spec, mspec_key.spec))
            if sharded else (lambda params, opt_state: (params, opt_state)))

    def call(params, opt_state, batch, extra, *key):
      params, opt_state, loss, aux = fn(params, opt_state, batch, extra, *key)
      return (*keep(params, opt_state), loss, aux)

    return jax.jit(call, donate_argnums=(0, 1) if self.donate else ())


def per_shard_update(tx: optax.GradientTransformation, mesh: Mesh, names: tuple, pspecs: Any,
                     mspec: Any) -> Callable[..., Any]:
  """The update of the model-sharded step (the runners share it): inside a ``shard_map`` manual
  over the data axes ``names`` only, where XLA partitions ``loss_fn`` and its gradient over the
  model axes, :func:`apply_update` runs inside a second ``shard_map``, manual over the model
  axes, so that every device synchronises (encodes, sends, decodes) its own shard of each
  gradient and keeps its own shard of each part of the state."""
  model = layout.model_axes(mesh, names)

  def per_shard(grads, opt_state, params):
    token = MODEL_AXES.set(model)  # whole-model sums over the shards
    try:
      return apply_update(tx, grads, opt_state, params)
    finally:
      MODEL_AXES.reset(token)

  def update(grads, opt_state, params):
    # Nested in the data-manual region: its mesh is the context's (data Manual, model not).
    return jax.shard_map(per_shard, in_specs=(pspecs, mspec, pspecs),
                         out_specs=(pspecs, mspec), axis_names=set(model))(grads, opt_state,
                                                                           params)

  return update


def keep_layout(mesh: Mesh, pspecs: Any, state_spec: Any) -> Callable[..., Any]:
  """``(params, opt_state) -> (params, opt_state)`` constrained to the layout they came in with,
  also where XLA's propagation would choose another (on Explicit axes the type carries it:
  ``reshard`` is then a no-op or a move)."""
  shardings = lambda t: jax.tree_util.tree_map(  # noqa: E731
      lambda s: NamedSharding(mesh, s), t, is_leaf=lambda s: isinstance(s, P))
  out_params, out_state = shardings(pspecs), shardings(state_spec)
  explicit = any(t == AxisType.Explicit for t in mesh.axis_types)
  constrain = jax.sharding.reshard if explicit else lax.with_sharding_constraint
  return lambda params, opt_state: (constrain(params, out_params),
                                    constrain(opt_state, out_state))


@contextlib.contextmanager
def _shard_errors(where: str):
  """A transformation whose state cannot follow the parameters' shards fails inside jax with an
  error about varying axes: re-raised as a ValueError that says what it means."""
  try:
    yield
  except ValueError as e:
    text = str(e)
    if "out_specs" not in text or ("vary" not in text and "varying" not in text):
      raise
    raise ValueError(
        f"dp.{where}: a part of the optimizer state differs between the shards of a "
        f"model-sharded parameter but has no parameter's shape to be sharded like (a codec "
        f"whose state depends on the leaf's shape, such as PowerSGD's factors), or a value the "
        f"update computes from one shard alone reaches a replicated leaf (a reduction over a "
        f"parameter's elements, as LAMB's trust ratio). Use a codec without per-leaf state "
        f"(QSGD, Summable, Cast, Wire16, NoCompression, TopK) and element-wise optimizers with "
        f"model-sharded parameters. jax said: "
        f"{text[:2000]}") from e


def local_step(loss_fn: Callable[..., Any], tx: optax.GradientTransformation, names: tuple,
               has_aux: bool, params: Any, opt_state: Any, batch: Any, extra: tuple,
               key: jax.Array | None = None,
               update: Callable[..., Any] | None = None) -> tuple[Any, Any, jax.Array, Any]:
  """The step on one device, inside ``shard_map`` over ``names`` (the runners share it).

  The gradient is taken at :func:`qcomm.local_params` (a diloco replica's own parameters, else
  ``params``), made varying over the data axes so that it is this device's own, not the psum that
  autodiff takes of the gradient of a replicated value. ``tx.update`` gets ``params`` (for diloco,
  the anchor); the updates are applied only on calls where every qcomm transformation
  communicated (:func:`jax_qcomm.transforms.specs.communicated`), so that a transformation chained after an
  accumulating sync acts once per optimizer step. Returns ``(params, opt_state, loss, aux)``:
  this device's own loss and ``aux``. ``update(grads, opt_state, params) -> (params,
  opt_state)`` replaces :func:`apply_update` (the model-sharded step runs it per shard)."""
  axes = frozenset(names)
  at = local_params(opt_state, params)
  diff = jax.tree_util.tree_map(lambda p: _compat.make_varying(p, axes), at)
  kwargs = {}
  if key is not None:  # dropout etc.: different randomness on every device
    kwargs["key"] = jax.random.fold_in(key, lax.axis_index(names))
  with param_shards.gather_scope(opt_state) as scope:  # gather_params takes the sync's codecs
    out, grads = jax.value_and_grad(_checked_loss(loss_fn, has_aux), has_aux=has_aux)(
        diff, batch, *extra, **kwargs)
  if scope is not None and scope.calls == 0:
    raise ValueError(
        "loss_fn never called qcomm.gather_params, but tx is a qcomm.sync(..., "
        "shard_params=True): the parameters arrive as shards, and only gather_params' backward "
        "pass averages their gradient over the devices. Gather each layer where it runs: "
        "full = qcomm.gather_params(shards['layer'])")
  loss, aux = out if has_aux else (out, None)
  new, opt_state = (update or functools.partial(apply_update, tx))(grads, opt_state, params)
  return new, opt_state, loss, aux


def _checked_loss(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
  """``loss_fn``, with a ValueError naming ``has_aux`` where its output does not match it."""

  def loss(*args, **kwargs):
    out = loss_fn(*args, **kwargs)
    if has_aux:
      if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ValueError(f"has_aux=True: loss_fn must return (loss, aux), got {_kind(out)}; "
                         f"drop has_aux=True for a loss_fn that returns the loss alone")
      return tuple(out)
    if isinstance(out, (tuple, list, dict)) or jnp.ndim(out) != 0:
      raise ValueError(f"loss_fn must return a scalar loss, got {_kind(out)}; a loss_fn that "
                       f"returns (loss, aux) needs data_parallel(..., has_aux=True)")
    return out

  return loss


def _kind(out: Any) -> str:
  if isinstance(out, (tuple, list)):
    return f"a {type(out).__name__} of {len(out)}"
  return f"{type(out).__name__} of shape {jnp.shape(out)}"


def check_batch(batch: Any, mesh: Mesh, axis_name: Any, batch_spec: P | None) -> None:
  """ValueError for a batch whose leading axis the data axes cannot split evenly (with the
  default ``batch_spec``)."""
  if batch_spec is not None:
    return
  d = math.prod(mesh.shape[n] for n in axis_names(axis_name))
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  sizes = {}
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    sizes.setdefault(shape[0] if shape else None, packing.path_str(path) or "<root>")
  if len(sizes) > 1:
    shown = ", ".join(f"'{where}': {n if n is not None else 'a scalar'}"
                      for n, where in sizes.items())
    raise ValueError(
        f"batch leaves must share their leading (example) axis, which the data axes split: "
        f"they have different leading sizes ({shown}). Give every leaf one row per example, or "
        f"pass batch_spec= to split the batch otherwise (and extra arguments, which are "
        f"replicated, after the batch: dp.step(params, opt_state, batch, *extra)).")
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    if not shape or shape[0] % d:
      n = shape[0] if shape else "no"
      raise ValueError(
          f"batch must have a leading axis that the {d} devices along {axis_name!r} split "
          f"evenly: leaf '{packing.path_str(path) or '<root>'}' has shape {tuple(shape)} ({n} "
          f"examples, batch size not divisible by the device count {d}). Use a global batch "
          f"size that is a multiple of {d}, or pass batch_spec= to split it otherwise.")


def _reduce_aux(aux: Any, how: str, names: tuple, replicas: tuple = ()) -> Any:
  """``aux`` (or the loss) reduced across the data axes ``names`` as ``how`` says. With diloco
  replicas, ``"mean"`` and ``"sum"`` reduce only over the axes inside a replica and give one row
  per replica (a leading axis split over ``replicas``): no collective crosses replicas."""
  axes = frozenset(names)
  if how == "stack":
    return jax.tree_util.tree_map(lambda a: _compat.make_varying(jnp.asarray(a), axes)[None], aux)
  if how == "concat":
    def concat(path, a):
      a = jnp.asarray(a)
      if a.ndim == 0:
        raise ValueError(
            f"aux_reduce='concat' concatenates per-example aux leaves along their leading axis, "
            f"but aux leaf '{packing.path_str(path) or '<root>'}' is a scalar: use "
            f"aux_reduce='mean' (or 'sum', or 'stack' for one value per device)")
      return _compat.make_varying(a, axes)
    return jax.tree_util.tree_map_with_path(concat, aux)
  op = lax.pmean if how == "mean" else lax.psum
  inside = tuple(n for n in names if n not in replicas)

  def reduce(a):
    a = jnp.asarray(a)
    if how == "mean" and not _compat.vma_of(a) & axes:
      # Varies over none of the data axes (loss_fn computed it with a collective over them, as a
      # BatchNorm with axis_name does its statistics): the same on every device, so its mean is
      # itself. A second allreduce would cost a collective and could round (the sum of D equal
      # floats divided by D need not give the value back exactly).
      pass
    elif inside:
      a = op(_compat.make_varying(a, frozenset(inside)), inside)
    if replicas:
      return _compat.make_varying(a, frozenset(replicas))[None]
    return a

  return jax.tree_util.tree_map(reduce, aux)


def out_specs_of(how: str, names: tuple, replicas: tuple) -> P:
  """The ``shard_map`` spec of the loss (``how="mean"``) or of aux reduced as ``how`` says."""
  if how in ("stack", "concat"):
    return device_spec(names)
  return device_spec(replicas) if replicas else P()


def data_parallel(loss_fn: Callable[..., Any], tx: optax.GradientTransformation, mesh: Mesh, *,
                  axis_name: collectives.AxisName = "data", has_aux: bool = False,
                  aux_reduce: str = "mean", batch_spec: P | None = None,
                  donate: bool = False, elastic: bool = False,
                  overlap: bool = False, param_spec: Any = None) -> DataParallel:
  """A jitted data-parallel train step for ``loss_fn``, synchronised by ``tx``.

  Args:
    loss_fn: ``loss_fn(params, batch, *extra) -> loss`` (a scalar: the mean over this device's
      share of the batch), or ``-> (loss, aux)`` with ``has_aux``. If the step is given a ``key``,
      loss_fn is called with ``key=`` a key of its own on every device (for dropout).
    tx: the optimizer, holding a qcomm transformation (alone or inside any optax combinator):
      ``qcomm.sync(...)`` (any ``accum_steps``, ``shard_state``) over ``axis_name``,
      ``qcomm.diloco(optax_optimizer, axis_name=...)``, or ``qcomm.diloco(qcomm.sync(...,
      axis_name=fast), axis_name=slow)`` with ``axis_name=(slow, fast)``; it receives each device's
      own gradient. ValueError if no qcomm transformation synchronises one of the data axes.
    mesh: a mesh with the data axis (``Mesh(np.array(jax.devices()), ("data",))`` or
      ``jax.make_mesh``).
    axis_name: the data axes of ``mesh`` (a name or a tuple of names): the batch is split over
      them, and the transformations of ``tx`` must synchronise over exactly these.
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
    elastic: for ``tx = qcomm.diloco(...)`` with one replica per process (``jax.distributed``
      joined to a coordination service outside the workers:
      ``jax_qcomm.tools.distributed.initialize(elastic=True)``, or ``launch --elastic``):
      replicas that die and come back. Each process steps its own replica on its own devices and
      its own share of the batch, and every synchronisation averages over the processes alive; a
      restarted process receives the group's state (:class:`jax_qcomm.runners.elastic.ElasticDataParallel`,
      docs/distributed.md). Also for ``tx`` holding a ``qcomm.sync`` (replicated state) over
      axes whose first is the process axis (``axis_name=("node", "data")``): every step is
      averaged over the processes alive at that step, a replica lost during it costs that
      step its share of the batch, and a restarted process receives the parameters, the state
      and the step count from a live peer
      (:class:`jax_qcomm.runners.elastic_sync.ElasticSyncDataParallel`).
    param_spec: optional, a pytree of ``PartitionSpec`` with the structure of ``params``: how each
      parameter is sharded over the mesh axes that are not data axes (the "model axes": tensor
      parallel ``P(None, "model")``, FSDP inside a node ``P("model", None)``, or a mix). Default:
      read from the params' own ``NamedSharding`` s (``jax.device_put(params, shardings)``).
      Parameters, gradients and every part of the optimizer state then keep that layout, in and
      out: ``loss_fn`` runs as ordinary jax code that XLA partitions over the model axes, and
      ``tx.update`` runs on each device's own shards, so every device encodes and sends only its
      shard's compressed bytes across the data axes. ValueError for a spec over a data axis, and
      for a shard whose dimension the model axes do not divide. See docs/usage.md, "Models
      sharded inside a node".
    overlap: for ``tx = qcomm.diloco(..., delay=1)``: run each synchronisation's collective on a
      device of each replica's process that ``mesh`` leaves out, while the next inner steps
      compute (:class:`jax_qcomm.runners.overlap.OverlappedDataParallel`; the same results as without).
      The runner also has ``flush(opt_state)``: the state with the mean in flight received, to
      checkpoint.

  Returns:
    A :class:`DataParallel`: ``opt_state = dp.init(params)``, then
    ``params, opt_state, loss, aux = dp.step(params, opt_state, batch, *extra, key=key)``.
    ``params`` come back with the layout they came in with: replicated, or sharded over model
    axes (see ``param_spec``; for diloco: the anchor, moved only on
    synchronising calls; the replicas' own parameters live in the state); ``batch`` is the global
    batch, its leading axis split over the devices (ValueError if they cannot split it evenly);
    ``extra`` arguments (e.g. BatchNorm statistics) are replicated and not differentiated; ``key``
    is folded with the device index before reaching ``loss_fn``, so use a new one every step.
    ``loss`` is the mean of the devices' losses (for diloco one per replica, shape ``(K,)``: the
    mean over each replica's devices, with no collective across replicas); ``aux`` is ``None``
    without ``has_aux``. Updates are applied only on calls where every qcomm transformation
    communicated, so a transformation chained after an accumulating sync that does not map zero
    to zero (``optax.add_decayed_weights``) acts once per optimizer step.

    ``dp.step`` may also be called inside the caller's own ``jax.jit``, to fuse it with bookkeeping
    such as a step counter into one program (one dispatch per call, rather than the step's plus one
    per eager operation): the inputs are then placed by sharding constraints inside that program,
    and ``donate`` has no effect there (donate with that jit's ``donate_argnums``).
  """
  check_bool("elastic", elastic)
  check_bool("overlap", overlap)
  if elastic or overlap:  # runners that drive diloco's phases themselves, over the ordinary one
    _check(loss_fn, tx, mesh, axis_name, has_aux, aux_reduce, batch_spec, donate)
    if elastic and overlap:
      raise ValueError("overlap=True cannot be combined with elastic=True")
    option, runner, why = (
        ("overlap", OverlappedDataParallel, "the state a synchronisation sends from stays in use "
         "until the collective ends") if overlap else
        ("elastic", ElasticDataParallel, "a synchronisation that fails is retried from the arrays "
         "passed in"))
    if donate:
      raise ValueError(f"donate=True is not supported with {option}=True ({why})")
    if param_spec is not None:
      raise ValueError(f"param_spec is not supported with {option}=True: its runner keeps the "
                       f"parameters replicated over each process's devices")
    if elastic and "sync" in _update_order(tx):  # per-step data parallelism, not diloco
      runner = ElasticSyncDataParallel
      if has_aux and aux_reduce != "mean":
        raise ValueError(f"elastic=True with qcomm.sync returns each process's aux as the mean "
                         f"over its devices: aux_reduce must be 'mean', got {aux_reduce!r}")
    local = functools.partial(_local_runner, loss_fn, axis_name, has_aux, aux_reduce, batch_spec)
    return runner(tx=tx, mesh=mesh, axis_name=axis_name, local_runner=local)
  return DataParallel(loss_fn=loss_fn, tx=tx, mesh=mesh, axis_name=axis_name, has_aux=has_aux,
                      aux_reduce=aux_reduce, batch_spec=batch_spec, donate=donate,
                      param_spec=param_spec)


def _local_runner(loss_fn, axis_name, has_aux, aux_reduce, batch_spec, tx, mesh) -> DataParallel:
  """The ordinary runner of ``tx`` on ``mesh`` with the caller's options (an elastic process's own
  devices; the inner steps of the overlapped runner)."""
  return DataParallel(loss_fn=loss_fn, tx=tx, mesh=mesh, axis_name=axis_name, has_aux=has_aux,
                      aux_reduce=aux_reduce, batch_spec=batch_spec)


def _update_order(obj: Any, seen: set | None = None, enter_sync: bool = False) -> list[str]:
  """The clippings by global norm (``"optax_clip"``, ``"qcomm_clip"``) and gradient
  synchronisations (``"sync"``) that ``obj`` (a transformation or its update function) runs, in
  order: read from the closures of optax's combinators (``optax.chain`` keeps its parts' update
  functions in one). A sync's own ``inner`` runs after it: entered only with ``enter_sync``."""
  seen = set() if seen is None else seen
  if id(obj) in seen or len(seen) > 2000:
    return []
  seen.add(id(obj))
  qualname = getattr(obj, "__qualname__", "")
  if qualname.startswith(("_Sync.", "_ShardedSync.", "ParamShardSync.")):
    inner = getattr(getattr(obj, "__self__", None), "inner", None)
    return ["sync"] + (_update_order(inner, seen, True) if enter_sync and inner else [])
  if "clip_by_global_norm" in qualname:
    return ["qcomm_clip" if "jax_qcomm" in getattr(obj, "__module__", "") else "optax_clip"]
  if qualname.startswith("apply_if_finite."):
    return ["apply_if_finite"]
  if hasattr(obj, "update") and hasattr(obj, "init"):  # a transformation: what its update runs
    return _update_order(obj.update, seen, enter_sync)
  if isinstance(obj, (tuple, list)):
    return [m for x in obj for m in _update_order(x, seen, enter_sync)]
  cells = getattr(obj, "__closure__", None) or ()
  out = []
  for cell in cells:
    try:
      out += _update_order(cell.cell_contents, seen, enter_sync)
    except ValueError:  # an empty cell
      pass
  return out


def _check(loss_fn, tx, mesh, axis_name, has_aux, aux_reduce, batch_spec, donate,
           check_tx: bool = True) -> None:
  """ValueError naming the first bad argument of :func:`data_parallel` / :class:`DataParallel`."""
  if not callable(loss_fn):
    raise ValueError(f"loss_fn must be callable, got {loss_fn!r}")
  if check_tx and not (hasattr(tx, "init") and hasattr(tx, "update")):
    raise ValueError(f"tx must be an optax.GradientTransformation, got {tx!r}")
  order = _update_order(tx) if check_tx else []
  clips = [i for i, m in enumerate(order) if m.endswith("_clip")]
  if clips and "sync" in order and clips[0] < order.index("sync"):
    raise ValueError(
        "tx clips by global norm before the qcomm synchronisation (optax.chain("
        "optax.clip_by_global_norm(...), qcomm.sync(...))): each device would clip its own "
        "gradient by its own norm, before the average. Clip the averaged gradient inside: "
        "qcomm.sync(optax.chain(qcomm.clip_by_global_norm(c), inner), ...) (the whole model's "
        "norm also where inner sees shards: shard_state=True, model-sharded parameters)")
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


def _check_shard_reductions(tx: optax.GradientTransformation) -> None:
  """ValueError for ``optax.clip_by_global_norm`` and ``optax.apply_if_finite`` in a
  model-sharded step: they would decide from each shard alone."""
  order = _update_order(tx, enter_sync=True)
  if "apply_if_finite" in order:
    raise ValueError(
        "tx holds optax.apply_if_finite, but the parameters are sharded over model axes: the "
        "update runs on each device's shards, and each would decide from its own shard whether "
        "to skip. Use qcomm.sync(..., shard_state=True), which skips a non-finite step itself "
        "with one decision for the whole model (counted in total_notfinite)")
  if "optax_clip" in order:
    raise ValueError(
        "tx holds optax.clip_by_global_norm, but the parameters are sharded over model axes: "
        "the update runs on each device's shards, and optax would clip each shard by its own "
        "norm. Use qcomm.clip_by_global_norm(max_norm), which adds the shards' sums of squares "
        "over the model axes (transformations that reduce over a parameter's elements, such "
        "as LAMB's and LARS's trust ratios, see shards too)")


def _check_param_spec(param_spec: Any, mesh: Mesh, axis_name: Any) -> None:
  """ValueError for a ``param_spec`` that is not a pytree of PartitionSpecs over the mesh's
  other axes than the data axes."""
  if param_spec is None:
    return
  leaves = jax.tree_util.tree_leaves(param_spec, is_leaf=lambda s: isinstance(s, P))
  bad = [s for s in leaves if not isinstance(s, P)]
  if bad or not leaves:
    raise ValueError(f"param_spec must be None or a pytree of PartitionSpec with the structure of "
                     f"params, got {bad[0] if bad else param_spec!r}")
  data = set(collectives.axis_names(axis_name))
  allowed = [a for a in mesh.axis_names if a not in data]
  for s in leaves:
    named = layout.spec_axes(s)
    if not named <= set(allowed):
      raise ValueError(f"param_spec entries must name only the mesh axes {allowed} (not the "
                       f"data axes {sorted(data)}), got {s}")
