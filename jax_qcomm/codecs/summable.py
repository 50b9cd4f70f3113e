"""Summable: levels on a scale shared by all devices, packed into uint32 words that XLA's own
all-reduce sums (one ``psum``; C++ kernel on CPU, pure JAX elsewhere)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm.native import _ffi, _reference, wire
from jax_qcomm._checks import check_int, check_int_in
from jax_qcomm.codecs.base import DEFAULT_COMM_BUCKET, split_leaves
from jax_qcomm.codecs.bucketed import _SummedFields


@dataclasses.dataclass(frozen=True)
class Summable(_SummedFields):
  """A summable (homomorphic) codec: payloads that XLA's own all-reduce sums (IntSGD / THC style).

  Every device quantises each bucket of ``bucket_size`` values with the same scale, the bucket's
  largest ``|x|`` over all devices (one small ``lax.pmax`` of :meth:`bucket_scale`), to signed
  levels ``q`` in ``[-L, L]``, ``L = 2**(bits-1) - 1`` (stochastic rounding: ``q = floor(x/s + u)``;
  or nearest). The offset codes ``q + L`` are packed as fields of uint32 words, wide enough for
  the sum over ``D`` devices (``bit_length(2 L D)`` bits); the words go through one ``lax.psum``
  (XLA's all-reduce, at link rate on every backend) and the sum is decoded once. Each value is
  quantised once (the scatter-reduce-allgather of :class:`QSGD` quantises twice, once on the owner), and every device
  ends with the same result. Wire bits per element: ``32 / (32 // bit_length(2 L D)) +
  16 / bucket_size`` (4 bits, D = 2: 5.46; docs/wire-format.md "Summable" has the table).

  In a reduction the shared scale of a bucket is its largest ``|x|`` over the devices rounded up
  to a bfloat16 (8 significant bits; the pmax sends 2 bytes per bucket). With ``step = s * 2**k``
  the bucket's step (``s`` that scale, brought to [1, 2) by the power of two ``2**k``, over ``L``,
  rounded up to 16 significant bits: ``step <= max|x| / L * (1 + 2**-7) * (1 + 2**-15)``; the
  standalone payload of :meth:`encode` keeps the exact maximum, ``(1 + 2**-15)``):

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
  the pure-JAX reference runs. On CPU, a pytree's leaves are encoded and decoded in place of their
  packed buffer (:meth:`~Codec.allreduce_leaves`; the same words).

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
  def name(self) -> str:
    rounding = "" if self.rounding == "stochastic" else f" {self.rounding}"
    return f"Summable {self.bits}b/{self.bucket_size}{rounding}"

  def check_devices(self, devices: int) -> int:
    """``devices`` as an int; ValueError unless 1 <= devices and the sum of that many payloads
    fits the fields of a uint32 word (``2 L D < 2**32``)."""
    return check_int_in("devices", devices, 1, wire.summable_max_devices(self.bits),
                        f" for {self.name} (the sum over the devices of a field must fit a uint32 "
                        f"word: 2 L D < 2**32)")

  def payload_size(self, n: int) -> int:
    """Bytes of the standalone payload of :meth:`encode`: one int32 scale statistic per bucket,
    then the uint32 words of one device (D = 1). In a reduction over D devices the fields are
    wider (:meth:`traffic`)."""
    return wire.summable_payload_bytes(check_int("n", n, 0), self.bits, self.bucket_size, 1)

  def wire_bits(self, devices: int = 1) -> float:
    """Bits per element for whole words and buckets when ``devices`` payloads are summed."""
    return wire.summable_wire_bits(self.bits, self.bucket_size, self.check_devices(devices))

  def _kernel_platforms(self) -> tuple[str, ...]:
    return ("cpu",) if _ffi.has_cpu_kernels() else ()  # no CUDA kernel: GPUs run the reference

  def comm_buffer_size(self, devices: int, collective: str = "allreduce") -> int:
    """In an allreduce ``4 * DEFAULT_COMM_BUCKET`` (2**26 elements): a buffer costs a ``pmax`` and
    a ``psum`` of its own, and on CPU the kernels read and write the leaves in place (no packed
    copy to bound), so a model of up to 67M values travels in one buffer. On 2 nodes at 1 Gbit/s
    ResNet-50 in one buffer took 168.6 ms against 176.9 ms in two (docs/benchmarks-log.md). Where
    the reference runs (GPUs) or the axis is Hierarchical, the packed copy of a buffer takes up to
    256 MiB. The rows of sharded state keep :data:`DEFAULT_COMM_BUCKET`."""
    return 4 * DEFAULT_COMM_BUCKET if collective == "allreduce" else DEFAULT_COMM_BUCKET

  # -- the reduction protocol: one pmax of the scales, one psum of the words -------------------------
  def buffer_length(self, n: int, devices: int) -> int:
    return -(-n // self.bucket_size) * self.bucket_size  # whole buckets; no chunks per device

  # -- the summed fields (see _SummedFields) ----------------------------------------------------------
  def _field_size(self, n):
    return n  # the kernels take a partial last bucket

  # The statistic a reduction shares: the largest |x| of each bucket as bfloat16 bits rounded up
  # (a uint16; finite maxima stay finite), so the pmax sends 2 bytes per bucket; the kernels read
  # it back as the int32 bits of that bfloat16.
  _stat_bytes = 2

  @staticmethod
  def _narrow(scale_bits: jax.Array) -> jax.Array:
    """int32 bits of the largest |x| -> uint16: the bits of the smallest bfloat16 >= it (at most
    the largest finite bfloat16 for a finite maximum; NaN and Inf keep their class)."""
    m = lax.bitcast_convert_type(scale_bits, jnp.uint32)
    up = (m >> 16) + jnp.where((m & 0xFFFF) != 0, jnp.uint32(1), jnp.uint32(0))
    finite = m < jnp.uint32(0x7F800000)
    return jnp.where(finite, jnp.minimum(up, jnp.uint32(0x7F7F)), m >> 16).astype(jnp.uint16)

  @staticmethod
  def _stat_max(shared: jax.Array) -> jax.Array:
    """The largest shared statistic as float32: the max of the uint16 bfloat16 bits of |x| as
    integers (exact, and NaN > Inf > finite in that order)."""
    top = jnp.max(shared, initial=jnp.uint16(0)).astype(jnp.uint32) << 16
    return lax.bitcast_convert_type(top, jnp.float32)

  @staticmethod
  def _widen(shared: jax.Array) -> jax.Array:
    """The uint16 statistic -> the int32 scale bits the kernels take."""
    return lax.shift_left(shared.astype(jnp.int32), jnp.int32(16))

  def _stat(self, x):
    return self._narrow(self.bucket_scale(x))

  def _fields(self, x, shared, key, devices):
    return self.wire_encode_summable(x, self._widen(shared), key, devices)

  def _unfields(self, words, shared, devices, count, n, scale=1.0):
    return self.decode_summed_words(words, self._widen(shared), devices, count, n, scale)

  def _words(self, n, devices):
    return wire.summable_words(n, self.bits, devices)

  # On CPU the kernels read and write the leaves in place of the packed buffer (the same words and
  # values); elsewhere the reference runs on the packed buffer.
  def _stat_leaves(self, parts):
    b = self.bucket_size
    return self._narrow(self._select(
        lambda *ps: _ffi.summable_scale_leaves(ps, bucket_size=b),
        lambda *ps: _reference.summable_bucket_scale(self._packed(ps), b), *parts))

  def _fields_leaves(self, parts, shared, key, devices):
    kw = dict(bits=self.bits, bucket_size=self.bucket_size, devices=devices, rounding=self.rounding)
    return self._select(
        lambda m, s, *ps: _ffi.summable_encode_leaves(ps, m, s, **kw),
        lambda m, s, *ps: _reference.summable_encode(self._packed(ps), m, s, **kw),
        self._widen(shared), self._seed(key), *parts)

  def _unfields_leaves(self, words, shared, devices, count, sizes, scale=1.0):
    kw = dict(bits=self.bits, bucket_size=self.bucket_size, devices=devices, count=count,
              scale=float(scale))
    n = wire.leaves_span(sizes, self.bucket_size)
    return self._select(
        lambda w, m: _ffi.summable_decode_leaves(w, m, sizes, **kw),
        lambda w, m: split_leaves(_reference.summable_decode(w, m, n, **kw), sizes,
                                  self.bucket_size),
        words, self._widen(shared))

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

  def decode_summed_words(self, words, shared, devices, count, n, scale=1.0):
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
      v = self.decode_summed_words(words, shared, 1, 1, n)
      out = v if out is None else out + v
    return out
