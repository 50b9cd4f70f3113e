"""How payloads cross between devices: the all-to-all of the compressed collectives
(:func:`exchange`: row j of every device goes to device j), their all-gather (:func:`gather`) and
the reduce-scatter of summed words (:func:`scatter_sum`).

``exchange(rows, axis)`` has the semantics of ``lax.all_to_all(rows, axis, 0, 0, tiled=True)``
for rows[d, W]: the result's row s is the row this device received from device s.

On GPUs that is what it runs (NCCL's all-to-all), and within one process. Across processes on
CPUs, where XLA's collectives go over gloo, it runs a schedule of ``lax.ppermute`` rounds instead:
gloo moves data between two processes at about half speed when they send to each other at once
over their one connection, and its all-to-all does exactly that between every pair. Measured on the
simulated 1 Gbit/s cluster (4 nodes, 3.6 MB rows, ``python -m benchmarks patterns``,
docs/benchmarks-log.md, "Run 10"): a ppermute round in which every node sends to one peer and receives from
another takes 1.2-1.4x the link floor; a round of swaps (0<->2, 1<->3) 1.9x; gloo's all-to-all 2.0x.

The schedules keep every round free of swaps where that is possible:

* 4 devices: the six directed Hamiltonian cycles of K4 cover every ordered pair exactly twice, so
  every row travels as two halves, one per cycle containing its arc: six rounds of half a row,
  each a 4-cycle (no swap): 1.27-1.34x the floor of the all-to-all (gloo's: 1.8-2.1x). A schedule of
  whole rows cannot avoid a swap at 4 (no decomposition of K4* into 3 Hamiltonian cycles exists:
  Tillson 1980).
* other sizes: D-1 rounds, device i sends to i+s in round s; only the round s = D/2 of an even D is
  made of swaps.
* 1 or 2 devices: ``lax.all_to_all`` (2 devices can only swap).

Within a single process (``jax_num_cpu_devices``) collectives are memory copies and one all-to-all
beats D-1 rounds (the embedded digits job, 8 devices: 4-bit scaling efficiency 0.83 with 7 rounds
against 0.87 with the all-to-all), so ``"auto"`` keeps ``lax.all_to_all`` there.

All schedules give the same bytes as ``lax.all_to_all``; collectives.py's allreduce, reduce-scatter
and every replica's result are unchanged by the choice.

**Pieces.** Where the transport bounds a message (:attr:`jax_qcomm.transport.Transport.
message_bytes`: two processes over gloo), each of the three runs as one collective per piece of
the rows, each piece at most that many bytes per row. Between two processes every
message of these collectives is a swap, and gloo moves a swap of large messages at about half the
link rate, but of messages up to about 1 MB at close to it (the simulated 1 Gbit/s cluster, 2
nodes, a 14 MB swap: whole 2.07x the link floor, pieces of 2 MB 1.66x, 1 MB 1.18x, 0.5 MB
1.08-1.11x, 0.25 MB 1.35-1.57x; the all-gather whole 1.52x, 1 MB 1.07x; the reduce-scatter whole
2.07x, 1 MB 1.20x). From three processes the rounds are not swaps and pieces changed nothing
(3 nodes, 6 MB rows: 1.14-1.17x at every piece size), so :data:`jax_qcomm.transport.GLOO` sends
whole rows. Pieces change no value: each is the same collective on a slice. Each piece starts at
a multiple of 8 bytes of its row (a payload's header words lie whole inside one piece).
:func:`exchange_pieces` and :func:`gather_pieces` take the pieces as a kernel wrote them and
return them as they arrived: joining them is a copy of the whole message, which a kernel that
reads and writes the pieces where they lie does not need.
"""

from __future__ import annotations

import functools
import math
from typing import Hashable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_qcomm.transport import cost as _transport
from jax_qcomm.transport.axes import axis_size

AxisName = Union[Hashable, tuple]

# succ[t][i]: the device that device i sends to in round t. The six directed Hamiltonian cycles of
# K4 (0-1-2-3, 0-1-3-2, 0-2-1-3, each both ways): every arc i->j (i != j) is in exactly two.
_HAMILTONIAN_4 = ((1, 2, 3, 0), (3, 0, 1, 2), (1, 3, 0, 2), (2, 0, 3, 1), (2, 3, 1, 0), (3, 2, 0, 1))


@functools.cache
def hamiltonian_schedule_4() -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
  """Rounds (succ, half) for 4 devices: in round t device i sends half ``half[i]`` (0: first, 1:
  second) of its row for ``succ[i]`` to ``succ[i]``. Each arc's first round carries half 0."""
  seen: dict[tuple[int, int], int] = {}
  rounds = []
  for succ in _HAMILTONIAN_4:
    half = []
    for i, j in enumerate(succ):
      half.append(seen.get((i, j), 0))
      seen[(i, j)] = half[-1] + 1
    rounds.append((succ, tuple(half)))
  return tuple(rounds)


