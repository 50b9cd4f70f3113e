"""Collectives across several JAX processes (jax.distributed over gloo on 127.0.0.1).

Two launches of tests/mp_worker.py through ``python -m jax_qcomm.tools.launch`` (2 processes x 2 host
devices, and 4 processes x 1 device with gloo bound to ``lo``); each process writes the rows its
devices hold, and the checks here run in numpy against the exact results of the known inputs:

* QSGD within 2 quantisation steps of the exact mean (the step of each bucket: its range / levels
  for maxmin, its L2 norm / levels for norm, the largest over the devices' inputs);
* NoCompression exact (1e-6), Cast(bf16) within bf16 rounding of inputs and result;
* every device of every process ends an allreduce / all_gather bit-identical.

The 2-D cases use the mesh ("proc", "local"): a tuple axis name, and Hierarchical(inner="local",
outer="proc") -- with one device per process its inner axis has size 1, a degenerate but valid case.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

import mp_worker
from mp_worker import CASES, OWN_TREE_SHAPES, RS_BLOCK, TREE_SHAPES, inputs

pytestmark = pytest.mark.multiprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = pathlib.Path(mp_worker.__file__).resolve()
LAUNCH_TIMEOUT = 150  # seconds the launcher lets the workers run before killing them
BUCKET = 128

# (processes, devices per process, extra launcher options)
CONFIGS = {"2x2": (2, 2, []), "4x1": (4, 1, ["--interface", "lo"])}


def _run_launcher(args, timeout):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the workers set their own device count
  return subprocess.run([sys.executable, "-m", "jax_qcomm.tools.launch", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def run(request, tmp_path_factory):
  """Launches the workers once per configuration; returns (config, {key: [row per process]})."""
  nproc, local, extra = CONFIGS[request.param]
  out = tmp_path_factory.mktemp(f"mp_{request.param}")
  start = time.monotonic()
  try:
    proc = _run_launcher(["-n", str(nproc), "--local-devices", str(local),
                          "--timeout", str(LAUNCH_TIMEOUT), *extra, str(WORKER), str(out)],
                         timeout=LAUNCH_TIMEOUT + 30)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"launcher hung past {LAUNCH_TIMEOUT + 30} s:\n{e.stdout}\n{e.stderr}")
  log = f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
  assert proc.returncode == 0, f"launcher exited {proc.returncode}\n{log}"
  print(f"{request.param}: {time.monotonic() - start:.1f} s")
  per_proc = []
  for p in range(nproc):
    with np.load(out / f"proc{p}.npz") as f:
      per_proc.append({k: f[k] for k in f.files})
  return dict(name=request.param, nproc=nproc, local=local, devices=nproc * local,
              per_proc=per_proc, log=log, out=out)


def rows(run, case, leaf="x"):
  """[D, ...] outputs of every global device (each from the process that owns it)."""
  d, local = run["devices"], run["local"]
  out = [run["per_proc"][g // local][f"{case}/{leaf}/{g}"] for g in range(d)]
  if leaf in TREE_SHAPES and TREE_SHAPES[leaf][1] == "bfloat16" and case.startswith("tree"):
    out = [r.view(ml_dtypes.bfloat16) for r in out]
  return np.stack(out)


def stacked_inputs(run, case, leaf="x"):
  d = run["devices"]
  return np.stack([inputs(case, g, d)[leaf] for g in range(d)]).astype(np.float32)


def qsgd_step(xs, bits, scheme, bucket=BUCKET):
  """Per-element quantisation step: per bucket of each device's flat input, the largest over the
  devices of range / levels (maxmin) or L2 norm / levels (norm). xs: [D, n] -> [n]."""
  d, n = xs.shape
  pad = -n % bucket
  if pad:  # pad like the library does: the last value (maxmin) keeps the range, 0 keeps the norm
    fill = xs[:, -1:] if scheme == "maxmin" else np.zeros((d, 1), np.float32)
    xs = np.concatenate([xs, np.repeat(fill, pad, axis=1)], axis=1)
  b = xs.reshape(d, -1, bucket).astype(np.float64)
  if scheme == "maxmin":
    step = (b.max(-1) - b.min(-1)) / ((1 << bits) - 1)
  else:
    step = np.sqrt((b * b).sum(-1)) / ((1 << (bits - 1)) - 1)
  return np.repeat(step.max(0), bucket)[:n]


def assert_identical_rows(out, what):
  for g in range(1, out.shape[0]):
    assert np.array_equal(out[g].view(np.uint8), out[0].view(np.uint8)), \
        f"{what}: device {g} differs from device 0"


ALLREDUCE_CASES = [c for c, v in CASES.items() if v[0] == "allreduce"]


@pytest.mark.parametrize("case", ALLREDUCE_CASES)
def test_allreduce(run, case):
  _, desc, _, op = CASES[case]
  xs = stacked_inputs(run, case)
  exact = xs.astype(np.float64).sum(0) / (1 if op == "sum" else xs.shape[0])
  out = rows(run, case)
  assert out.dtype == np.float32 and out.shape == xs.shape
  assert_identical_rows(out, case)
  err = np.abs(out[0].astype(np.float64) - exact)
  if desc[0] == "none":
    np.testing.assert_allclose(out[0], exact, rtol=1e-6, atol=1e-6)
  elif desc[0] == "cast":
    tol = 2.0**-8 * (np.abs(xs).mean(0) + np.abs(exact)) + 1e-7
    assert np.all(err <= tol), f"{case}: max err/tol {np.max(err / tol):.3f}"
  else:
    scale = xs.shape[0] if op == "sum" else 1
    tol = 2 * scale * qsgd_step(xs, desc[1], desc[2]) + 1e-6
    assert np.all(err <= tol), f"{case}: max err/tol {np.max(err / tol):.3f}"
    assert np.mean(err) < 0.5 * np.mean(tol), f"{case}: mean error {np.mean(err)} too large"


def test_powersgd_tree_across_processes_matches_the_float64_simulation(run):
  """PowerSGD(2) over gloo between processes: every device the same bits, each leaf the float64
  simulation's result from the Q that qcomm.allreduce draws from its key (small and 1-D leaves
  exact)."""
  import jax
  from test_powersgd import _oracle

  import jax_qcomm as qcomm
  from jax_qcomm import collectives

  case, d = "tree_powersgd2", run["devices"]
  codec = qcomm.PowerSGD(2)
  shapes = {leaf: np.zeros(shape, np.float32) for leaf, (shape, _) in TREE_SHAPES.items()}
  states = collectives.init_codec_state(shapes, codec, None,
                                        collectives.fresh_state_key(jax.random.key(1234)))
  policy = qcomm.LeafPolicy()
  for (leaf, (shape, dtype)), q in zip(sorted(TREE_SHAPES.items()), states):
    xs = stacked_inputs(run, case, leaf)
    out = rows(run, case, leaf)
    assert_identical_rows(out, f"{case}/{leaf}")
    sent = policy.codec_for(leaf, np.zeros(shape), codec) == codec and codec.compresses(shape)
    assert isinstance(q, tuple) != sent
    want, _, _ = _oracle(xs, None if isinstance(q, tuple) else np.asarray(q, np.float64), 2, d)
    tol = 2.0**-8 * np.abs(want) + 1e-5 if dtype == "bfloat16" else 1e-4 * np.abs(want) + 1e-5
    err = np.abs(out[0].astype(np.float64) - want)
    assert np.all(err <= tol), f"{case}/{leaf}: max err/tol {np.max(err / tol):.3f}"


def test_allreduce_tree(run):
  case = "tree_qsgd4"
  d = run["devices"]
  _, (_, bits, scheme), _, _ = CASES[case]
  for leaf, (shape, dtype) in TREE_SHAPES.items():
    xs = stacked_inputs(run, case, leaf).reshape(d, -1)
    exact = xs.astype(np.float64).mean(0)
    out = rows(run, case, leaf)
    assert out.shape == (d,) + shape and out.dtype == np.dtype(getattr(ml_dtypes, dtype, dtype))
    assert_identical_rows(out, f"{case}/{leaf}")
    got = out[0].astype(np.float64).reshape(-1)
    compressed = len(shape) > 1 and int(np.prod(shape)) >= 1024
    if compressed:
      tol = 2 * qsgd_step(xs, bits, scheme) + 1e-6
    else:
      tol = np.full(exact.shape, 1e-6)
    if dtype == "bfloat16":  # the result is rounded to bfloat16 as well
      tol = tol + 2.0**-8 * np.abs(exact)
    err = np.abs(got - exact)
    assert np.all(err <= tol), f"{case}/{leaf}: max err/tol {np.max(err / tol):.3f}"


def test_exact_tree_across_processes_sends_large_leaves_as_their_own_operands(run):
  """Over gloo the exact path reduces a leaf of at least the transport's own_operand values as its
  own all-reduce operand and packs the rest: the result is the mean on every device, bit-identical,
  and the compiled program's operands show the split."""
  case, d = "tree_fp32_own", run["devices"]
  for leaf, (shape, _) in OWN_TREE_SHAPES.items():
    xs = stacked_inputs(run, case, leaf)
    out = rows(run, case, leaf)
    assert out.shape == (d,) + shape and out.dtype == np.float32
    assert_identical_rows(out, f"{case}/{leaf}")
    np.testing.assert_allclose(out[0], xs.astype(np.float64).mean(0), rtol=1e-6, atol=1e-6)
  for p in range(run["nproc"]):
    operands = " ".join(json.loads((run["out"] / f"proc{p}_own.json").read_text()))
    big = OWN_TREE_SHAPES["big"][0]
    assert f"f32[{big[0]},{big[1]}]" in operands or f"f32[{big[0] * big[1]}]" in operands, operands
    assert f"f32[{300 * 7 + 40}]" in operands, operands


