"""The codec choice: :class:`Auto` (QSGD or Summable, whichever the transport and the device count
make faster), :func:`codec_for_bits` (the ``bits`` shorthand of ``sync``) and
:func:`default_bucket`."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jax_qcomm.transport import cost as _transport
from jax_qcomm._checks import check_int_in
from jax_qcomm.transport.axes import axis_size
from jax_qcomm.codecs.base import Codec, _check_traffic
from jax_qcomm.codecs.bucketed import _Bucketed
from jax_qcomm.codecs.cast import NoCompression
from jax_qcomm.codecs.qsgd import QSGD
from jax_qcomm.codecs.summable import Summable
from jax_qcomm.codecs.wire16 import Wire16


#: The bucket of the ``bits`` shorthand: 64 values at 1 and 2 bits, 128 from 3 bits. At 2 bits the
#: bucket's range sets most of the error: on normal values at D = 2 a bucket of 64 brings the
#: relative error of the mean from 0.92 to 0.82 for 3.0 wire bits per value instead of 2.5. From
#: 3 bits a larger bucket saves less than it costs: on a transformer's gradients 256 values at 4
#: bits send 5.6% fewer bytes at 28-31% more error (docs/benchmarks.md, "The bucket size").
def default_bucket(bits: int) -> int:
  """The bucket size ``codec_for_bits(bits)`` and ``sync(bits=...)`` use when none is given."""
  return 64 if bits <= 2 else 128


@dataclasses.dataclass(frozen=True)
class Auto(_Bucketed):
  """The fastest ``bits``-bit codec for the transport and the number of devices: ``sync(bits=b)``.

  The candidates are :class:`QSGD` (a scatter-reduce-allgather: an all-to-all and an all-gather
  of ``b``-bit payloads) and, for 3..8 bits, :class:`Summable` (one all-reduce of fields that widen
  with log2(D)), both with this ``bucket_size``, ``rounding`` and ``impl`` (``scheme`` is QSGD's).
  Summable's ``2**b - 1`` levels span ``[-max, max]`` and QSGD's ``2**b`` span ``[min, max]``: from
  3 bits their steps are within 1.2x of each other, and Summable quantises once where QSGD
  quantises twice (once on the device that reduces a value's chunk); at 2 bits Summable is
  ternary (a 1.5x step) and is not a candidate.

  For each reduction, at trace time, :meth:`resolve` picks the candidate whose
  :meth:`~Codec.traffic` takes the least time on the transport: each collective's bytes times the
  transport's factor for it (:class:`jax_qcomm.transport.Transport`); QSGD on a tie. The transport
  is :func:`jax_qcomm.transport.current`. On the measured transports (gloo between CPU
  processes, with the messages between two of them in pieces; GPUs and one process, where every
  collective runs at the link rate) QSGD's fewer bytes win at every D (docs/benchmarks.md
  "Transport factors"); Summable wins where the all-reduce is much the cheapest collective. At
  4 bits QSGD's error of the mean is the lower too (normal values: 0.173 against 0.179 at D = 2,
  0.194 against 0.203 at D = 8). ``qcomm.describe`` names the codec picked; pass
  ``codec=qcomm.QSGD(...)`` or ``codec=qcomm.Summable(...)`` to force one.

  The standalone array API (:meth:`encode` and the rest, one device) is QSGD's.

  Args:
    bits: 1..8 (1 and 2 bits: QSGD only).
    bucket_size: values sharing scales; a positive multiple of 8; default :func:`default_bucket`
      (64 at 1 and 2 bits, 128 from 3).
    scheme: QSGD's ``"maxmin"`` or ``"norm"``.
    rounding: ``"stochastic"`` (needs a key) or ``"nearest"``.
    impl: ``"auto"``, ``"ffi"`` or ``"jax"``, as the candidates take it.
  """

  bits: int = 4
  bucket_size: int | None = None
  scheme: str = "maxmin"
  rounding: str = "stochastic"
  impl: str = "auto"

  def __post_init__(self):
    check_int_in("bits", self.bits, 1, 8, " for Auto")
    if self.bucket_size is None:
      object.__setattr__(self, "bucket_size", default_bucket(int(self.bits)))
    candidates = [QSGD(self.bits, self.bucket_size, self.scheme, self.rounding, self.impl)]
    if self.bits >= 3:  # 2-bit Summable is ternary: 3 levels against QSGD's 4, a 1.5x step
      candidates.append(Summable(self.bits, self.bucket_size, self.rounding, self.impl))
    object.__setattr__(self, "bits", int(self.bits))
    object.__setattr__(self, "bucket_size", int(self.bucket_size))
    object.__setattr__(self, "_candidates", tuple(candidates))

  @property
  def candidates(self) -> tuple[Codec, ...]:
    """The codecs :meth:`resolve` chooses from, QSGD first."""
    return self._candidates

  def resolve(self, devices: int, collective: str = "allreduce",
              transport: _transport.Transport | None = None) -> Codec:
    super().resolve(devices, collective, transport)  # the checks
    d = int(devices)
    if transport is None:
      transport = _transport.current(d)
    n = 1 << 20  # a reference buffer: large enough that padding and scales weigh as in a model
    best, best_t = None, math.inf
    for codec in self._candidates:
      try:
        t = transport.weighted_bytes(codec.traffic(n, d, collective))
      except ValueError:  # D beyond what the codec's fields hold
        continue
      if t < best_t:
        best, best_t = codec, t
    return best

  @property
  def name(self) -> str:
    rounding = "" if self.rounding == "stochastic" else f" {self.rounding}"
    return f"auto {self.bits}b/{self.bucket_size}{rounding}"

  # One device and the array API: QSGD.
  def pad_fill(self, x):
    return self._candidates[0].pad_fill(x)

  def payload_size(self, n):
    return self._candidates[0].payload_size(n)

  def wire_bits(self, devices=1):
    return self.resolve(devices).wire_bits(devices)

  def wire_encode(self, x, key):
    return self._candidates[0].wire_encode(x, key)

  def wire_decode_sum(self, wires, n):
    return self._candidates[0].wire_decode_sum(wires, n)

  def wire_decode_sum_reencode(self, wires, n, key, scale=1.0):
    return self._candidates[0].wire_decode_sum_reencode(wires, n, key, scale)

  # The reduction protocol: the candidate resolved for the axis.
  def buffer_length(self, n, devices):
    return self.resolve(devices).buffer_length(n, devices)

  def comm_buffer_size(self, devices, collective="allreduce"):
    return self.resolve(devices, collective).comm_buffer_size(devices, collective)

  def allreduce_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    return self.resolve(axis_size(axis_name)).allreduce_flat(x, axis_name, key, op, exchange)

  def allreduce_leaves(self, parts, axis_name, key, op="mean", exchange="auto"):
    return self.resolve(axis_size(axis_name)).allreduce_leaves(parts, axis_name, key, op, exchange)

  def allreduce_leaves_marked(self, parts, axis_name, key, op="mean", exchange="auto"):
    codec = self.resolve(axis_size(axis_name))
    return codec.allreduce_leaves_marked(parts, axis_name, key, op, exchange)

  def mark_traffic(self, devices):
    return self.resolve(devices).mark_traffic(devices)

  def reduce_scatter_flat(self, x, axis_name, key, op="mean", exchange="auto"):
    codec = self.resolve(axis_size(axis_name), "reduce_scatter")
    return codec.reduce_scatter_flat(x, axis_name, key, op, exchange)

  def all_gather_flat(self, x, axis_name, key):
    return self.resolve(axis_size(axis_name), "all_gather").all_gather_flat(x, axis_name, key)

  def reduce_scatter_leaves(self, rows, axis_name, key, op="mean", exchange="auto"):
    codec = self.resolve(axis_size(axis_name), "reduce_scatter")
    return codec.reduce_scatter_leaves(rows, axis_name, key, op, exchange)

  def reduce_scatter_leaves_marked(self, rows, axis_name, key, op="mean", exchange="auto"):
    codec = self.resolve(axis_size(axis_name), "reduce_scatter")
    return codec.reduce_scatter_leaves_marked(rows, axis_name, key, op, exchange)

  def all_gather_differences(self, news, olds, index, axis_name, key):
    codec = self.resolve(axis_size(axis_name), "all_gather")
    return codec.all_gather_differences(news, olds, index, axis_name, key)

  def all_gather_leaves(self, parts, axis_name, key):
    return self.resolve(axis_size(axis_name), "all_gather").all_gather_leaves(parts, axis_name, key)

  def traffic(self, n, devices, collective="allreduce"):
    n, d, collective = _check_traffic(n, devices, collective)
    return self.resolve(d, collective).traffic(n, d, collective)


def codec_for_bits(bits: int, bucket_size: int | None = None, scheme: str = "maxmin",
                   rounding: str = "stochastic") -> Codec:
  """The codec a ``bits`` shorthand names: 32 -> NoCompression, 16 -> Wire16 (fixed-point fields
  summed as integers on CPU, the bf16 cast on GPUs), 1..8 -> ``Auto(bits, bucket_size, scheme,
  rounding)``: QSGD or Summable, whichever the transport and the number of devices make faster
  (``bucket_size`` default :func:`default_bucket`: 64 at 1 and 2 bits, 128 from 3;
  ``bucket_size``, ``scheme`` and ``rounding`` apply to 1..8 bits; they are checked even where
  they do not apply). Any other codec, e.g. ``QSGD(4)`` to force the scatter-reduce-allgather, is
  passed as an object: ``sync(inner, codec=...)``."""
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not (
      bits in (16, 32) or 1 <= bits <= 8):
    raise ValueError(f"bits must be 32 (exact), 16 (16 bits on the wire) or 1..8 (quantised), "
                     f"got {bits!r}")
  bits = int(bits)
  if bits in (16, 32):
    QSGD(bits=4, bucket_size=128 if bucket_size is None else bucket_size, scheme=scheme,
         rounding=rounding)
  if bits == 32:
    return NoCompression()
  if bits == 16:
    return Wire16()
  return Auto(bits=bits, bucket_size=bucket_size, scheme=scheme, rounding=rounding)
