"""``qcomm.nnx_data_parallel``: the data-parallel train step for a Flax NNX model and optimizer.

From single-device NNX::

    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    grads = nnx.grad(loss_fn)(model, batch); optimizer.update(model, grads)

to compressed data parallelism over the devices of a mesh::

    optimizer = nnx.Optimizer(model, qcomm.sync(optax.adamw(1e-3), accum_steps=2), wrt=nnx.Param)
    dp = qcomm.nnx_data_parallel(loss_fn, mesh)
    loss = dp.step(model, optimizer, batch)         # updates model and optimizer in place

It runs every transformation :func:`qcomm.data_parallel` runs (sync, sharded, diloco, diloco
around a sync), through the same step (``data_parallel.local_step``): the parameters (the
optimizer's ``wrt``) and the plain optax state (``nnx.as_pure(optimizer.opt_state)``) are taken
from model and optimizer, the gradient is taken with respect to parameters that vary per device
(each device's own gradient; for diloco, at the replica's own parameters, while the model holds
the anchor), and parameters, state and ``optimizer.step`` are written back. What the forward pass
changed per device (BatchNorm statistics) is averaged; the loss is the devices' mean. This module
imports flax; ``import jax_qcomm`` does not load it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
from flax import nnx

from jax_qcomm import _compat
from jax_qcomm._checks import check_bool, check_key
from jax_qcomm.transport.axes import AxisName, axis_names
from jax_qcomm.runners.data_parallel import (_check, _check_shard_reductions, _reduce_aux,
                                             _shard_errors, check_batch, data_parallel,
                                             keep_layout, local_step, out_specs_of,
                                             per_shard_update)
from jax_qcomm.transforms import layout, param_shards
from jax_qcomm.transforms.specs import _SpecKey, checked_spec, device_spec, place, replica_axes


@dataclasses.dataclass(frozen=True, eq=False)
class NNXDataParallel:
  """A data-parallel step for an ``nnx.Module`` and its ``nnx.Optimizer``, made by
  :func:`nnx_data_parallel`. ``step(model, optimizer, batch, *extra, key=None)`` updates both in
  place and returns the mean loss (and ``aux`` with ``has_aux``)."""

  loss_fn: Callable[..., Any]
  mesh: Mesh
  axis_name: AxisName = "data"
  has_aux: bool = False
  aux_reduce: str = "mean"
  batch_spec: P | None = None
  donate: bool = False
  elastic: bool = False
  overlap: bool = False

  def __post_init__(self):
    object.__setattr__(self, "_layouts", {})  # params treedef -> the layout seen (model specs)
    # The elastic or overlapped runner once made: "key" (graphdef, wrt, tx), "runner", and
    # "state", the optimizer state it returned last.
    object.__setattr__(self, "_held", {})
    _check(self.loss_fn, None, self.mesh, self.axis_name, self.has_aux, self.aux_reduce,
           self.batch_spec, self.donate, check_tx=False)
    check_bool("elastic", self.elastic)
    check_bool("overlap", self.overlap)
    if self.elastic and self.overlap:
      raise ValueError("overlap=True cannot be combined with elastic=True")
    if self.donate and (self.elastic or self.overlap):
      raise ValueError(f"donate=True is not supported with "
                       f"{'elastic' if self.elastic else 'overlap'}=True (as qcomm.data_parallel)")

  @property
  def runner(self) -> Any:
    """The :func:`qcomm.data_parallel` runner (``elastic=`` / ``overlap=``) the steps go through,
    once the first step has made it (None before, and without those options): its
    ``replicas_per_sync``, ``stall_s``, ``short_syncs`` (elastic) and ``flush`` (overlap)."""
    return self._held.get("runner")

  @property
  def _spec(self) -> P:
    return device_spec(axis_names(self.axis_name))

  def step(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any, *extra: Any,
           key: jax.Array | None = None) -> Any:
    """One train step on the global ``batch`` (its leading axis split over the devices); ``extra``
    arguments reach ``loss_fn`` replicated; ``key`` gives ``loss_fn`` a per-device
    ``rngs=nnx.Rngs(dropout=...)``. Updates ``model`` and ``optimizer`` in place. The step is
    compiled already; it may also be called inside ``nnx.jit``."""
    if not isinstance(model, nnx.Module):
      raise ValueError(f"model must be an nnx.Module, got {type(model).__name__}")
    if not isinstance(optimizer, nnx.Optimizer):
      raise ValueError(f"optimizer must be an nnx.Optimizer(model, qcomm.sync(...), wrt=...), got "
                       f"{type(optimizer).__name__}")
    check_key("key", key)
    graphdef, params, rest = nnx.split(model, optimizer.wrt, ...)
    # Plain arrays, as nnx.Optimizer.update hands them to optax: the qcomm states keep their
    # structure (and settings) there, unlike in the mapping form of nnx.state(optimizer).
    params, opt_state = nnx.as_pure(params), nnx.as_pure(optimizer.opt_state)
    if self.elastic or self.overlap:
      return self._runner_step(graphdef, params, rest, opt_state, model, optimizer, batch, extra,
                               key)
    spec = checked_spec(opt_state, self.axis_name)
    if param_shards.sharded_params_config(opt_state) is not None:
      raise ValueError(
          "nnx_data_parallel does not run qcomm.sync(..., shard_params=True): an nnx.Optimizer "
          "holds the model's full parameters. Run the sharded mode through qcomm.data_parallel "
          "on the shards of nnx.state(model) (dp.shard(params); docs/usage.md, \"Sharded "
          "parameters (ZeRO-3)\")")
    check_batch(batch, self.mesh, self.axis_name, self.batch_spec)
    names = axis_names(self.axis_name)
    # Parameters sharded over model axes (nnx.with_partitioning, placed on the mesh): the step
    # keeps their layout and updates each device's shards (qcomm.data_parallel's model-sharded
    # step).
    pspecs = layout.cached_param_specs(self._layouts, params, self.mesh, names)
    mspec, state_spec = None, spec
    if pspecs is not None:
      _check_shard_reductions(optimizer.tx)
      mspec, state_spec = layout.state_specs(opt_state, params, pspecs, spec, self.mesh, names)
    fn = self._step_fn(graphdef, optimizer.wrt, optimizer.tx, _SpecKey(spec),
                       replica_axes(opt_state), len(extra), key is not None,
                       None if pspecs is None else _SpecKey(mspec),
                       None if pspecs is None else _SpecKey(pspecs))
    put = functools.partial(place, mesh=self.mesh)
    batch_spec = self.batch_spec if self.batch_spec is not None else self._spec
    args = (put(params, P() if pspecs is None else pspecs), put(opt_state, state_spec),
            put(rest, P()), put(batch, batch_spec), put(extra, P()))
    if key is not None:
      args += (put(key, P()),)
    with _shard_errors("step"):
      params, opt_state, rest, loss, aux = fn(*args)
    return self._write_back(model, optimizer, params, rest, opt_state, loss, aux)

  __call__ = step

  def _write_back(self, model, optimizer, params, rest, opt_state, loss, aux) -> Any:
    nnx.update(model, params, rest)
    jax.tree_util.tree_map(lambda v, x: v.set_value(x), optimizer.opt_state, opt_state,
                           is_leaf=_is_variable)
    optimizer.step.set_value(optimizer.step.get_value() + 1)
    return (loss, aux) if self.has_aux else loss

  def _runner_step(self, graphdef, params, rest, opt_state, model, optimizer, batch, extra, key):
    """The step through :func:`qcomm.data_parallel`'s elastic or overlapped runner, on the pure
    parameters and state; the model's other state goes to ``loss_fn`` unchanged."""
    runner, opt_state = self._runner_of(graphdef, params, opt_state, optimizer)
    params, opt_state, loss, aux = runner.step(params, opt_state, batch, rest, *extra, key=key)
    self._held["state"] = opt_state
    out = self._write_back(model, optimizer, params, rest, opt_state, loss, aux)
    if self.elastic:  # the group's count, which a restarted process takes up
      self._set_step(optimizer, runner.calls(opt_state))
    return out

  @staticmethod
  def _set_step(optimizer: nnx.Optimizer, calls: int) -> None:
    optimizer.step.set_value(jnp.asarray(calls, jnp.result_type(optimizer.step.get_value())))

  def _runner_of(self, graphdef, params, opt_state, optimizer) -> tuple[Any, Any]:
    """The runner of this model and optimizer, made at the first call, and the state to step
    from: for ``elastic``, at the first call this process's replica of the state, which the runner
    makes (the optimizer's own, made over the whole mesh, is replaced); for ``overlap``, the
    optimizer's state placed on the mesh."""
    runner_key = (graphdef, optimizer.wrt, optimizer.tx)
    if self._held:
      if self._held["key"] != runner_key:
        raise ValueError("an nnx_data_parallel with elastic= or overlap= steps one model and "
                         "optimizer: make another for another")
      # The state the runner returned last, if the optimizer still holds its arrays: the runner
      # knows that object (the overlapped runner's collective in flight belongs to it).
      last = self._held.get("state")
      if last is not None and _same_arrays(opt_state, last):
        opt_state = last
      return self._held["runner"], opt_state
    runner = data_parallel(
        _pure_loss(self.loss_fn, graphdef, optimizer.wrt), optimizer.tx, self.mesh,
        axis_name=self.axis_name, has_aux=self.has_aux, aux_reduce=self.aux_reduce,
        batch_spec=self.batch_spec, elastic=self.elastic, overlap=self.overlap)
    fresh = runner.init(params)
    self._held.update(key=runner_key, runner=runner)
    if self.elastic:
      return runner, fresh
    return runner, place(opt_state, runner.state_spec(opt_state), self.mesh)

  def join(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any = None, *extra: Any,
           key: jax.Array | None = None) -> None:
    """``elastic=True``: until this process holds the group's state (a restarted process takes
    the parameters, the optimizer's state and its step count from a live peer), written into
    ``model`` and ``optimizer``; a no-op once it does. ``step`` joins first in any case. With a
    ``batch`` (and the step's ``extra`` and ``key``), a restarted process compiles its step
    before it asks to be admitted, so that the others do not wait for that."""
    if not self.elastic:
      raise ValueError("join is for nnx_data_parallel(..., elastic=True)")
    graphdef, params, rest = nnx.split(model, optimizer.wrt, ...)
    params, opt_state = nnx.as_pure(params), nnx.as_pure(optimizer.opt_state)
    runner, opt_state = self._runner_of(graphdef, params, opt_state, optimizer)
    example = () if batch is None else (batch, rest, *extra)
    params, opt_state = runner.join(params, opt_state, *example, key=key)
    self._held["state"] = opt_state
    nnx.update(model, params)
    jax.tree_util.tree_map(lambda v, x: v.set_value(x), optimizer.opt_state, opt_state,
                           is_leaf=_is_variable)
    self._set_step(optimizer, runner.calls(opt_state))

  def flush(self, optimizer: nnx.Optimizer) -> None:
    """``overlap=True``: waits for the mean in flight and writes it into the optimizer's state
    (its ``pending`` fields): the state to checkpoint or evaluate from; training may go on."""
    if not self.overlap:
      raise ValueError("flush is for nnx_data_parallel(..., overlap=True)")
    if self.runner is None:
      return
    state = nnx.as_pure(optimizer.opt_state)
    if _same_arrays(state, self._held.get("state")):
      state = self._held["state"]
    state = self.runner.flush(state)
    self._held["state"] = state
    jax.tree_util.tree_map(lambda v, x: v.set_value(x), optimizer.opt_state, state,
                           is_leaf=_is_variable)

  def calls(self, optimizer: nnx.Optimizer) -> int:
    """``elastic=True``: the calls of ``step`` the group's state has seen (0 before the first)."""
    if self.runner is None:
      return 0
    return self.runner.calls(nnx.as_pure(optimizer.opt_state))

  @functools.lru_cache(maxsize=None)
  def _step_fn(self, graphdef, wrt, tx, spec_key, replicas: tuple, n_extra: int,
               with_key: bool, mspec_key=None, pspec_key=None):
    names = axis_names(self.axis_name)
    loss_fn, has_aux, reduce = self.loss_fn, self.has_aux, self.aux_reduce
    sharded = pspec_key is not None
    update = (per_shard_update(tx, self.mesh, names, pspec_key.spec, mspec_key.spec)
              if sharded else None)

    def step(params, opt_state, rest, batch, extra, key=None):
      def loss_of(p, batch, *extra, key=None):
        # Fresh variables of this trace (the forward pass writes BatchNorm statistics).
        model = nnx.merge(graphdef, p, jax.tree_util.tree_map(lambda a: a, rest))
        kwargs = {} if key is None else {"rngs": nnx.Rngs(dropout=key)}
        out = loss_fn(model, batch, *extra, **kwargs)
        loss, aux = out if has_aux else (out, None)
        return loss, (aux, nnx.state(model, nnx.Not(wrt)))

      params, opt_state, loss, (aux, changed) = local_step(
          loss_of, tx, names, True, params, opt_state, batch, extra, key, update=update)
      # What the forward pass changed per device (BatchNorm statistics): the devices' mean.
      changed = jax.tree_util.tree_map(lambda a: _mean_if_varying(a, names), changed)
      return (params, opt_state, changed, _reduce_aux(loss, "mean", names, replicas),
              _reduce_aux(aux, reduce, names, replicas))

    batch_spec = self.batch_spec if self.batch_spec is not None else self._spec
    in_specs = (P(), spec_key.spec, P(), batch_spec, P()) + ((P(),) if with_key else ())
    fn = jax.shard_map(step, mesh=self.mesh, in_specs=in_specs,
                       out_specs=(P(), spec_key.spec, P(), out_specs_of("mean", names, replicas),
                                  out_specs_of(reduce, names, replicas)),
                       **({"axis_names": set(names)} if sharded else {}))
    donate = (0, 1) if self.donate else ()  # the model's parameters and the optimizer's state
    if not sharded:
      return jax.jit(fn, donate_argnums=donate)
    keep = keep_layout(self.mesh, pspec_key.spec, layout.merge(spec_key.spec, mspec_key.spec))

    def call(*args):
      params, opt_state, rest, loss, aux = fn(*args)
      return (*keep(params, opt_state), rest, loss, aux)

    return jax.jit(call, donate_argnums=donate)


