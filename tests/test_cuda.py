"""Tests of the CUDA kernels (kernels/qsgd_cuda.cu, xla_ffi/cuda_module.cc).

* ``test_cuda_module_built_where_nvcc_is_found`` runs everywhere (no GPU needed): where ``nvcc`` is
  on PATH the build must have produced ``jax_qcomm._qcomm_cuda``, registering the same FFI targets
  as the CPU module.
* The ``gpu``-marked tests (skipped without an NVIDIA GPU and the CUDA module; tests/conftest.py)
  hold the CUDA kernels to the CPU kernels: the same payload bytes for the same input and key, and
  the same decoded float32 values, bit for bit (a NaN's bit pattern aside: GPU arithmetic returns
  its canonical NaN 0x7fffffff where x86 propagates 0x7fc00000). Each comparison covers every byte
  of the output; outputs are also computed into buffers poisoned with two different patterns (where
  XLA reuses a donated buffer for the result), so unwritten bytes cannot pass by chance.
"""

from __future__ import annotations

import functools
import math
import shutil

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm.native import _ffi

TARGETS = {"qcomm_qsgd_encode", "qcomm_qsgd_decode_sum", "qcomm_qsgd_decode_sum_reencode"}
#: CPU only: qcomm.Summable has no CUDA kernel yet (GPUs run its pure-JAX reference; docs/cuda.md).
# CPU-only targets: the summable codec's, and QSGD's on a pytree's leaves in place (GPUs run the
# packed rows through the three targets above instead: QSGD._select(..., only=("cpu",))).
CPU_ONLY = {"qcomm_summable_scale", "qcomm_summable_encode", "qcomm_summable_decode",
            "qcomm_summable_scale_leaves", "qcomm_summable_encode_leaves",
            "qcomm_summable_decode_leaves", "qcomm_qsgd_encode_leaves",
            "qcomm_qsgd_decode_sum_reencode_own", "qcomm_qsgd_encode_chunks",
            "qcomm_qsgd_decode_sum_chunks", "qcomm_qsgd_encode_differences",
            "qcomm_qsgd_decode_chunks", "qcomm_qsgd_decode_pieces"}


# ---- the build (no GPU needed) ---------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: the CUDA module is not built")
def test_cuda_module_built_where_nvcc_is_found():
  from jax_qcomm import _qcomm_cpu, _qcomm_cuda  # noqa: F401  (ImportError = build did not make it)

  assert _ffi.has_cuda_kernels()
  cuda, cpu = _qcomm_cuda.registrations(), _qcomm_cpu.registrations()
  assert set(cuda) == TARGETS
  assert set(cuda) == set(cpu) - CPU_ONLY, "both platforms must register the same QSGD FFI targets"
  assert CPU_ONLY <= set(cpu)
  assert all(type(c).__name__ == "PyCapsule" for c in cuda.values())
  assert "80" in _qcomm_cuda.architectures() and "90" in _qcomm_cuda.architectures()
  assert _qcomm_cuda.cuda_runtime_version() >= 12000
  _ffi.register()  # registering the CUDA targets must not fail on a machine without a GPU


# ---- GPU vs CPU --------------------------------------------------------------------------------

def _gpu():
  return jax.devices("gpu")[0]


def _cpu():
  return jax.devices("cpu")[0]


def _run(device, fn, *args):
  """fn(*args) jitted on `device` (the FFI kernel of that platform), as numpy."""
  args = jax.device_put(args, device)
  return jax.tree.map(np.asarray, jax.jit(fn)(*args))


