"""Transports: how close each XLA collective comes to the link rate on a backend.

A :class:`Transport` is what :class:`jax_qcomm.Auto` weighs the candidate codecs' bytes with, and
what the cost model (:mod:`jax_qcomm.tools.efficiency`) turns bytes into seconds with. Each factor
multiplies the link-floor time of the bytes a collective carries (1.0: at the link rate). Measured
on the simulated cluster (one process per node, 1 Gbit/s links; ``python -m benchmarks cluster
--nodes N --rate 1gbit -- patterns``, docs/benchmarks.md "Transport factors"), each collective as
the library sends it (``jax_qcomm.transport._exchange``): the all-to-all as ppermute rounds on CPU across
processes, and between two processes the all-to-all, all-gather and reduce-scatter in pieces of
at most ``message_bytes``:

==============  ==========  ==========  ==========  ==============  =============
transport       all-reduce  all-to-all  all-gather  reduce-scatter  message_bytes
==============  ==========  ==========  ==========  ==============  =============
``GLOO_PAIR``   1.05        1.15        1.08        1.24            2**20
``GLOO``        1.09        1.13        1.08        2.09            None
``IDEAL``       1.0         1.0         1.0         1.0             None
==============  ==========  ==========  ==========  ==============  =============

``GLOO_PAIR`` is XLA's CPU collectives over gloo between two processes (medians of six runs, rows
of 3.6 and 14 MB), ``GLOO`` the same from three processes up (three and four nodes; the
reduce-scatter measured 2.85 at three), ``IDEAL`` every collective at the link rate, full duplex:
NCCL's rings on paper, and a single process, whose collectives are memory copies.

:func:`current` names the transport the running program's collectives take for D devices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

import jax

from jax_qcomm._checks import check_int_or_none

__all__ = ["Transport", "GLOO_PAIR", "GLOO", "IDEAL", "current"]


def _factor(name: str, value: Any, *, zero_ok: bool = False) -> float:
  ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        and (value >= 0 if zero_ok else value > 0))
  if not ok:
    raise ValueError(f"{name} must be a finite number {'>= 0' if zero_ok else '> 0'}, "
                     f"got {value!r}")
  return float(value)


@dataclasses.dataclass(frozen=True)
class Transport:
  """How close a transport's collectives come to the link rate, and its per-message latency.

  Each factor multiplies the link-floor time of the bytes a collective carries (1.0: at the link
  rate). ``allreduce``: XLA's all-reduce (``psum`` / ``pmax``: exact float32 and the summable
  codecs); ``all_to_all`` and ``all_gather``: the two halves of a scatter-reduce-allgather (SRA);
  ``reduce_scatter``: ``psum_scatter``. The default is the ideal transport. ``latency_s`` is the
  seconds each message adds. ``own_operand`` is the number of values from which an exact float32
  leaf is reduced as its own operand of a collective instead of being copied into a packed buffer
  (:class:`jax_qcomm.NoCompression`): an operand costs about a message's latency, a copy two
  passes over the leaf. ``message_bytes`` is the most bytes one message of an exchange,
  all-gather or reduce-scatter carries (:mod:`jax_qcomm.transport._exchange`): a longer row travels as
  pieces of at most this size, one collective each (None: whole rows). ``python -m
  benchmarks.model`` measures the factors on a cluster.
  """
  allreduce: float = 1.0
  all_to_all: float = 1.0
  all_gather: float = 1.0
  reduce_scatter: float = 1.0
  latency_s: float = 0.0
  own_operand: int = 1 << 15
  message_bytes: int | None = None

  def __post_init__(self):
    for name in ("allreduce", "all_to_all", "all_gather", "reduce_scatter"):
      _factor(name, getattr(self, name))
    _factor("latency_s", self.latency_s, zero_ok=True)
    if (isinstance(self.own_operand, bool) or not isinstance(self.own_operand, int)
        or self.own_operand < 1):
      raise ValueError(f"own_operand must be an int >= 1, got {self.own_operand!r}")
    check_int_or_none("message_bytes", self.message_bytes)

  def factor(self, collective: str) -> float:
    """The factor of an XLA collective named as :meth:`jax_qcomm.Codec.traffic` names it
    (``"all-reduce"``, ``"all-to-all"``, ``"all-gather"``, ``"reduce-scatter"``)."""
    factors = {"all-reduce": self.allreduce, "all-to-all": self.all_to_all,
               "all-gather": self.all_gather, "reduce-scatter": self.reduce_scatter}
    if collective not in factors:
      raise ValueError(f"collective must be one of {tuple(factors)}, got {collective!r}")
    return factors[collective]

  def weighted_bytes(self, traffic: Iterable[tuple[str, float]]) -> float:
    """Bytes at the link rate that take as long as ``traffic`` (a codec's
    :meth:`~jax_qcomm.Codec.traffic`) on this transport: each collective's bytes times its
    factor."""
    return float(sum(nbytes * self.factor(kind) for kind, nbytes in traffic))


#: XLA's CPU collectives over gloo between two processes (measured, 2 nodes, 1 Gbit/s): every
#: message between them is a swap, and gloo moves a swap of messages over about 1 MB at about half
#: the link rate (the exchange 1.86-2.09x the link floor, the all-gather 1.33-1.53x, the
#: reduce-scatter 1.88-2.13x, rows of 3.6 and 14 MB); in pieces of at most ``message_bytes`` the
#: three run at 1.15x, 1.08x and 1.24x, the all-reduce (gloo's own ring) at 1.05x either way.
#: ``message_bytes``: 2**20 against 2**19 in ``sync(bits=4)``'s update on ResNet-50 (QSGD), one run
#: each: 202.6 against 207.0 ms at the default buffers, 191.6 against 211.2 ms at 3.2M-value
#: buffers, though alone a swap in pieces of 0.5 MB ran at 1.08-1.11x against 1.18x at 1 MB: each
#: piece is a collective, and the two processes meet at each.
#: ``own_operand``: with ResNet-50's leaves of 2**18 values and more as their own operands, its
#: exact all-reduce and ``sync(bits=32)``'s update took 0-2.5% less than with every leaf packed,
#: the least of the thresholds from 2**15 to 2**22, or within 1% of it, in five runs (``python -m
#: benchmarks.exact_path --processes``; docs/benchmarks.md "The exact path", "Across processes").
GLOO_PAIR = Transport(allreduce=1.05, all_to_all=1.15, all_gather=1.08, reduce_scatter=1.24,
                      latency_s=1.9e-3, own_operand=1 << 18, message_bytes=1 << 20)

#: XLA's CPU collectives over gloo among three or more processes: all near the link rate but the
#: reduce-scatter (measured, 3 and 4 nodes, 1 Gbit/s). ``own_operand`` is the pair's: the same
#: latency per message (not measured apart).
GLOO = Transport(allreduce=1.09, all_to_all=1.13, all_gather=1.08, reduce_scatter=2.09,
                 latency_s=1.9e-3, own_operand=1 << 18)

#: Every collective at the link rate, full duplex: NCCL's rings on paper, a single process.
#: ``own_operand`` 2**15, measured in one process on 8 devices (``python -m benchmarks.exact_path``:
#: every leaf packed took 0.60x the per-leaf ``pmean`` on a tree of 6k-value leaves but 1.63x on
#: ResNet-50's 161 leaves; with this rule 0.56x and 1.06x).
IDEAL = Transport()


def current(devices: int) -> Transport:
  """The transport of the running program's collectives over ``devices`` devices:
  :data:`GLOO_PAIR` (2) or :data:`GLOO` (3 or more) where the default backend is the CPU, the job
  spans several processes and XLA's CPU collectives use gloo; :data:`IDEAL` otherwise. Read at
  trace time."""
  if jax.default_backend() == "cpu" and jax.process_count() > 1:
    impl = getattr(jax.config, "jax_cpu_collectives_implementation", None)
    if impl in (None, "gloo"):
      return GLOO_PAIR if devices == 2 else GLOO
  return IDEAL
