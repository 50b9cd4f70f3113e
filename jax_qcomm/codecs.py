"""Codecs: how an array is turned into bytes on the wire and back.

Every codec maps an array of any shape to one flat ``uint8`` payload (``encode``), back to an
array (``decode``), and sums several payloads in float32 (``decode_sum``, the middle of a
compressed allreduce). Payload layouts are specified in docs/wire-format.md.

* :class:`QSGD` -- per-bucket quantisation to 1..8 bits with stochastic or nearest rounding;
  two implementations of one format: the C++/CUDA FFI kernels and a pure-JAX reference.
* :class:`Cast` -- bfloat16 / float16 bits on the wire, float32 accumulation.
* :class:`NoCompression` -- float32 bytes (collectives use plain ``psum`` for it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm import _ffi, _reference, wire

Shape = Sequence[int]
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
IMPLS = ("auto", "ffi", "jax")


def is_float_dtype(dtype: Any) -> bool:
  """float32, bfloat16 or float16: the dtypes codecs and collectives accept."""
  return any(jnp.dtype(dtype) == d for d in FLOAT_DTYPES)


def _check_float(x: jax.Array, name: str = "x") -> None:
  if not is_float_dtype(x.dtype):
    raise ValueError(f"{name} must be a float32, bfloat16 or float16 array, got dtype {x.dtype}")


def _check_out_dtype(dtype: Any) -> jnp.dtype:
  dtype = jnp.dtype(dtype)
  if not is_float_dtype(dtype):
    raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
  return dtype


def _check_payload(payload: jax.Array, expected: int, lead: tuple[int, ...] = ()) -> None:
  if payload.dtype != jnp.uint8:
    raise ValueError(f"payload must be a uint8 array, got dtype {payload.dtype}")
  if tuple(payload.shape) != lead + (expected,):
    raise ValueError(f"payload must have shape {lead + (expected,)} for this shape and codec, "
                     f"got {tuple(payload.shape)}")


def seed_words(key: jax.Array) -> jax.Array:
  """Two uint32 words drawn from a JAX PRNG key (typed or raw): the codec's rounding seed."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.shape != ():
      raise ValueError(f"key must be a single PRNG key, got a key array of shape {key.shape}")
  elif not (key.dtype == jnp.uint32 and key.ndim == 1):
    raise ValueError("key must be a JAX PRNG key (jax.random.key(...) or jax.random.PRNGKey(...)), "
                     f"got an array of dtype {key.dtype} and shape {key.shape}")
  return jax.random.bits(key, (2,), jnp.uint32)


def _sum_in_order(vals: jax.Array) -> jax.Array:
  """vals[0] + vals[1] + ... in float32, unrolled: XLA CPU's reduce over a short axis is slow."""
  out = vals[0]
  for j in range(1, vals.shape[0]):
    out = out + vals[j]
  return out