def _assert_same_floats(a, b, msg=""):
  """Bit-identical float32 arrays, NaNs compared as NaNs (their bit patterns may differ)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  assert a.shape == b.shape, msg
  na, nb = np.isnan(a), np.isnan(b)
  np.testing.assert_array_equal(na, nb, err_msg=f"{msg}: NaN positions")
  np.testing.assert_array_equal(np.where(na, 0, a.view(np.uint32)), np.where(nb, 0, b.view(np.uint32)),
                                err_msg=f"{msg}: float32 bits")


def _configs():
  """Every bits x scheme x rounding, the bucket size rotating through sizes that exercise every
  team size of the encode kernel (4..32 threads), buckets above 256 (values read twice) and odd
  payload sizes (unaligned payload rows)."""
  buckets = (8, 24, 128, 256, 264, 1024, 4104, 16, 40, 512)
  out = []
  for bits in range(1, 9):
    for scheme in ("maxmin", "norm"):
      if scheme == "norm" and bits < 2:
        continue
      for rounding in ("stochastic", "nearest"):
        out.append((bits, buckets[len(out) % len(buckets)], scheme, rounding))
  return out


CONFIGS = _configs()


def _cid(c):
  return f"b{c[0]}-B{c[1]}-{c[2]}-{c[3][:4]}"


def _sizes(bucket):
  """Tiny sizes, partial buckets, and a few thousand buckets."""
  return sorted({1, 7, 8, 9, bucket - 1, bucket, bucket + 1, 3 * bucket + 5, 1000, 100_003})


def _data(n, seed, special=True):
  r = np.random.default_rng(seed)
  x = (r.standard_normal(n) * np.exp(r.uniform(-3, 3, n))).astype(np.float32)
  if special and n > 600:
    x[100] = np.nan
    x[300] = np.inf
    x[301] = -np.inf
    x[500:520] = np.float32(1e-39)  # denormal inputs
    x[520:540] = -np.float32(3e-39)
    x[540:560] = np.float32(1e-30)  # squares and steps that underflow
    x[560:600] = 0.0
    x[580] = -0.0
  if special and n > 800:  # the ends of the float32 range (scaled buckets, capped norm steps)
    x[600:700] = np.clip(r.standard_normal(100), -1, 1) * np.float32(3.4e38)
    x[650] = np.finfo(np.float32).max
    x[700:760] = (2.0 + 0.1 * r.standard_normal(60)) * np.float32(1e-37)
    x[760:800] = r.standard_normal(40) * np.float32(2.0**-120)
    x[780] = np.float32(1e30)
  return x


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=_cid)
def test_encode_decode_bytes_equal_cpu(config):
  bits, bucket, scheme, rounding = config
  c = qcomm.QSGD(bits, bucket, scheme, rounding, impl="ffi")
  key = jax.random.key(bits * 1000 + bucket)
  sizes = _sizes(bucket)
  xs = [jnp.asarray(_data(n, n + bits)) for n in sizes]

  def fn(xs, key):
    out = []
    for x in xs:
      p = c.encode(x, key)
      out.append((p, c.decode(p, x.shape)))
    return out

  gpu, cpu = _run(_gpu(), fn, xs, key), _run(_cpu(), fn, xs, key)
  for n, (pg, dg), (pc, dc) in zip(sizes, gpu, cpu):
    assert pg.dtype == np.uint8 and pg.shape == (c.payload_size(n),)
    np.testing.assert_array_equal(pg, pc, err_msg=f"payload bytes, n={n}")
    _assert_same_floats(dg, dc, f"decode, n={n}")


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS[::3], ids=_cid)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_narrow_input_dtypes_and_shapes(config, dtype):
  bits, bucket, scheme, rounding = config
  c = qcomm.QSGD(bits, bucket, scheme, rounding, impl="ffi")
  key = jax.random.key(5)
  xs = [jnp.asarray(_data(math.prod(s), 3, special=False).reshape(s)).astype(dtype)
        for s in [(3, 5), (2, 3, 7), (bucket + 3,), (17, 31)]]

  def fn(xs, key):
    return [(c.encode(x, key), c.roundtrip(x, key)) for x in xs]

  for (pg, rg), (pc, rc) in zip(_run(_gpu(), fn, xs, key), _run(_cpu(), fn, xs, key)):
    np.testing.assert_array_equal(pg, pc)
    np.testing.assert_array_equal(np.asarray(rg).view(np.uint16), np.asarray(rc).view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=_cid)
@pytest.mark.parametrize("k,scale", [(1, 1.0), (3, 1.0 / 3.0), (8, 0.125)])
def test_decode_sum_and_reencode_equal_cpu(config, k, scale):
  bits, bucket, scheme, rounding = config
  c = qcomm.QSGD(bits, bucket, scheme, rounding, impl="ffi")
  n = 5 * bucket + 3
  xs = jnp.asarray(np.stack([_data(n, 10 + j) for j in range(k)]))
  keys = jax.random.split(jax.random.key(1), k)
  payloads = _run(_cpu(), jax.vmap(c.encode), xs, keys)
  key = jax.random.key(2)

  def fn(p, key):
    reduced = c.decode_sum(p, (n,))
    scaled = reduced if scale == 1.0 else reduced * jnp.float32(scale)
    return reduced, c.decode_sum_reencode(p, (n,), key, scale), c.encode(scaled, key)

  (sg, fg, ug), (sc, fc, uc) = _run(_gpu(), fn, payloads, key), _run(_cpu(), fn, payloads, key)
  _assert_same_floats(sg, sc, "decode_sum")
  np.testing.assert_array_equal(fg, fc, err_msg="fused reencode: gpu vs cpu")
  np.testing.assert_array_equal(fg, ug, err_msg="fused vs unfused on the gpu")
  np.testing.assert_array_equal(fc, uc, err_msg="fused vs unfused on the cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(4, 128, "maxmin", "stochastic"), (3, 24, "norm", "stochastic"),
                                    (7, 8, "maxmin", "nearest")], ids=_cid)
def test_vmapped_rows_unaligned(config):
  """Rows of odd sizes (unaligned float rows and payload rows) and more rows than gridDim.y."""
  bits, bucket, scheme, rounding = config
  c = qcomm.QSGD(bits, bucket, scheme, rounding, impl="ffi")
  for rows, n in [(5, 2 * bucket + 3), (70_000, 5)]:
    xs = jnp.asarray(_data(rows * n, rows, special=False).reshape(rows, n))
    keys = jax.random.split(jax.random.key(rows), rows)

    def fn(xs, keys):
      p = jax.vmap(c.encode)(xs, keys)
      d = jax.vmap(lambda q: c.decode(q, (n,)))(p)
      r = jax.vmap(lambda q, kk: c.decode_sum_reencode(jnp.stack([q, q]), (n,), kk, 0.5))(p, keys)
      return p, d, r

    for g, h, what in zip(_run(_gpu(), fn, xs, keys), _run(_cpu(), fn, xs, keys),
                          ("payloads", "decodes", "reencodes")):
      if what == "decodes":
        _assert_same_floats(g, h, f"rows={rows}")
      else:
        np.testing.assert_array_equal(g, h, err_msg=f"{what}, rows={rows}")


def _poisoned(fn, shape, dtype, fill):
  """jit of (poison, *args) -> fn(*args), the poison buffer donated: where XLA gives its memory to
  the result, bytes the kernel does not write keep the poison."""
  return jax.jit(lambda poison, *args: fn(*args), donate_argnums=0), jnp.full(shape, fill, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(4, 128, "maxmin", "stochastic"), (3, 24, "norm", "nearest"),
                                    (1, 8, "maxmin", "stochastic"), (5, 264, "norm", "stochastic")],
                         ids=_cid)
def test_every_output_byte_written(config):
  bits, bucket, scheme, rounding = config
  c = qcomm.QSGD(bits, bucket, scheme, rounding, impl="ffi")
  n = 7 * bucket + 5
  gpu = _gpu()
  x = jax.device_put(jnp.asarray(_data(n, 4)), gpu)
  key = jax.device_put(jax.random.key(4), gpu)
  p = c.payload_size(n)
  payloads = jax.device_put(jnp.stack([c.encode(x, key), c.encode(-x, key)]), gpu)
  want = _run(_cpu(), lambda x, k: (c.encode(x, k), c.decode_sum(jnp.stack([c.encode(x, k),
                                                                             c.encode(-x, k)]), (n,)),
                                    c.decode_sum_reencode(jnp.stack([c.encode(x, k), c.encode(-x, k)]),
                                                          (n,), k, 0.5)), x, key)
  cases = [(lambda x, k: c.encode(x, k), (p,), jnp.uint8, (x, key), want[0]),
           (lambda q: c.decode_sum(q, (n,)), (n,), jnp.float32, (payloads,), want[1]),
           (lambda q, k: c.decode_sum_reencode(q, (n,), k, 0.5), (p,), jnp.uint8, (payloads, key),
            want[2])]
  for fn, shape, dtype, args, expected in cases:
    for fill in ((0xAB, 0x54) if dtype == jnp.uint8 else (np.float32(-7.25e11), np.float32(3.5))):
      f, poison = _poisoned(fn, shape, dtype, fill)
      got = np.asarray(f(jax.device_put(poison, gpu), *args))
      if dtype == jnp.uint8:
        np.testing.assert_array_equal(got, expected, err_msg=f"poison {fill}")
      else:
        _assert_same_floats(got, expected, f"poison {fill}")


@pytest.mark.gpu
@pytest.mark.parametrize("codec", [qcomm.QSGD(4, 128), qcomm.QSGD(3, 24, "norm"),
                                   qcomm.QSGD(8, 512, rounding="nearest")], ids=str)
def test_allreduce_on_one_gpu_matches_cpu(codec):
  """qcomm.allreduce under shard_map over a 1-device GPU mesh gives the CPU's bits."""
  x = jnp.asarray(_data(3 * codec.bucket_size + 11, 9, special=False))
  key = jax.random.key(9)

  def run(device):
    mesh = Mesh(np.array([device]), ("d",))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
    def f(xs, key):
      return qcomm.allreduce(xs[0], "d", codec=codec, key=key)[None]

    xs = jax.device_put(x[None], NamedSharding(mesh, P("d")))
    return np.asarray(f(xs, jax.device_put(key, device)))[0]

  g, c = run(_gpu()), run(_cpu())
  _assert_same_floats(g, c, "allreduce")
  assert np.isfinite(g).all()


@pytest.mark.gpu
def test_ffi_errors_surface_on_gpu():
  """Bad attributes reach the CUDA handler's checks and come back as INVALID_ARGUMENT."""
  x = jax.device_put(jnp.ones((64,), jnp.float32), _gpu())
  seed = jax.device_put(jnp.zeros((2,), jnp.uint32), _gpu())
  with pytest.raises(Exception, match="bucket_size must be a positive multiple of 8"):
    jax.block_until_ready(_ffi.qsgd_encode(x, seed, bits=4, bucket_size=12, scheme="maxmin",
                                           rounding="nearest"))
