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
from jax_qcomm._checks import check_key
from jax_qcomm.transport.axes import AxisName, axis_names
from jax_qcomm.runners.data_parallel import (_check, _check_shard_reductions, _reduce_aux,
                                             _shard_errors, check_batch,
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

  def __post_init__(self):
    object.__setattr__(self, "_layouts", {})  # params treedef -> the layout seen (model specs)
    _check(self.loss_fn, None, self.mesh, self.axis_name, self.has_aux, self.aux_reduce,
           self.batch_spec, self.donate, check_tx=False)

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
    nnx.update(model, params, rest)
    jax.tree_util.tree_map(lambda v, x: v.set_value(x), optimizer.opt_state, opt_state,
                           is_leaf=_is_variable)
    optimizer.step.set_value(optimizer.step.get_value() + 1)
    return (loss, aux) if self.has_aux else loss

  __call__ = step

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
                      batch_spec: P | None = None, donate: bool = False) -> NNXDataParallel:
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

  Returns:
    An :class:`NNXDataParallel`; ``loss = dp.step(model, optimizer, batch, *extra, key=key)``
    updates ``model`` and ``optimizer`` in place. The optimizer must hold a qcomm transformation,
    ``nnx.Optimizer(model, qcomm.sync(...), wrt=nnx.Param)`` or ``qcomm.diloco(...)`` (ValueError
    otherwise); create it under ``jax.set_mesh(mesh)`` (its per-device parts are split over the
    axes).
  """
  return NNXDataParallel(loss_fn=loss_fn, mesh=mesh, axis_name=axis_name, has_aux=has_aux,
                         aux_reduce=aux_reduce, batch_spec=batch_spec, donate=donate)
