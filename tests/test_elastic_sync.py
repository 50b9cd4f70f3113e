"""Elastic per-step data parallelism across processes (``data_parallel(..., elastic=True)`` with a
``qcomm.sync``; jax_qcomm/runners/elastic_sync.py, launch --elastic): workers killed (SIGKILL, one or
two at once, rank 0 repeatedly) or stopped past the heartbeat timeout, restarted by the launcher
with their rank and admitted with the group's state; parameters bit-identical at every optimizer
step. tests/elastic_worker.py in its ``sync`` mode (a noisy linear regression, 4 bits, 2
accumulation steps); the helpers are tests/test_elastic.py's. A file of its own, so that it runs
beside test_elastic.py under pytest-xdist."""

import os
import re
import signal
import time

import pytest

from test_elastic import (_assert_programs_loaded_ahead, _check_run, _finish, _kill_mid_window,
                          _launch, _pids, _syncs, _wait)

SYNC_CALLS, SYNC_PAUSE = 1000, 0.03  # per-step sync: 500 optimizer steps of 2 calls


@pytest.fixture(scope="module")
def sync_uninterrupted(tmp_path_factory):
  out = tmp_path_factory.mktemp("elastic_sync_clean")
  _finish(_launch(out, SYNC_CALLS, "sync", SYNC_PAUSE))
  done = _check_run(out)
  assert done["replicas_per_sync"] == [3] * (SYNC_CALLS // 2)
  return done


def test_per_step_sync_survives_losses_mid_collective_in_an_admission_of_rank_zero_and_two(
    tmp_path, sync_uninterrupted):
  """Per-step data parallelism (qcomm.sync, 4 bits, 2 accumulation steps) under launch
  --elastic: rank 0 dies while the others wait in its step's collective, and rank 2 dies in the
  round that admits it (as the transfer of the state begins); rank 1 is killed; rank 0 again;
  ranks 1 and 2 at once; rank 2 stopped past the heartbeat timeout. Every loss is
  restarted and admitted, the run ends with exit 0, the parameters are bit-identical at every
  optimizer step, each short step is logged, and the final loss is within 2% of the
  uninterrupted run's."""
  out = tmp_path
  proc = _launch(out, SYNC_CALLS, "sync", SYNC_PAUSE, "collective@0", "admission@2")
  _wait(lambda: all(_pids(out, r) for r in range(3)), proc, "all to join")
  # Rank 0 dies mid-collective; rank 2 dies in the round that admits it; both rejoin.
  _wait(lambda: len(_pids(out, 0)) == 2 and len(_pids(out, 2)) == 2, proc,
        "ranks 0 and 2 to die (mid-collective, in the admission) and rejoin")
  _kill_mid_window(out, proc, 1, 10, SYNC_PAUSE)
  _kill_mid_window(out, proc, 0, 10, SYNC_PAUSE)
  _kill_mid_window(out, proc, 1, 10, SYNC_PAUSE, also=(2,))
  pid = _pids(out, 2)[-1]
  start = len(_syncs(out, 2, pid))
  _wait(lambda: len(_syncs(out, 2, pid)) >= start + 10, proc, "rank 2 syncs")
  os.kill(pid, signal.SIGSTOP)
  time.sleep(8.0)
  os.kill(pid, signal.SIGCONT)
  _wait(lambda: _pids(out, 2)[-1] != pid, proc, "rank 2 to rejoin")
  text = _finish(proc)
  assert text.count("restarting it with rank") == 7, text[-4000:]
  assert "rank 0 kills itself in _outer" in text and "rank 2 kills itself in _broadcast" in text
  _assert_programs_loaded_ahead(text)
  done = _check_run(out)
  replicas = done["replicas_per_sync"]
  assert len(replicas) == SYNC_CALLS // 2 and min(replicas) == 1 and replicas[-1] == 3
  assert re.search(r"step \d+ averaged 1 of 3 replicas \(missing \[1, 2\]\)", text), text[-4000:]
  assert re.search(r"averaged 2 of 3 replicas \(missing \[0\]\)[^\n]*, admitted \[0\]", text)
  # The admission that rank 2's death broke: ranks 0 and 2 admitted together afterwards.
  assert re.search(r"averaged 1 of 3 replicas \(missing \[0, 2\]\), admitted \[0, 2\]", text)
  want = sync_uninterrupted["loss"]
  assert abs(done["loss"] - want) <= 0.02 * want + 1e-5, (done["loss"], want)