@pytest.mark.parametrize("case", ["rs_qsgd4", "rs_fp32"])
def test_reduce_scatter(run, case):
  d = run["devices"]
  _, desc, _, _ = CASES[case]
  xs = stacked_inputs(run, case)  # [D, D * RS_BLOCK]
  exact = xs.astype(np.float64).mean(0).reshape(d, RS_BLOCK)
  out = rows(run, case)  # [D, RS_BLOCK]: device g holds block g
  assert out.shape == (d, RS_BLOCK)
  for g in range(d):
    err = np.abs(out[g] - exact[g])
    if desc[0] == "none":
      np.testing.assert_allclose(out[g], exact[g], rtol=1e-6, atol=1e-6)
    else:  # each block encoded on its own: buckets start at the block
      block = xs[:, g * RS_BLOCK:(g + 1) * RS_BLOCK]
      tol = 2 * qsgd_step(block, desc[1], desc[2]) + 1e-6
      assert np.all(err <= tol), f"{case} block {g}: max err/tol {np.max(err / tol):.3f}"


@pytest.mark.parametrize("case", ["ag_default", "ag_qsgd4"])
def test_all_gather(run, case):
  d = run["devices"]
  _, desc, _, _ = CASES[case]
  bits, scheme = (8, "maxmin") if desc[0] == "default" else desc[1:]
  xs = stacked_inputs(run, case)  # [D, AG_LEN]
  out = rows(run, case)  # [D, D, AG_LEN]: every device sees every device's row
  assert out.shape == (d,) + xs.shape
  assert_identical_rows(out, case)
  for g in range(d):
    tol = 2 * qsgd_step(xs[g:g + 1], bits, scheme) + 1e-6
    err = np.abs(out[0, g] - xs[g])
    assert np.all(err <= tol), f"{case} row {g}: max err/tol {np.max(err / tol):.3f}"


