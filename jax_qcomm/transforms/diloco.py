"""``qcomm.diloco``: infrequent, compressed outer synchronisation (the DiLoCo family).

    tx = qcomm.diloco(optax.adamw(3e-4), axis_name="node", every=50, codec=qcomm.QSGD(4))
    dp = qcomm.data_parallel(loss_fn, tx, mesh, axis_name="node")
    opt_state = dp.init(params)
    params, opt_state, loss, aux = dp.step(params, opt_state, batch)   # params: the anchor

Each replica along ``axis_name`` keeps its own parameters (in the state) and runs ``inner`` on its
own gradients, taken at those parameters, with no collective, for ``every`` inner optimizer
steps. Then, on one call, every replica computes its pseudo-gradient ``delta = anchor - local
parameters`` (float32), the codec's allreduce averages it (with this replica's error-feedback
residual added), the outer optimizer takes the mean as a *gradient*, and the update returned moves
the anchor; the replicas' parameters are reset to the new anchor. Every replica applies the same
decoded mean to the same anchor, so the anchors stay bit-identical. The collective sits in the
taken branch of a ``lax.cond``: the other calls run none and return zero updates.

The ``params`` given to ``update`` (and held by the caller) are the **anchor**: replicated, shaped
like the model, the thing to evaluate and checkpoint. The replicas' parameters, ``inner``'s state
and the residual are per replica in the state (a leading replica axis split over ``axis_name``,
:func:`qcomm.state_partition_spec`); the outer optimizer's state is replicated. ``inner`` may
itself be :func:`qcomm.sync` over a faster axis (``axis_name="gpu"`` inside a node), replicated or
sharded: its ``accum_steps`` is honoured (``every`` counts its optimizer steps).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import numpy as np
import optax

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm import _compat
from jax_qcomm.transforms import _parts
from jax_qcomm.transport import _varying
from jax_qcomm.collectives import ops as collectives, packing
from jax_qcomm._checks import (check_array_leaves, check_axis_name, check_instance,
                               check_int, check_int_or_none, check_real)
from jax_qcomm.transport.axes import AxisName, Hierarchical, axis_names, axis_size
from jax_qcomm.codecs import Codec, TopK
from jax_qcomm.collectives.shard_layout import REPLICA_AXES
from jax_qcomm.transforms.specs import find_states, local_params, register_state

#: The default outer optimizer of :func:`diloco`: Nesterov SGD at a momentum-adjusted rate
#: lr / (1 - momentum) of 3 (MaxText's choice), the smallest worst gap to each cell's best outer
#: optimizer over the K x H study of two tasks (docs/accuracy.md).
DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM = 0.3, 0.9
#: The default outer optimizer's (lr, Nesterov momentum) for a sparse codec with error feedback.
SPARSE_OUTER_LR, SPARSE_OUTER_MOMENTUM = 1.0, 0.5
#: ``outer="sparseloco"``: the outer learning rate alpha (plain SGD on the mean of what was sent)
#: and the decay beta of each replica's error-feedback accumulator, ``e <- beta e + delta``.
SPARSELOCO_LR, SPARSELOCO_DECAY = 1.0, 0.95
#: ``outer="sparseloco"``'s codec when given none: 64 of every 4096 values (1/64), 2-bit values,
#: 12-bit positions.
SPARSELOCO_CODEC = TopK(1 / 64, bits=2, chunk=4096)
#: The outer rules :func:`diloco` names by a string.
OUTERS = ("sparseloco",)
#: The extra argument of a diloco ``update`` that runs one part of it (the elastic runner runs the
#: inner steps and the synchronisation as separate programs): ``"inner"`` takes the inner step and
#: never synchronises; ``"outer"`` synchronises now, with no inner step (``grads`` is ignored and
#: may be None); absent, the call does both, as a plain optax update.
PHASE_ARG = "qcomm_diloco_phase"
#: ``"arrive"`` (``delay=1`` only): the synchronisation without its collective: the mean in
#: ``pending`` is applied and this round's pseudo-gradient is left for the caller to send
#: (:class:`qcomm.data_parallel`'s ``overlap=True`` runner sends it on devices of its own).
PHASES = ("inner", "outer", "arrive")
#: The extra argument of an ``"outer"`` call that leaves this replica's pseudo-gradient out of the
#: mean: a boolean scalar per replica (varying over the replica axes), False where the replica
#: counts for nothing this time. The mean is over the replicas where it is True (at least one):
#: the others send zeros, and the sum is divided by the count of the present. The elastic runner
#: passes it for a process that has just received the group's state and has taken no inner step
#: (``runners.elastic``). Needs ``fragments=1`` and ``delay=0``.
PRESENT_ARG = "qcomm_diloco_present"
#: Values of ``delay``.
DELAYS = (0, 1)


def default_outer(codec: Codec, error_feedback: bool) -> optax.GradientTransformation:
  """The outer optimizer :func:`diloco` uses when given none: Nesterov SGD (lr 0.3, momentum 0.9),
  or (lr 1.0, momentum 0.5) for a sparse codec (:attr:`Codec.sparse`) with error feedback, whose
  residual already carries part of what the momentum would (docs/accuracy.md)."""
  if codec.sparse and error_feedback:
    return optax.sgd(SPARSE_OUTER_LR, momentum=SPARSE_OUTER_MOMENTUM, nesterov=True)
  return optax.sgd(DEFAULT_OUTER_LR, momentum=DEFAULT_OUTER_MOMENTUM, nesterov=True)


@dataclasses.dataclass(frozen=True)
class DiLoCoConfig:
  """The settings of a :func:`diloco` transformation, carried by its state
  (``DiLoCoState.config``, a static pytree node with no leaves). :func:`qcomm.describe` reports
  bytes per call = bytes per synchronisation / ``accum_steps``."""

  axis_name: Any
  codec: Codec
  policy: packing.LeafPolicy
  every: int
  error_feedback: bool
  comm_bucket_size: int | None
  seed: int = 0
  inner_accum_steps: int = 1
  inner_axis_name: Any = None
  fragments: int = 1
  delay: int = 0
  residual_decay: float = 1.0

  @property
  def accum_steps(self) -> int:
    """Calls per round, in which every parameter is synchronised once: ``every`` inner optimizer
    steps of ``inner_accum_steps`` calls."""
    return self.every * self.inner_accum_steps

  @property
  def uses_mark(self) -> bool:
    """Whether the outer guard is the codecs' mark (Codec.allreduce_leaves_marked), so that
    describe counts what the mark sends (Codec.mark_traffic): without a delay. A delayed mean is
    checked when it arrives, by a pass over it."""
    return self.delay == 0

  @property
  def sync_calls(self) -> int:
    """Calls between two synchronisations: a round, or with fragments a round / ``fragments``
    (each synchronisation then carries one fragment)."""
    return self.accum_steps // self.fragments

  def __hash__(self):  # static pytree data must hash; a policy's overrides may hold unhashables
    return hash((type(self).__name__, repr(self.axis_name), self.every))


jax.tree_util.register_static(DiLoCoConfig)


@register_state
class DiLoCoState(NamedTuple):
  """State of :func:`diloco` (a pytree of arrays; checkpointable with orbax as it is).

  Per replica (a leading replica axis: ``(K, ...)`` as a global array, ``(1, ...)`` inside the
  step; split over ``axis_name`` by :func:`qcomm.state_partition_spec`):
    params: this replica's own parameters (the parameters' dtypes), reset to the anchor at every
      synchronisation; the gradient is taken at them (:func:`qcomm.local_params`).
    inner_opt_state: ``inner``'s state, every leaf with the replica axis in front (of the inner
      sync's own device axis, if ``inner`` is a ``qcomm.sync``). Never reset, never sent.
    residual: float32 error-feedback residual of the pseudo-gradient (``()`` without error
      feedback).
  Replicated (``PartitionSpec()``):
    outer_opt_state: the outer optimizer's state (float32, the parameters' structure).
    mini_step: calls since the last synchronisation (int32; 0 right after one).
    outer_step: synchronisations so far (int32); with fragments, the next one carries fragment
      ``outer_step % fragments``.
    key: rounding key data (uint32[2]), advanced at every synchronisation.
    total_notfinite: synchronisations whose mean pseudo-gradient held a NaN or an infinity; they
      leave the anchor, the outer state and the residual as they were.
  With ``delay=1`` (``()`` otherwise):
    round_start: per replica, its parameters at the start of the round (where the last
      synchronisation put them).
    pending: replicated, float32: the mean pseudo-gradient of the last synchronisation, applied
      at the next one.
    pending_lost: per replica, float32: what the codec lost of this replica's share of
      ``pending`` (its next error-feedback residual; ``()`` without error feedback).
    pending_valid: replicated int32, 1 if ``pending`` holds a mean not applied yet.
  config: the settings (:class:`DiLoCoConfig`; no arrays).
  """

  params: Any
  inner_opt_state: Any
  outer_opt_state: Any
  residual: Any
  mini_step: jax.Array
  outer_step: jax.Array
  key: jax.Array
  total_notfinite: jax.Array
  round_start: Any = ()
  pending: Any = ()
  pending_lost: Any = ()
  pending_valid: Any = ()
  config: DiLoCoConfig | None = None

  PER_DEVICE_FIELDS = ("params", "residual", "round_start", "pending_lost")
  NESTED_FIELDS = ()
  PER_DEVICE_NESTED_FIELDS = ("inner_opt_state",)
  REPLICATED_FIELDS = ("mini_step", "outer_step", "key", "total_notfinite")


def diloco(inner: optax.GradientTransformation, *, axis_name: AxisName, every: int,
           codec: Codec | None = None, outer: optax.GradientTransformation | None = None,
           error_feedback: bool | None = None, policy: packing.LeafPolicy | None = None,
           comm_bucket_size: int | None = None, seed: int = 0,
           fragments: int = 1, delay: int = 0,
           residual_decay: float | None = None) -> optax.GradientTransformationExtraArgs:
  """Local steps of ``inner``, and every ``every`` steps a compressed outer step across replicas.

  Args:
    inner: the optimizer each replica runs on its own gradients (any optax transformation), or
      ``qcomm.sync(...)`` over another, faster axis (data parallelism inside a replica: the
      "GPU-poor" topology of fast links inside a node and a slow link between nodes), replicated
      or with ``shard_state=True``.
    axis_name: the replica axis (a name or a tuple of names); ``update`` runs inside
      ``jax.shard_map`` binding it.
    every: inner optimizer steps between synchronisations (H). If ``inner`` is a ``qcomm.sync``
      with ``accum_steps=k``, a synchronisation happens every ``every * k`` calls, on the call
      where the inner optimizer stepped; otherwise every ``every`` calls.
    codec: the pseudo-gradient's codec (any :class:`qcomm.Codec`); default ``qcomm.Auto(4)``, as
      :func:`qcomm.sync`'s. ``qcomm.NoCompression()`` is DiLoCo's fp32.
    outer: the outer optimizer, applied to the mean pseudo-gradient as a gradient; default
      ``optax.sgd(0.3, momentum=0.9, nesterov=True)``, for every replica count: over K = 2, 4, 8
      and H = 10, 50, 100 on two tasks its worst gap to each cell's best outer optimizer is the
      smallest measured (docs/accuracy.md; DiLoCo's (0.7, 0.9) and plain averaging each lose
      badly on one of the tasks). Except for a sparse codec
      (:attr:`Codec.sparse`, e.g. ``qcomm.TopK``) with ``error_feedback=True``: then
      ``optax.sgd(1.0, momentum=0.5, nesterov=True)``, since the residual already carries part
      of what the momentum would (with momentum 0.9 on top, the held-back mass arrives late and
      amplified: docs/accuracy.md). Its state is float32 and replicated. ``optax.sgd(1.0)``
      makes the anchor the replicas' mean.

      ``"sparseloco"``: SparseLoCo's rule (Sarfi, Therien, Lidin, Belilovsky, "Communication
      Efficient LLM Pre-training with SparseLoCo", 2025, arXiv:2508.15706): no outer momentum;
      each replica's error-feedback accumulator takes its place, decayed,
      ``e <- beta e + delta``; the replica sends ``Q(top-k(e))`` and keeps ``e - sent``; the
      anchor moves by ``-alpha`` times the mean of what was sent. The same as
      ``outer=optax.sgd(1.0), error_feedback=True, residual_decay=0.95`` with ``codec``
      defaulting to ``qcomm.TopK(1/64, bits=2, chunk=4096)`` (64 of every 4096 values, 2-bit
      values, 12-bit positions); give ``outer=optax.sgd(alpha)`` and ``residual_decay=beta``
      for other values. It needs a lossy codec.
    error_feedback: keep, per replica, what its quantisation of the pseudo-gradient lost and add it
      to the next one (float32; only for lossy codecs). Default (None): on for a codec that wants
      it (:attr:`qcomm.Codec.wants_error_feedback`: ``qcomm.TopK``, ``qcomm.PowerSGD``), off
      otherwise.
    policy: which leaves travel exact (:class:`qcomm.LeafPolicy`; default ``LeafPolicy()``: small
      and 1-D leaves exact, except with a sparse codec, which sends every leaf).
    comm_bucket_size: most elements per flat communication buffer (None: the codec's own
      :meth:`~qcomm.Codec.comm_buffer_size`).
    seed: seeds the rounding key (a Python or numpy integer).
    fragments: P >= 1, dividing ``every``. With P > 1 the parameters are cut into P fragments
      (consecutive leaves in the tree's order, about equal in size) and every ``every / P`` inner
      steps one fragment is synchronised, in turn (Streaming DiLoCo): each parameter still
      synchronises every ``every`` steps, the bytes per call are the same, and each
      synchronisation sends about 1/P of them, so the peak traffic drops P-fold. Each fragment
      has its own outer optimizer state; between its synchronisations a replica's other
      fragments keep their local values.
    delay: 0 or 1. With 1, each synchronisation's mean is applied one round late, at the next
      synchronisation (one-step delayed outer updates): at a synchronisation a replica
      applies the mean sent at the previous one to the anchor, moves its own parameters onto the
      new anchor while keeping the progress of the round just ended (``anchor - (round start -
      local parameters)``), and sends that progress. Its next inner steps then need nothing from
      the collective, so :func:`qcomm.data_parallel` with ``overlap=True`` runs the collective
      on devices of its own while they compute (docs/usage.md). As a plain update the
      collective still runs in the step, with the same results. Not with ``fragments > 1``.
      The delay costs accuracy (the byte LM at K = 2, H = 50: +3.9%); it pays where the
      synchronisation is a sizable share of the time (docs/benchmarks.md).
    residual_decay: beta in [0, 1], the decay of the error-feedback residual at each
      synchronisation: a replica sends ``delta + beta * residual`` (default 1.0, or 0.95 with
      ``outer="sparseloco"``). Needs error feedback.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. ``init(params)`` builds a :class:`DiLoCoState`
    (inside ``shard_map``: this replica's parts ``(1, ...)``; outside: global ``(K, ...)``, K the
    current mesh's axis or ``jax.device_count()``). ``update(grads, state, params)`` takes the
    **anchor** as ``params`` (replicated) and ``grads`` taken at this replica's own parameters,
    :func:`qcomm.local_params` ``(state, params)``; it returns zero updates between
    synchronisations and the outer step on a synchronising call, so ``optax.apply_updates`` gives
    the new anchor. :func:`qcomm.data_parallel` runs it all.
  """
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise ValueError(f"inner must be an optax.GradientTransformation, got {inner!r}")
  check_axis_name("axis_name", axis_name)
  every = check_int("every", every)
  fragments = check_int("fragments", fragments)
  if every % fragments:
    raise ValueError(f"fragments must divide every (one fragment every every / fragments inner "
                     f"steps), got fragments={fragments}, every={every}")
  if isinstance(outer, str):
    if outer not in OUTERS:
      raise ValueError(f"outer must be an optax.GradientTransformation, one of {OUTERS} or None, "
                       f"got {outer!r}")
    if error_feedback is False:
      raise ValueError("error_feedback must be True or None with outer='sparseloco': its "
                       "error-feedback accumulator is the rule")
    codec = SPARSELOCO_CODEC if codec is None else codec
    if not check_instance("codec", codec, Codec, "a qcomm.Codec").lossy:
      raise ValueError(f"outer='sparseloco' needs a lossy codec (its accumulator carries what the "
                       f"codec does not send), got {codec.name}; qcomm.TopK is SparseLoCo's")
    error_feedback, outer = True, optax.sgd(SPARSELOCO_LR)
    residual_decay = SPARSELOCO_DECAY if residual_decay is None else residual_decay
  error_feedback = _parts.resolve_error_feedback(error_feedback, codec)
  if residual_decay is None:
    residual_decay = 1.0
  else:
    residual_decay = check_real("residual_decay", residual_decay)
    if not 0 <= residual_decay <= 1:
      raise ValueError(f"residual_decay must be in [0, 1], got {residual_decay!r}")
    if residual_decay != 1 and not error_feedback:
      raise ValueError(f"residual_decay={residual_decay!r} decays the error-feedback residual, "
                       f"so it must come with error_feedback=True (or a codec that wants it)")
  if isinstance(delay, bool) or delay not in DELAYS:
    raise ValueError(f"delay must be one of {DELAYS}, got {delay!r}")
  if delay and fragments > 1:
    raise ValueError(f"delay=1 cannot be combined with fragments > 1 (got fragments="
                     f"{fragments}): delay each whole synchronisation, or stream fragments")
  codec = _parts.resolve_codec(codec, None, None, error_feedback)
  if outer is None:
    outer = default_outer(codec, error_feedback)
  elif not (hasattr(outer, "init") and hasattr(outer, "update")):
    raise ValueError(f"outer must be an optax.GradientTransformation, got {outer!r}")
  policy = packing.LeafPolicy() if policy is None else check_instance(
      "policy", policy, packing.LeafPolicy, "a qcomm.LeafPolicy")
  config = DiLoCoConfig(axis_name=axis_name, codec=codec, policy=policy, every=every,
                        error_feedback=error_feedback and codec.lossy,
                        comm_bucket_size=check_int_or_none("comm_bucket_size", comm_bucket_size),
                        seed=_parts.check_seed(seed), fragments=fragments, delay=int(delay),
                        residual_decay=residual_decay)
  d = _DiLoCo(optax.with_extra_args_support(inner), outer, config)
  return optax.GradientTransformationExtraArgs(d.init, d.update)


def _paths_and_leaves(tree: Any) -> tuple[list[str], list[Any]]:
  """The leaves of ``tree`` and their paths ('params/Dense_0/kernel'), the keys under which a
  fragment's leaves travel (so that the leaf policy sees the same paths)."""
  with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [packing.path_str(p) for p, _ in with_path], [x for _, x in with_path]


def _comm_axis(cfg: DiLoCoConfig) -> Any:
  """The axis of the pseudo-gradient's allreduce: with a sync inside, delta is the same on every
  device of its axis, and each sends only its share across the slow axis (collectives'
  Hierarchical path for values equal inside)."""
  return (cfg.axis_name if cfg.inner_axis_name is None
          else Hierarchical(cfg.inner_axis_name, cfg.axis_name))


def _round_progress(state: DiLoCoState, local: Any) -> Any:
  """``delay=1``: this round's pseudo-gradient, round start - local parameters (float32)."""
  return jax.tree_util.tree_map(lambda s, p: s[0].astype(jnp.float32) - p.astype(jnp.float32),
                                state.round_start, local)


def _with_residual(delta: Any, residual: Any, cfg: DiLoCoConfig) -> Any:
  """What a replica sends: ``delta`` plus its residual decayed by ``residual_decay``."""
  if not cfg.error_feedback:
    return delta
  return _parts.add_residual(delta, residual, cfg.residual_decay)


def delayed_send(before: DiLoCoState, after: DiLoCoState) -> tuple[Any, jax.Array]:
  """Inside the step, around an ``"arrive"`` update from ``before`` to ``after``: what this
  replica sends (its round's progress plus its residual, float32, shaped like the parameters)
  and the rounding key of that allreduce."""
  send = _with_residual(_round_progress(before, _replica(before.params)), after.residual,
                        before.config)
  return send, _parts.split_key(before.key)[1]


def replica_rows(state: Any, mesh: Any, option: str) -> tuple[str, np.ndarray]:
  """For a runner that moves diloco's replicas itself (``option``: its argument, for the
  errors): the replica axis's name and the mesh's devices as rows, one per replica."""
  if not isinstance(state, DiLoCoState):
    raise ValueError(
        f"{option} runs a qcomm.diloco: tx must be qcomm.diloco(...) itself (its state a "
        f"qcomm.DiLoCoState), got a state of type {type(state).__name__}")
  names = axis_names(state.config.axis_name)
  if len(names) != 1:
    raise ValueError(f"{option} needs diloco's axis_name to be one mesh axis, got "
                     f"{state.config.axis_name!r}")
  axis = mesh.axis_names.index(names[0])
  return names[0], np.moveaxis(mesh.devices, axis, 0).reshape(mesh.devices.shape[axis], -1)


def _replica(rows: Any) -> Any:
  return jax.tree_util.tree_map(lambda a: a[0], rows)


class _DiLoCo:
  """The functions of one diloco transformation; ``config`` is its settings (completed at init
  with the inner sync's, read from the inner state)."""

  def __init__(self, inner: optax.GradientTransformationExtraArgs,
               outer: optax.GradientTransformation, config: DiLoCoConfig):
    self.inner = inner
    self.outer = outer
    self.config = config
    self.names = axis_names(config.axis_name)

  def _with_inner(self, inner_state: Any) -> DiLoCoConfig:
    """The config with the accumulation and axis of a qcomm.sync inside ``inner``."""
    syncs = [s.config for s in find_states(inner_state) if hasattr(s.config, "shard_state")]
    if not syncs:
      return self.config
    if len(syncs) > 1:
      raise ValueError(f"inner of qcomm.diloco may hold at most one qcomm.sync, found "
                       f"{len(syncs)}")
    inner = syncs[0]
    shared = set(axis_names(inner.axis_name)) & set(self.names)
    if shared:
      raise ValueError(f"axis_name {self.config.axis_name!r} must differ from the inner sync's "
                       f"axis {inner.axis_name!r} (they share {sorted(shared)})")
    return dataclasses.replace(self.config, inner_accum_steps=inner.accum_steps,
                               inner_axis_name=inner.axis_name)

  def init(self, params: Any) -> DiLoCoState:
    check_array_leaves("params", params)
    d, bound = _parts.num_devices(self.config.axis_name)
    inner_state = self.inner.init(params)
    cfg = self._with_inner(inner_state)
    rows = lambda t: _parts.per_device(t, self.names, d, bound)  # noqa: E731
    f32 = jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.float32), params)
    if cfg.fragments == 1:
      outer_state = self.outer.init(f32)
    else:  # one outer state per fragment, over the fragment's leaves keyed by their paths
      paths, leaves = _paths_and_leaves(f32)
      groups = packing.fragment_groups([x.size for x in leaves], cfg.fragments)
      outer_state = tuple(self.outer.init({paths[i]: leaves[i] for i in g}) for g in groups)
    return DiLoCoState(
        params=rows(params), inner_opt_state=rows(inner_state),
        outer_opt_state=outer_state,
        residual=rows(jax.tree_util.tree_map(jnp.zeros_like, f32)) if cfg.error_feedback else (),
        mini_step=_parts.zero(), outer_step=_parts.zero(), key=_parts.seed_key(cfg.seed),
        total_notfinite=_parts.zero(), **(self._delay_fields(params, f32, rows) if cfg.delay
                                           else {}), config=cfg)

  def _delay_fields(self, params: Any, f32: Any, rows: Callable[[Any], Any]) -> dict[str, Any]:
    """The ``delay=1`` fields of a fresh state: the round starts at ``params``, nothing pending."""
    zeros = jax.tree_util.tree_map(jnp.zeros_like, f32)
    return dict(round_start=rows(params), pending=zeros,
                pending_lost=rows(zeros) if self.config.error_feedback else (),
                pending_valid=_parts.zero())

  def update(self, grads: Any, state: DiLoCoState, params: Any = None, **extra_args: Any):
    axis_size(self.config.axis_name)  # clear error outside shard_map
    phase = extra_args.pop(PHASE_ARG, None)
    present = extra_args.pop(PRESENT_ARG, None)
    if phase is not None and phase not in PHASES:
      raise ValueError(f"{PHASE_ARG} must be one of {PHASES} (or absent), got {phase!r}")
    if present is not None and (phase != "outer" or state.config.fragments > 1
                                or state.config.delay):
      raise ValueError(f"{PRESENT_ARG} needs {PHASE_ARG}='outer', fragments=1 and delay=0; got "
                       f"{PHASE_ARG}={phase!r}, fragments={state.config.fragments}, "
                       f"delay={state.config.delay}")
    if phase == "arrive" and not state.config.delay:
      raise ValueError(f"{PHASE_ARG}='arrive' needs qcomm.diloco(..., delay=1)")
    if phase in ("outer", "arrive"):
      grads = params  # no inner step: only the structure is checked
    packing.check_float_leaves(grads, "grads")
    self._check(grads, state, params)
    cfg = state.config
    rows = lambda t: _parts.per_device(t, self.names, 1, True)  # noqa: E731
    local = local_params(state, params)  # the anchor itself right after a synchronisation
    inner_state = _replica(state.inner_opt_state)
    if phase in ("outer", "arrive"):
      mini_step = state.mini_step
    else:
      token = REPLICA_AXES.set(tuple(REPLICA_AXES.get()) + tuple(self.names))
      try:  # the replicas differ: values vary over their axes without being shards
        updates, inner_state = self.inner.update(grads, inner_state, local, **extra_args)
      finally:
        REPLICA_AXES.reset(token)
      local = optax.apply_updates(local, updates)
      mini_step = state.mini_step + 1

    def between():
      zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.result_type(p)),
                                     params)
      return zeros, state._replace(params=rows(local), inner_opt_state=rows(inner_state),
                                   mini_step=mini_step)

    def outer_step(group=None, f=0):
      """The synchronisation of the leaves in ``group`` (None: all) and fragment f's outer
      state."""
      anchor = jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.float32), params)
      delta = jax.tree_util.tree_map(lambda a, p: a - p.astype(jnp.float32), anchor, local)
      delta = _with_residual(delta, state.residual, cfg)
      if present is not None:  # an absent replica sends zeros (residual included)
        delta = jax.tree_util.tree_map(lambda d: jnp.where(present, d, 0), delta)
      key, sub = _parts.split_key(state.key)
      if group is not None:  # the fragment's leaves, keyed by their paths (the policy reads them)
        paths, anchor_leaves = _paths_and_leaves(anchor)
        treedef = jax.tree_util.tree_structure(params)
        delta_leaves = jax.tree_util.tree_leaves(delta)
        delta = {paths[i]: delta_leaves[i] for i in group}
      # The codecs' mark of the mean (Codec.allreduce_leaves_marked), as sync's guard: from a
      # codec's own bound where it holds one, without another pass over the mean. The mean is
      # bit-identical on every replica, and so is the mark, so this decision is too.
      mean, lost, _, mark = collectives.allreduce_tree(
          delta, _comm_axis(cfg), cfg.codec, sub, "mean", policy=cfg.policy,
          comm_bucket_size=cfg.comm_bucket_size)
      finite = jnp.isfinite(_parts.whole_model(mark, axis_names(_comm_axis(cfg))))
      if present is not None:  # the mean over the present replicas
        names = axis_names(_comm_axis(cfg))
        count = lax.psum(_compat.make_varying(jnp.asarray(present, jnp.float32),
                                              frozenset(names)), names)
        scale = axis_size(_comm_axis(cfg)) / count
        mean = jax.tree_util.tree_map(lambda m: m * scale.astype(m.dtype), mean)
      if group is None:
        outer_updates, outer_state = self.outer.update(mean, state.outer_opt_state, anchor)
        new_outer = _parts.keep_if_finite(finite, outer_state, state.outer_opt_state)
      else:
        sub_updates, outer_state = self.outer.update(
            mean, state.outer_opt_state[f], {paths[i]: anchor_leaves[i] for i in group})
        new_outer = tuple(_parts.keep_if_finite(finite, outer_state, o) if j == f else o
                          for j, o in enumerate(state.outer_opt_state))
        full = [jnp.zeros(jnp.shape(x), jnp.float32) for x in anchor_leaves]
        for i in group:
          full[i] = sub_updates[paths[i]]
        outer_updates = jax.tree_util.tree_unflatten(treedef, full)
      updates = jax.tree_util.tree_map(
          lambda u, p: jnp.where(finite, u, 0).astype(jnp.result_type(p)), outer_updates, params)
      # The new anchor, as the caller's optax.apply_updates makes it from the updates returned:
      # the barrier keeps XLA from contracting the add into the outer step (an FMA here and a
      # plain add there could differ in the last bit). The next call starts from the caller's
      # anchor in any case (local_params at mini_step == 0).
      new_anchor = optax.apply_updates(params, lax.optimization_barrier(updates))
      new_local = new_anchor
      residual = state.residual
      if group is None:
        if cfg.error_feedback:
          residual = _parts.next_residual(finite, lost, state.residual)
      else:  # the other fragments keep their own values and residuals
        new_leaves = jax.tree_util.tree_leaves(new_anchor)
        local_leaves = jax.tree_util.tree_leaves(local)
        new_local = jax.tree_util.tree_unflatten(
            treedef, [new_leaves[i] if i in group else local_leaves[i]
                      for i in range(len(local_leaves))])
        if cfg.error_feedback:
          res_leaves = jax.tree_util.tree_leaves(state.residual)
          kept = _parts.next_residual(finite, [lost[paths[i]] for i in group],
                                      [res_leaves[i] for i in group])
          for i, r in zip(group, kept):
            res_leaves[i] = r
          residual = jax.tree_util.tree_unflatten(treedef, res_leaves)
      return updates, DiLoCoState(
          params=rows(new_local), inner_opt_state=rows(inner_state),
          outer_opt_state=new_outer, residual=residual, mini_step=_parts.zero(),
          outer_step=state.outer_step + 1, key=key,
          total_notfinite=_parts.count_notfinite(state.total_notfinite, finite), config=cfg)

    if cfg.delay:
      synchronise = functools.partial(self._delayed, state, params, local, inner_state,
                                      phase != "arrive")
    elif cfg.fragments > 1:
      groups = packing.fragment_groups([jnp.size(x) for x in jax.tree_util.tree_leaves(params)],
                               cfg.fragments)
      synchronise = lambda: _compat.switch(  # noqa: E731
          state.outer_step % cfg.fragments,
          [functools.partial(outer_step, g, f) for f, g in enumerate(groups)])
    else:
      synchronise = outer_step
    if phase == "inner":
      return between()
    if phase in ("outer", "arrive"):
      return synchronise()
    return _compat.cond(mini_step >= cfg.sync_calls, (synchronise, between))

  def _delayed(self, state: DiLoCoState, params: Any, local: Any, inner_state: Any,
               communicate: bool) -> tuple[Any, DiLoCoState]:
    """A ``delay=1`` synchronisation: the pending mean moves the anchor, this replica goes on from
    the new anchor plus this round's progress, and (``communicate``) the progress is sent, its
    mean pending until the next synchronisation. Without ``communicate`` (the ``"arrive"``
    phase) the caller sends :func:`delayed_send` of the input state and fills ``pending``."""
    cfg = state.config
    rows = lambda t: _parts.per_device(t, self.names, 1, True)  # noqa: E731
    anchor = jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.float32), params)
    progress = _round_progress(state, local)
    key, sub = _parts.split_key(state.key)
    # The pending mean is bit-identical on every replica, so this decision is too.
    finite = (state.pending_valid > 0) & _parts.all_finite(state.pending)
    outer_updates, outer_state = self.outer.update(state.pending, state.outer_opt_state, anchor)
    updates = jax.tree_util.tree_map(
        lambda u, p: jnp.where(finite, u, 0).astype(jnp.result_type(p)), outer_updates, params)
    new_anchor = optax.apply_updates(params, lax.optimization_barrier(updates))
    # A replica whose progress is not finite starts again from the anchor; what it sends still
    # carries the NaN, so every replica skips that mean.
    ok = _parts.all_finite(progress)
    new_local = jax.tree_util.tree_map(
        lambda a, d: jnp.where(ok, a.astype(jnp.float32) - d, a.astype(jnp.float32)).astype(
            a.dtype), new_anchor, progress)
    residual = state.residual
    if cfg.error_feedback:
      residual = _parts.next_residual(finite, _replica(state.pending_lost), state.residual)
    # Counted when a mean arrived and was not finite (nothing arrives at the first one).
    notfinite = _parts.count_notfinite(state.total_notfinite, finite | (state.pending_valid == 0))
    new_state = state._replace(
        params=rows(new_local), inner_opt_state=rows(inner_state),
        outer_opt_state=_parts.keep_if_finite(finite, outer_state, state.outer_opt_state),
        residual=residual, mini_step=_parts.zero(), outer_step=state.outer_step + 1, key=key,
        total_notfinite=notfinite, round_start=rows(new_local), pending_valid=_parts.zero())
    if not communicate:
      return updates, new_state
    send = _with_residual(progress, residual, cfg)
    mean, lost = collectives.allreduce(
        send, _comm_axis(cfg), cfg.codec, sub, "mean", policy=cfg.policy,
        comm_bucket_size=cfg.comm_bucket_size, return_residual=True, check_varying=False)
    return updates, new_state._replace(
        pending=mean, pending_lost=rows(lost) if cfg.error_feedback else (),
        pending_valid=jnp.ones((), jnp.int32))

  def _check(self, grads: Any, state: Any, params: Any) -> None:
    if not isinstance(state, DiLoCoState) or state.config is None:
      raise TypeError(f"state must be the qcomm.DiLoCoState made by this transformation's init, "
                      f"got {type(state).__name__}")
    if params is None:
      raise ValueError("params must be given to a qcomm.diloco update: the anchor (the "
                       "replicated parameters the outer step moves), tx.update(grads, state, "
                       "params)")
    check_array_leaves("params", params)
    if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(grads):
      raise ValueError(f"params must have the structure of grads, got "
                       f"{jax.tree_util.tree_structure(params)} vs "
                       f"{jax.tree_util.tree_structure(grads)}")
    if _varying.tracked(self.names):
      varying = [packing.path_str(path) for path, p in
                 jax.tree_util.tree_flatten_with_path(params)[0]
                 if set(self.names) & _compat.vma_of(p)]
      if varying:
        raise ValueError(
            f"params must be the anchor, replicated over {self.config.axis_name!r}; leaf "
            f"'{varying[0] or '<root>'}' varies over it. This replica's own parameters are in "
            f"the state: take the gradient at qcomm.local_params(opt_state, params) and pass the "
            f"anchor itself (qcomm.data_parallel does).")
    for field in ("params", "inner_opt_state", "residual"):
      for path, a in jax.tree_util.tree_flatten_with_path(getattr(state, field))[0]:
        got = tuple(jnp.shape(a))
        if got[:1] != (1,):
          raise ValueError(
              f"qcomm.diloco: the per-replica part of the state (DiLoCoState.{field}, leaf "
              f"'{packing.path_str(path) or '<root>'}') has shape {got} inside the step; it "
              f"must have a leading replica axis of size 1. "
              + _parts.state_shape_hint(got, (1,) + got[1:], self.config.axis_name))
