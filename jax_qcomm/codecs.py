"""Codecs: how an array is turned into bytes on the wire and back.

Every codec maps an array of any shape to one flat ``uint8`` payload (``encode``), back to an
array (``decode``), and sums several payloads in float32 (``decode_sum``, the middle of a
compressed allreduce). Payload layouts are specified in docs/wire-format.md. :class:`Codec` is the
interface, written down: what the collectives, the packing, the cost model and ``describe`` read
from a codec, and the four methods a new codec implements.

* :class:`QSGD` -- per-bucket quantisation to 1..8 bits with stochastic or nearest rounding;
  two implementations of one format: the C++/CUDA FFI kernels and a pure-JAX reference.
* :class:`Cast` -- bfloat16 / float16 bits on the wire, float32 accumulation.
* :class:`NoCompression` -- float32 bytes (collectives use plain ``psum`` for it).
* :class:`Summable` -- levels with a scale shared by all devices, packed into uint32 words that
  XLA's own all-reduce sums (one ``psum``; C++ kernel on CPU, pure JAX elsewhere).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm import _ffi, _reference, wire
from jax_qcomm._checks import (as_array, check_array, check_bool, check_float_dtype, check_int,
                               check_int_in, check_key, check_real, check_shape)

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
  return check_float_dtype("dtype", dtype)


def _check_payload(payload: jax.Array, expected: int, lead: tuple[int, ...] = ()) -> None:
  check_array("payload" if not lead else "payloads", payload)
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


class Codec(abc.ABC):
  """The interface of a codec: everything the collectives, the packing of pytrees, the cost model
  (:mod:`jax_qcomm.tools.efficiency`) and :func:`jax_qcomm.describe` know about one.

  A codec is an immutable, hashable value (a frozen dataclass): the collectives group leaves by
  codec and ``jit`` sees it as a static part of the traced program. Nothing outside this module
  looks at a concrete codec's type or private state; it reads the attributes below.

  **What it states**

  * :attr:`exact` -- ``decode(encode(x)) == x`` bit for bit. The collectives then skip the codec
    and reduce the float32 values with XLA's own ``psum`` / ``psum_scatter`` / ``all_gather``
    (the same bytes, fewer steps). :attr:`lossy` is its negation.
  * :attr:`needs_key` -- :meth:`encode` needs a JAX PRNG key (stochastic rounding).
  * :attr:`pad_multiple` -- a buffer is padded to a multiple of this many elements (per leaf in
    a packed buffer, per device chunk in the allreduce) so that no group of values that share
    scales straddles two leaves or two chunks. :meth:`pad_fill` is the value padding uses.
  * :attr:`wire_dtype` -- the word type the payload travels as inside the collectives.
  * :attr:`name` -- a short human-readable name.

  **Sizes**: :meth:`payload_size` (bytes for ``n`` elements), :meth:`wire_size` (words of
  :attr:`wire_dtype` for ``n`` elements) and :meth:`wire_bits` (bits per element).

  **Array API** (public, any shape, ``uint8`` payloads in the documented wire format):
  :meth:`encode`, :meth:`decode`, :meth:`decode_sum`, :meth:`decode_sum_reencode`,
  :meth:`roundtrip`. Built here from the wire API; subclasses need not touch them.

  **Wire API** (what the collectives call; flat float32 in, rows of :attr:`wire_dtype` words out):

  * ``wire_encode(x: float32[n], key) -> wire[wire_size(n)]``
  * ``wire_decode_sum(wires: wire[k, W], n) -> float32[n]``: the in-order float32 sum of the k
    decodes (``k = 1`` decodes);
  * ``wire_decode_sum_reencode(wires, n, key, scale) -> wire[W]``: the middle of the allreduce,
    ``wire_encode(wire_decode_sum(wires, n) * float32(scale), key)`` (no multiplication where
    ``scale == 1``); a codec may fuse it into one kernel with the same bytes (QSGD does).

  **Summable codecs** (:attr:`summable` True, e.g. :class:`Summable`): the payloads of all
  devices add up as integers, so the allreduce is one ``lax.psum`` of uint32 words (XLA's own
  all-reduce) instead of the scatter-reduce-allgather. The collectives then call, with ``D`` the
  number of devices summed (static):

  * ``bucket_scale(x: float32[n]) -> int32[nb]``: this device's statistic per group of values
    sharing a scale, combined across devices by ``lax.pmax`` into ``shared`` (the same everywhere);
  * ``wire_encode_summable(x: float32[n], shared, key, devices) -> uint32[W]``: words whose
    element-wise uint32 sum over ``devices`` payloads is the payload of the sum;
  * ``wire_decode_summed(words, shared, devices, count, n, scale=1.0) -> float32[n]``: the decode
    of the sum of ``count`` payloads (1 <= count <= devices; 1: this device's own, for the
    error-feedback residual), times ``float32(scale)``;
  * ``check_devices(devices)``: ValueError where the sum of ``devices`` payloads does not fit.

  Their sizes depend on D: ``payload_size(n, devices=1)``, ``wire_size(n, devices=1)`` and
  ``wire_bits(devices=1)`` take it (default 1: the standalone payload of :meth:`encode`); the
  cost model and ``describe`` pass it where :attr:`summable` is True. A summable codec still
  implements the wire API above (its standalone payload), so that the array API works.

  **Adding a codec**: subclass as a frozen dataclass and implement :meth:`payload_size`,
  :meth:`wire_bits`, :meth:`wire_encode` and :meth:`wire_decode_sum`; override the stated
  attributes where the defaults (lossy, no key, no padding, ``uint8`` words) do not hold.
  """

  #: True if decode(encode(x)) == x bit for bit (collectives then use XLA's float32 collectives).
  exact: bool = False
  #: Word type of the payload inside the collectives; its size divides every payload size.
  wire_dtype: Any = np.uint8

  @property
  def lossy(self) -> bool:
    """True if the codec discards information (collectives then quantise each value twice)."""
    return not self.exact

  @property
  def needs_key(self) -> bool:
    """True if :meth:`encode` needs a PRNG key (stochastic rounding)."""
    return False

  @property
  def pad_multiple(self) -> int:
    """Buffers are padded to a multiple of this many elements (the quantisation bucket)."""
    return 1

  @property
  def name(self) -> str:
    """A short human-readable name ('QSGD 4b/128 maxmin', 'Cast bfloat16', 'exact fp32')."""
    return type(self).__name__

  def pad_fill(self, x: jax.Array) -> jax.Array:
    """The float32 scalar that pads float32[n] ``x`` without changing its last group's scales."""
    del x
    return jnp.float32(0)

  @property
  def summable(self) -> bool:
    """True if payloads add up in a ``lax.psum`` (see "Summable codecs" above)."""
    return False

  def check_devices(self, devices: int) -> int:
    """Summable codecs: ``devices`` if that many payloads can be summed, else ValueError."""
    raise NotImplementedError(f"{self.name} is not a summable codec")

  def bucket_scale(self, x: jax.Array) -> jax.Array:
    """Summable codecs: float32[n] -> int32[nb], this device's statistic, combined by lax.pmax."""
    raise NotImplementedError(f"{self.name} is not a summable codec")

  def wire_encode_summable(self, x: jax.Array, shared: jax.Array, key: jax.Array | None,
                           devices: int) -> jax.Array:
    """Summable codecs: float32[n] -> uint32[W], words that add up across ``devices`` payloads."""
    raise NotImplementedError(f"{self.name} is not a summable codec")

  def wire_decode_summed(self, words: jax.Array, shared: jax.Array, devices: int, count: int,
                         n: int, scale: float = 1.0) -> jax.Array:
    """Summable codecs: uint32[W], the sum of ``count`` payloads -> float32[n] (times scale)."""
    raise NotImplementedError(f"{self.name} is not a summable codec")

  @abc.abstractmethod
  def payload_size(self, n: int) -> int:
    """Bytes of the payload of an array of n elements."""

  @abc.abstractmethod
  def wire_bits(self) -> float:
    """Bits on the wire per element, for whole buckets."""

  def wire_size(self, n: int) -> int:
    """Words of :attr:`wire_dtype` in the payload of n elements."""
    return self.payload_size(n) // np.dtype(self.wire_dtype).itemsize

  # -- wire API: to implement --------------------------------------------------------------------
  @abc.abstractmethod
  def wire_encode(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """float32[n] -> wire_dtype[wire_size(n)]: the payload of x."""

  @abc.abstractmethod
  def wire_decode_sum(self, wires: jax.Array, n: int) -> jax.Array:
    """wire_dtype[k, wire_size(n)] -> float32[n]: the in-order float32 sum of the k decodes."""

  def wire_decode_sum_reencode(self, wires: jax.Array, n: int, key: jax.Array | None,
                               scale: float = 1.0) -> jax.Array:
    """wire[k, W] -> wire[W]: ``wire_encode(wire_decode_sum(wires, n) * float32(scale), key)``."""
    reduced = self.wire_decode_sum(wires, n)
    if scale != 1.0:
      reduced = reduced * jnp.float32(scale)
    return self.wire_encode(reduced, key)

  # -- array API ---------------------------------------------------------------------------------
  def _to_bytes(self, wire: jax.Array) -> jax.Array:
    """wire[..., W] -> uint8[..., W * itemsize] (the same bytes, little-endian)."""
    if wire.dtype == jnp.uint8:
      return wire
    return lax.bitcast_convert_type(wire, jnp.uint8).reshape(wire.shape[:-1] + (-1,))

  def _from_bytes(self, payloads: jax.Array) -> jax.Array:
    """uint8[..., P] -> wire[..., P / itemsize]."""
    size = np.dtype(self.wire_dtype).itemsize
    if size == 1:
      return payloads
    words = payloads.reshape(payloads.shape[:-1] + (payloads.shape[-1] // size, size))
    return lax.bitcast_convert_type(words, self.wire_dtype)

  def encode(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """Encodes x (any shape; float32/bfloat16/float16) to uint8[payload_size(x.size)]."""
    x = as_array("x", x)
    _check_float(x)
    check_key("key", key)
    return self._to_bytes(self.wire_encode(x.reshape(-1).astype(jnp.float32), key))

  def decode(self, payload: jax.Array, shape: Shape, dtype: Any = jnp.float32) -> jax.Array:
    """Decodes a payload made by ``encode`` of an array of ``shape``; returns ``dtype``."""
    shape = check_shape("shape", shape)
    dtype = _check_out_dtype(dtype)
    n = math.prod(shape)
    _check_payload(payload, self.payload_size(n))
    return self.wire_decode_sum(self._from_bytes(payload[None]), n).reshape(shape).astype(dtype)

  def decode_sum(self, payloads: jax.Array, shape: Shape, dtype: Any = jnp.float32) -> jax.Array:
    """Sum of the decodes of payloads[k, P] (float32 accumulation, in order 0..k-1)."""
    shape = check_shape("shape", shape)
    dtype = _check_out_dtype(dtype)
    n = math.prod(shape)
    self._check_payloads(payloads, n)
    return self.wire_decode_sum(self._from_bytes(payloads), n).reshape(shape).astype(dtype)

  def decode_sum_reencode(self, payloads: jax.Array, shape: Shape, key: jax.Array | None = None,
                          scale: float = 1.0) -> jax.Array:
    """``encode(decode_sum(payloads, shape) * float32(scale), key)``: the middle of the compressed
    allreduce, where the owner of a chunk sums the k payloads it received and re-encodes the
    (scaled) sum. The bytes are those of the three steps done apart (the multiplication is skipped
    where ``scale == 1``, as the collectives do); a codec may fuse them (QSGD's FFI kernels do).
    """
    shape = check_shape("shape", shape)
    check_key("key", key)
    scale = check_real("scale", scale)
    n = math.prod(shape)
    self._check_payloads(payloads, n)
    wire = self.wire_decode_sum_reencode(self._from_bytes(payloads), n, key, scale)
    return self._to_bytes(wire)

  def roundtrip(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """decode(encode(x, key)): what the receiver sees, in x's shape and dtype."""
    x = as_array("x", x)
    return self.decode(self.encode(x, key), x.shape, x.dtype)

  def _check_payloads(self, payloads: jax.Array, n: int) -> None:
    check_array("payloads", payloads)
    if payloads.ndim != 2 or payloads.shape[0] < 1:
      raise ValueError(f"payloads must have shape [k >= 1, {self.payload_size(n)}], "
                       f"got {payloads.shape}")
    _check_payload(payloads, self.payload_size(n), lead=(payloads.shape[0],))


class _Bucketed(Codec):
  """What the bucketed quantisers (QSGD, Summable) share: buffers padded to whole buckets, a key
  needed exactly when rounding is stochastic, and the choice between a compiled kernel and the
  pure-JAX reference. Subclasses have ``bits``, ``bucket_size``, ``rounding`` and ``impl``."""

  def _kernel_platforms(self) -> tuple[str, ...]:
    """The lowering platforms ("cpu", "cuda") with a compiled kernel of this codec."""
    raise NotImplementedError

  def _select(self, ffi_fn, jax_fn, *args):
    """Runs ffi_fn on platforms with a compiled kernel, jax_fn elsewhere (chosen per lowering by
    ``lax.platform_dependent``); impl="jax": always jax_fn; impl="ffi": no fallback."""
    platforms = self._kernel_platforms()
    if self.impl == "jax" or not platforms:
      return jax_fn(*args)
    branches = {p: ffi_fn for p in platforms}
    if self.impl == "ffi":
      return lax.platform_dependent(*args, **branches)
    return lax.platform_dependent(*args, default=jax_fn, **branches)

  def _seed(self, key: jax.Array | None) -> jax.Array:
    """The kernels' uint32[2] rounding seed; a key is required for stochastic rounding."""
    if key is not None:
      return seed_words(key)
    if self.rounding == "stochastic":
      raise ValueError("key is required for rounding='stochastic' (pass a jax.random key)")
    return jnp.zeros((2,), jnp.uint32)

  @property
  def needs_key(self) -> bool:
    return self.rounding == "stochastic"

  @property
  def pad_multiple(self) -> int:
    return self.bucket_size

  def _check_bucket_size(self) -> None:
    if (isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, (int, np.integer))
        or self.bucket_size <= 0 or self.bucket_size % 8):
      raise ValueError(f"bucket_size must be a positive multiple of 8, got {self.bucket_size!r}")

  def _check_rounding_and_impl(self, kernels: str) -> None:
    """The last checks of ``__post_init__``; then ``bits`` and ``bucket_size`` become plain ints."""
    if self.rounding not in wire.ROUNDINGS:
      raise ValueError(f"rounding must be one of {wire.ROUNDINGS}, got {self.rounding!r}")
    if self.impl not in IMPLS:
      raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
    if self.impl == "ffi" and not self._kernel_platforms():
      raise ValueError(f"impl='ffi' but no compiled {kernels} were found (build the package)")
    object.__setattr__(self, "bits", int(self.bits))
    object.__setattr__(self, "bucket_size", int(self.bucket_size))


@dataclasses.dataclass(frozen=True)
class QSGD(_Bucketed):
  """QSGD: quantisation of each bucket of ``bucket_size`` values to ``bits`` bits.

  Each bucket is scaled by the power of two that brings its largest magnitude to [1, 2) (exact),
  quantised there, and stores its step in those units with the exponent (docs/wire-format.md), so
  every magnitude is handled alike. With ``L = 2**bits - 1`` (maxmin) or ``2**(bits-1) - 1``
  (norm) levels and ``step`` the bucket's stored step:

  * Valid range: any finite float32, from the smallest normal (2**-126 ~ 1.2e-38) to the largest
    finite (3.4e38), mixed freely within a bucket; every decoded value is then finite.
  * Error bound, per element: ``|decoded - x| <= step`` (stochastic; ``E[decoded] = x`` but for
    values that clamp to the top level, within 2**-11 of the bucket's largest ``|x|``) or
    ``<= step / 2`` (nearest), up to float32 rounding (2**-20 of the bucket's largest ``|x|``)
    and the flush below 2**-126 (next point), where ``step <= (max - min) / L`` (maxmin) or
    ``step <= min(||bucket||_2, 3.4e38) / L`` (norm), each times ``1 + 2**-14`` (the step has
    16 significant bits, rounded up). For ``"norm"`` this is
    QSGD's bound: ``||decoded - x||^2 <= n * step^2 ~ n / L^2 * ||x||^2`` per bucket of ``n``
    values, and ``E||decoded - x||^2 <= min(n / L^2, sqrt(n) / L) * ||x||^2`` when stochastic.
  * Below the smallest normal, all implementations flush denormals as XLA's CPU runtime does
    (FTZ/DAZ): a subnormal input reads as 0 (a bucket of subnormals and zeros decodes to zeros) and
    a decoded value below 2**-126 in magnitude is 0, so the bound above holds up to an absolute
    2**-126. Values more than 2**126 times smaller than their bucket's largest count as 0.
  * A bucket holding NaN or +-Inf decodes to NaN throughout (never to finite values).

  The C++ kernels (each ISA), the CUDA kernels and the pure-JAX reference give the same payload
  bytes and the same decoded float32 values for the same key.

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
    check_int_in("bits", self.bits, 1, 8)
    self._check_bucket_size()
    if self.scheme not in wire.SCHEMES:
      raise ValueError(f"scheme must be one of {wire.SCHEMES}, got {self.scheme!r}")
    if self.scheme == "norm" and self.bits < 2:
      raise ValueError("bits must be >= 2 for scheme='norm' (one bit is the sign), got 1")
    self._check_rounding_and_impl("kernels")

  @property
  def _fmt(self) -> dict:
    return dict(bits=self.bits, bucket_size=self.bucket_size, scheme=self.scheme)

  @property
  def name(self) -> str:
    rounding = "" if self.rounding == "stochastic" else f" {self.rounding}"
    return f"QSGD {self.bits}b/{self.bucket_size} {self.scheme}{rounding}"

  def pad_fill(self, x: jax.Array) -> jax.Array:
    # maxmin: repeating the last value keeps the bucket's min and max; norm: 0 keeps its norm.
    if self.scheme == "maxmin" and x.shape[0] > 0:
      return x[-1]
    return jnp.float32(0)

  def payload_size(self, n: int) -> int:
    return wire.qsgd_payload_bytes(check_int("n", n, 0), **self._fmt)

  def wire_bits(self) -> float:
    return 32.0 / wire.qsgd_compression_ratio(**self._fmt)

  def _kernel_platforms(self) -> tuple[str, ...]:
    return (("cpu",) if _ffi.has_cpu_kernels() else ()) + (("cuda",) if _ffi.has_cuda_kernels() else ())

  def wire_encode(self, x, key):
    n = x.shape[0]
    seed = self._seed(key)
    if n == 0:
      return jnp.zeros((0,), jnp.uint8)
    kw = dict(rounding=self.rounding, **self._fmt)
    return self._select(lambda a, s: _ffi.qsgd_encode(a, s, **kw),
                        lambda a, s: _reference.encode(a, s, **kw), x, seed)

  def wire_decode_sum(self, payloads, n):
    if n == 0:
      return jnp.zeros((0,), jnp.float32)
    kw = self._fmt
    return self._select(lambda p: _ffi.qsgd_decode_sum(p, n, **kw),
                        lambda p: _reference.decode_sum(p, n, **kw), payloads)

  def wire_decode_sum_reencode(self, payloads, n, key, scale=1.0):
    # One kernel on the FFI platforms (CPU, CUDA); the pure-JAX reference composes the three steps.
    # Same bytes either way (tests/test_codec.py).
    seed = self._seed(key)
    if n == 0:
      return jnp.zeros((0,), jnp.uint8)
    kw = dict(rounding=self.rounding, **self._fmt)

    def reference(p, s):
      reduced = _reference.decode_sum(p, n, **self._fmt)
      if scale != 1.0:
        reduced = reduced * jnp.float32(scale)
      return _reference.encode(reduced, s, **kw)

    return self._select(
        lambda p, s: _ffi.qsgd_decode_sum_reencode(p, s, n, scale, **kw), reference, payloads, seed)


@dataclasses.dataclass(frozen=True)
class Cast(Codec):
  """bfloat16 or float16 on the wire (round to nearest even), float32 accumulation.

  The narrow values travel as raw uint8 bytes so that XLA cannot promote the collective to float32
  (it does so for a bf16 all-reduce on CPU).
  """

  dtype: Any = jnp.bfloat16

  def __post_init__(self):
    try:
      dtype = jnp.dtype(self.dtype)
    except Exception:  # "foo", an object: not a dtype at all
      dtype = None
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      raise ValueError(f"dtype must be bfloat16 or float16, got "
                       f"{dtype if dtype is not None else repr(self.dtype)}")
    object.__setattr__(self, "dtype", dtype)

  def payload_size(self, n: int) -> int:
    return 2 * check_int("n", n, 0)

  def wire_bits(self) -> float:
    return 16.0

  # Words of uint16 in the collectives: the same bytes as the uint8 payload, but XLA CPU converts
  # float32 -> bf16 -> uint16 about 4x faster than into a uint8 view (a relayout of every value
  # into two bytes).
  wire_dtype = np.uint16

  @property
  def name(self) -> str:
    return f"Cast {jnp.dtype(self.dtype).name}"

  def wire_encode(self, x, key):
    return lax.bitcast_convert_type(x.astype(self.dtype), jnp.uint16)

  def wire_decode_sum(self, wires, n):
    return _sum_in_order(lax.bitcast_convert_type(wires, self.dtype).astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class NoCompression(Codec):
  """Exact float32. Collectives use ``lax.psum`` for it; encode/decode are the float32 bytes."""

  exact = True

  @property
  def name(self) -> str:
    return "exact fp32"

  def payload_size(self, n: int) -> int:
    return 4 * check_int("n", n, 0)

  def wire_bits(self) -> float:
    return 32.0

  def wire_encode(self, x, key):
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)

  def wire_decode_sum(self, payloads, n):
    k = payloads.shape[0]
    return _sum_in_order(lax.bitcast_convert_type(payloads.reshape(k, n, 4), jnp.float32))


@dataclasses.dataclass(frozen=True)
class Summable(_Bucketed):
  """A summable (homomorphic) codec: payloads that XLA's own all-reduce sums (IntSGD / THC style).

  Every device quantises each bucket of ``bucket_size`` values with the same scale, the bucket's
  largest ``|x|`` over all devices (one small ``lax.pmax`` of :meth:`bucket_scale`), to signed
  levels ``q`` in ``[-L, L]``, ``L = 2**(bits-1) - 1`` (stochastic rounding: ``q = floor(x/s + u)``;
  or nearest). The offset codes ``q + L`` are packed as fields of uint32 words, wide enough for
  the sum over ``D`` devices (``bit_length(2 L D)`` bits); the words go through one ``lax.psum``
  (XLA's all-reduce, at link rate on every backend) and the sum is decoded once. Each value is
  quantised once (the scatter-reduce-allgather of :class:`QSGD` quantises twice), and every device
  ends with the same result. Wire bits per element: ``32 / (32 // bit_length(2 L D)) +
  32 / bucket_size`` (4 bits, D = 2: 5.58; docs/wire-format.md "Summable" has the table).

  With ``step = s * 2**k`` the bucket's step (``s`` the shared max, brought to [1, 2) by the power
  of two ``2**k``, over ``L``, rounded up to 16 significant bits: ``step <= max|x| / L * (1 +
  2**-15)``):

  * Error bound, per element and device: ``|decoded - x| <= step`` (stochastic; unbiased,
    ``E[decoded] = x``, but for values that clamp to the top level, within ``2**-15`` of the
    bucket's largest ``|x|``) or ``<= step / 2`` (nearest), up to float32 rounding (``2**-22`` of
    the shared max); so the decoded sum of D devices is within ``D * step`` (the mean within
    ``step``), and with independent stochastic roundings its standard deviation is at most
    ``sqrt(D) * step / 2`` (the mean's ``step / (2 sqrt(D))``).
  * Valid range: any finite float32, mixed freely (scaling by powers of two as QSGD, docs
    /wire-format.md); subnormals read as 0 (FTZ/DAZ, as XLA CPU), an all-zero bucket decodes to
    exact zeros; a decoded value beyond the largest float32 (a sum of D values near 3.4e38)
    saturates to +-3.4e38. A bucket holding NaN or +-Inf on any device decodes to NaN throughout,
    on every device.
  * D is limited by the word: ``2 L D < 2**32`` (``wire.summable_max_devices(bits)``; 4 bits:
    306 783 378 devices), ValueError beyond.

  The C++ CPU kernel (each ISA) and the pure-JAX reference give the same words and decoded values
  for the same key. There is no CUDA kernel: on GPUs (and any platform without a compiled kernel)
  the pure-JAX reference runs.

  Args:
    bits: 2..8 bits per level (``2 L + 1`` levels, ``L = 2**(bits-1) - 1``; 2 bits: ternary).
    bucket_size: values sharing one scale; a positive multiple of 8.
    rounding: ``"stochastic"`` (unbiased; needs a key) or ``"nearest"`` (error feedback).
    impl: ``"auto"`` (the C++ kernel on CPU, the pure-JAX reference elsewhere), ``"ffi"`` or
      ``"jax"``.
  """

  bits: int = 4
  bucket_size: int = 128
  rounding: str = "stochastic"
  impl: str = "auto"

  def __post_init__(self):
    check_int_in("bits", self.bits, 2, 8, " for Summable")
    self._check_bucket_size()
    self._check_rounding_and_impl("CPU kernels")

  @property
  def summable(self) -> bool:
    return True

  @property
  def name(self) -> str:
    rounding = "" if self.rounding == "stochastic" else f" {self.rounding}"
    return f"Summable {self.bits}b/{self.bucket_size}{rounding}"

  def check_devices(self, devices: int) -> int:
    """``devices`` as an int; ValueError unless 1 <= devices and the sum of that many payloads
    fits the fields of a uint32 word (``2 L D < 2**32``)."""
    return check_int_in("devices", devices, 1, wire.summable_max_devices(self.bits),
                        f" for {self.name} (the sum over the devices of a field must fit a uint32 "
                        f"word: 2 L D < 2**32)")

  def payload_size(self, n: int, devices: int = 1) -> int:
    """Bytes per device per summable allreduce of n elements over ``devices`` devices (the uint32
    words of the psum and one int32 scale statistic per bucket, the pmax); ``devices=1`` is the
    standalone payload of :meth:`encode`."""
    n = check_int("n", n, 0)
    return wire.summable_payload_bytes(n, self.bits, self.bucket_size, self.check_devices(devices))

  def wire_size(self, n: int, devices: int = 1) -> int:
    return self.payload_size(n, devices)

  def wire_bits(self, devices: int = 1) -> float:
    """Bits per element for whole words and buckets, ``devices`` summed payloads."""
    return wire.summable_wire_bits(self.bits, self.bucket_size, self.check_devices(devices))

  def _kernel_platforms(self) -> tuple[str, ...]:
    return ("cpu",) if _ffi.has_cpu_kernels() else ()  # no CUDA kernel: GPUs run the reference

  # -- summable wire API ---------------------------------------------------------------------------
  def bucket_scale(self, x: jax.Array) -> jax.Array:
    if x.shape[0] == 0:
      return jnp.zeros((0,), jnp.int32)
    return self._select(lambda a: _ffi.summable_scale(a, bucket_size=self.bucket_size),
                        lambda a: _reference.summable_bucket_scale(a, self.bucket_size), x)

  def wire_encode_summable(self, x, shared, key, devices):
    devices = self.check_devices(devices)
    seed = self._seed(key)
    if x.shape[0] == 0:
      return jnp.zeros((0,), jnp.uint32)
    kw = dict(bits=self.bits, bucket_size=self.bucket_size, devices=devices, rounding=self.rounding)
    return self._select(lambda a, m, s: _ffi.summable_encode(a, m, s, **kw),
                        lambda a, m, s: _reference.summable_encode(a, m, s, **kw), x, shared, seed)

  def wire_decode_summed(self, words, shared, devices, count, n, scale=1.0):
    devices = self.check_devices(devices)
    count = check_int_in("count", count, 1, devices, hi_text=f"devices={devices}")
    if n == 0:
      return jnp.zeros((0,), jnp.float32)
    kw = dict(bits=self.bits, bucket_size=self.bucket_size, devices=devices, count=count,
              scale=float(scale))
    return self._select(lambda w, m: _ffi.summable_decode(w, m, n, **kw),
                        lambda w, m: _reference.summable_decode(w, m, n, **kw), words, shared)

  # -- the standalone payload (array API): [int32 scale statistic x nb][uint32 words, D = 1] -------
  def wire_encode(self, x, key):
    shared = self.bucket_scale(x)
    words = self.wire_encode_summable(x, shared, key, 1)
    return jnp.concatenate([self._to_bytes(shared), self._to_bytes(words)])

  def wire_decode_sum(self, payloads, n):
    if n == 0:
      return jnp.zeros((0,), jnp.float32)
    nb = wire.num_buckets(n, self.bucket_size)
    out = None
    for j in range(payloads.shape[0]):  # in order
      p = payloads[j]
      shared = lax.bitcast_convert_type(p[:4 * nb].reshape(nb, 4), jnp.int32)
      words = lax.bitcast_convert_type(p[4 * nb:].reshape(-1, 4), jnp.uint32)
      v = self.wire_decode_summed(words, shared, 1, 1, n)
      out = v if out is None else out + v
    return out


def codec_for_bits(bits: int, bucket_size: int = 128, scheme: str = "maxmin",
                   rounding: str = "stochastic", summable: bool = False) -> Codec:
  """32 -> NoCompression, 16 -> Cast(bfloat16), 1..8 -> QSGD(bits, bucket_size, scheme, rounding).

  The ``bits`` of :func:`jax_qcomm.sync` and of the cost model; ``bucket_size``, ``scheme`` and
  ``rounding`` apply to QSGD only. ``summable=True``: 2..8 -> Summable(bits, bucket_size,
  rounding) instead (one psum of uint32 words; ``scheme`` must then be left "maxmin", and bits
  32/16 or 1 are a ValueError)."""
  if check_bool("summable", summable):
    check_int_in("bits", bits, 2, 8, " with summable=True")
    if scheme != "maxmin":
      raise ValueError(f"scheme applies to QSGD only: leave it 'maxmin' with summable=True, "
                       f"got {scheme!r}")
    return Summable(bits=bits, bucket_size=bucket_size, rounding=rounding)
  if isinstance(bits, bool) or not isinstance(bits, int) or not (bits in (16, 32) or 1 <= bits <= 8):
    raise ValueError(f"bits must be 32 (exact), 16 (bf16 on the wire) or 1..8 (QSGD), got {bits!r}")
  if bits in (16, 32):  # the QSGD settings are checked even where they do not apply
    QSGD(bits=4, bucket_size=bucket_size, scheme=scheme, rounding=rounding)
  if bits == 32:
    return NoCompression()
  if bits == 16:
    return Cast(jnp.bfloat16)
  return QSGD(bits=bits, bucket_size=bucket_size, scheme=scheme, rounding=rounding)
