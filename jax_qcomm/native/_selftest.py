"""The known-answer test of the compiled kernels: they must give the pure-JAX reference's bytes.

Before a codec with ``impl="auto"`` runs a compiled kernel on a platform ("cpu", "cuda"), the
kernels of that platform are tested once per process on one of its devices (:func:`trusted`):
every kernel entry point -- QSGD encode, decode-and-sum and the fused decode-sum-reencode at bits
1..8 and both schemes, and the summable scale, encode and decode at bits 2..8 -- runs on inputs
that cover whole and partial buckets, zeros, the float32 extremes, subnormals, NaN and infinities,
and the SHA-256 of each output is compared with the pure-JAX reference's for the same inputs and
seed (:data:`KNOWN_ANSWERS`, checked against the live reference by the test suite; compiling the
reference at run time would cost ~20 s per process, the kernels alone well under one). A platform whose
kernels disagree falls back to the reference with one warning naming the first failing case;
:func:`jax_qcomm.implementation` says which implementation runs and why.

:func:`self_test` runs the same test on demand for every local platform (``qcomm.self_test()``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import warnings
from typing import Callable

import numpy as np

import jax
import jax.numpy as jnp

from jax_qcomm.native import _ffi, _reference
from jax_qcomm._checks import check_bool
from jax_qcomm.native._known_answers import KNOWN_ANSWERS

N = 2 * 1024 + 77  # 16 whole buckets of 128 and a partial one
BUCKET = 128
SCHEMES = ("maxmin", "norm")
ROUNDING = "stochastic"
SEED = np.array([0x12345678, 0x9ABCDEF0], np.uint32)

# platform -> (passed, first failing case or "", milliseconds); filled by _run.
_results: dict[str, tuple[bool, str, float]] = {}


def inputs() -> np.ndarray:
  """float32[N]: buckets of normals at several scales, a zero bucket, the extremes, subnormals,
  a NaN bucket and an infinity bucket, then a partial bucket."""
  rng = np.random.default_rng(20261124)
  x = rng.standard_normal(N).astype(np.float32)
  b = BUCKET
  x[0:b] *= np.float32(1e-30)
  x[b:2 * b] *= np.float32(1e30)
  x[2 * b:3 * b] = 0.0
  x[3 * b:4 * b:2] = np.float32(3.4028235e38)
  x[3 * b + 1:4 * b:2] = np.float32(-3.4028235e38)
  x[4 * b:5 * b] = np.float32(1e-40) * rng.standard_normal(b).astype(np.float32)  # subnormals
  x[5 * b + 7] = np.nan
  x[6 * b + 3] = np.inf
  x[7 * b:8 * b] = np.abs(x[7 * b:8 * b])  # one sign only
  x[8 * b:9 * b] = np.float32(2.0)  # constant
  return x


def _cases() -> list[tuple[str, Callable]]:
  """(name, fn(x, seed, ffi: bool) -> uint32 words) for every kernel entry point and format."""
  cases = []
  for scheme in SCHEMES:
    for bits in range(2 if scheme == "norm" else 1, 9):
      kw = dict(bits=bits, bucket_size=BUCKET, scheme=scheme)

      def qsgd(x, seed, ffi, kw=kw):
        enc = (lambda a, s: _ffi.qsgd_encode(a, s, rounding=ROUNDING, **kw)) if ffi else \
            (lambda a, s: _reference.encode(a, s, rounding=ROUNDING, **kw))
        dec = (lambda p: _ffi.qsgd_decode_sum(p, N, **kw)) if ffi else \
            (lambda p: _reference.decode_sum(p, N, **kw))
        p0 = enc(x, seed)
        p1 = enc(x[::-1], seed + jnp.uint32(1))
        payloads = jnp.stack([p0, p1])
        summed = dec(payloads)
        if ffi:
          again = _ffi.qsgd_decode_sum_reencode(payloads, seed, N, 0.5, rounding=ROUNDING, **kw)
        else:
          again = _reference.encode(summed * jnp.float32(0.5), seed, rounding=ROUNDING, **kw)
        return [p0, p1, summed, again]

      cases.append((f"QSGD {bits}b/{BUCKET} {scheme}", qsgd))
  for bits in range(2, 9):
    kw = dict(bits=bits, bucket_size=BUCKET)

    def summable(x, seed, ffi, kw=kw):
      scale = (lambda a: _ffi.summable_scale(a, bucket_size=BUCKET)) if ffi else \
          (lambda a: _reference.summable_bucket_scale(a, BUCKET))
      enc = _ffi.summable_encode if ffi else _reference.summable_encode
      dec = _ffi.summable_decode if ffi else _reference.summable_decode
      shared = jnp.maximum(scale(x), scale(x[::-1]))
      w0 = enc(x, shared, seed, devices=2, rounding=ROUNDING, **kw)
      w1 = enc(x[::-1], shared, seed + jnp.uint32(1), devices=2, rounding=ROUNDING, **kw)
      out = dec(w0 + w1, shared, N, devices=2, count=2, scale=0.5, **kw)
      return [shared, w0, w1, out]

    cases.append((f"Summable {bits}b/{BUCKET}", summable))
  return cases


def digest(a) -> str:
  """The first 16 hex digits of the SHA-256 of an output's bytes. In float outputs every NaN is
  hashed as the one NaN 0x7fc00000: where a NaN is belongs to the format, its bit pattern does not
  (x86 propagates 0x7fc00000, GPU arithmetic returns 0x7fffffff)."""
  a = np.ascontiguousarray(np.asarray(a))
  if a.dtype.kind == "f":
    a = np.where(np.isnan(a), np.array(np.nan, a.dtype), a)
  return hashlib.sha256(a.tobytes()).hexdigest()[:16]


def _platform_cases(platform: str) -> list[tuple[str, Callable]]:
  return [(name, fn) for name, fn in _cases()
          if platform == "cpu" or name.startswith("QSGD")]  # no summable CUDA kernel


def _outputs(cases, ffi: bool, device) -> list[list[str]]:
  """Digests of every case's outputs, computed on ``device`` (one jit for all cases)."""
  # Evaluated now, also when the first use is inside another function's trace (jit, shard_map).
  with jax.ensure_compile_time_eval(), jax.default_device(device):
    outs = jax.jit(lambda v, s: [fn(v, s, ffi) for _, fn in cases])(inputs(), SEED)
    return [[digest(o) for o in case] for case in outs]


