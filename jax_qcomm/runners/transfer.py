"""The elastic state's transfer: bytes down a chain of TCP streams between processes.

    endpoint = Endpoint(client, process, incarnation)   # listens; publishes its address
    endpoint.send(key, payload, to=(receiver, incarnation))            # the source
    data = endpoint.receive(key, nbytes, then=(next_receiver, incarnation))  # a receiver

An elastic round (:mod:`jax_qcomm.runners.elastic`) hands the holders' state to the processes
that need it: the source sends it to the first receiver, which passes on every chunk to the next
while it reads the following one, so each link carries the bytes once and the last receiver holds
them a chunk's time after the first.

Why streams, not a collective: a collective over the new membership needs the communicators that
XLA:CPU builds only after every process has rebuilt its CPU backend, and the first collective on
them connects them; a stream between two processes needs neither, so the state travels while the
backends are rebuilt. The address a process listens on is the one it reaches the coordination
service from (the interface gloo uses on a one-interface node); peers find it under
:data:`ENDPOINT_DIR` in the service.

The stream is not encrypted (nor are gloo's collectives). Its integrity is checked: the source
publishes the bytes' SHA-256 under the round's key in the coordination service (authenticated when
the service uses TLS), and a receiver raises if what it read differs. A stream names the round it
belongs to, so a connection left from an attempt that a lost process broke is refused.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import socket
import struct
from typing import Any

#: Key directory where each process publishes, under ``<process>/<incarnation>``, the
#: ``[host, port]`` it receives the state on.
ENDPOINT_DIR = "qcomm/elastic/endpoint/"
#: Bytes read (and passed on down the chain) at a time.
CHUNK_BYTES = 64 * 1024
#: A stream's header: magic, the round key's length, the payload's length; then the key.
_HEADER = struct.Struct("!4sIQ")
_MAGIC = b"QCST"
#: XLA's timeout of a CPU collective across processes: a transfer that makes no progress for as
#: long ends as a collective would (``XLA_FLAGS``; XLA's default is 30 minutes).
_TIMEOUT_FLAG = re.compile(r"--xla_cpu_collective_timeout_seconds=(\d+)")
DEFAULT_TIMEOUT_S = 1800


def timeout_s() -> float:
  """Seconds a transfer waits without progress: ``xla_cpu_collective_timeout_seconds`` from
  ``XLA_FLAGS`` (the timeout of the collectives this process runs), else XLA's default."""
  found = _TIMEOUT_FLAG.findall(os.environ.get("XLA_FLAGS", ""))
  return float(found[-1]) if found else float(DEFAULT_TIMEOUT_S)


def local_address(coordinator_address: str) -> str:
  """The address this host reaches ``coordinator_address`` (``host:port``, ``[v6]:port``) from:
  that of the interface the route to it leaves by (no packet is sent)."""
  host, _, port = coordinator_address.rpartition(":")
  host = host.strip("[]")
  family, kind, proto, _, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
  with socket.socket(family, kind, proto) as probe:
    probe.connect(sockaddr)
    return probe.getsockname()[0]


class Endpoint:
  """This process's listening socket for the state's transfer, and its address published in
  the coordination service under ``ENDPOINT_DIR<process>/<incarnation>``."""

  def __init__(self, client: Any, process: int, incarnation: int, coordinator_address: str):
    self._client = client
    host = local_address(coordinator_address)
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    self._listener = socket.socket(family, socket.SOCK_STREAM)
    self._listener.bind((host, 0))
    self._listener.listen(8)
    self.address = (host, self._listener.getsockname()[1])
    client.key_value_set(f"{ENDPOINT_DIR}{process}/{incarnation}", json.dumps(self.address),
                         allow_overwrite=True)

  def close(self) -> None:
    self._listener.close()

  def _connect(self, to: tuple[int, int], timeout: float) -> socket.socket:
    process, incarnation = to
    host, port = json.loads(self._client.blocking_key_value_get(
        f"{ENDPOINT_DIR}{process}/{incarnation}", int(timeout * 1000)))
    conn = socket.create_connection((host, port), timeout=timeout)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn

  def send(self, key: str, payload: bytes | memoryview, to: tuple[int, int]) -> None:
    """Sends ``payload`` as round ``key``'s state to process ``to = (index, incarnation)``, after
    publishing its SHA-256 (:meth:`digest_key`). Raises ``OSError`` if the receiver fails."""
    timeout = timeout_s()
    self._client.key_value_set(self.digest_key(key), hashlib.sha256(payload).hexdigest(),
                               allow_overwrite=True)
    with self._connect(to, timeout) as conn:
      conn.sendall(_header(key, len(payload)))
      conn.sendall(payload)
      conn.shutdown(socket.SHUT_WR)
      conn.recv(1)  # the receiver closes once it has read everything

  def receive(self, key: str, nbytes: int, then: tuple[int, int] | None = None) -> bytes:
    """Reads round ``key``'s state, ``nbytes`` bytes, from the first connection that names that
    round (others are closed); passes every chunk on to process ``then`` while it reads the next.
    Raises ``OSError`` if the sender or ``then`` fails, ``RuntimeError`` if the bytes differ
    from those the source published the digest of."""
    timeout = timeout_s()
    self._listener.settimeout(timeout)
    while True:
      conn, _ = self._listener.accept()
      conn.settimeout(timeout)
      try:
        magic, key_len, length = _HEADER.unpack(_read(conn, _HEADER.size))
        if magic == _MAGIC and _read(conn, key_len).decode() == key:
          break
      except (OSError, UnicodeDecodeError, struct.error):
        pass
      conn.close()
    data = bytearray(nbytes)
    with conn:
      if length != nbytes:
        raise RuntimeError(f"the state's transfer of round {key!r} brings {length} bytes, "
                           f"{nbytes} expected: the processes hold different states")
      downstream = self._connect(then, timeout) if then is not None else None
      try:
        if downstream is not None:
          downstream.sendall(_header(key, nbytes))
        view, at = memoryview(data), 0
        while at < nbytes:
          got = conn.recv_into(view[at:at + CHUNK_BYTES])
          if not got:
            raise ConnectionError(f"the sender of round {key!r}'s state closed after {at} of "
                                  f"{nbytes} bytes")
          if downstream is not None:
            downstream.sendall(view[at:at + got])
          at += got
        if downstream is not None:
          downstream.shutdown(socket.SHUT_WR)
          downstream.recv(1)
      finally:
        if downstream is not None:
          downstream.close()
    want = self._client.blocking_key_value_get(self.digest_key(key), int(timeout * 1000))
    if hashlib.sha256(data).hexdigest() != want:
      raise RuntimeError(f"the state received in round {key!r} is not what its source sent "
                         f"(SHA-256 differs)")
    return bytes(data)

  @staticmethod
  def digest_key(key: str) -> str:
    """The coordination-service key of round ``key``'s SHA-256 (the source deletes it when every
    receiver holds the state)."""
    return f"{key}/sha256"


def _header(key: str, nbytes: int) -> bytes:
  name = key.encode()
  return _HEADER.pack(_MAGIC, len(name), nbytes) + name


def _read(conn: socket.socket, n: int) -> bytes:
  data = bytearray()
  while len(data) < n:
    got = conn.recv(n - len(data))
    if not got:
      raise ConnectionError(f"closed after {len(data)} of {n} bytes")
    data += got
  return bytes(data)