def _pairs(succ: Sequence[int]) -> list[tuple[int, int]]:
  return [(i, j) for i, j in enumerate(succ)]


def _rounds_4(rows: jax.Array, axis_name: AxisName) -> jax.Array:
  """Six half-row rounds along the Hamiltonian cycles of K4 (see the module docstring)."""
  d, w = rows.shape
  pad = w % 2
  if pad:  # halves must have one size on every device
    rows = jnp.pad(rows, ((0, 0), (0, 1)))
  h = (w + pad) // 2
  halves = rows.reshape(2 * d, h)  # row j's half p at 2 j + p
  me = lax.axis_index(axis_name)
  schedule = hamiltonian_schedule_4()
  got = []
  for succ, half in schedule:
    send = jnp.asarray([2 * j + p for j, p in zip(succ, half)], jnp.int32)[me]
    got.append(lax.ppermute(lax.dynamic_index_in_dim(halves, send, keepdims=False), axis_name,
                            _pairs(succ)))

  def arrange(i: int):
    """Device i's received halves in source order (its own row from `halves`)."""
    def branch():
      piece = {(i, p): halves[2 * i + p] for p in range(2)}
      for t, (succ, half) in enumerate(schedule):
        src = succ.index(i)
        piece[(src, half[src])] = got[t]
      return jnp.stack([piece[(s, p)] for s in range(d) for p in range(2)]).reshape(d, 2 * h)
    return branch

  out = lax.switch(me, [arrange(i) for i in range(d)])
  return out[:, :w] if pad else out


def _rounds_shift(rows: jax.Array, axis_name: AxisName) -> jax.Array:
  """D-1 rounds; in round s device i sends its row for i+s to it (receives from i-s)."""
  d = rows.shape[0]
  me = lax.axis_index(axis_name)
  # got[s]: the row from device (me - s) % d; got[0] is this device's own row.
  got = [lax.dynamic_index_in_dim(rows, me, keepdims=False)]
  for s in range(1, d):
    send = lax.dynamic_index_in_dim(rows, (me + s) % d, keepdims=False)
    got.append(lax.ppermute(send, axis_name, [(i, (i + s) % d) for i in range(d)]))
  # Row j of the result is got[(me - j) % d] = q[(j - me) % d] with q[k] = got[(-k) % d]: a roll of
  # q by me, read as one dynamic slice of q twice over.
  q = jnp.stack([got[(-k) % d] for k in range(d)])
  return lax.dynamic_slice_in_dim(jnp.concatenate([q, q]), (d - me) % d, d)


def exchange_rounds(rows: jax.Array, axis_name: AxisName) -> jax.Array:
  """The ppermute schedule for rows[d, W] (any platform; the CPU choice of :func:`exchange`)."""
  d = rows.shape[0]
  if d <= 2:
    return lax.all_to_all(rows, axis_name, 0, 0, tiled=True)
  return _rounds_4(rows, axis_name) if d == 4 else _rounds_shift(rows, axis_name)


#: The schedules of :func:`exchange`; the collectives take one as their ``exchange`` argument.
METHODS = ("auto", "rounds", "all_to_all")


def check_method(method: str, name: str = "method") -> None:
  """ValueError naming the argument unless ``method`` is one of :data:`METHODS`."""
  if method not in METHODS:
    raise ValueError(f"{name} must be one of {METHODS}, got {method!r}")


