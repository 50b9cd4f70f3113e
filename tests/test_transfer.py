"""The elastic state's transfer (jax_qcomm/runners/transfer.py): bytes down a chain of TCP
streams on this host, with an in-memory stand-in for the coordination service's key-value store."""

import hashlib
import socket
import threading

import pytest

from jax_qcomm.runners import transfer


class KeyValues:
  """The calls of the coordination client that an Endpoint makes."""

  def __init__(self):
    self.values, self.changed = {}, threading.Condition()

  def key_value_set(self, key, value, allow_overwrite=False):
    with self.changed:
      if key in self.values and not allow_overwrite:
        raise RuntimeError(f"ALREADY_EXISTS: {key}")
      self.values[key] = value
      self.changed.notify_all()

  def blocking_key_value_get(self, key, timeout_ms):
    with self.changed:
      if not self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
      return self.values[key]

  def key_value_delete(self, key):
    with self.changed:
      self.values.pop(key, None)


@pytest.fixture
def endpoints(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_timeout_seconds=10")
  client = KeyValues()
  made = [transfer.Endpoint(client, p, 7, "127.0.0.1:1234") for p in range(4)]
  yield client, made
  for e in made:
    e.close()


def _run(calls):
  """Runs ``calls`` (name -> function) in threads; their results, or exceptions, by name."""
  out = {}

  def run(name, fn):
    try:
      out[name] = fn()
    except Exception as error:  # noqa: BLE001
      out[name] = error

  threads = [threading.Thread(target=run, args=item) for item in calls.items()]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  return out


@pytest.mark.parametrize("chain", [(2, 0), (1, 3, 0), (3, 2, 1, 0)])
def test_the_state_goes_down_a_chain_of_receivers(endpoints, chain):
  client, ends = endpoints
  payload = bytes(range(256)) * 781 + b"odd"  # 199,939 bytes: several chunks and a remainder
  key = "qcomm/elastic/round/3"
  calls = {chain[0]: lambda: ends[chain[0]].send(key, payload, to=(chain[1], 7))}
  for at, p in enumerate(chain[1:], 1):
    then = (chain[at + 1], 7) if at + 1 < len(chain) else None
    calls[p] = (lambda p=p, then=then: ends[p].receive(key, len(payload), then=then))
  out = _run(calls)
  assert out[chain[0]] is None
  for p in chain[1:]:
    assert out[p] == payload, p
  assert client.values[transfer.Endpoint.digest_key(key)] == hashlib.sha256(payload).hexdigest()


def test_a_stream_of_another_round_is_refused(endpoints):
  client, ends = endpoints
  payload = b"\x01\x02\x03" * 1000
  stale = socket.create_connection(ends[1].address)  # an attempt a lost process broke
  stale.sendall(transfer._header("qcomm/elastic/round/2", len(payload)) + b"\xff" * len(payload))
  out = _run({0: lambda: ends[0].send("qcomm/elastic/round/3", payload, to=(1, 7)),
              1: lambda: ends[1].receive("qcomm/elastic/round/3", len(payload))})
  stale.close()
  assert out == {0: None, 1: payload}


def test_bytes_that_differ_from_the_published_digest_raise(endpoints):
  client, ends = endpoints
  key = "qcomm/elastic/round/4"
  client.key_value_set(transfer.Endpoint.digest_key(key), hashlib.sha256(b"other").hexdigest())
  conn = socket.create_connection(ends[1].address)
  conn.sendall(transfer._header(key, 5) + b"mine!")
  out = _run({1: lambda: ends[1].receive(key, 5)})
  conn.close()
  assert isinstance(out[1], RuntimeError) and "SHA-256" in str(out[1])


def test_a_sender_with_another_state_size_raises(endpoints):
  client, ends = endpoints
  out = _run({0: lambda: ends[0].send("k", b"abcdef", to=(1, 7)),
              1: lambda: ends[1].receive("k", 8)})
  assert isinstance(out[1], RuntimeError) and "6 bytes, 8 expected" in str(out[1])


def test_a_sender_lost_mid_stream_raises(endpoints):
  client, ends = endpoints
  conn = socket.create_connection(ends[2].address)
  conn.sendall(transfer._header("k", 100_000) + b"x" * 1000)
  threading.Timer(0.2, conn.close).start()
  out = _run({2: lambda: ends[2].receive("k", 100_000)})
  assert isinstance(out[2], ConnectionError) and "after 1000 of 100000 bytes" in str(out[2])


def test_a_receiver_that_never_reads_ends_at_the_timeout(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_timeout_seconds=1")
  client = KeyValues()
  ends = [transfer.Endpoint(client, p, 0, "127.0.0.1:1") for p in range(2)]
  try:
    out = _run({1: lambda: ends[1].receive("k", 10)})  # nobody sends
    assert isinstance(out[1], TimeoutError)
  finally:
    for e in ends:
      e.close()


def test_the_timeout_is_the_collectives_one(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                  "--xla_cpu_collective_timeout_seconds=20")
  assert transfer.timeout_s() == 20
  monkeypatch.delenv("XLA_FLAGS")
  assert transfer.timeout_s() == transfer.DEFAULT_TIMEOUT_S


@pytest.mark.parametrize("coordinator,want", [("127.0.0.1:8476", "127.0.0.1"),
                                              ("[::1]:8476", "::1")])
def test_the_endpoint_listens_where_the_coordinator_is_reached_from(coordinator, want):
  if want == "::1" and not socket.has_ipv6:
    pytest.skip("no IPv6 on this host")
  try:
    assert transfer.local_address(coordinator) == want
  except OSError as error:  # no IPv6 loopback configured
    pytest.skip(f"{coordinator}: {error}")
