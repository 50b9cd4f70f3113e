"""The parts that every qcomm transformation (``sync``, its sharded mode, ``diloco``) shares.

One definition each, so that the transformations agree:

* the rounding key: seeded from an integer (Python or numpy), kept as ``uint32[2]`` key data in
  the state, split once per communication;
* error feedback: the residual added before the codec, and kept as it was after a non-finite
  communication (one bad step never poisons later ones);
* the finite guard: one decision from the averaged values, which every replica holds
  bit-identical, so no collective is needed to agree on it;
* the counters (``int32`` scalars) and the per-device leaves (``(1, ...)`` inside the step, typed
  as varying over the axis; ``(D, ...)`` outside it);
* the default codec of the ``bits`` shorthand and the number of devices along an axis.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm import _compat
from jax_qcomm.transport import _varying
from jax_qcomm._checks import check_instance
from jax_qcomm.transport.axes import AxisName, axis_names, axis_size
from jax_qcomm.codecs import Codec, codec_for_bits
from jax_qcomm.codecs.base import nonfinite_mark
from jax_qcomm.collectives.shard_layout import PROBE, SHARDED, SYNC_AXES, shard_axes


# ---- counters, keys ---------------------------------------------------------------------------

def zero() -> jax.Array:
  """A fresh int32 counter."""
  return jnp.zeros((), jnp.int32)


def check_seed(seed: Any) -> int:
  """``seed`` as a Python int (Python or numpy integers; not bools)."""
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise ValueError(f"seed must be an integer, got {seed!r}")
  return int(seed)


def seed_key(seed: int) -> jax.Array:
  """The state's rounding key data for ``seed`` (``uint32[2]``)."""
  return jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32)


