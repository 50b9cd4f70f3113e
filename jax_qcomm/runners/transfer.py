"""The state's transfer to restarted processes (the elastic runners' admitting round): the leaves
packed into one buffer of 32-bit words, and two ways to send it. :func:`relay` is a program that
sends a row of a mesh down a chain of the others, in pieces (every process waits for it: XLA:CPU
runs a process's programs one after the other). :func:`serve` and :func:`fetch` send it over a
TCP connection of its own, from a thread, while the sender's programs go on; receivers in a
chain pass each piece on as it comes (``fetch(..., passing=Sender(...))``).

    plan = runner._plan(params, state)            # per leaf: None (travels), ZEROS, or a copy
    words = pack(sent_leaves(leaves, plan))       # uint32[packed_words(...)]
    rows = relay(mesh, "node", (0, 2, 1), pieces)(global_rows)   # rows 2 and 1 take row 0's
    address = serve(words, toward=coordinator)                   # or, on the source...
    words = fetch(address, words.nbytes)                         # ...and on a receiver
    leaves = received_leaves(unpack(words, sent_leaves(leaves, plan)), leaves, plan)
"""

from __future__ import annotations

import functools
import queue
import socket
import struct
import threading
from typing import Any, Callable

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, PartitionSpec as P

from jax_qcomm import _compat
from jax_qcomm.transforms.specs import is_state, place

#: In a transfer plan (``Transfers._plan``): a leaf the receiver starts at zero.
ZEROS = "zeros"
#: Seconds :func:`serve` waits for its receivers to connect, and :func:`fetch` for the bytes.
SERVE_TIMEOUT_S = 120.0
#: Pieces the state is cut into when it travels to more than one receiver by :func:`relay`: it
#: goes down a chain of them, each passing on the piece it has while it takes the next.
PIPELINE_PIECES = 8


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
  """The leaves that travel in a transfer of plan ``plan`` (``Transfers._plan``)."""
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


def _field_leaves(tree: Any, fields: tuple[str, ...]) -> list[bool]:
  """For each leaf of ``tree``: whether it lies in one of the named fields of a qcomm state."""
  def mark(node):
    flags = jax.tree_util.tree_map(lambda _: False, node)
    if not is_state(node):
      return flags
    return flags._replace(**{f: jax.tree_util.tree_map(lambda _: True, getattr(node, f))
                             for f in fields if hasattr(node, f)})
  return jax.tree_util.tree_leaves(jax.tree_util.tree_map(mark, tree, is_leaf=is_state))


def _local_address(toward: str) -> str:
  """The address of this machine's interface that routes to ``toward`` (``host:port``)."""
  host, port = toward.rsplit(":", 1)
  host = host.strip("[]")
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_DGRAM) as probe:  # connect() sends nothing over UDP
    probe.connect((host, int(port)))
    return probe.getsockname()[0]


class Sender:
  """Sends bytes to the first connection on a port of its own, from a daemon thread, as they
  come (:meth:`put`, then :meth:`close`): the ``host:port`` in ``address`` is on the interface
  that routes to ``toward`` (the coordination service's address). The listener closes once one
  has connected, or after ``timeout_s``. :func:`fetch` is the other end."""

  def __init__(self, nbytes: int, toward: str, timeout_s: float = SERVE_TIMEOUT_S):
    host = _local_address(toward)
    self._listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    self._listener.bind((host, 0))
    self._listener.listen(1)
    self._listener.settimeout(timeout_s)
    port = self._listener.getsockname()[1]
    self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    self._chunks: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=self._send, args=(nbytes, timeout_s), name="qcomm-state-send",
                     daemon=True).start()

  def put(self, chunk: bytes) -> None:
    self._chunks.put(chunk)

  def close(self) -> None:
    self._chunks.put(None)

  def _send(self, nbytes: int, timeout_s: float) -> None:
    with self._listener:
      try:
        conn, _ = self._listener.accept()
      except OSError:  # timed out: the receiver is gone
        return
    with conn:
      conn.settimeout(timeout_s)
      try:
        conn.sendall(struct.pack("!Q", nbytes))
        while (chunk := self._chunks.get()) is not None:
          conn.sendall(chunk)
      except OSError:  # the receiver is gone
        return


def serve(data: np.ndarray, toward: str, timeout_s: float = SERVE_TIMEOUT_S) -> str:
  """Sends ``data``'s bytes to the first connection (:class:`Sender`), while the caller goes
  on; returns the address to :func:`fetch` them from."""
  payload = np.ascontiguousarray(data).view(np.uint8).tobytes()
  sender = Sender(len(payload), toward, timeout_s)
  sender.put(payload)
  sender.close()
  return sender.address


def _recv(conn: socket.socket, nbytes: int, passing: Sender | None = None) -> bytearray:
  """Up to ``nbytes`` bytes from ``conn`` (fewer if it closes first), each chunk also handed
  to ``passing`` as it comes."""
  data = bytearray()
  while len(data) < nbytes:
    chunk = conn.recv(min(1 << 20, nbytes - len(data)))
    if not chunk:
      break
    data += chunk
    if passing is not None:
      passing.put(chunk)
  return data