def reference_digests(device=None) -> dict[str, list[str]]:
  """The pure-JAX reference's answers for every case (what :data:`KNOWN_ANSWERS` holds; the test
  suite checks that the two agree). Compiles the whole reference: about 20 s on a CPU."""
  device = device or jax.devices("cpu")[0]
  cases = _cases()
  return dict(zip((name for name, _ in cases), _outputs(cases, False, device)))


def _run(platform: str, device) -> tuple[bool, str, float]:
  """Runs every kernel case on ``device`` and compares its outputs with the known answers."""
  start = time.perf_counter()
  cases = _platform_cases(platform)
  failed = ""
  for (name, _), got in zip(cases, _outputs(cases, True, device)):
    want = KNOWN_ANSWERS[name]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if bad:
      failed = f"{name}, output {bad[0]} ({('payload', 'payload', 'decoded sum', 'fused re-encode') if name.startswith('QSGD') else ('scales', 'words', 'words', 'decoded sum')}[{bad[0]}])"
      break
  return not failed, failed, 1e3 * (time.perf_counter() - start)


def _devices(platform: str) -> list:
  """This process's devices of a platform (in a multi-process run, the test runs on its own)."""
  try:
    return jax.local_devices(backend="gpu" if platform == "cuda" else platform)
  except RuntimeError:
    return []


def trusted(platform: str) -> bool:
  """True if the compiled kernels of ``platform`` passed the known-answer test on its first
  device (run once per process), or if there is no device of that platform here (nothing runs
  there). False, with one warning, if they failed it."""
  if platform not in _results:
    devices = _devices(platform)
    if not devices:
      return True
    _results[platform] = _run(platform, devices[0])
    ok, failed, _ = _results[platform]
    if not ok:
      warnings.warn(f"jax_qcomm: the compiled {platform} kernels failed their known-answer test "
                    f"({failed}); codecs with impl='auto' run the pure-JAX reference there "
                    f"(qcomm.self_test() shows the report)", RuntimeWarning, stacklevel=3)
  return _results[platform][0]


def status(platform: str) -> tuple[bool, str, float] | None:
  """(passed, first failing case, ms) once :func:`trusted` has run for ``platform``, else None."""
  return _results.get(platform)