def _pure_loss(loss_fn: Callable[..., Any], graphdef: Any, wrt: Any):
  """``loss_fn`` on the pure parameters: ``(params, batch, rest, *extra, key=None)``, the model
  merged from them and its other state ``rest``; ValueError if the forward pass changes ``rest``
  (the elastic and overlapped runners return parameters and optimizer state only)."""
  def pure(params, batch, rest, *extra, key=None):
    rest = jax.tree_util.tree_map(lambda a: a, rest)  # fresh variables of this trace
    before = jax.tree_util.tree_leaves(rest)
    model = nnx.merge(graphdef, params, rest)
    kwargs = {} if key is None else {"rngs": nnx.Rngs(dropout=key)}
    out = loss_fn(model, batch, *extra, **kwargs)
    if not _same_arrays(nnx.state(model, nnx.Not(wrt)), before):
      raise ValueError(
          "nnx_data_parallel(elastic=True / overlap=True): the forward pass changed model state "
          "other than the optimizer's parameters (BatchNorm statistics, a counter, an RNG held "
          "by the model), which these runners do not carry; use a model whose forward pass "
          "changes none (pass rngs to loss_fn: step(..., key=key)), or the ordinary runner")
    return out

  return pure


def _same_arrays(a: Any, b: Any) -> bool:
  """Whether two pytrees hold the very same array objects, leaf for leaf."""
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  return len(la) == len(lb) and all(x is y for x, y in zip(la, lb))


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _mean_if_varying(a: jax.Array, names: tuple) -> jax.Array:
  """The devices' mean of a model variable the forward pass made per device; ValueError for one
  that cannot be averaged."""
  if not set(names) & set(_compat.vma_of(a)):
    return a
  if not jnp.issubdtype(a.dtype, jnp.floating):
    raise ValueError(f"the forward pass made a non-float model variable (dtype {a.dtype}) differ "
                     f"between devices; it cannot be averaged. Keep such state out of the model "
                     f"(pass rngs to loss_fn: step(..., key=key)).")
  return lax.pmean(a, names)