def fetch(address: str, nbytes: int, timeout_s: float = SERVE_TIMEOUT_S,
          passing: Sender | None = None) -> np.ndarray:
  """The ``nbytes`` bytes a :class:`Sender` sends from ``address``, as ``uint32[nbytes // 4]``;
  ``passing``: a sender to the next receiver of a chain, which gets each piece as it comes (and
  is closed at the end, whole or not). OSError if the sender is gone or sends another size."""
  try:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as conn:
      head = _recv(conn, 8)
      if len(head) == 8 and struct.unpack("!Q", head)[0] == nbytes:
        data = _recv(conn, nbytes, passing)
      else:
        data = bytearray()
  finally:
    if passing is not None:
      passing.close()
  if len(data) != nbytes:
    raise OSError(f"the state's sender at {address} sent {len(data)} of {nbytes} bytes")
  return np.frombuffer(bytes(data), np.uint32)


class Transfers:
  """The elastic runner's sending of its state (``runners.elastic.ElasticDataParallel`` inherits
  it; its meshes, ``OWN_FIELDS``, ``_param_fields``, ``_spec`` and coordination client serve
  here)."""

  def _plan(self, params: Any, state: Any) -> list[int | str | None]:
    """How a receiver of ``(params, state)`` makes each of its leaves (flattened): None, the leaf
    travels; :data:`ZEROS`, it starts at zero (``OWN_FIELDS``: the source's own); ``j``,
    a copy of leaf ``j`` of ``params`` (which travels) in the leaf's shape
    (:meth:`_param_fields`)."""
    tree = (params, state)
    own = _field_leaves(tree, self.OWN_FIELDS)
    copies = _field_leaves(tree, self._param_fields(state))
    n, copied, plan = len(jax.tree_util.tree_leaves(params)), 0, []
    for is_own, is_copy in zip(own, copies, strict=True):
      if is_copy:
        plan.append(copied % n)
        copied += 1
      else:
        plan.append(ZEROS if is_own else None)
    return plan

  def _broadcast(self, processes: list[int], source: int, receivers: list[int], params: Any,
                 state: Any, sending: threading.Thread | None = None) -> tuple[Any, Any]:
    """The receivers take the source's params and state (``lax.ppermute`` from the source down
    the chain of receivers, :meth:`_broadcast_fn`): the others send nothing. The leaves travel
    packed into one buffer (:func:`pack`), without those a receiver makes itself
    (:meth:`_plan`: the source's own fields start at zero, copies of the parameters).
    ``sending``: a thread started once the transfer is under way (not before: a thread that
    traces holds the interpreter's lock, and would hold up this process's part of it)."""
    mesh = self._mesh_of(processes)
    name = self.mesh.axis_names[self._replica_axis]
    order = sorted(processes, key=self._row_of.__getitem__)
    sent, unpacked = self._packing(params, state)
    words = pack(sent)
    rows = multihost_utils.host_local_array_to_global_array(words[None], mesh, P(name))
    out = self._broadcast_fn(tuple(processes), order.index(source),
                             tuple(order.index(r) for r in receivers))(rows)
    if sending is not None:
      sending.start()
    jax.block_until_ready(out)
    if self._me in receivers:
      return unpacked(
          np.asarray(multihost_utils.global_array_to_host_local_array(out, mesh, P(name)))[0])
    return unpacked(None)

  def _packing(self, params: Any, state: Any) -> tuple[list[np.ndarray], Callable]:
    """(the leaves of ``(params, state)`` a transfer sends, on the host (:func:`pack` makes its
    words), and ``unpacked(words)``: the params and state a receiver of ``words`` makes, placed
    on this process's devices (None: this process's own))."""
    leaves, treedef = jax.tree_util.tree_flatten((params, state))
    leaves = [np.asarray(x) for x in leaves]
    plan = self._plan(params, state)
    sent = sent_leaves(leaves, plan)

    def unpacked(words):
      out = leaves if words is None else received_leaves(
          unpack(words, sent), leaves, plan)
      p, s = jax.tree_util.tree_unflatten(treedef, out)
      return place(p, P(), self._local_mesh), place(s, self._spec(s), self._local_mesh)

    return sent, unpacked

  def _hand_over(self, key: str, params: Any, state: Any) -> None:
    """The source's part of a background transfer: the state served to the first receiver from
    a thread (:func:`serve`), its address published under ``key/state/0`` (each receiver passes
    it on to the next: :meth:`_take`)."""
    words = pack(self._packing(params, state)[0])
    self._client.key_value_set(f"{key}/state/0", serve(words, _compat.coordinator_address()),
                               allow_overwrite=True)

  def _take(self, key: str, params: Any, state: Any, index: int, last: bool,
            timeout_s: float) -> tuple[Any, Any]:
    """Receiver ``index``'s part of a background transfer: the state from the address under
    ``key/state/<index>``, passed on as it comes to the next receiver (unless ``last``), whose
    address it publishes first."""
    sent, unpacked = self._packing(params, state)
    nbytes = 4 * packed_words(sent)  # its own leaves' size: nothing to pack
    passing = None
    if not last:
      passing = Sender(nbytes, _compat.coordinator_address())
      self._client.key_value_set(f"{key}/state/{index + 1}", passing.address,
                                 allow_overwrite=True)
    address = self._client.blocking_key_value_get(f"{key}/state/{index}",
                                                  int(timeout_s * 1000))
    return unpacked(fetch(address, nbytes, passing=passing))

  @functools.lru_cache(maxsize=None)
  def _broadcast_fn(self, processes: tuple, source_row: int, receiver_rows: tuple) -> Callable:
    pieces = 1 if len(receiver_rows) == 1 else PIPELINE_PIECES
    return relay(self._mesh_of(list(processes)),
                          self.mesh.axis_names[self._replica_axis], (source_row, *receiver_rows),
                          pieces)

