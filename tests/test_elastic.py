"""Elastic diloco across processes (jax_qcomm/runners/elastic.py, launch --elastic): processes killed
(SIGKILL) or stopped (SIGSTOP past the heartbeat timeout), restarted by the launcher with their
rank, rejoining with the group's state; anchors bit-identical at every synchronisation; the same
with an NNX model (nnx_data_parallel(elastic=True)).

Each run is three processes of tests/elastic_worker.py (a noisy linear regression, diloco every
4 steps); the worker writes one JSON line per synchronisation."""

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "elastic_worker.py")
STEPS, PAUSE = 200, 0.1


def _launch(out, steps=STEPS, mode=None, pause=PAUSE, *deaths):
  """The launcher with 3 elastic workers; ``deaths``: the worker's WHERE@RANK arguments."""
  cmd = [sys.executable, "-m", "jax_qcomm.tools.launch", "-n", "3", "--elastic",
         "--heartbeat-timeout", "5", "--collective-timeout", "10", "--timeout", "400",
         WORKER, str(out), str(steps), str(pause)] + ([mode] if mode else []) + list(deaths)
  # The launcher's output goes to a file: a pipe nobody reads until the end fills up with the
  # log lines of a long run and blocks the launcher (and the workers writing through it).
  log_path = os.path.join(out, "launcher.log")
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
  proc.log_path = log_path
  return proc


def _output(proc) -> str:
  with open(proc.log_path) as f:
    return f.read()


