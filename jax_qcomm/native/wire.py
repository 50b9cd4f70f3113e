"""The wire format's arithmetic: payload sizes and compression ratios (docs/wire-format.md)."""

from __future__ import annotations

import numpy as np

SCHEMES = ("maxmin", "norm")       # index = the `scheme` attribute of the FFI kernels
ROUNDINGS = ("stochastic", "nearest")


def scales_per_bucket(scheme: str) -> int:
  """4-byte header words per bucket: maxmin (min, step word), norm (step word); docs/wire-format.md."""
  return 2 if scheme == "maxmin" else 1


def num_levels(bits: int, scheme: str) -> int:
  """Highest quantisation level: maxmin uses all 2**bits codes, norm spends one bit on the sign."""
  return (1 << bits) - 1 if scheme == "maxmin" else (1 << (bits - 1)) - 1


def recip_levels(bits: int, scheme: str) -> np.float32:
  """fl(1 / levels), the constant the format multiplies by (never a division: see qsgd_math.h)."""
  return np.float32(1) / np.float32(num_levels(bits, scheme))


def num_buckets(n: int, bucket_size: int) -> int:
  return -(-n // bucket_size)


def leaves_span(sizes, multiple: int) -> int:
  """Elements of the buffer that carries leaves of these sizes, each padded to a multiple."""
  return sum(-(-int(n) // multiple) * multiple for n in sizes)


def chunk_runs(pre: int, chunk: int, multiple: int) -> tuple[int, int]:
  """How device j's shard of a leaf held as ``pre`` runs of D chunks of ``chunk`` values travels
  in a sharded reduce-scatter: ``(runs, n)``, as ``runs`` payloads of ``n`` values. Each chunk its
  own payload where ``chunk`` is whole buckets of ``multiple`` (or ``pre == 1``); otherwise the
  shard's runs end to end, one payload (no bucket straddles two chunks' padding)."""
  return (1, pre * chunk) if pre > 1 and chunk % multiple else (pre, chunk)


def qsgd_payload_bytes(n: int, bits: int, bucket_size: int, scheme: str) -> int:
  """Bytes of the QSGD payload of n elements: per bucket 4*S scale bytes + bucket*bits/8 code bytes."""
  per_bucket = 4 * scales_per_bucket(scheme) + bucket_size * bits // 8
  return num_buckets(n, bucket_size) * per_bucket


def qsgd_compression_ratio(bits: int, bucket_size: int, scheme: str) -> float:
  """float32 bytes / payload bytes for whole buckets."""
  return 4 * bucket_size / (4 * scales_per_bucket(scheme) + bucket_size * bits / 8)


# ---- the summable codec (docs/wire-format.md, "Summable") ----------------------------------------

def summable_levels(bits: int) -> int:
  """Highest level L of the summable codec: signed levels in [-L, L], L = 2**(bits-1) - 1."""
  return (1 << (bits - 1)) - 1


def summable_field_bits(bits: int, devices: int) -> int:
  """Bits of one field when ``devices`` payloads are summed: bit_length(2 L D) (> 32: no room)."""
  return (2 * summable_levels(bits) * devices).bit_length()


def summable_fields(bits: int, devices: int) -> int:
  """Fields (elements) per uint32 word: 32 // field bits."""
  return 32 // summable_field_bits(bits, devices)


def summable_max_devices(bits: int) -> int:
  """The most devices whose summed fields still fit a uint32 word: 2 L D < 2**32."""
  return ((1 << 32) - 1) // (2 * summable_levels(bits))


def summable_words(n: int, bits: int, devices: int) -> int:
  """uint32 words of the summable payload of n elements for ``devices`` summed payloads."""
  f = summable_fields(bits, devices)
  return -(-n // f)


def summable_payload_bytes(n: int, bits: int, bucket_size: int, devices: int) -> int:
  """Bytes one device contributes per summable allreduce of n elements: the uint32 words (psum)
  and one 4-byte scale statistic per bucket (pmax)."""
  return 4 * (summable_words(n, bits, devices) + num_buckets(n, bucket_size))


def summable_wire_bits(bits: int, bucket_size: int, devices: int) -> float:
  """Bits per element on the wire of a reduction, for whole words and buckets: 32 / fields + 16 /
  bucket (a 16-bit statistic per bucket)."""
  return 32.0 / summable_fields(bits, devices) + 16.0 / bucket_size