def split_key(key_data: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(the state's next key data, a key for this communication)."""
  key, sub = jax.random.split(jax.random.wrap_key_data(key_data))
  return jax.random.key_data(key).astype(jnp.uint32), sub


# ---- error feedback and the finite guard --------------------------------------------------------

@contextlib.contextmanager
def inside(names: Sequence[Any]):
  """While a sync over ``names`` traces its ``inner``: whole-model sums there
  (:func:`qcomm.clip_by_global_norm`) add the shards of model-sharded leaves over their axes."""
  token = SYNC_AXES.set(tuple(names))
  try:
    yield
  finally:
    SYNC_AXES.reset(token)


def whole_model(mark: jax.Array, names: Sequence[Any]) -> jax.Array:
  """A finite mark (or any scalar sum) of a synchronisation over ``names`` made the whole
  model's where each device marks its own shards of model-sharded parameters: summed over those
  axes (:func:`~jax_qcomm.collectives.shard_layout.shard_axes`), so every device takes the same
  decision. Unchanged elsewhere."""
  other = shard_axes(mark, names)
  return lax.psum(mark, other) if other else mark


def all_finite(tree: Any) -> jax.Array:
  """True if no leaf of ``tree`` holds a NaN or an infinity (a bool scalar)."""
  return jnp.isfinite(nonfinite_mark(tree))


def count_notfinite(total: jax.Array, finite: jax.Array) -> jax.Array:
  return total + jnp.logical_not(finite).astype(jnp.int32)


def add_residual(values: Any, residual: Any, decay: float = 1.0) -> Any:
  """``values`` plus this device's error-feedback residual (``(1, ...)`` leaves), times
  ``decay``."""
  if decay == 1:
    return jax.tree_util.tree_map(lambda x, r: x + r[0], values, residual)
  return jax.tree_util.tree_map(lambda x, r: x + jnp.float32(decay) * r[0], values, residual)


def next_residual(finite: jax.Array, lost: Any, residual: Any) -> Any:
  """The residual after a communication: what the codec lost, or the old one if it was not
  finite."""
  return jax.tree_util.tree_map(lambda new, old: jnp.where(finite, new, old[0])[None],
                                lost, residual)


def keep_if_finite(finite: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where ``finite``, else ``old`` (leaf by leaf, in ``old``'s dtypes)."""
  return jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b).astype(jnp.result_type(b)),
                                new, old)


# ---- per-device leaves ------------------------------------------------------------------------

def per_device(tree: Any, names: Sequence, d: int, bound: bool) -> Any:
  """Every leaf with a leading device axis: ``(1, ...)`` typed as varying over ``names`` when
  ``bound`` (inside the step), else broadcast to ``(d, ...)`` (the global array of all devices'
  parts, split by :func:`qcomm.state_partition_spec`)."""
  tracked = bound and _varying.tracked(names)
  axes = frozenset(names)

  def one(a):
    a = jnp.asarray(a)
    if not bound:
      return jnp.broadcast_to(a[None], (d,) + a.shape)
    return _compat.make_varying(a[None], axes) if tracked else a[None]

  return jax.tree_util.tree_map(one, tree)


def num_devices(axis_name: AxisName = "data") -> tuple[int, bool]:
  """(D, bound): the number of devices along ``axis_name`` and whether the axis is bound here.

  Inside ``shard_map`` / ``pmap`` over the axis: its size, True. Elsewhere (False): the size of the
  axis in the current mesh (``jax.set_mesh(mesh)``; ``jax.sharding.get_abstract_mesh()``) if it
  has that axis, else ``jax.device_count()`` (all devices of all processes).
  """
  try:
    return axis_size(axis_name), True
  except ValueError:
    pass
  names = axis_names(axis_name)
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and all(n in mesh.axis_names for n in names):
    return math.prod(mesh.shape[n] for n in names), False
  return jax.device_count(), False


# ---- the default codec ------------------------------------------------------------------------

def resolve_error_feedback(error_feedback: Any, codec: Any) -> bool:
  """``error_feedback`` as a bool: None means the codec's own :attr:`Codec.wants_error_feedback`
  (``codec`` None: the ``bits`` shorthand's codecs, which do not want it)."""
  if error_feedback is None:
    return bool(getattr(codec, "wants_error_feedback", False))
  if isinstance(error_feedback, (bool, np.bool_)):
    return bool(error_feedback)
  raise ValueError(f"error_feedback must be True, False or None (the codec's default), "
                   f"got {error_feedback!r}")


def resolve_codec(codec: Any, bits: Any, bucket_size: Any, error_feedback: bool) -> Codec:
  """The codec from ``codec=`` or the ``bits`` / ``bucket_size`` shorthand (default: 4 bits,
  ``qcomm.Auto(4)``)."""
  if codec is not None:
    if bits is not None or bucket_size is not None:
      raise ValueError(f"pass either codec= or the bits= / bucket_size= shorthand, not both; "
                       f"got codec={codec!r}, bits={bits!r}, bucket_size={bucket_size!r}")
    return check_instance("codec", codec, Codec, "a jax_qcomm codec (qcomm.QSGD(4), "
                          "qcomm.Summable(4), qcomm.Cast(jnp.bfloat16), qcomm.NoCompression(), "
                          "or any qcomm.Codec)")
  # Error feedback compensates a deterministic compressor; with stochastic rounding at 1 bit the
  # residual (up to a whole bucket range) feeds the next range and training diverged.
  return codec_for_bits(4 if bits is None else bits, bucket_size,
                        rounding="nearest" if error_feedback else "stochastic")


# ---- what a misplaced state is told --------------------------------------------------------------

def state_fix_hint(axis_name: Any) -> str:
  """How to give a per-device part of a qcomm state its place (the step's specs)."""
  return (f"Give jax.shard_map the specs qcomm.state_partition_spec(opt_state, {axis_name!r}) "
          f"for the optimizer state, in in_specs and out_specs: they split the per-device parts "
          f"over the axis and replicate the rest (P() for the whole state is what goes wrong). "
          f"Under jax.pmap, create the state inside pmap: jax.pmap(tx.init, "
          f"axis_name={axis_name!r}). qcomm.data_parallel (and qcomm.nnx_data_parallel for an "
          f"nnx.Optimizer) does all of this for you.")


def state_shape_hint(got: tuple, want: tuple, axis_name: Any) -> str:
  """Why a per-device part has the wrong leading size: a state passed with P(), or one made for
  another number of devices (tx.init outside the step's mesh counts jax.device_count())."""
  d = axis_size(axis_name)
  if len(got) == len(want) and got[1:] == want[1:] and got[0] not in (1, d):
    return (f"With state_partition_spec's specs this is a state made for {got[0] * d} devices "
            f"along {axis_name!r}, but the step runs on {d}: tx.init outside the step's mesh "
            f"counts all jax.device_count() = {jax.device_count()} devices. Create the state "
            f"under the step's mesh: `with jax.set_mesh(mesh): opt_state = tx.init(params)` (or "
            f"use qcomm.data_parallel(...).init(params); with nnx_data_parallel, build the "
            f"nnx.Optimizer under `with jax.set_mesh(mesh):`).")
  return state_fix_hint(axis_name)


@contextlib.contextmanager
def sharded(value: Any):
  """Sets :data:`SHARDED` (whole-model sums over the shards) while ``inner`` is traced."""
  token = SHARDED.set(value)
  try:
    yield
  finally:
    SHARDED.reset(token)


# Primitives that combine elements of an array: on a shard they see part of a parameter.
_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin", "dot_general", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "sort", "reduce", "conv_general_dilated"})


def refuse_shard_reductions(closed: Any) -> None:
  """ValueError if ``inner``'s update (traced on the shards) reduces over the elements of an
  array: a norm, a trust ratio or a factored moment computed on a shard differs on every device
  and is silently wrong (``optax.clip_by_global_norm``, LAMB, LARS, Adafactor). Whole-model sums
  through :func:`qcomm.clip_by_global_norm` are exempt (traced as a constant here)."""
  def visit(jaxpr: Any) -> None:
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in _REDUCTIONS and any(
          len(getattr(v.aval, "shape", ())) > 0 for v in eqn.invars):
        raise ValueError(
            f"inner of a sync with shard_state=True or shard_params=True reduces over the "
            f"elements of a parameter (a {eqn.primitive.name}): it sees this device's shard of every parameter, so a "
            f"norm, trust ratio or factored moment would be computed per shard, differently on "
            f"every device. For global-norm clipping use qcomm.clip_by_global_norm(max_norm) "
            f"(the norm over the whole model), not optax.clip_by_global_norm; run LAMB, LARS and "
            f"Adafactor unsharded.")
      for value in eqn.params.values():
        for sub in (value if isinstance(value, (tuple, list)) else (value,)):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            visit(inner)

  visit(closed.jaxpr)


def inner_on_shards(inner: Any, names: Sequence[Any], extra_args: dict, *probe: Any):
  """``run(grads, state, params)``: ``inner.update`` on this device's shards (the sharded
  modes), after tracing it once on ``probe`` (shards like those it will get) to refuse the
  reductions a shard makes wrong (:func:`refuse_shard_reductions`). Call ``run`` under
  ``sharded((names, weights))`` so that whole-model sums add the shards."""
  def run(g, s, p):
    with inside(names):
      return inner.update(g, s, p, **extra_args)

  with sharded(PROBE):
    refuse_shard_reductions(jax.make_jaxpr(run)(*probe))
  return run