def test_cpu_exchange_across_processes_is_ppermute_rounds(run):
  """Across processes on CPU the SRA's all-to-all runs as ppermute rounds (jax_qcomm.transport._exchange):
  4 devices, six Hamiltonian half-row rounds; the results above are those of lax.all_to_all."""
  for p in range(run["nproc"]):
    counts = json.loads((run["out"] / f"proc{p}_hlo.json").read_text())
    assert counts == {"collective_permute": 6, "all_to_all": 0}, (p, counts)


def test_all_processes_wrote_their_devices(run):
  local = run["local"]
  for p, got in enumerate(run["per_proc"]):
    owned = {int(k.rsplit("/", 1)[1]) for k in got}
    assert owned == set(range(p * local, (p + 1) * local)), f"process {p} wrote {sorted(owned)}"


# -- the launcher itself (no JAX computation in the children) ----------------------------------------

def test_launcher_propagates_failure_and_kills_the_others(tmp_path):
  script = tmp_path / "fail.py"
  script.write_text(
      "import os, sys, time\n"
      "rank = int(os.environ['QCOMM_PROCESS_ID'])\n"
      "print('hello from', rank, os.environ['QCOMM_NUM_PROCESSES'], os.environ['QCOMM_COORDINATOR'],"
      " flush=True)\n"
      "if rank == 1:\n"
      "    time.sleep(2)  # let the others start and print before the failure kills them\n"
      "    sys.exit(3)\n"
      "time.sleep(60)\n")
  start = time.monotonic()
  proc = _run_launcher(["-n", "3", "--kill-grace", "1", str(script)], timeout=60)
  assert proc.returncode == 3, proc.stderr
  assert time.monotonic() - start < 30
  for rank in range(3):
    assert f"[{rank}] hello from {rank} 3 127.0.0.1:" in proc.stdout
  assert "process 1 exited with status 3" in proc.stderr