class Codec:
  """Interface shared by the codecs. Subclasses implement the flat float32 methods."""

  #: True if the codec discards information (collectives then quantise each value twice).
  lossy: bool = True

  def payload_size(self, n: int) -> int:
    """Bytes of the payload of an array of n elements."""
    raise NotImplementedError

  def wire_bits(self) -> float:
    """Bits on the wire per element, for whole buckets."""
    raise NotImplementedError

  def encode(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """Encodes x (any shape; float32/bfloat16/float16) to uint8[payload_size(x.size)]."""
    x = jnp.asarray(x)
    _check_float(x)
    flat = x.reshape(-1).astype(jnp.float32)
    return self._encode_flat(flat, key)

  def decode(self, payload: jax.Array, shape: Shape, dtype: Any = jnp.float32) -> jax.Array:
    """Decodes a payload made by ``encode`` of an array of ``shape``; returns ``dtype``."""
    shape = tuple(int(d) for d in shape)
    dtype = _check_out_dtype(dtype)
    n = math.prod(shape)
    _check_payload(payload, self.payload_size(n))
    return self._decode_sum_flat(payload[None], n).reshape(shape).astype(dtype)

  def decode_sum(self, payloads: jax.Array, shape: Shape, dtype: Any = jnp.float32) -> jax.Array:
    """Sum of the decodes of payloads[k, P] (float32 accumulation, in order 0..k-1)."""
    shape = tuple(int(d) for d in shape)
    dtype = _check_out_dtype(dtype)
    n = math.prod(shape)
    if payloads.ndim != 2 or payloads.shape[0] < 1:
      raise ValueError(f"payloads must have shape [k >= 1, {self.payload_size(n)}], "
                       f"got {payloads.shape}")
    _check_payload(payloads, self.payload_size(n), lead=(payloads.shape[0],))
    return self._decode_sum_flat(payloads, n).reshape(shape).astype(dtype)

  def roundtrip(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """decode(encode(x, key)): what the receiver sees, in x's shape and dtype."""
    x = jnp.asarray(x)
    return self.decode(self.encode(x, key), x.shape, x.dtype)

  # -- to implement: flat float32[n] in, uint8[P] out and back ------------------------------------
  def _encode_flat(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
    raise NotImplementedError

  def _decode_sum_flat(self, payloads: jax.Array, n: int) -> jax.Array:
    raise NotImplementedError

  # -- the collectives' wire: the payload in the words it travels as -------------------------------
  # The collectives send rows of these; by default they are the uint8 payload itself. A codec may
  # send the same bytes as wider words when XLA handles those faster (Cast: uint16).
  def _to_wire(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """float32[n] -> wire[W]: the payload of x."""
    return self._encode_flat(x, key)

  def _wire_decode_sum(self, wires: jax.Array, n: int) -> jax.Array:
    """wire[k, W] -> float32[n]: the in-order sum of the k decodes."""
    return self._decode_sum_flat(wires, n)


@dataclasses.dataclass(frozen=True)
class QSGD(Codec):
  """QSGD: quantisation of each bucket of ``bucket_size`` values to ``bits`` bits.

  Args:
    bits: 1..8 bits per value (``"norm"`` needs at least 2: one is the sign).
    bucket_size: values sharing one set of scales; a positive multiple of 8.
    scheme: ``"maxmin"`` (CGX: levels spread between the bucket's min and max) or ``"norm"`` (QSGD
      paper: sign + level in units of the bucket's L2 norm).
    rounding: ``"stochastic"`` (unbiased; needs a key) or ``"nearest"``.
    impl: ``"auto"`` (FFI kernel where one is built for the platform, else pure JAX), ``"ffi"``
      or ``"jax"``.
  """

  bits: int = 4
  bucket_size: int = 128
  scheme: str = "maxmin"
  rounding: str = "stochastic"
  impl: str = "auto"

  def __post_init__(self):
    if isinstance(self.bits, bool) or not isinstance(self.bits, (int, np.integer)) or not 1 <= self.bits <= 8:
      raise ValueError(f"bits must be an integer in 1..8, got {self.bits!r}")
    if (isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, (int, np.integer))
        or self.bucket_size <= 0 or self.bucket_size % 8):
      raise ValueError(f"bucket_size must be a positive multiple of 8, got {self.bucket_size!r}")
    if self.scheme not in wire.SCHEMES:
      raise ValueError(f"scheme must be one of {wire.SCHEMES}, got {self.scheme!r}")
    if self.scheme == "norm" and self.bits < 2:
      raise ValueError("bits must be >= 2 for scheme='norm' (one bit is the sign), got 1")
    if self.rounding not in wire.ROUNDINGS:
      raise ValueError(f"rounding must be one of {wire.ROUNDINGS}, got {self.rounding!r}")
    if self.impl not in IMPLS:
      raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
    if self.impl == "ffi" and not (_ffi.has_cpu_kernels() or _ffi.has_cuda_kernels()):
      raise ValueError("impl='ffi' but no compiled kernels were found (build the package)")
    object.__setattr__(self, "bits", int(self.bits))
    object.__setattr__(self, "bucket_size", int(self.bucket_size))

  @property
  def _fmt(self) -> dict:
    return dict(bits=self.bits, bucket_size=self.bucket_size, scheme=self.scheme)

  def payload_size(self, n: int) -> int:
    return wire.qsgd_payload_bytes(n, **self._fmt)

  def wire_bits(self) -> float:
    return 32.0 / wire.qsgd_compression_ratio(**self._fmt)

  def _platform_select(self, ffi_fn, jax_fn, *args):
    """Runs ffi_fn on platforms with a compiled kernel, jax_fn elsewhere (per lowering)."""
    if self.impl == "jax":
      return jax_fn(*args)
    branches = {}
    if _ffi.has_cpu_kernels():
      branches["cpu"] = ffi_fn
    if _ffi.has_cuda_kernels():
      branches["cuda"] = ffi_fn
    if self.impl == "ffi":
      return lax.platform_dependent(*args, **branches)
    return lax.platform_dependent(*args, default=jax_fn, **branches)

  def _encode_flat(self, x, key):
    n = x.shape[0]
    seed = self._seed(key)
    if n == 0:
      return jnp.zeros((0,), jnp.uint8)
    kw = dict(rounding=self.rounding, **self._fmt)
    return self._platform_select(lambda a, s: _ffi.qsgd_encode(a, s, **kw),
                                 lambda a, s: _reference.encode(a, s, **kw), x, seed)

  def _decode_sum_flat(self, payloads, n):
    if n == 0:
      return jnp.zeros((0,), jnp.float32)
    kw = self._fmt
    return self._platform_select(lambda p: _ffi.qsgd_decode_sum(p, n, **kw),
                                 lambda p: _reference.decode_sum(p, n, **kw), payloads)

  def _seed(self, key):
    if self.rounding == "stochastic":
      if key is None:
        raise ValueError("key is required for rounding='stochastic' (pass a jax.random key)")
      return seed_words(key)
    return jnp.zeros((2,), jnp.uint32) if key is None else seed_words(key)

  def decode_sum_reencode(self, payloads: jax.Array, shape: Shape, key: jax.Array | None = None,
                          scale: float = 1.0) -> jax.Array:
    """``encode(decode_sum(payloads, shape) * float32(scale), key)`` in one kernel.

    The middle of the compressed allreduce: the owner of a chunk sums the k payloads it received
    and re-encodes the (scaled) sum. The payload bytes are those of the three steps done apart
    (the multiplication is skipped where ``scale == 1``, as :func:`jax_qcomm.collectives` does);
    the FFI kernels (CPU and CUDA) fuse them, the pure-JAX reference composes them.
    """
    shape = tuple(int(d) for d in shape)
    n = math.prod(shape)
    if payloads.ndim != 2 or payloads.shape[0] < 1:
      raise ValueError(f"payloads must have shape [k >= 1, {self.payload_size(n)}], "
                       f"got {payloads.shape}")
    _check_payload(payloads, self.payload_size(n), lead=(payloads.shape[0],))
    scale = float(scale)
    seed = self._seed(key)
    if n == 0:
      return jnp.zeros((0,), jnp.uint8)
    kw = dict(rounding=self.rounding, **self._fmt)

    def reference(p, s):
      reduced = _reference.decode_sum(p, n, **self._fmt)
      if scale != 1.0:
        reduced = reduced * jnp.float32(scale)
      return _reference.encode(reduced, s, **kw)

    return self._platform_select(
        lambda p, s: _ffi.qsgd_decode_sum_reencode(p, s, n, scale, **kw), reference, payloads, seed)


@dataclasses.dataclass(frozen=True)
class Cast(Codec):
  """bfloat16 or float16 on the wire (round to nearest even), float32 accumulation.

  The narrow values travel as raw uint8 bytes so that XLA cannot promote the collective to float32
  (it does so for a bf16 all-reduce on CPU).
  """

  dtype: Any = jnp.bfloat16

  def __post_init__(self):
    dtype = jnp.dtype(self.dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      raise ValueError(f"dtype must be bfloat16 or float16, got {dtype}")
    object.__setattr__(self, "dtype", dtype)

  def payload_size(self, n: int) -> int:
    return 2 * n

  def wire_bits(self) -> float:
    return 16.0

  def _encode_flat(self, x, key):
    return lax.bitcast_convert_type(x.astype(self.dtype), jnp.uint8).reshape(-1)

  def _decode_sum_flat(self, payloads, n):
    k = payloads.shape[0]
    return _sum_in_order(
        lax.bitcast_convert_type(payloads.reshape(k, n, 2), self.dtype).astype(jnp.float32))

  # The collectives send uint16 words: the same bytes, but XLA CPU converts float32 -> bf16 ->
  # uint16 about 4x faster than into a uint8 view (a relayout of every value into two bytes).
  def _to_wire(self, x, key):
    return lax.bitcast_convert_type(x.astype(self.dtype), jnp.uint16)

  def _wire_decode_sum(self, wires, n):
    return _sum_in_order(lax.bitcast_convert_type(wires, self.dtype).astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class NoCompression(Codec):
  """Exact float32. Collectives use ``lax.psum`` for it; encode/decode are the float32 bytes."""

  lossy = False

  def payload_size(self, n: int) -> int:
    return 4 * n

  def wire_bits(self) -> float:
    return 32.0

  def _encode_flat(self, x, key):
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)

  def _decode_sum_flat(self, payloads, n):
    k = payloads.shape[0]
    return _sum_in_order(lax.bitcast_convert_type(payloads.reshape(k, n, 4), jnp.float32))
