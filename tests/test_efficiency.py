"""The cost model (jax_qcomm.tools.efficiency) against hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_qcomm as qcomm
from jax_qcomm.tools import efficiency as eff


# -- bytes ------------------------------------------------------------------------------------------

def test_ring_fp32_bytes():
  # 2 (D-1)/D * N * 4: ResNet50-sized gradient over 4 devices.
  assert eff.allreduce_bytes(25_600_000, 4, 32) == pytest.approx(1.5 * 102_400_000)
  assert eff.allreduce_bytes(1000, 8, qcomm.NoCompression()) == pytest.approx(2 * 7 / 8 * 4000)
  assert eff.ring_allreduce_bytes(1000, 4, itemsize=2) == pytest.approx(3000)
  assert eff.allreduce_bytes(1000, 1, 32) == 0


def test_sra_qsgd_bytes_with_scales_and_padding():
  # n = 1000 over D = 4, bucket 128: padded to 1024 (a multiple of 4 * 128); chunk 256 = 2 buckets,
  # each bucket 8 scale bytes (maxmin: min, step) + 128 * 4 / 8 = 64 code bytes.
  q4 = qcomm.QSGD(4)
  assert q4.buffer_length(1000, 4) == 1024
  assert q4.traffic(1000, 4) == (("all-to-all", 3 / 4 * 4 * 2 * 72), ("all-gather", 3 / 4 * 4 * 2 * 72))
  assert eff.allreduce_bytes(1000, 4, 4) == pytest.approx(2 * 3 / 4 * 576)
  # 2 bits, bucket 64, norm scheme: 4 scale bytes + 16 code bytes per bucket; 8 devices.
  codec = qcomm.QSGD(bits=2, bucket_size=64, scheme="norm")
  n_pad = -(-5000 // 512) * 512
  assert eff.allreduce_bytes(5000, 8, codec) == pytest.approx(2 * 7 / 8 * n_pad // 64 * 20)


def test_sra_bytes_match_the_allreduce_benchmark_convention():
  from benchmarks.allreduce import wire_bytes
  for name, codec in (("qsgd4", qcomm.QSGD(4)), ("qsgd2", qcomm.QSGD(2)),
                      ("cast_bf16", qcomm.Cast(jnp.bfloat16))):
    for n, d in ((5000, 4), (25_600_000, 4), (12345, 8)):
      _, sent = wire_bytes(name, codec, n, d)
      assert eff.allreduce_bytes(n, d, codec) == pytest.approx(sent, abs=1)


def test_cast_bf16_halves_fp32():
  assert eff.allreduce_bytes(4096, 4, qcomm.Cast(jnp.bfloat16)) == pytest.approx(
      eff.allreduce_bytes(4096, 4, 32) / 2)
  # bits=16 is Wire16, two 16-bit fields per word at D = 4: 2 bytes per value of whole buckets of
  # 192 (22 buckets, 4224 values) plus a float32 scale per bucket (CPU)
  assert eff.allreduce_bytes(4096, 4, 16) == pytest.approx(1.5 * (2 * 4224 + 4 * 22))
  # at D = 2 three fields per word: 4 bytes per 3 values
  assert eff.allreduce_bytes(4224, 2, 16) == pytest.approx(4 * 4224 / 3 + 4 * 22)


def test_hierarchical_bytes():
  # 2 fast x 2 slow, QSGD 4: pad 1000 -> 1024 (2 * 2 * 128); inner float32 RS + AG of 1024 values,
  # outer SRA of the 512-value shard over 2 devices: payload 2 chunks x 2 buckets x 72 = 288.
  h = eff.hierarchical_allreduce_bytes(1000, inner=2, outer=2, codec=4)
  assert h["inner"] == pytest.approx(2 * 1 / 2 * 4 * 1024)
  assert h["outer"] == pytest.approx(2 * 1 / 2 * 288)
  # Exact: the same composition (reduce-scatter inside, the shard's all-reduce across), unpadded.
  exact = eff.hierarchical_allreduce_bytes(1000, 2, 2, 32)
  assert exact == {"inner": pytest.approx(4000), "outer": pytest.approx(2 * 1 / 2 * 4 * 500)}


def test_tree_bytes_follow_the_leaf_policy():
  tree = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32),   # 2048: compressed
          "b": jax.ShapeDtypeStruct((32,), jnp.float32),      # 1-D: exact
          "s": jax.ShapeDtypeStruct((8, 8), jnp.float32)}     # 64 < min_size: exact
  info = eff.tree_allreduce_bytes(tree, 4, 4)
  assert info["elements"] == 2048 + 32 + 64
  assert info["coded_elements"] == 2048
  exact = eff.ring_allreduce_bytes(32 + 64, 4, 4)
  assert info["bytes"] == pytest.approx(exact + eff.allreduce_bytes(2048, 4, 4))
  assert info["messages"] == 2 * eff.messages_per_allreduce(4)
  fp32 = eff.tree_allreduce_bytes(tree, 4, 32)
  assert fp32["bytes"] == pytest.approx(eff.ring_allreduce_bytes(2144, 4)) and fp32["coded_elements"] == 0


# -- times and efficiency ---------------------------------------------------------------------------

def test_transfer_and_comm_time():
  # 153.6 MB at 1 Gbit/s = 1.2288 s.
  assert eff.transfer_time(153_600_000, 1.0) == pytest.approx(1.2288)
  assert eff.comm_time(25_600_000, 4, 32, 1.0) == pytest.approx(1.2288)
  assert eff.transfer_time(1e6, 8.0, latency_s=1e-3, messages=6) == pytest.approx(1e-3 + 6e-3)
  # latency: 2 (D-1) messages; codec work: n / throughput (lossy codecs only)
  t = eff.comm_time(1024, 4, 4, 1.0, latency_s=1e-4, codec_elems_per_s=1024 * 100)
  assert t == pytest.approx(eff.allreduce_bytes(1024, 4, 4) * 8 / 1e9 + 12e-4 + 0.01)  # 2 collectives
  assert eff.comm_time(1024, 4, 32, 1.0, codec_elems_per_s=1.0) == pytest.approx(
      eff.allreduce_bytes(1024, 4, 32) * 8 / 1e9)
  assert eff.comm_time(1024, 1, 4, 1.0) == 0.0
  # overlapped codec work: max(transfer, codec) instead of the sum
  transfer = eff.allreduce_bytes(1024, 4, 4) * 8 / 1e9
  assert eff.comm_time(1024, 4, 4, 1.0, codec_elems_per_s=1024 * 100, overlap_codec=True) == \
      pytest.approx(max(transfer, 0.01))
  assert eff.comm_time(1024, 4, 4, 1.0, codec_elems_per_s=1e12, overlap_codec=True) == \
      pytest.approx(transfer)
  assert eff.codec_time(100, None) == 0.0 and eff.codec_time(100, 50) == pytest.approx(2.0)


def test_step_time_and_eta_hand_computed():
  assert eff.optimizer_step_time(0.1, 0.3, 2) == pytest.approx(0.5)
  assert eff.micro_step_time(0.1, 0.3, 2) == pytest.approx(0.25)
  assert eff.scaling_efficiency(0.1, 0.3) == pytest.approx(0.25)
  assert eff.scaling_efficiency(0.1, 0.3, 2) == pytest.approx(0.4)
  assert eff.scaling_efficiency(0.1, 0.0) == 1.0
  assert eff.speedup(0.1, 0.3, 4) == pytest.approx(1.0)


def test_eta_monotone_in_bits_link_and_accum():
  n, d, ts = 25_600_000, 4, 0.2
  etas = [eff.scaling_efficiency(ts, eff.comm_time(n, d, b, 1.0)) for b in (32, 16, 8, 4, 2)]
  assert all(a < b for a, b in zip(etas, etas[1:])), etas
  by_link = [eff.scaling_efficiency(ts, eff.comm_time(n, d, 32, g)) for g in (1, 2.5, 10, 100)]
  assert all(a < b for a, b in zip(by_link, by_link[1:]))
  by_k = [eff.scaling_efficiency(ts, 1.0, k) for k in (1, 2, 4, 8)]
  assert all(a < b < 1 for a, b in zip(by_k, by_k[1:]))


def test_accumulation_halves_the_share_of_tc():
  ts, tc = 0.2, 1.2
  share1 = 1 - eff.scaling_efficiency(ts, tc, 1)            # (Tc/k) / (Ts + Tc/k)
  r1 = tc / ts
  r2 = (tc / 2) / ts
  assert share1 == pytest.approx(r1 / (1 + r1))
  assert 1 - eff.scaling_efficiency(ts, tc, 2) == pytest.approx(r2 / (1 + r2))
  # per micro-step, communication time is exactly halved
  assert eff.micro_step_time(ts, tc, 2) - ts == pytest.approx((eff.micro_step_time(ts, tc, 1) - ts) / 2)


def test_bandwidths_nccl_convention():
  assert eff.algbw(1e9, 2.0) == pytest.approx(5e8)
  assert eff.busbw(1e9, 2.0, 4) == pytest.approx(5e8 * 1.5)
  assert eff.busbw(1e9, 2.0, 4, "all_gather") == pytest.approx(5e8 * 0.75)
  assert eff.busbw(1e9, 2.0, 8, "broadcast") == pytest.approx(5e8)
  # a ring allreduce exactly at link rate has busbw = link bytes/s
  n, d = 25_600_000, 4
  t = eff.comm_time(n, d, 32, 1.0)
  assert eff.busbw(4 * n, t, d) == pytest.approx(1e9 / 8)


def test_eta_table():
  table = eff.eta_table(0.1, {"fp32": 0.3, "q4": 0.03}, accum=(1, 2))
  assert table[("fp32", 2)] == pytest.approx(0.4) and len(table) == 4


# -- argument errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: eff.allreduce_bytes(-1, 4, 32), "n must be"),
    (lambda: eff.allreduce_bytes(10, 0, 32), "devices must be"),
    (lambda: eff.allreduce_bytes(10, 4, 12), "bits must be"),
    (lambda: eff.allreduce_bytes(10, 4, "qsgd"), "codec must be"),
    (lambda: eff.allreduce_bytes(10.5, 4, 32), "n must be"),
    (lambda: eff.allreduce_bytes(10, True, 32), "devices must be"),
    (lambda: eff.transfer_time(100, 0.0), "link_gbps must be"),
    (lambda: eff.transfer_time(100, -1.0), "link_gbps must be"),
    (lambda: eff.transfer_time(-5, 1.0), "nbytes must be"),
    (lambda: eff.transfer_time(5, 1.0, latency_s=float("nan")), "latency_s must be"),
    (lambda: eff.comm_time(100, 4, 4, 1.0, codec_elems_per_s=0), "codec_elems_per_s must be"),
    (lambda: eff.scaling_efficiency(0.0, 1.0), "ts must be"),
    (lambda: eff.scaling_efficiency(0.1, -1.0), "tc must be"),
    (lambda: eff.scaling_efficiency(0.1, 1.0, 0), "accum_steps must be"),
    (lambda: eff.optimizer_step_time(0.1, 1.0, 1.5), "accum_steps must be"),
    (lambda: eff.busbw(1e6, 1.0, 4, "scatter"), "collective must be"),
    (lambda: eff.algbw(1e6, 0.0), "seconds must be"),
    (lambda: eff.hierarchical_allreduce_bytes(100, 0, 2), "inner must be"),
    (lambda: eff.comm_time(100, 4, 4, 1.0, overlap_codec="yes"), "overlap_codec must be"),
])
def test_argument_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_numpy_scalars_accepted():
  assert eff.allreduce_bytes(np.int64(1000), np.int32(4), 32) == pytest.approx(6000)
  assert eff.allreduce_bytes(1000, 4, np.int64(16)) == pytest.approx(1.5 * (2 * 1152 + 4 * 6))
  assert eff.scaling_efficiency(np.float32(0.1), np.float64(0.3), np.int64(2)) == pytest.approx(0.4)


def test_transport_scales_each_collectives_share():
  n, d, gbps = 25_600_000, 2, 1.0
  ideal_fp32 = eff.comm_time(n, d, 32, gbps)
  slow = eff.Transport(allreduce=1.5, all_to_all=2.0, all_gather=3.0, latency_s=0.001)
  # exact: every byte in the all-reduce; + 2 (D-1) messages of latency
  assert eff.comm_time(n, d, 32, gbps, transport=slow) == pytest.approx(1.5 * ideal_fp32 + 0.002)
  # SRA: half the bytes in the all_to_all, half in the all_gather (mean factor 2.5); codec work adds
  q4 = qcomm.QSGD(4)
  ideal_q4 = eff.comm_time(n, d, q4, gbps)
  got = eff.comm_time(n, d, q4, gbps, transport=slow, codec_elems_per_s=1e8)
  assert got == pytest.approx(2.5 * ideal_q4 + 0.004 + n / 1e8)  # two collectives' latency
  assert eff.comm_time(n, 1, 4, gbps, transport=slow) == 0.0
  with pytest.raises(ValueError, match="transport"):
    eff.comm_time(n, d, 4, gbps, transport="gloo")
  with pytest.raises(ValueError, match="all_gather"):
    eff.Transport(all_gather=0.0)