def _records(out, rank):
  path = os.path.join(out, f"rank{rank}.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _wait(predicate, proc, what, limit=240):
  t0 = time.monotonic()
  while not predicate():
    if proc.poll() is not None:
      raise AssertionError(f"the run ended (status {proc.returncode}) before {what}:\n"
                           f"{_output(proc)[-4000:]}")
    if time.monotonic() - t0 > limit:
      raise AssertionError(f"timed out waiting for {what}:\n{_output(proc)[-4000:]}")
    time.sleep(0.1)


def _pids(out, rank):
  return [r["pid"] for r in _records(out, rank) if r["event"] == "joined"]


def _syncs(out, rank, pid=None):
  return [r for r in _records(out, rank) if r["event"] == "sync" and pid in (None, r["pid"])]


def _finish(proc):
  proc.wait(timeout=400)
  text = _output(proc)
  assert proc.returncode == 0, text[-6000:]
  return text


def _assert_programs_loaded_ahead(text):
  """Every restarted process traced and loaded the next round's programs before it announced
  itself ready, and no process failed to load them ahead (after a rebuild or before)."""
  assert "compiled its step and the next round's programs" in text, text[-4000:]
  assert "could not load the next round's programs ahead" not in text, text[-4000:]


def _check_run(out):
  """Anchors bit-identical per synchronisation across every record; the final results."""
  anchors = collections.defaultdict(set)
  for rank in range(3):
    for r in _syncs(out, rank):
      anchors[r["outer_step"]].add(r["anchor"])
  assert anchors and all(len(a) == 1 for a in anchors.values()), dict(anchors)
  done = [[r for r in _records(out, rank) if r["event"] == "done"][-1] for rank in range(3)]
  assert len({d["loss"] for d in done}) == 1  # the same anchor everywhere at the end
  assert len({json.dumps(d["replicas_per_sync"]) for d in done}) == 1
  return done[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  out = tmp_path_factory.mktemp("elastic_clean")
  _finish(_launch(out))
  done = _check_run(out)
  assert done["replicas_per_sync"] == [3] * (STEPS // 4)
  return done


def _kill_mid_window(out, proc, rank, after_syncs, pause=PAUSE, also=()):
  """SIGKILL ``rank``'s current incarnation (and those of the ranks in ``also``, at once) once
  it has recorded ``after_syncs`` more synchronisations, two pauses later (in the middle of its
  inner steps); waits for the restarted ones to join. Returns the old pid."""
  pid = _pids(out, rank)[-1]
  start = len(_syncs(out, rank, pid))
  _wait(lambda: len(_syncs(out, rank, pid)) >= start + after_syncs, proc, f"rank {rank} syncs")
  time.sleep(2 * pause)
  victims = {r: _pids(out, r)[-1] for r in (rank, *also)}
  for p in victims.values():
    os.kill(p, signal.SIGKILL)
  for r, p in victims.items():
    _wait(lambda r=r, p=p: _pids(out, r)[-1] != p, proc, f"rank {r} to rejoin")
  return pid


def test_killed_workers_and_worker_zero_rejoin(tmp_path, uninterrupted):
  out = tmp_path
  proc = _launch(out)
  _wait(lambda: all(_pids(out, r) for r in range(3)), proc, "all to join")
  survivor = _pids(out, 2)[0]
  _kill_mid_window(out, proc, 1, 3)   # a non-coordinator worker
  _kill_mid_window(out, proc, 0, 3)   # the process that was worker 0
  # Both again, at once: repeated restarts, and two receivers of the state (down a chain).
  _kill_mid_window(out, proc, 1, 3, also=(0,))
  text = _finish(proc)
  assert _pids(out, 2) == [survivor]  # the survivor never restarted
  assert len(_pids(out, 0)) == 3 and len(_pids(out, 1)) == 3
  assert text.count("restarting it with rank") == 4
  _assert_programs_loaded_ahead(text)
  # Each admission's state travelled behind the survivors' steps, and the admitted processes
  # sat out the next synchronisation's mean.
  assert re.search(r"averaged 1 of 3 replicas \(missing \[0, 1\]\), admitted \[0, 1\]; [^\n]*"
                   r"its transfer goes on behind the next steps", text), text[-4000:]
  assert re.search(r"averaged 1 of 3 replicas \(without \[0, 1\], admitted at the last one\)",
                   text), text[-4000:]
  assert "could not take the state" not in text
  done = _check_run(out)
  replicas = done["replicas_per_sync"]
  assert len(replicas) == STEPS // 4 and min(replicas) < 3 and replicas[-1] == 3
  assert abs(done["loss"] - uninterrupted["loss"]) <= 0.1 * uninterrupted["loss"], (
      done["loss"], uninterrupted["loss"])


def test_nnx_killed_workers_rejoin(tmp_path, uninterrupted):
  """The same model as an nnx.Module, stepped by nnx_data_parallel(elastic=True): workers 1 and
  0 killed mid-window and restarted; anchors bit-identical at every synchronisation, the
  optimizer's step the group's count, the loss that of the Linen run's."""
  out = tmp_path
  proc = _launch(out, mode="nnx")
  _wait(lambda: all(_pids(out, r) for r in range(3)), proc, "all to join")
  _kill_mid_window(out, proc, 1, 3)
  _kill_mid_window(out, proc, 0, 3)
  text = _finish(proc)
  assert text.count("restarting it with rank") == 2
  done = _check_run(out)
  replicas = done["replicas_per_sync"]
  assert len(replicas) == STEPS // 4 and min(replicas) < 3 and replicas[-1] == 3
  assert abs(done["loss"] - uninterrupted["loss"]) <= 0.1 * uninterrupted["loss"], (
      done["loss"], uninterrupted["loss"])


def _stop_then(out, proc, rank, seconds, then):
  """SIGSTOP ``rank`` after its third synchronisation, ``seconds`` later send it ``then``, wait
  for its restarted incarnation to join. Returns the other ranks' pids."""
  _wait(lambda: all(_pids(out, r) for r in range(3)), proc, "all to join")
  others = {r: _pids(out, r)[0] for r in range(3) if r != rank}
  pid = _pids(out, rank)[0]
  _wait(lambda: len(_syncs(out, rank, pid)) >= 3, proc, f"rank {rank} syncs")
  os.kill(pid, signal.SIGSTOP)
  time.sleep(seconds)
  os.kill(pid, then)
  _wait(lambda: len(_pids(out, rank)) == 2, proc, f"rank {rank} to rejoin")
  return others


def _check_against(out, others, uninterrupted):
  assert {r: _pids(out, r) for r in others} == {r: [p] for r, p in others.items()}  # never restarted
  done = _check_run(out)
  assert done["replicas_per_sync"][-1] == 3
  assert abs(done["loss"] - uninterrupted["loss"]) <= 0.1 * uninterrupted["loss"]
  return done


def test_worker_killed_during_a_synchronisation(tmp_path, uninterrupted):
  """Rank 1 is held (SIGSTOP for 2 s, shorter than the heartbeat timeout) right after a
  synchronisation, so that the others finish their window (4 x 0.1 s) and enter the next round,
  waiting for it; then it is killed. The survivors are inside the synchronisation when it dies:
  they run it again without it, and again with its restarted incarnation."""
  proc = _launch(tmp_path)
  others = _stop_then(tmp_path, proc, 1, 2.0, signal.SIGKILL)
  text = _finish(proc)
  assert "the synchronisation runs again" in text
  _check_against(tmp_path, others, uninterrupted)


def test_stopped_worker_is_declared_lost_and_rejoins(tmp_path, uninterrupted):
  """SIGSTOP past the heartbeat timeout (5 s): declared lost; on SIGCONT it learns it, exits and
  is restarted."""
  proc = _launch(tmp_path)
  others = _stop_then(tmp_path, proc, 2, 8.0, signal.SIGCONT)
  text = _finish(proc)
  done = _check_against(tmp_path, others, uninterrupted)
  assert min(done["replicas_per_sync"]) == 2
  # one line per synchronisation that ran short, naming the missing process, and the admission
  assert re.search(r"synchronisation \d+ averaged 2 of 3 replicas \(missing \[2\]\)", text), text
  assert re.search(r"of 3 replicas[^\n]*, admitted \[2\]; it took [0-9.]+ s", text), text


def test_elastic_needs_a_coordination_service_outside_the_workers():
  """In one process with no jax.distributed: a clear error naming how to start one."""
  import numpy as np
  import optax
  import jax
  from jax.sharding import Mesh

  import jax_qcomm as qcomm

  mesh = Mesh(np.array(jax.devices()[:1]), ("node",))
  tx = qcomm.diloco(optax.sgd(0.1), axis_name="node", every=2)
  with pytest.raises(RuntimeError, match="elastic=True"):
    qcomm.data_parallel(lambda p, b: 0.0, tx, mesh, axis_name="node", elastic=True)
  with pytest.raises(ValueError, match="donate"):
    qcomm.data_parallel(lambda p, b: 0.0, tx, mesh, axis_name="node", elastic=True, donate=True)


def test_launch_elastic_arguments():
  from jax_qcomm.tools import launch

  with pytest.raises(ValueError, match="max_restarts"):
    launch.launch(["x.py"], 2, max_restarts=2)
  with pytest.raises(ValueError, match="max_restarts must"):
    launch.launch(["x.py"], 2, elastic=True, max_restarts=-1)
  with pytest.raises(ValueError, match="recoverable"):
    launch.launch(["x.py"], 2, elastic=True, recoverable=False)


def test_a_replayed_program_traces_its_python_once_and_computes_the_same_bits():
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax import lax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from jax_qcomm.runners import replay

  mesh = Mesh(np.array(jax.devices()[:3]), ("node",))
  tx = optax.adam(1e-2)
  traced = []

  def update(params, state, grads):
    traced.append(1)  # Python that runs only while tracing
    grads = jax.tree_util.tree_map(lambda g: lax.pmean(g[0], "node"), grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def program():
    return jax.jit(jax.shard_map(update, mesh=mesh.abstract_mesh, in_specs=(P(), P(), P("node")),
                                 out_specs=(P(), P())))

  params = {"w": jnp.linspace(-1, 1, 7, dtype=jnp.float32), "b": jnp.float32(0.5)}
  state = tx.init(params)
  grads = jax.tree_util.tree_map(
      lambda p: jax.device_put(np.random.default_rng(0).normal(size=(3, *p.shape)).astype(
          np.float32), NamedSharding(mesh, P("node"))), params)
  want = jax.device_get(program()(params, state, grads))
  traces = {}
  first = replay.Replayed(program(), traces, "update")
  compiled = first.lower(params, state, grads).compile()  # what the loading thread does
  again = replay.Replayed(program(), traces, "update")   # as after a backend rebuild
  assert len(traced) == 2  # the direct program's trace and the first replay's: not again's
  for got in (first(params, state, grads), again(params, state, grads),
              compiled(*jax.tree_util.tree_leaves((params, state, grads)))):
    got = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(want),
                                       jax.tree_util.tree_leaves(jax.device_get(got)))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
      np.testing.assert_array_equal(np.atleast_1d(g).view(np.uint8), np.atleast_1d(w).view(np.uint8))
  # Other shapes are traced anew, not replayed wrongly.
  wide = jax.tree_util.tree_map(lambda x: jnp.concatenate([x, x], -1) if x.ndim else x, params)
  other = replay.Replayed(program(), traces, "update")
  wide_grads = jax.tree_util.tree_map(
      lambda p: jax.device_put(np.ones((3, *p.shape), np.float32), NamedSharding(mesh, P("node"))),
      wide)
  assert other(wide, tx.init(wide), wide_grads)[0]["w"].shape == (14,)
  assert len(traced) == 3
  # A constant with no host form (a typed key) is replayed on this backend only: not kept.
  key = jax.random.key(3)
  keyed = replay.Replayed(jax.jit(lambda x: x + jax.random.normal(key, x.shape)), traces, "k")
  np.testing.assert_array_equal(keyed(jnp.zeros(3)), jax.random.normal(key, (3,)))
  assert "k" not in traces


def test_global_shapes_are_what_the_host_local_arrays_become():
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, PartitionSpec as P

  from jax_qcomm.runners import replay

  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("node", "data"))
  tree = {"a": np.zeros((2, 8), np.float32), "b": np.zeros((), np.int32),
          "c": np.zeros((4, 3), np.uint8)}
  specs = {"a": P(None, ("node", "data")), "b": P(), "c": P("data")}
  for spec in (specs, P()):
    want = multihost_utils.host_local_array_to_global_array(tree, mesh, spec)
    got = replay.global_shapes(tree, mesh, spec)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
      assert (g.shape, g.dtype, g.sharding) == (w.shape, w.dtype, w.sharding)


def test_the_state_transfer_packs_every_leaf_into_one_buffer_and_back():
  import numpy as np

  from jax_qcomm.runners import transfer

  leaves = [np.arange(7, dtype=np.float32) / 3, np.array([True, False, True]),
            np.int8(-5) * np.ones((), np.int8), np.arange(5, dtype=np.uint16).reshape(5, 1),
            np.array([np.nan, -np.inf], np.float32), np.zeros((0, 3), np.float32)]
  words = transfer.pack(leaves)
  assert words.dtype == np.uint32 and words.shape == (transfer.packed_words(leaves),)
  assert words.size * 4 - sum(x.nbytes for x in leaves) in range(4)
  like = [np.zeros_like(x) for x in leaves]
  for got, want in zip(transfer.unpack(words, like), leaves, strict=True):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # bits, NaN included


@pytest.mark.parametrize("chain,pieces", [((2, 5), 1), ((2, 5, 0), 8), ((7, 1, 3, 6), 8),
                                          ((0, 4, 2), 3)])
def test_the_state_goes_down_a_chain_of_receivers_in_pieces(chain, pieces):
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from jax_qcomm.runners import transfer

  rows = 8
  mesh = Mesh(np.array(jax.devices()[:rows]), ("node",))
  words = 37  # not a multiple of the pieces
  data = np.arange(rows * words, dtype=np.uint32).reshape(rows, words) * 2654435761
  program = transfer.relay(mesh, "node", chain, pieces)
  out = np.asarray(program(jax.device_put(data, NamedSharding(mesh, P("node")))))
  want = data.copy()
  want[list(chain[1:])] = data[chain[0]]
  np.testing.assert_array_equal(out, want)
  # Each link carries the words once: ticks = pieces + receivers - 1 collective-permutes, each
  # of one piece.
  hlo = program.lower(jax.ShapeDtypeStruct(data.shape, data.dtype,
                                           sharding=NamedSharding(mesh, P("node")))).as_text()
  permutes = [line for line in hlo.splitlines() if "collective_permute" in line and "=" in line]
  assert len(permutes) == pieces + len(chain) - 2, hlo
  size = -(-words // pieces)
  assert all(f"tensor<{size}xui32>" in line for line in permutes), permutes


def test_the_state_goes_over_tcp_down_a_chain_of_receivers_each_passing_it_on():
  import threading

  import numpy as np

  from jax_qcomm.runners import transfer

  data = (np.arange(300_001, dtype=np.uint32) * 2654435761).astype(np.uint32)
  toward = "127.0.0.1:1"  # the interface that routes there: the loopback
  address = transfer.serve(data, toward)
  # Three receivers: each passes what it takes to the next, which connects first or later.
  senders = [transfer.Sender(data.nbytes, toward) for _ in range(2)]
  sources = [address] + [s.address for s in senders]
  got = {}

  def take(i):
    got[i] = transfer.fetch(sources[i], data.nbytes,
                            passing=senders[i] if i < len(senders) else None)

  threads = [threading.Thread(target=take, args=(i,)) for i in (2, 0, 1)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  for i in range(3):
    np.testing.assert_array_equal(got[i], data)
  # The sender serves one connection: a second finds nothing there.
  with pytest.raises(OSError):
    transfer.fetch(address, data.nbytes, timeout_s=5)


def test_a_chain_broken_upstream_fails_every_receiver_after_it():
  import threading

  import numpy as np

  from jax_qcomm.runners import transfer

  toward, nbytes = "127.0.0.1:1", 4 * 100_000
  upstream = transfer.Sender(nbytes, toward)  # sends a quarter, then its end is gone
  passing = transfer.Sender(nbytes, toward)
  errors = {}

  def take(name, address, passing=None):
    try:
      transfer.fetch(address, nbytes, timeout_s=30, passing=passing)
    except OSError as error:
      errors[name] = str(error)

  threads = [threading.Thread(target=take, args=("first", upstream.address, passing)),
             threading.Thread(target=take, args=("second", passing.address))]
  for t in threads:
    t.start()
  upstream.put(bytes(nbytes // 4))
  upstream.close()
  for t in threads:
    t.join(60)
  assert set(errors) == {"first", "second"}, errors
  assert f"sent {nbytes // 4} of {nbytes} bytes" in errors["first"]
  # Another size than expected is refused before any data is taken.
  wrong = transfer.serve(np.zeros(7, np.uint32), toward)
  with pytest.raises(OSError, match="sent 0 of 32 bytes"):
    transfer.fetch(wrong, 32)


def test_a_receiver_makes_the_leaves_that_do_not_travel():
  import numpy as np

  from jax_qcomm.runners import transfer

  source = [np.arange(3, dtype=np.float32), np.ones((2, 2), np.int32),    # the parameters
            np.arange(3, dtype=np.float32)[None], np.full((3,), 7.0, np.float32),
            np.full((1, 2, 2), 1, np.int32)]
  plan = [None, None, 0, transfer.ZEROS, 1]
  sent = transfer.sent_leaves(source, plan)
  assert len(sent) == 2
  mine = [np.zeros_like(x) - 1 for x in source]  # the receiver's own, before
  got = transfer.received_leaves(transfer.unpack(transfer.pack(sent), sent), mine, plan)
  want = [source[0], source[1], source[0][None], np.zeros(3, np.float32), source[1][None]]
  for g, w in zip(got, want, strict=True):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g, w)


_SPARE_SCRIPT = """
import os, sys, time
from jax_qcomm.tools import distributed
distributed.initialize()
rank = int(os.environ["QCOMM_PROCESS_ID"])
print(f"joined rank={rank} pid={os.getpid()} spare={os.environ.get('QCOMM_SPARE')}", flush=True)
if rank == 1 and not os.path.exists(sys.argv[1]):
  open(sys.argv[1], "w").close()
  time.sleep(1.0)
  os.kill(os.getpid(), 9)
time.sleep(4.0)
"""


def test_a_lost_process_is_replaced_by_its_spare_and_the_spares_left_exit(tmp_path):
  script = tmp_path / "spare.py"
  script.write_text(_SPARE_SCRIPT)
  run = subprocess.run(
      [sys.executable, "-m", "jax_qcomm.tools.launch", "-n", "3", "--elastic", "--spare-delay",
       "0", "--heartbeat-timeout", "5", "--timeout", "120", str(script), str(tmp_path / "died")],
      capture_output=True, text=True, timeout=180)
  text = run.stdout + run.stderr
  assert run.returncode == 0, text[-4000:]
  assert "process 1 lost (was killed by SIGKILL (signal 9)); restarting it with rank 1 " \
         "(restart 1 of 3, a spare started ahead)" in text, text[-4000:]
  joined = re.findall(r"joined rank=(\d) pid=(\d+) spare=(\S+)", text)
  assert sorted(r for r, _, _ in joined) == ["0", "1", "1", "2"], text[-4000:]
  assert {s for _, _, s in joined} == {"None"}  # an activated spare leaves QCOMM_SPARE behind
  assert len({p for r, p, _ in joined if r == "1"}) == 2
  assert "final status" not in text  # the spares still waiting read EOF and exit with 0


def test_spare_delay_needs_elastic_and_seconds():
  from jax_qcomm.tools import launch

  with pytest.raises(ValueError, match="spare_delay needs elastic=True"):
    launch.launch(["-c", "pass"], 1, spare_delay=1.0)
  with pytest.raises(ValueError, match="spare_delay must be a number of seconds >= 0"):
    launch.launch(["-c", "pass"], 1, elastic=True, spare_delay=-1)
  for argv, message in (
      (["-n", "1", "--spare-delay", "1", "x.py"], "--spare-delay needs --elastic"),
      (["-n", "1", "--elastic", "--spare-delay", "-2", "x.py"], "must be >= 0")):
    run = subprocess.run([sys.executable, "-m", "jax_qcomm.tools.launch", *argv],
                         capture_output=True, text=True)
    assert run.returncode == 2 and message in run.stderr


class _Service:
  """A coordination-service client whose barrier over ``stuck`` never answers (a restarted
  member never asks), and whose keys hold the incarnations the processes published."""

  def __init__(self, live, published, stuck):
    self.live, self.published, self.stuck, self.dir_reads = live, published, stuck, 0

  def get_live_nodes(self, processes):
    if sorted(processes) == sorted(self.stuck):
      threading.Event().wait()
    return {p: self.live[p] for p in processes if p in self.live}

  def key_value_dir_get(self, directory):
    self.dir_reads += 1
    return [(f"{directory}{p}", str(i)) for p, i in self.published.items()]


def _bare_runner(service, me=0, n=3):
  from jax_qcomm.runners import elastic

  runner = object.__new__(elastic.ElasticDataParallel)
  runner._client, runner._me, runner._n = service, me, n
  return runner


def test_a_barrier_held_up_by_a_process_restarted_since_the_last_one_ends_without_it(
    monkeypatch):
  """Process 2 died after the last barrier and came back (a new incarnation) before this one:
  the service counts it live and it never asks, so the barrier would wait for ever. The round's
  check reads the incarnations the processes published and leaves it out instead."""
  from jax_qcomm.runners import elastic

  monkeypatch.setattr(elastic, "BARRIER_POLL_S", 0.05)
  expected = {0: 11, 2: 12}
  service = _Service(live={0: 11, 2: 99}, published={0: 11, 1: 5, 2: 99}, stuck=[0, 2])
  runner = _bare_runner(service)
  t0 = time.monotonic()
  with pytest.raises(elastic._Changed) as changed:
    runner._check_live(expected)
  assert time.monotonic() - t0 < 5 and service.dir_reads >= 1
  assert changed.value.live == {0: 11, 2: 99}  # 2's new incarnation: the round goes on without it
  # Nothing restarted: the barrier's own answer, and no reading of the keys.
  service = _Service(live={0: 11, 2: 12}, published={0: 11, 2: 12}, stuck=[])
  _bare_runner(service)._check_live(expected)
  assert service.dir_reads == 0
  # A member lost (not restarted) is the barrier's answer, as before.
  service = _Service(live={0: 11}, published={0: 11, 2: 12}, stuck=[])
  with pytest.raises(elastic._Changed) as changed:
    _bare_runner(service)._check_live(expected)
  assert changed.value.live == {0: 11}
