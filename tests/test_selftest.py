"""The kernels' known-answer test (jax_qcomm.native._selftest): qcomm.self_test(), the check impl="auto"
runs before trusting a platform's kernels, and the fallback with one warning when they fail."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_qcomm as qcomm
from jax_qcomm.native import _ffi, _selftest
from jax_qcomm.native._known_answers import KNOWN_ANSWERS

needs_kernels = pytest.mark.skipif(not _ffi.has_cpu_kernels(), reason="no compiled CPU kernels")


def test_known_answers_are_the_live_references():
  """The stored answers are what the pure-JAX reference computes today (~20 s: it compiles the
  whole reference for bits 1..8, both schemes, and Summable 2..8)."""
  assert _selftest.reference_digests() == KNOWN_ANSWERS


def test_inputs_cover_the_documented_cases():
  x = _selftest.inputs()
  assert x.shape == (_selftest.N,) and _selftest.N % _selftest.BUCKET  # a partial bucket
  assert np.isnan(x).any() and np.isinf(x).any() and (x == 0).sum() >= _selftest.BUCKET
  assert np.nanmax(np.abs(x[np.isfinite(x)])) == np.float32(3.4028235e38)
  tiny = np.abs(x[(x != 0) & np.isfinite(x)]).min()
  assert tiny < np.finfo(np.float32).tiny  # subnormals
  names = list(KNOWN_ANSWERS)
  assert [n for n in names if "maxmin" in n] == [f"QSGD {b}b/128 maxmin" for b in range(1, 9)]
  assert [n for n in names if "norm" in n] == [f"QSGD {b}b/128 norm" for b in range(2, 9)]
  assert [n for n in names if "Summable" in n] == [f"Summable {b}b/128" for b in range(2, 9)]


@needs_kernels
def test_self_test_passes_on_cpu_and_names_every_platform():
  report = qcomm.self_test()
  text = str(report)
  assert report.passed, text
  cpu = {r.platform: r for r in report.results}["cpu"]
  assert cpu.passed is True and cpu.cases == 22 and cpu.ms > 0
  assert "cpu" in text and "cuda" in text and "PASS" in text
  assert "known-answer test passed" in qcomm.implementation()["cpu"]


@needs_kernels
@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_self_test_passes_on_every_isa(isa):
  env = dict(os.environ, QCOMM_CPU_ISA=isa)
  env.pop("XLA_FLAGS", None)
  code = "import jax_qcomm as q; r = q.self_test(); raise SystemExit(0 if r.passed else 1)"
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=300)
  if "not supported" in proc.stderr:
    pytest.skip(f"this CPU lacks {isa}")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert f"ffi (C++, {isa})" in proc.stdout


@needs_kernels
def test_a_failing_kernel_falls_back_to_the_reference_with_one_warning(monkeypatch):
  """A kernel that gives other bytes than the reference: impl="auto" runs the reference, one
  warning names the failing case, implementation() says why; impl="ffi" still runs the kernel."""
  real = _ffi.qsgd_encode

  def broken(x, seed, *, bits, **kw):
    out = real(x, seed, bits=bits, **kw)
    return out.at[0].add(jnp.uint8(1)) if bits == 3 else out

  monkeypatch.setattr(_ffi, "qsgd_encode", broken)
  monkeypatch.setattr(_selftest, "_results", {})
  x = jnp.asarray(np.random.default_rng(0).standard_normal(1000), jnp.float32)
  key = jax.random.key(1)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = np.asarray(jax.jit(lambda v, k: qcomm.QSGD(4).encode(v, k))(x, key))
    np.asarray(jax.jit(lambda v, k: qcomm.QSGD(2).encode(v, k))(x, key))  # no second warning
  msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
  # One warning per platform whose kernels the broken encode breaks: the CPU's, and on a GPU
  # machine also the CUDA kernels' (the same _ffi entry point serves both).
  platforms = ["cpu"] + (["cuda"] if _ffi.has_cuda_kernels() and _selftest._devices("cuda") else [])
  assert len(msgs) == len(platforms), msgs
  assert all(f"compiled {p} kernels" in m and "QSGD 3b/128 maxmin" in m
             for p, m in zip(sorted(platforms), sorted(msgs))), msgs
  want = np.asarray(qcomm.QSGD(4, impl="jax").encode(x, key))
  np.testing.assert_array_equal(got, want)
  impl = qcomm.implementation()["cpu"]
  assert impl.startswith("jax (pure-JAX reference)") and "QSGD 3b/128 maxmin" in impl
  assert not qcomm.self_test().passed
  # impl="ffi" asked for the kernel: it runs, untested (here: the broken one).
  bad = np.asarray(jax.jit(lambda v, k: qcomm.QSGD(3, impl="ffi").encode(v, k))(x, key))
  assert not np.array_equal(bad, np.asarray(qcomm.QSGD(3, impl="jax").encode(x, key)))