def nnx_data_parallel(loss_fn: Callable[..., Any], mesh: Mesh, *, axis_name: AxisName = "data",
                      has_aux: bool = False, aux_reduce: str = "mean",
                      batch_spec: P | None = None, donate: bool = False,
                      elastic: bool = False, overlap: bool = False) -> NNXDataParallel:
  """A jitted data-parallel train step for a Flax NNX model and its ``nnx.Optimizer``.

  Args:
    loss_fn: ``loss_fn(model, batch, *extra) -> loss`` (a scalar: the mean over this device's share
      of the batch), or ``-> (loss, aux)`` with ``has_aux``; called with ``rngs=`` (an
      ``nnx.Rngs`` with a per-device ``dropout`` stream) when the step gets a ``key``.
    mesh: a mesh with the data axis.
    axis_name: the data axes of ``mesh`` (as in :func:`qcomm.data_parallel`).
    has_aux: loss_fn returns ``(loss, aux)``.
    aux_reduce: ``"mean"`` (default), ``"sum"``, ``"stack"`` or ``"concat"`` (per-example outputs
      such as logits, for the global batch), as in :func:`qcomm.data_parallel`.
    batch_spec: how the batch is split (default ``PartitionSpec(axis_name)``).
    donate: donate the model's parameters and the optimizer's state to the step, as
      :func:`qcomm.data_parallel`'s ``donate`` (saves memory: XLA writes the new values into
      their buffers; the arrays the model and optimizer held before the step are then invalid,
      and the step replaces them in place as always). No effect inside your own ``nnx.jit``.
    elastic: for ``qcomm.diloco`` with one replica per process, as :func:`qcomm.data_parallel`'s
      ``elastic`` (the same runner, the same meaning): replicas in processes that may die and
      come back, synchronisations over those alive. At the first step the runner makes this
      process's replica of the state and the optimizer holds it from then on; a restarted
      process receives the group's state there (``dp.runner.join`` happens inside the step).
    overlap: for ``qcomm.diloco(..., delay=1)``, as :func:`qcomm.data_parallel`'s ``overlap``:
      each synchronisation's collective on a device the mesh leaves out, while the next round
      computes; ``dp.flush(optimizer)`` receives the mean in flight into the optimizer's state.
      With ``elastic`` or ``overlap``, the forward pass must change no model state besides the
      parameters (ValueError otherwise), the step is called eagerly (not inside ``nnx.jit``),
      and ``donate`` is refused.

  Returns:
    An :class:`NNXDataParallel`; ``loss = dp.step(model, optimizer, batch, *extra, key=key)``
    updates ``model`` and ``optimizer`` in place. The optimizer must hold a qcomm transformation,
    ``nnx.Optimizer(model, qcomm.sync(...), wrt=nnx.Param)`` or ``qcomm.diloco(...)`` (ValueError
    otherwise); create it under ``jax.set_mesh(mesh)`` (its per-device parts are split over the
    axes).
  """
  return NNXDataParallel(loss_fn=loss_fn, mesh=mesh, axis_name=axis_name, has_aux=has_aux,
                         aux_reduce=aux_reduce, batch_spec=batch_spec, donate=donate,
                         elastic=elastic, overlap=overlap)