def test_launcher_timeout_and_module_mode(tmp_path):
  (tmp_path / "sleeper_mod.py").write_text(
      "import sys, time\nprint('args', sys.argv[1:])\ntime.sleep(60)\n")
  env_path = str(tmp_path)
  proc = subprocess.run(
      [sys.executable, "-m", "jax_qcomm.tools.launch", "-n", "2", "--timeout", "3", "--kill-grace", "1",
       "-m", "sleeper_mod", "--sizes", "5"],
      cwd=ROOT, env=dict(os.environ, PYTHONPATH=env_path + os.pathsep + os.environ.get("PYTHONPATH", "")),
      capture_output=True, text=True, timeout=60)
  assert proc.returncode == 124, proc.stderr
  assert "[0] args ['--sizes', '5']" in proc.stdout and "[1] args" in proc.stdout
  assert "timeout" in proc.stderr


def test_initialize_after_backend_raises():
  code = ("import jax; jax.devices()\n"
          "from jax_qcomm.tools import distributed\n"
          "try:\n"
          "    distributed.initialize('127.0.0.1:1', 1, 0, interface='lo')\n"
          "except RuntimeError as e:\n"
          "    print('RuntimeError', e)\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "RuntimeError jax_qcomm.tools.distributed.initialize:" in proc.stdout, proc.stdout
  assert "must be called before any JAX calls" in proc.stdout, proc.stdout


def test_importing_jax_qcomm_creates_no_backend():
  """distributed.initialize must run before any backend exists, and users import jax_qcomm first:
  nothing at import time may create one (e.g. a jnp constant at module level)."""
  # jax refuses to change jax_num_cpu_devices once a backend exists.
  code = ("import jax, jax_qcomm, jax_qcomm.tools.distributed, jax_qcomm.tools.launch\n"
          "jax.config.update('jax_num_cpu_devices', 3)\n"
          "print(len(jax.devices()))\n")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                        env=env)
  assert proc.returncode == 0 and proc.stdout.split() == ["3"], proc.stdout + proc.stderr[-3000:]