def piece_widths(width: int, unit: int, devices: int) -> list[int]:
  """How a row of ``width`` elements of ``unit`` bytes travels among ``devices``: the widths of
  its pieces of at most the transport's ``message_bytes`` (:func:`jax_qcomm.transport.current`;
  equal pieces but the last, each starting at a multiple of 8 bytes where the bound allows), or
  ``[width]`` where it has no bound or the row fits."""
  bound = _transport.current(devices).message_bytes
  if bound is None or width * unit <= bound:
    return [width]
  step = -(-width // -(-(width * unit) // bound))
  align = 8 // unit if 8 % unit == 0 else 1  # whole 8-byte words (a payload's header words)
  if align * unit <= bound:
    step = min(-(-step // align) * align, bound // unit // align * align)
  return [min(step, width - s) for s in range(0, width, step)]


def cut(x: jax.Array, axis: int, devices: int) -> list[jax.Array]:
  """``x`` cut along ``axis`` as :func:`piece_widths` says its rows travel."""
  unit = x.dtype.itemsize * math.prod(x.shape[axis + 1:])
  widths = piece_widths(x.shape[axis], unit, devices)
  if len(widths) == 1:
    return [x]
  starts = np.cumsum([0] + widths[:-1])
  return [lax.slice_in_dim(x, int(s), int(s) + w, axis=axis) for s, w in zip(starts, widths)]


def joined(pieces: Sequence, axis: int = 1) -> jax.Array:
  """Pieces of rows, as :func:`cut`, :func:`exchange_pieces` or :func:`gather_pieces` give them
  (a piece: an array, or a list of blocks of its rows), as one array."""
  arrays = [p if isinstance(p, jax.Array) else _rows_joined(p) for p in pieces]
  return arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays, axis=axis)


def blocks_of(pieces: Sequence) -> list[list[jax.Array]]:
  """Pieces of rows, as :func:`joined` takes them, each as the list of blocks of its rows."""
  return [[p] if isinstance(p, jax.Array) else list(p) for p in pieces]


def _rows_joined(blocks: Sequence[jax.Array]) -> jax.Array:
  return blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=0)


def exchange(rows: jax.Array, axis_name: AxisName, method: str = "auto") -> jax.Array:
  """rows[d, W] -> [d, W]: row j to device j, as ``lax.all_to_all(rows, axis_name, 0, 0,
  tiled=True)``. ``method``: ``"auto"`` (ppermute rounds on CPU across processes, all-to-all
  elsewhere: GPUs, and the devices of a single process, where collectives are memory copies),
  ``"rounds"`` or ``"all_to_all"``. It is an argument, never global state: the schedule is part
  of the traced program, so a jitted function sees the one its caller passed. Rows longer than
  the transport's ``message_bytes`` travel in pieces (see the module docstring).
  d must be the size of ``axis_name``."""
  return joined(exchange_pieces(cut(rows, 1, rows.shape[0]), axis_name, method))


def exchange_pieces(pieces: Sequence[jax.Array], axis_name: AxisName,
                    method: str = "auto") -> list[list[jax.Array]]:
  """:func:`exchange` of rows[d, W] cut along W as :func:`cut` cuts them, each piece its own
  collective, the received pieces as they arrived: each a list of blocks of its rows, [1, w] per
  row where the piece went by one ``lax.all_to_all`` (XLA hands its results over as they are),
  else one [d, w]. For a consumer that reads them where they lie: :func:`joined` is a copy of
  the whole message."""
  check_method(method)
  d = pieces[0].shape[0]
  by_rows = d <= 2  # whether one lax.all_to_all moves each piece (exchange_rounds at d <= 2)
  if method == "rounds":
    one = lambda r: exchange_rounds(r, axis_name)  # noqa: E731
  # "auto" in one process, where collectives are memory copies: one all-to-all is cheaper
  elif method == "all_to_all" or jax.process_count() == 1:
    one = lambda r: lax.all_to_all(r, axis_name, 0, 0, tiled=True)  # noqa: E731
    by_rows = True
  else:
    one = lambda r: lax.platform_dependent(  # noqa: E731
        r, cpu=lambda q: exchange_rounds(q, axis_name),
        default=lambda q: lax.all_to_all(q, axis_name, 0, 0, tiled=True))
  got = [one(r) for r in pieces]
  return [[g[j:j + 1] for j in range(d)] if by_rows else [g] for g in got]


def gather(x: jax.Array, axis_name: AxisName) -> jax.Array:
  """x[W] -> [D, W], every device's ``x`` in device order, the same everywhere: ``lax.all_gather(
  x, axis_name, to="invarying")``, in pieces where ``x`` is longer than the transport's
  ``message_bytes``."""
  return joined(gather_pieces(cut(x, 0, axis_size(axis_name)), axis_name))


def gather_pieces(pieces: Sequence[jax.Array], axis_name: AxisName) -> list[list[jax.Array]]:
  """:func:`gather` of x[W] cut as :func:`cut` cuts it, each piece its own collective, the
  gathered pieces as they arrived (each one block [D, w])."""
  return [[lax.all_gather(p, axis_name, to="invarying")] for p in pieces]


def scatter_sum(x: jax.Array, axis_name: AxisName) -> jax.Array:
  """x[D*m] -> [m], this device's block of the sum over the axis: ``lax.psum_scatter(x,
  axis_name, scatter_dimension=0, tiled=True)``, in pieces of each block where a block is longer
  than the transport's ``message_bytes``."""
  d = axis_size(axis_name)
  rows = x.reshape(d, -1)
  return joined([lax.psum_scatter(p, axis_name, scatter_dimension=0, tiled=True)
                 for p in cut(rows, 1, d)]).reshape(-1)
