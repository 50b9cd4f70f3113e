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


def qsgd_payload_bytes(n: int, bits: int, bucket_size: int, scheme: str) -> int:
  """Bytes of the QSGD payload of n elements: per bucket 4*S scale bytes + bucket*bits/8 code bytes."""
  per_bucket = 4 * scales_per_bucket(scheme) + bucket_size * bits // 8
  return num_buckets(n, bucket_size) * per_bucket


def qsgd_compression_ratio(bits: int, bucket_size: int, scheme: str) -> float:
  """float32 bytes / payload bytes for whole buckets."""
  return 4 * bucket_size / (4 * scales_per_bucket(scheme) + bucket_size * bits / 8)