@dataclasses.dataclass(frozen=True)
class PlatformResult:
  """One platform's known-answer test: ``passed`` is None where it did not run, with the reason
  in ``detail``."""

  platform: str
  implementation: str
  passed: bool | None
  detail: str
  cases: int
  ms: float


@dataclasses.dataclass(frozen=True)
class SelfTestReport:
  """What :func:`jax_qcomm.self_test` found, per platform; ``str()`` is a readable report and
  ``passed`` is False if any compiled kernel disagreed with the reference."""

  results: tuple[PlatformResult, ...]

  @property
  def passed(self) -> bool:
    return all(r.passed is not False for r in self.results)

  def __str__(self) -> str:
    lines = ["jax_qcomm self-test: compiled kernels against the pure-JAX reference's bytes "
             f"({N} values: buckets of normals at 1e-30..1e30, zeros, +-3.4e38, subnormals, NaN, "
             f"inf, a partial bucket)"]
    for r in self.results:
      verdict = {True: "PASS", False: "FAIL", None: "not run"}[r.passed]
      lines.append(f"  {r.platform:<5} {verdict:<8} {r.implementation}: {r.detail}")
    lines.append("result: " + ("PASS" if self.passed else "FAIL"))
    return "\n".join(lines)

  __repr__ = __str__


def self_test(verbose: bool = True) -> SelfTestReport:
  """Runs the kernels' known-answer test now, on the first device of every local platform with
  compiled kernels, prints the report (unless ``verbose=False``) and returns it (``.passed``). The
  same test runs on its own, once per process and platform, before ``impl="auto"`` first uses a
  platform's kernels.

  Example (``python -c "import jax_qcomm as q; q.self_test()"``)::

    >>> report = qcomm.self_test()   # doctest: +SKIP
    jax_qcomm self-test: compiled kernels against the pure-JAX reference's bytes (...)
      cpu   PASS     ffi (C++, avx2): 22 cases (...) give the reference's bytes on cpu:0 (910 ms)
      cuda  not run  jax (pure-JAX reference): no compiled kernels in this install
    result: PASS
  """
  verbose = check_bool("verbose", verbose)
  out = []
  for platform in ("cpu", "cuda"):
    kernels = {"cpu": _ffi.has_cpu_kernels(), "cuda": _ffi.has_cuda_kernels()}[platform]
    devices = _devices(platform)
    impl = _ffi.implementation()[platform]
    if not kernels:
      out.append(PlatformResult(platform, impl, None, "no compiled kernels in this install", 0, 0.0))
      continue
    if not devices:
      out.append(PlatformResult(platform, impl, None,
                                f"no {platform} device here (kernels built, not tested)", 0, 0.0))
      continue
    ok, failed, ms = _results[platform] = _run(platform, devices[0])
    n = len(_platform_cases(platform))
    detail = (f"{n} cases (QSGD bits 1..8 x maxmin/norm: encode, decode-sum, decode-sum-reencode"
              + ("; Summable bits 2..8: scale, encode, decode" if platform == "cpu" else "")
              + f") give the reference's bytes on {devices[0]} ({ms:.0f} ms)" if ok
              else f"MISMATCH with the reference: {failed}")
    out.append(PlatformResult(platform, impl, ok, detail, n, ms))
  report = SelfTestReport(tuple(out))
  if verbose:
    print(report)
  return report


def implementation() -> dict[str, str]:
  """What ``impl="auto"`` codecs run on each platform: the compiled kernels (``"ffi (C++, avx2)"``,
  ``"ffi (CUDA)"``) with the state of their known-answer test (pending until first use, passed),
  or the pure-JAX reference, with the reason (no kernels built, or the kernels failed the test).
  Public as ``jax_qcomm.implementation()``."""
  out = {}
  for platform, compiled in _ffi.implementation().items():
    result = _results.get(platform)
    if not compiled.startswith("ffi"):
      out[platform] = compiled
    elif result is None and not _devices(platform):
      out[platform] = f"{compiled}; no {platform} device here"
    elif result is None:
      out[platform] = f"{compiled}; known-answer test at first use"
    elif result[0]:
      out[platform] = f"{compiled}; known-answer test passed ({result[2]:.0f} ms)"
    else:
      out[platform] = (f"jax (pure-JAX reference): the compiled kernels failed their known-answer "
                       f"test ({result[1]})")
  return out
