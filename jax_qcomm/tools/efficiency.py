"""Cost model of data-parallel training with (compressed) gradient allreduce.

Small pure functions; every size is in **bytes** or **elements** (float32 values), every time in
**seconds**, link rates in **Gbit/s** (10**9 bits per second), throughputs in **elements per second**.

Bytes each device sends per allreduce of ``n`` float32 values over ``D`` devices
(:func:`allreduce_bytes`) are the codec's own count, :meth:`jax_qcomm.Codec.traffic` /
``sent_bytes`` (ring convention: all-reduce ``2 (D-1)/D`` of its buffer, all-to-all and all-gather
``(D-1)/D`` of the gathered size), the same count :func:`jax_qcomm.transforms.describe` reports:

* exact float32 (``NoCompression``, XLA's ring all-reduce): ``2 (D-1)/D * 4 n``;
* scatter-reduce-allgather (SRA) codecs (``QSGD``, ``Cast``): the buffer padded to a multiple of
  ``D * bucket`` elements, ``D`` chunk payloads ``P`` in an all-to-all and ``D`` reduced ones in an
  all-gather: ``2 (D-1)/D * P``;
* summable codecs (``Summable``): ring all-reduces of the uint32 words (fields as wide as the sum of
  D payloads needs) and of one scale word per bucket;
* :class:`jax_qcomm.Hierarchical` (``D_in`` fast x ``D_out`` slow devices,
  :func:`hierarchical_allreduce_bytes`): exact float32 reduce-scatter + all-gather on the fast links
  (``2 (D_in-1)/D_in * 4 n``), the codec's allreduce of the ``n / D_in`` shard on the slow links.

Communication time of one allreduce (:func:`comm_time`)::

    Tc = bytes / (link_gbps * 1e9 / 8)  +  messages * latency_s  +  n_coded / codec_elems_per_s

where ``messages = 2 (D-1)`` per flat buffer (ring: D-1 reduce-scatter + D-1 all-gather steps;
SRA: all_to_all to D-1 peers + all_gather from D-1 peers) and the codec term is a device's whole
codec work in one SRA allreduce (encode its D chunks, decode-and-sum the D received payloads,
re-encode its reduced chunk, decode the D gathered payloads), expressed as *elements of the
allreduced buffer per second* (what ``python -m benchmarks step`` measures). By default the
codec work and the transfer add up (``overlap_codec=True``: ``max`` of the two, when several buffers
pipeline). The model assumes no overlap of communication with the compute of the step (an upper
bound on the step time when XLA overlaps).

Step time and scaling efficiency with gradient accumulation (``k = accum_steps``: one allreduce
every ``k`` micro-steps). **Ts is the compute time of one micro-step** (forward + backward + the
local accumulation; the inner optimizer's step is small and counted in it), so that::

    optimizer step:   T_step = k * Ts + Tc
    per micro-step:   T_micro = Ts + Tc / k
    efficiency:       eta = Ts / (Ts + Tc / k) = k Ts / (k Ts + Tc)

The step benchmark reports per-optimizer-step numbers: its ``ts_s`` is ``k * Ts`` (a full cycle of
``k`` micro-steps without synchronisation), its ``tstep_s`` the same cycle with synchronisation,
``tc_s = tstep_s - ts_s`` and ``eta = ts_s / tstep_s`` -- the same eta as above.

Bandwidths (nccl-tests convention, :func:`algbw`, :func:`busbw`): ``algbw = S / t`` for a buffer of
``S`` bytes, ``busbw = algbw * factor`` with factor ``2 (D-1)/D`` for allreduce, ``(D-1)/D`` for
reduce-scatter, all-gather and all-to-all, 1 for broadcast and reduce. For a compressed allreduce use
``S`` = payload bytes for the bus bandwidth (bytes really carried) and the float32 size for the
*effective* algbw.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

import jax

from jax_qcomm.collectives import ops as collectives, packing
from jax_qcomm._checks import check_int, check_int_or_none
from jax_qcomm.codecs import Codec, codec_for_bits
from jax_qcomm.transport import GLOO, GLOO_PAIR, IDEAL, Transport

__all__ = [
    "DEFAULT_COMM_BUCKET", "codec_of", "ring_allreduce_bytes", "allreduce_bytes", "hierarchical_allreduce_bytes", "tree_allreduce_bytes",
    "messages_per_allreduce", "transfer_time", "codec_time", "Transport", "GLOO_PAIR", "GLOO", "IDEAL", "comm_time", "optimizer_step_time",
    "micro_step_time", "scaling_efficiency", "speedup", "algbw", "busbw", "BUS_FACTORS", "eta_table",
]

#: elements per flat communication buffer where the codec does not say otherwise
#: (``Codec.comm_buffer_size``; the collectives' default ``comm_bucket_size`` is None).
DEFAULT_COMM_BUCKET = collectives.DEFAULT_COMM_BUCKET

#: nccl-tests bus-bandwidth factors, as functions of the device count D.
BUS_FACTORS = {
    "allreduce": lambda d: 2 * (d - 1) / d,
    "reduce_scatter": lambda d: (d - 1) / d,
    "all_gather": lambda d: (d - 1) / d,
    "all_to_all": lambda d: (d - 1) / d,
    "broadcast": lambda d: 1.0,
    "reduce": lambda d: 1.0,
}


# -- argument checks --------------------------------------------------------------------------------

def _num(name: str, value: Any, *, positive: bool = False, allow_none: bool = False) -> float | None:
  if value is None and allow_none:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise ValueError(f"{name} must be a {'positive' if positive else 'non-negative'} number, "
                     f"got {value!r}")
  v = float(value)
  if not math.isfinite(v) or v < 0 or (positive and v == 0):
    raise ValueError(f"{name} must be a finite {'positive' if positive else 'non-negative'} "
                     f"number, got {value!r}")
  return v


def codec_of(codec: Any) -> Codec:
  """A codec object from a codec or a ``bits`` value (:func:`jax_qcomm.codec_for_bits`, as
  :func:`jax_qcomm.transforms.sync`: 32 exact, 16 Wire16, 1..8 ``Auto``, which resolves for the transport
  passed where a function takes one, else for :func:`jax_qcomm.transport.current`); ValueError
  otherwise."""
  if isinstance(codec, Codec):
    return codec
  if isinstance(codec, bool) or not isinstance(codec, (int, np.integer)):
    raise ValueError(f"codec must be a jax_qcomm codec (QSGD, Summable, Cast, ...) or bits "
                     f"(32, 16 or 1..8), got {codec!r}")
  return codec_for_bits(int(codec))


# -- bytes ------------------------------------------------------------------------------------------

def ring_allreduce_bytes(n: int, devices: int, itemsize: int = 4) -> float:
  """Bytes each device sends in a ring allreduce of ``n`` values of ``itemsize`` bytes:
  ``2 (D-1)/D * n * itemsize`` (0 for one device)."""
  n = check_int("n", n, 0)
  d = check_int("devices", devices, 1)
  itemsize = check_int("itemsize", itemsize, 1)
  return 2 * (d - 1) / d * n * itemsize


def allreduce_bytes(n: int, devices: int, codec: Any = 32) -> float:
  """Bytes each device sends per allreduce of one flat buffer of ``n`` float32 values:
  ``codec.sent_bytes(n, devices)`` (padding and scales included)."""
  return codec_of(codec).sent_bytes(check_int("n", n, 0), check_int("devices", devices, 1))


def hierarchical_allreduce_bytes(n: int, inner: int, outer: int, codec: Any = 4) -> dict[str, float]:
  """Bytes each device sends in a ``Hierarchical(inner, outer)`` allreduce of ``n`` float32 values.

  Returns ``{"inner": bytes on the fast links, "outer": bytes on the slow links}``: the buffer is
  padded to ``inner * pad_multiple`` elements; an exact float32 reduce-scatter and all-gather over
  ``inner`` (``2 (Di-1)/Di * 4 n_pad``), the codec's allreduce of the ``n_pad / Di`` shard over
  ``outer``.
  """
  codec = codec_of(codec)
  di = check_int("inner", inner, 1)
  do = check_int("outer", outer, 1)
  n = check_int("n", n, 0)
  m = di * codec.pad_multiple
  n_pad = -(-n // m) * m
  return {"inner": ring_allreduce_bytes(n_pad, di, 4),
          "outer": codec.sent_bytes(n_pad // di, do)}


def tree_allreduce_bytes(tree: Any, devices: int, codec: Any = 4, *, policy: Any = None,
                         comm_bucket_size: int | None = None) -> dict[str, Any]:
  """Bytes each device sends when ``qcomm.allreduce`` / ``qcomm.sync`` synchronise a pytree.

  ``tree``: arrays or ``jax.ShapeDtypeStruct`` leaves (only shapes are read). Applies the same leaf
  policy (default ``LeafPolicy()``: leaves under 1024 elements and 1-D leaves exact) and the same
  packing into flat buffers of at most ``comm_bucket_size`` elements (None: the codec's own
  ``comm_buffer_size``) as the library.

  Returns a dict: ``bytes`` (total sent per device), ``messages`` (``2 (D-1)`` per buffer),
  ``coded_elements`` (elements going through a lossy codec, i.e. its codec work), ``elements``
  (all gradient elements), ``buffers`` (list of ``(codec repr, elements, bytes)``).
  """
  codec = codec_of(codec)
  d = check_int("devices", devices, 1)
  comm_bucket_size = check_int_or_none("comm_bucket_size", comm_bucket_size)
  leaves = jax.tree_util.tree_leaves(tree)
  codecs = packing.leaf_codecs(tree, codec, policy)
  total, messages, coded, buffers = 0.0, 0, 0, []
  for group in packing.plan(leaves, codecs, comm_bucket_size, d):
    n = sum(packing.padded_size(int(math.prod(leaves[i].shape)), group.codec) for i in group.leaves)
    sent = group.codec.leaves_sent_bytes([tuple(leaves[i].shape) for i in group.leaves], d)
    total += sent
    messages += messages_per_allreduce(d) if n else 0
    if group.codec.lossy:
      coded += n
    buffers.append((repr(group.codec), n, sent))
  elements = sum(int(math.prod(leaf.shape)) for leaf in leaves)
  return dict(bytes=total, messages=messages, coded_elements=coded, elements=elements,
              buffers=buffers)


def messages_per_allreduce(devices: int) -> int:
  """Messages each device sends per flat buffer: ``2 (D-1)`` (ring and SRA alike)."""
  d = check_int("devices", devices, 1)
  return 2 * (d - 1)


# -- times ------------------------------------------------------------------------------------------

def transfer_time(nbytes: float, link_gbps: float, *, latency_s: float = 0.0,
                  messages: int = 0) -> float:
  """Seconds to send ``nbytes`` bytes over a link of ``link_gbps`` Gbit/s (10**9 bit/s), plus
  ``messages * latency_s``."""
  nbytes = _num("nbytes", nbytes)
  rate = _num("link_gbps", link_gbps, positive=True)
  latency_s = _num("latency_s", latency_s)
  messages = check_int("messages", messages, 0)
  return nbytes * 8 / (rate * 1e9) + messages * latency_s


def codec_time(coded_elements: float, codec_elems_per_s: float | None) -> float:
  """Seconds of codec work: ``coded_elements / codec_elems_per_s`` (0 when the throughput is None,
  i.e. free). The throughput is in elements of the allreduced buffer per second of one device's
  whole codec work in one SRA allreduce (see the module docstring)."""
  coded_elements = _num("coded_elements", coded_elements)
  tput = _num("codec_elems_per_s", codec_elems_per_s, positive=True, allow_none=True)
  return 0.0 if tput is None or coded_elements == 0 else coded_elements / tput


def comm_time(n: int, devices: int, codec: Any, link_gbps: float, *, latency_s: float = 0.0,
              codec_elems_per_s: float | None = None, overlap_codec: bool = False,
              transport: Transport | None = None) -> float:
  """Tc, seconds of one allreduce of ``n`` float32 values as one flat buffer: transfer of
  :func:`allreduce_bytes` at ``link_gbps`` + ``2 (D-1)`` messages per collective (exact: one
  collective; SRA and summable codecs: two) x ``latency_s`` + codec work
  ``n / codec_elems_per_s`` (lossy codecs only). 0 on one device.

  ``transport`` (default: ideal) scales each collective's share of the bytes by its factor and
  adds its per-message latency to ``latency_s``, for each collective the codec's
  :meth:`~jax_qcomm.Codec.traffic` names (exact and summable codecs: all-reduces; an SRA: half of
  its bytes in an all-to-all and half in an all-gather).

  ``overlap_codec=True``: the codec work fully overlaps the transfer (several buffers pipelined:
  one is encoded while another travels), ``Tc = max(transfer, codec)`` -- the lower bound to the
  default (serial) upper bound."""
  codec = codec_of(codec)
  d = check_int("devices", devices, 1)
  n = check_int("n", n, 0)
  if not isinstance(overlap_codec, bool):
    raise ValueError(f"overlap_codec must be True or False, got {overlap_codec!r}")
  if transport is None:
    transport = Transport()
  elif not isinstance(transport, Transport):
    raise ValueError(f"transport must be an efficiency.Transport or None, got {transport!r}")
  if d == 1:
    return 0.0
  # Each of the codec's collectives carries its bytes at its transport factor and pays the
  # per-message latency 2 (D-1) times.
  traffic = codec.resolve(d, transport=transport).traffic(n, d)
  nbytes = transport.weighted_bytes(traffic)
  t = transfer_time(nbytes, link_gbps, latency_s=latency_s + transport.latency_s,
                    messages=len(traffic) * messages_per_allreduce(d) if n else 0)
  c = codec_time(n, codec_elems_per_s) if codec.lossy else 0.0
  return max(t, c) if overlap_codec else t + c


def optimizer_step_time(ts: float, tc: float, accum_steps: int = 1) -> float:
  """Seconds per optimizer step: ``accum_steps * ts + tc`` (``ts``: compute per micro-step,
  ``tc``: one allreduce; no overlap)."""
  ts = _num("ts", ts)
  tc = _num("tc", tc)
  k = check_int("accum_steps", accum_steps, 1)
  return k * ts + tc


def micro_step_time(ts: float, tc: float, accum_steps: int = 1) -> float:
  """Seconds per micro-step: ``ts + tc / accum_steps``."""
  return optimizer_step_time(ts, tc, accum_steps) / check_int("accum_steps", accum_steps, 1)


def scaling_efficiency(ts: float, tc: float, accum_steps: int = 1) -> float:
  """eta = ``ts / (ts + tc / accum_steps)`` in [0, 1]: ``ts`` compute seconds per micro-step,
  ``tc`` seconds per allreduce (one every ``accum_steps`` micro-steps)."""
  ts = _num("ts", ts, positive=True)
  tc = _num("tc", tc)
  k = check_int("accum_steps", accum_steps, 1)
  return ts / (ts + tc / k)


def speedup(ts: float, tc: float, devices: int, accum_steps: int = 1) -> float:
  """Throughput of ``devices`` data-parallel devices relative to one: ``devices * eta``."""
  return check_int("devices", devices, 1) * scaling_efficiency(ts, tc, accum_steps)


# -- bandwidths (nccl-tests) ------------------------------------------------------------------------

def algbw(size_bytes: float, seconds: float) -> float:
  """Algorithm bandwidth in bytes/s: ``size_bytes / seconds`` (nccl-tests' algbw)."""
  return _num("size_bytes", size_bytes) / _num("seconds", seconds, positive=True)


def busbw(size_bytes: float, seconds: float, devices: int, collective: str = "allreduce") -> float:
  """Bus bandwidth in bytes/s (nccl-tests): ``algbw * factor(D)``, factor ``2 (D-1)/D`` for an
  allreduce (see :data:`BUS_FACTORS`). Comparable with the link rate: a ring allreduce at the link
  rate has busbw = link bytes/s."""
  if collective not in BUS_FACTORS:
    raise ValueError(f"collective must be one of {tuple(BUS_FACTORS)}, got {collective!r}")
  d = check_int("devices", devices, 1)
  return algbw(size_bytes, seconds) * BUS_FACTORS[collective](d)


def eta_table(ts: float, tcs: dict[Any, float], accum: Iterable[int] = (1, 2)) -> dict[tuple, float]:
  """``{(name, k): eta}`` for every ``tcs[name]`` and accumulation ``k`` (for plots)."""
  return {(name, k): scaling_efficiency(ts, tc, k) for name, tc in tcs.items() for k in accum}
