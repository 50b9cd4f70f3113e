"""The state's transfer to restarted processes (the elastic runners' admitting round): the leaves
packed into one buffer of 32-bit words, and a program that sends a row of a mesh down a chain of
the others, in pieces.

    plan = runner._plan(params, state)            # per leaf: None (travels), ZEROS, or a copy
    words = pack(sent_leaves(leaves, plan))       # uint32[packed_words(...)]
    rows = relay(mesh, "node", (0, 2, 1), pieces)(global_rows)   # rows 2 and 1 take row 0's
    leaves = received_leaves(unpack(words, sent_leaves(leaves, plan)), leaves, plan)
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

#: In a transfer plan (``ElasticDataParallel._plan``): a leaf the receiver starts at zero.
ZEROS = "zeros"


def relay(mesh: Mesh, name: str, chain: tuple[int, ...], pieces: int) -> Callable:
  """A program over ``mesh`` of ``uint32[rows, words]`` (a row per index along ``name``): the
  rows of ``chain[1:]`` take row ``chain[0]``'s words, the others keep theirs. The words go down
  the chain, in ``pieces`` pieces: at tick ``t`` link ``k`` (``chain[k]`` to ``chain[k + 1]``)
  carries piece ``t - k``, so every link carries the words once and ``r`` receivers wait
  ``(pieces + r - 1) / pieces`` times one transfer (sent from the first row to each in turn,
  ``r`` times); one receiver takes them whole (``pieces=1``)."""
  position = np.full(mesh.shape[name], -1, np.int32)  # of each row in the chain
  position[list(chain)] = np.arange(len(chain))

  def relay(x):
    words = x.shape[-1]
    size = -(-words // pieces)
    buf = jnp.pad(x.reshape(-1), (0, size * pieces - words)).reshape(pieces, size)
    at = jnp.asarray(position)[lax.axis_index(name)]
    for tick in range(pieces + len(chain) - 2):
      links = [(chain[k], chain[k + 1]) for k in range(len(chain) - 1) if 0 <= tick - k < pieces]
      got = lax.ppermute(buf[jnp.clip(tick - at, 0, pieces - 1)], name, perm=links)
      piece = tick - (at - 1)  # the piece this row takes, if it is a receiver with a link now
      takes = (at >= 1) & (piece >= 0) & (piece < pieces)
      buf = jnp.where(takes, buf.at[jnp.clip(piece, 0, pieces - 1)].set(got), buf)
    return buf.reshape(-1)[:words].reshape(x.shape)

  return jax.jit(jax.shard_map(relay, mesh=mesh, in_specs=P(name), out_specs=P(name)))


def sent_leaves(leaves: list[Any], plan: list[int | str | None]) -> list[Any]:
  """The leaves that travel in a transfer of plan ``plan`` (``ElasticDataParallel._plan``)."""
  return [x for x, how in zip(leaves, plan, strict=True) if how is None]


def received_leaves(got: list[np.ndarray], leaves: list[np.ndarray],
                    plan: list[int | str | None]) -> list[np.ndarray]:
  """A receiver's leaves: those of ``got`` (the leaves that travelled, in order), the others made
  as ``plan`` says (in ``leaves``' shapes and dtypes)."""
  got, out = iter(got), []
  for x, how in zip(leaves, plan, strict=True):
    if how is None:
      out.append(next(got))
    elif how == ZEROS:
      out.append(np.zeros_like(x))
    else:  # a copy of the parameters' leaf, which came first
      out.append(np.broadcast_to(out[how], x.shape).astype(x.dtype))
  return out


def _nbytes(x: Any) -> int:
  return int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize


def pack(leaves: list[np.ndarray]) -> np.ndarray:
  """The bytes of ``leaves`` end to end, zero-padded to whole 32-bit words: ``uint32[words]``."""
  pad = -sum(map(_nbytes, leaves)) % 4
  data = np.concatenate([np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in leaves]
                        + [np.zeros(pad, np.uint8)])
  return data.view(np.uint32)


def packed_words(leaves: list[Any]) -> int:
  """The 32-bit words :func:`pack` makes of ``leaves`` (arrays or shapes)."""
  return -(-sum(map(_nbytes, leaves)) // 4)


def unpack(words: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
  """The inverse of :func:`pack`: leaves of ``like``'s shapes and dtypes, from ``words``."""
  data, out, at = np.ascontiguousarray(words).view(np.uint8), [], 0
  for x in like:
    out.append(data[at:at + x.nbytes].view(x.dtype).reshape(x.shape).copy())
    at += x.nbytes
  return out
