"""Wire16: 16-bit fixed-point fields summed as integers by XLA's all-reduce (CPU), the bf16 cast
elsewhere."""

from __future__ import annotations

import dataclasses

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm.native import wire
from jax_qcomm._checks import check_int, check_int_in
from jax_qcomm.codecs.base import _check_traffic, _pad_to, _sum_in_order
from jax_qcomm.codecs.bucketed import _SummedFields
from jax_qcomm.codecs.cast import Cast


#: Wire16: the radix of ``k`` fields in one uint32 word, the largest ``R`` with ``R**k <= 2**32``.
_RADIX = {2: 1 << 16, 3: 1625}
#: Wire16 packs three fields per word only where that keeps at least this many levels per side
#: (D <= 2): on normal values its error is then within the bf16 cast's (docs/wire-format.md).
_MIN_LEVELS_3 = 400


def _levels(fields: int, devices: int) -> int:
  """Wire16's largest level with ``fields`` per word summed over ``devices``: ``(R - 1) // 2D``."""
  return (_RADIX[fields] - 1) // (2 * devices)


@dataclasses.dataclass(frozen=True)
class Wire16(_SummedFields):
  """bfloat16-class accuracy in fields that the transport sums at its integer rate: ``sync(bits=16)``.

  On CPU (XLA's collectives over gloo) a bfloat16 all-reduce is carried out in float32, so the
  bf16 cast halves nothing there. This codec sends fixed-point fields instead, ``k`` per uint32
  word, which XLA's ``psum`` sums as integers: every bucket of ``bucket_size`` values shares one
  scale, its largest ``|x|`` over all devices (one float32 ``lax.pmax`` per bucket); over D devices
  a value becomes a level ``q`` in ``[-L, L]``, ``L = (R - 1) // (2 D)`` with ``R`` the radix of
  ``k`` fields (``R**k <= 2**32``: 65536 for two, 1625 for three), sent as the field ``q + L``;
  one ``psum`` of the words and one decode give every device the same sum. Each value is quantised
  once.

  * ``fields=None`` (the default) packs three fields per word where they keep at least 400 levels
    per side (D <= 2; ``L = 406`` at D = 2): ``32 / 3 + 32 / bucket_size`` bits per value, 10.8 at
    the default bucket of 192. Elsewhere it packs two, ``L = (2**16 - 1) // (2 D)`` (10922 at
    D = 3, 4095 at D = 8, 511 at D = 64): ``16 + 32 / bucket_size`` bits. Three fields need a
    ``bucket_size`` divisible by 3; with any other bucket the codec packs two at every D.
    ``fields=2`` or ``3`` fixes the packing; :meth:`resolve` names the one a reduction uses.
  * Error per value and device: ``<= step / 2`` (nearest, the default: like the bf16 cast's
    round-to-nearest, biased but small) or ``< step`` (stochastic: unbiased), ``step = max|x| / L``
    of the bucket (float32 arithmetic aside). Against bf16's ``2**-9`` of each value: on normal
    values the mean's relative error at D = 2 is 2.3e-3 with three fields (the bf16 cast's
    all-reduce: 2.4e-3) and 6e-5 with two; on heavy-tailed values (Student t with 3 degrees of
    freedom) three fields reach 6.4e-3 against the cast's 2.4e-3: pass ``fields=2`` there.
  * Valid range: any finite float32; an all-zero bucket decodes to exact zeros; a bucket holding
    NaN or +-Inf on any device decodes to NaN throughout, on every device. D <= 32767 (two
    fields; 812 with ``fields=3``).
  * On other platforms (GPUs, whose NCCL sums bf16 natively) the same codec sends the bf16 cast:
    ``Cast(bfloat16)``'s scatter-reduce-allgather. :meth:`traffic` reports the bytes of the
    platform ``jax.default_backend()`` names.

  Args:
    bucket_size: values sharing one scale; a positive multiple of 8 (and of 3 for three fields).
    rounding: ``"nearest"`` (default) or ``"stochastic"`` (unbiased; needs a key).
    fields: fields per uint32 word: ``None`` (three where they keep 400 levels, else two), 2 or 3.
  """

  bucket_size: int = 192
  rounding: str = "nearest"
  fields: int | None = None

  wire_dtype = np.uint32

  def __post_init__(self):
    self._check_bucket_size()
    if self.rounding not in wire.ROUNDINGS:
      raise ValueError(f"rounding must be one of {wire.ROUNDINGS}, got {self.rounding!r}")
    object.__setattr__(self, "bucket_size", int(self.bucket_size))
    if self.fields is not None:
      check_int_in("fields", self.fields, 2, 3, " (fields per uint32 word) or None")
      object.__setattr__(self, "fields", int(self.fields))
      if self.bucket_size % self.fields:
        raise ValueError(f"bucket_size must be a multiple of fields={self.fields}, "
                         f"got {self.bucket_size}")

  @property
  def name(self) -> str:
    rounding = "" if self.rounding == "nearest" else f" {self.rounding}"
    fields = "" if self.fields is None else f" {self.fields}x"
    return f"Wire16{fields} /{self.bucket_size}{rounding}"

  def _kernel_platforms(self) -> tuple[str, ...]:
    return ()  # pure JAX: XLA fuses the few elementwise passes

  def fields_for(self, devices: int) -> int:
    """Fields per word when ``devices`` payloads are summed (the rule of ``fields=None``)."""
    if self.fields is not None:
      return self.fields
    if self.bucket_size % 3 == 0 and _levels(3, devices) >= _MIN_LEVELS_3:
      return 3
    return 2

  def levels(self, devices: int) -> int:
    """L: the largest level when ``devices`` fields are summed (their sum fits the radix)."""
    return _levels(self.fields_for(devices), devices)

  def resolve(self, devices, collective="allreduce", transport=None):
    super().resolve(devices, collective, transport)  # the checks
    d = self.check_devices(devices)
    return self if self.fields is not None else dataclasses.replace(self, fields=self.fields_for(d))

  def check_devices(self, devices: int) -> int:
    r = _RADIX[self.fields or 2]  # fields=None packs two where three would not fit
    return check_int_in("devices", devices, 1, (r - 1) // 2,
                        f" for {self.name} (at least one level per side: 2 D < {r})")

  def _buckets(self, n: int) -> int:
    return -(-n // self.bucket_size)

  def payload_size(self, n: int) -> int:
    """Standalone payload (D = 1): a float32 scale per bucket, then the words of whole buckets."""
    nb = self._buckets(check_int("n", n, 0))
    return 4 * nb + 4 * nb * self.bucket_size // self.fields_for(1)

  def wire_bits(self, devices: int = 1) -> float:
    d = self.check_devices(devices)
    if not _fixed16_here():
      return 16.0
    return 32.0 / self.fields_for(d) + 32.0 / self.bucket_size

  # -- the fixed-point fields ----------------------------------------------------------------------
  def bucket_max(self, x: jax.Array) -> jax.Array:
    """float32[k * bucket_size] -> float32[k]: each bucket's largest |x|; +inf for a bucket
    holding NaN or +-inf (an inf reaches every device through the pmax); subnormals read as 0
    (FTZ/DAZ, as XLA CPU). NaN is made +inf before the max, so no max can drop it (XLA CPU's
    vectorised float max does); one fused pass over x."""
    xr = x.reshape(-1, self.bucket_size)
    return jnp.max(jnp.where(jnp.isnan(xr), jnp.float32(jnp.inf), jnp.abs(xr)), axis=1)

  def encode_fields(self, x: jax.Array, shared: jax.Array, key: jax.Array | None,
                    devices: int) -> jax.Array:
    """float32[m * bucket_size] -> uint32[m * bucket_size / k]: fields ``q + L`` for ``devices``,
    ``k = fields_for(devices)``; word i of a bucket holds value ``i + j bucket_size / k`` as digit
    j (``R**j`` times its field: for two fields, the low and the high 16 bits)."""
    k, lv = self.fields_for(devices), self.levels(devices)
    inv = jnp.where(shared > 0, lv / shared, 0.0).astype(jnp.float32)  # 0 for zero / inf buckets
    parts = x.reshape(-1, k, self.bucket_size // k)
    if self.rounding == "stochastic":
      if key is None:
        raise ValueError("key is required for rounding='stochastic' (pass a jax.random key)")
      u = jax.random.uniform(key, parts.shape, jnp.float32)

    def field(h):  # one part of every bucket; a fused pass each (XLA CPU vectorises them apart)
      v = parts[:, h] * inv[:, None]
      q = jnp.floor(v + u[:, h]) if self.rounding == "stochastic" else jnp.round(v)
      # NaN (only in a bucket whose scale is inf, decoded as NaN) -> the clip's lower end.
      return (jnp.clip(q, -lv, lv) + lv).astype(jnp.uint32)

    words = field(k - 1)
    for h in range(k - 2, -1, -1):  # Horner: ((f_{k-1} R) + ... ) R + f_0
      words = words * jnp.uint32(_RADIX[k]) + field(h)
    return words.reshape(-1)

  def decode_fields(self, words: jax.Array, shared: jax.Array, devices: int, count: int,
                    scale: float = 1.0) -> jax.Array:
    """The inverse for a sum of ``count`` devices' words: float32[k * words] times ``scale``."""
    k, lv = self.fields_for(devices), self.levels(devices)
    r = jnp.uint32(_RADIX[k])
    w = words.reshape(-1, 1, self.bucket_size // k)
    digits = []
    for _ in range(k - 1):
      digits.append(w % r)
      w = w // r
    fields = jnp.concatenate(digits + [w], axis=1)
    q = fields.astype(jnp.int32) - jnp.int32(count * lv)
    step = (shared / jnp.float32(lv)) * jnp.float32(scale)  # NaN / inf for NaN / inf buckets
    out = q.astype(jnp.float32) * step[:, None, None]
    bad = ~jnp.isfinite(shared)
    return jnp.where(bad[:, None, None], jnp.float32(jnp.nan), out).reshape(-1)

  # -- the standalone payload: [float32 scale x nb][uint32 words] as uint32 ------------------------
  def wire_encode(self, x, key):
    n = x.shape[0]
    x = _pad_to(x.astype(jnp.float32), self._buckets(n) * self.bucket_size)
    shared = self.bucket_max(x)
    words = self.encode_fields(x, shared, key, 1)
    return jnp.concatenate([lax.bitcast_convert_type(shared, jnp.uint32), words])

  def wire_decode_sum(self, wires, n):
    nb = self._buckets(n)
    vals = jnp.stack([self.decode_fields(wires[j, nb:],
                                         lax.bitcast_convert_type(wires[j, :nb], jnp.float32),
                                         1, 1)[:n] for j in range(wires.shape[0])])
    return _sum_in_order(vals)

  # -- the reduction protocol: one pmax of the scales, one psum of the words ------------------------
  def buffer_length(self, n: int, devices: int) -> int:
    if not _fixed16_here():
      return _BF16.buffer_length(n, devices)
    return self._buckets(n) * self.bucket_size

  def allreduce_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    if not _fixed16_here():
      return _BF16.allreduce_flat(x, axis_name, key, op, exchange)
    return super().allreduce_flat(x, axis_name, key, op, exchange)

  def allreduce_leaves_marked(self, parts, axis_name, key, op="mean", exchange="auto"):
    if not _fixed16_here():
      return _BF16.allreduce_leaves_marked(parts, axis_name, key, op, exchange)
    return super().allreduce_leaves_marked(parts, axis_name, key, op, exchange)

  def reduce_scatter_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    if not _fixed16_here():
      return _BF16.reduce_scatter_flat(x, axis_name, key, op, exchange)
    return super().reduce_scatter_flat(x, axis_name, key, op, exchange)

  def all_gather_flat(self, x, axis_name, key):
    if not _fixed16_here():
      return _BF16.all_gather_flat(x, axis_name, key)
    return super().all_gather_flat(x, axis_name, key)

  def traffic(self, n, devices, collective="allreduce"):
    """CPU: the summed fields' (``32 / fields_for(D)`` bits per value and a float32 scale per
    bucket; see ``_SummedFields.traffic``). Elsewhere: ``Cast(bfloat16)``'s."""
    n, d, collective = _check_traffic(n, devices, collective)
    if not _fixed16_here():
      return _BF16.traffic(n, d, collective)
    return super().traffic(n, d, collective)

  # -- the summed fields (see _SummedFields) ----------------------------------------------------------
  def _field_size(self, n):
    return self._buckets(n) * self.bucket_size  # whole buckets

  def _stat(self, x):
    return self.bucket_max(x)

  @staticmethod
  def _stat_max(shared):
    return jnp.max(shared, initial=0.0)  # no NaN there: a NaN bucket's statistic is +inf

  def _fields(self, x, shared, key, devices):
    return self.encode_fields(x, shared, key, devices)

  def _unfields(self, words, shared, devices, count, n, scale=1.0):
    return self.decode_fields(words, shared, devices, count, scale)[:n]

  def _words(self, n, devices):
    return self._buckets(n) * self.bucket_size // self.fields_for(devices)


_BF16 = Cast(jnp.bfloat16)


def _fixed16_here() -> bool:
  """Wire16 sends fixed-point fields where XLA's all-reduce would widen bf16 (CPU: gloo)."""
  return jax.default_backend() == "cpu"
