"""The peers benchmark's parts that need neither torch nor a cluster: payload shapes, the shared
inputs and error, wire-byte accounting (PowerSGD's as torch counts it), the node placement, the
markdown reports; then, only where the torch venv exists (``benchmarks/peers/setup_torch.sh``),
the torch worker itself on two local processes. No test here requires torch.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import allreduce, cluster, report
from benchmarks.peers import data, payloads
from benchmarks.peers import run as peers_run

ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCH_PYTHON = ROOT / ".venv-torch" / "bin" / "python"


# -- payloads ------------------------------------------------------------------------------------------

def test_gpt2_small_is_124m_in_148_leaves():
  leaves = payloads.gpt2_small()
  assert len(leaves) == 148 and payloads.count(leaves) == payloads.GPT2_SMALL_PARAMS == 124_439_808
  assert leaves[0] == ("wte.weight", (50257, 768))
  assert dict(leaves)["h.11.mlp.c_fc.weight"] == (768, 3072)


def test_resnet50_leaves_from_the_flax_model_in_torch_layout():
  leaves = payloads.resnet50()
  assert len(leaves) == 161 and payloads.count(leaves) == payloads.RESNET50_PARAMS
  names = [n for n, _ in leaves]
  assert len(set(names)) == 161
  # Forward order, PyTorch layout: OIHW stem first, the (out, in) classifier last.
  assert leaves[0] == ("conv_init/kernel", (64, 3, 7, 7))
  assert leaves[-2:] == [("Dense_0/kernel", (1000, 2048)), ("Dense_0/bias", (1000,))]
  assert names.index("BottleneckResNetBlock_2/Conv_0/kernel") < names.index(
      "BottleneckResNetBlock_10/Conv_0/kernel")
  assert sum(len(s) == 4 for _, s in leaves) == 53 and sum(len(s) == 1 for _, s in leaves) == 107


def test_small_payloads():
  leaves = payloads.leaves("gpt2:1x8x16")
  assert len(leaves) == 16  # GPT-2's structure with one layer: 2 embeddings, 12 per layer, ln_f
  d, vocab, pos = 8, 16, 32  # positions = 4 d
  layer = (2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (2 * d) + (4 * d * d + 4 * d) + (4 * d * d + d)
  assert payloads.count(leaves) == vocab * d + pos * d + layer + 2 * d
  assert payloads.leaves("flat:1000") == [("flat", (1000,))] and payloads.is_flat("flat:1000")
  assert not payloads.is_flat("gpt2:1x8x16")


@pytest.mark.parametrize("bad", ["resnet", "gpt2:0x8x8", "flat:0", "flat:", ""])
def test_payload_names_are_checked(bad):
  with pytest.raises(Exception, match="payload must be"):
    payloads.check_name(bad)


# -- inputs, mean, error -------------------------------------------------------------------------------

@pytest.fixture
def small_spec():
  return data.make_spec("gpt2:1x8x16", payloads.leaves("gpt2:1x8x16"))


def test_inputs_are_deterministic_and_differ_by_rank(small_spec):
  a0 = data.leaf_array(small_spec, 0, 2)
  np.testing.assert_array_equal(a0, data.leaf_array(small_spec, 0, 2))
  assert a0.dtype == np.float32 and a0.shape == tuple(small_spec["leaves"][2]["shape"])
  assert not np.array_equal(a0, data.leaf_array(small_spec, 1, 2))


def test_relative_error_zero_for_the_mean_and_one_for_zeros(small_spec):
  n = len(small_spec["leaves"])
  mean = [data.exact_mean(small_spec, i, 2) for i in range(n)]
  assert data.relative_error(mean, small_spec, 2) == pytest.approx(0.0, abs=1e-15)
  assert data.relative_error([np.zeros_like(m) for m in mean], small_spec, 2) == pytest.approx(1.0)
  noisy = [m * 1.01 for m in mean]  # 1% larger everywhere: error exactly 0.01
  assert data.relative_error(noisy, small_spec, 2) == pytest.approx(0.01)
  with pytest.raises(ValueError, match="outputs"):
    data.relative_error(mean[:-1], small_spec, 2)


def test_gradients_npz_roundtrip(tmp_path, small_spec):
  arrays = {data.npz_key(r, leaf["name"]): np.full(leaf["shape"], r + 1, np.float32)
            for r in range(3) for leaf in small_spec["leaves"]}
  path = tmp_path / "g.npz"
  np.savez(path, **arrays)
  spec = data.make_spec(small_spec["payload"], [(l["name"], l["shape"]) for l in small_spec["leaves"]],
                        str(path))
  assert data.gradient_ranks(str(path)) == 3
  np.testing.assert_array_equal(data.leaf_array(spec, 1, 0), 2.0)
  np.testing.assert_allclose(data.exact_mean(spec, 0, 3), 2.0)


# -- wire bytes ----------------------------------------------------------------------------------------

def test_powersgd_elements_follow_torchs_rule():
  # conv 64x3x7x7 -> 64 x 147: (64 + 147) * 1 * 2 < 9408, compressed; 1-D never (m = 1).
  e = data.powersgd_elements([(64, 3, 7, 7), (64,)], rank=1)
  assert e == dict(uncompressed=64, p=64, q=147, matrices=1)
  # A small matrix fails the rate test at rank 4: 8 x 8 -> (16) * 4 * 2 = 128 >= 64.
  assert data.powersgd_elements([(8, 8)], rank=4) == dict(uncompressed=64, p=0, q=0, matrices=0)
  assert data.powersgd_elements([(100, 10, 10, 10)], rank=4) == dict(uncompressed=0, p=400,
                                                                     q=4000, matrices=1)
  # The rank is capped by the matrix (r = 3 here), and then the rate test fails: sent as is.
  assert data.powersgd_elements([(3, 1000)], rank=4) == dict(uncompressed=3000, p=0, q=0,
                                                             matrices=0)


def test_torch_payload_bytes_and_ring():
  shapes = [(64, 3, 7, 7), (64,)]
  n = 64 * 147 + 64
  assert data.torch_payload_bytes("allreduce_fp32", shapes) == 4 * n
  assert data.torch_payload_bytes("ddp_fp16", shapes) == 2 * n
  assert data.torch_payload_bytes("ddp_powersgd1", shapes) == 4 * (64 + 64 + 147)
  assert data.ring_sent(1000, 2) == 1000 and data.ring_sent(1000, 4) == 1500
  assert data.ring_sent(1000, 1) == 0
  assert data.link_floor_s(125_000_000, 1.0) == pytest.approx(1.0)
  with pytest.raises(ValueError, match="unknown torch method"):
    data.torch_payload_bytes("ddp_int8", shapes)


def test_resnet50_powersgd_rank1_sends_about_2_percent():
  shapes = [s for _, s in payloads.resnet50()]
  fp32 = data.torch_payload_bytes("ddp_fp32", shapes)
  ratio = data.torch_payload_bytes("ddp_powersgd1", shapes) / fp32
  assert 0.005 < ratio < 0.05, ratio


def test_qcomm_tree_wire_bytes_count_the_policy_buffers():
  import jax.numpy as jnp

  from jax_qcomm import QSGD, Cast

  shapes = [s for _, s in payloads.leaves("gpt2:1x64x256")]
  total = sum(math.prod(s) for s in shapes)
  one_d = sum(math.prod(s) for s in shapes if len(s) == 1)
  # Exact fp32: every value, float32, ring.
  assert allreduce.tree_wire_bytes("fp32", None, shapes, 2) == (4 * total, 4 * total)
  # Cast(bf16): the 2-D leaves at 2 bytes (no padding at D=2, bucket 1), 1-D leaves exact float32.
  payload, sent = allreduce.tree_wire_bytes("cast_bf16", Cast(jnp.bfloat16), shapes, 2)
  assert payload == 2 * (total - one_d) + 4 * one_d and sent == payload
  # QSGD 4 bits: about an eighth of float32 for the 2-D part, plus scales; 1-D exact.
  payload4, _ = allreduce.tree_wire_bytes("qsgd4", QSGD(bits=4), shapes, 4)
  two_d = total - one_d
  assert 4 * one_d + two_d // 2 < payload4 < 4 * one_d + two_d // 2 * 1.2


# -- placement -----------------------------------------------------------------------------------------

def test_node_cpus_one_core_per_node_or_sharing():
  cpus, label = cluster.node_cpus(2, "auto", available=[0, 1])
  assert cpus == [0, 1] and label.startswith("one core per node")
  cpus, label = cluster.node_cpus(4, "auto", available=[0, 1])
  assert cpus is None and label.startswith("nodes sharing cores")
  cpus, label = cluster.node_cpus(4, "yes", available=[2, 5])
  assert cpus == [2, 5, 2, 5] and label.startswith("nodes sharing cores")
  cpus, label = cluster.node_cpus(2, "no", available=[0, 1])
  assert cpus is None and label.startswith("nodes sharing cores")
  with pytest.raises(ValueError, match="--pin"):
    cluster.node_cpus(2, "sometimes", available=[0, 1])


def test_peers_arguments_are_checked_before_building_anything(tmp_path):
  import argparse

  parser = argparse.ArgumentParser()
  peers_run.add_arguments(parser)
  args = parser.parse_args(["--rate", "100mbit", "--payloads", "gpt2:1x8x16"])
  assert peers_run.validate(args) == {} and args.nodes == 2 and args.pin == "auto"
  for argv, match in [(["--gradients", "resnet50=x.npz"], "not among"),
                      (["--gradients", "nonsense"], "PAYLOAD=NPZ"),
                      (["--gradients", f"gpt2:1x8x16={tmp_path / 'missing.npz'}"], "no such file"),
                      (["--jax-codecs", "fp64"], "unknown"),
                      (["--nodes", "1"], "--nodes")]:
    bad = parser.parse_args(["--rate", "100mbit", "--payloads", "gpt2:1x8x16", *argv])
    with pytest.raises(ValueError, match=match):
      peers_run.validate(bad)
  with pytest.raises(SystemExit):
    parser.parse_args(["--rate", "1gbit", "--torch-methods", "ddp_int8"])


def test_peers_cli_without_torch_venv_exits_unavailable(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "benchmarks", "peers", "--rate", "100mbit",
                         "--payloads", "flat:1000", "--torch-python", str(tmp_path / "nope")],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == cluster.EXIT_UNAVAILABLE, proc.stderr
  assert "cannot run here" in proc.stderr


# -- reports -------------------------------------------------------------------------------------------

def _peer_row(framework, method, median, sent, **kw):
  row = dict(payload="resnet50", framework=framework, method=method, elements=25_557_032,
             leaves=161, gradients="real (npz)", devices=2, wire_bytes_per_device=sent,
             link_floor_s=sent * 8 / 1e9, median_s=median, min_s=median, max_s=median,
             time_vs_floor=None if median is None else median / (sent * 8 / 1e9),
             rel_error=1e-3, status="ok")
  row.update(kw)
  return row


def test_peers_markdown_has_every_row_and_the_refusal():
  merged = dict(metadata=dict(config=dict(payloads=["resnet50"], repeats=5, warmup=1),
                              torch_version="2.13.0+cpu",
                              cluster=dict(nodes=2, rate="1gbit", placement="one core per node")),
                rows=[_peer_row("torch", "allreduce_fp32", 0.856, 102_228_128),
                      _peer_row("torch", "ddp_bf16", None, 51_114_064, status="refused",
                                error="TypeError: BF16 all reduce communication hook required CUDA "
                                      "11+ and NCCL 2.10+"),
                      _peer_row("torch", "ddp_powersgd1", 0.28, 546_444,
                                rel_error_first_compressed=0.8, ddp_bucket_bytes=[102_228_128]),
                      _peer_row("jax_qcomm", "qsgd4", 0.40, 13_000_000, all_reduces=1)])
  text = report.peers_markdown(merged)
  lines = [l for l in text.splitlines() if l.startswith("| ")]
  assert len(lines) == 2 + 4  # header, alignment, one per row
  assert "refused by torch: TypeError: BF16" in text
  assert "| torch | allreduce_fp32 | 102.23 | 817.8 | 856.0 |" in text
  assert "1.05x" in text  # 856 / 817.8 ms
  assert "error at 1st compressed step 0.8" in text and "1 bucket(s)" in text
  assert "2.14x" in text  # gloo fp32 856 / qsgd4 400


def test_crossover_size_and_table():
  pts = {1024: (1.0, 2.0), 4096: (1.0, 0.9), 16384: (2.0, 2.5), 65536: (4.0, 1.0),
         262144: (8.0, 2.0)}
  assert report.crossover_size(pts) == 65536  # beats fp32 from 64K on, not at 16K
  assert report.crossover_size({1: (1.0, 2.0)}) is None

  def rows(times):
    out = []
    for n, (t32, t4) in times.items():
      out += [dict(size=n, codec="fp32", median_s=t32, speedup_vs_fp32=1.0, time_vs_floor=1.1),
              dict(size=n, codec="qsgd4", median_s=t4, speedup_vs_fp32=t32 / t4)]
    return out

  result = dict(metadata=dict(config=dict(link_gbps=1.0), cluster=dict(rate="1gbit", nodes=2,
                                                                      placement="one core per node")),
                rows=rows(pts))
  text = report.crossover_markdown([result])
  assert "| 1gbit | qsgd4 | 64K | 4.00x | 4.00x |" in text
  never = dict(result, rows=rows({1024: (1.0, 2.0), 2048: (1.0, 3.0)}))
  assert "never (up to 2K)" in report.crossover_markdown([never])


def test_breakdown_markdown():
  result = dict(metadata=dict(num_devices=2, num_processes=2, config=dict(link_gbps=1.0, repeats=5),
                              cluster=dict(nodes=2, rate="1gbit", placement="one core per node")),
                rows=[dict(size=25_600_000, codec="qsgd4", median_s=0.4, wire_bytes_per_device=13e6,
                           link_floor_s=0.104, time_vs_floor=3.85, speedup_vs_fp32=2.1)],
                breakdown=[dict(size=25_600_000, codec="qsgd4", fused=True, encode_chunks_s=0.05,
                                decode_sum_s=0.02, encode_reduced_s=0.02, decode_sum_reencode_s=0.03,
                                decode_chunks_s=0.04, codec_total_s=0.12, transfer_s=0.2)])
  text = report.breakdown_markdown(result)
  assert "| 25.6M | qsgd4 | 400.0 | 13.00 | 104.0 | 3.85x | 2.10x |" in text
  assert "| 50.0 | 30.0 | 40.0 | 120.0 | 200.0 | 1.92x | 320.0 | 400.0 | 104.0 | 3.85x |" in text


def test_report_cli(tmp_path):
  path = tmp_path / "x.json"
  path.write_text(json.dumps(dict(metadata=dict(config=dict(link_gbps=1.0)), rows=[
      dict(size=1024, codec="fp32", median_s=0.001, speedup_vs_fp32=1.0, time_vs_floor=2.0),
      dict(size=1024, codec="cast_bf16", median_s=0.002, speedup_vs_fp32=0.5)])))
  proc = subprocess.run([sys.executable, "-m", "benchmarks.report", "crossover", str(path)],
                        cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert "never (up to 1K)" in proc.stdout


# -- the torch worker (only with the torch venv) --------------------------------------------------------

@pytest.mark.skipif(not TORCH_PYTHON.exists(), reason="no torch venv (benchmarks/peers/setup_torch.sh)")
def test_torch_worker_on_two_local_processes(tmp_path):
  spec_path = tmp_path / "spec.json"
  spec = payloads.spec("gpt2:1x32x64")
  data.write_spec(str(spec_path), spec)
  out = tmp_path / "torch.json"
  port = 29000 + os.getpid() % 1000
  env = {k: v for k, v in os.environ.items() if not k.startswith(("QCOMM_", "PYTHON"))}
  env.update(QCOMM_COORDINATOR=f"127.0.0.1:{port}", QCOMM_NUM_PROCESSES="2",
             PYTHONNOUSERSITE="1")
  procs = [subprocess.Popen([str(TORCH_PYTHON), "-m", "benchmarks.peers.torch_worker", "--spec",
                             str(spec_path), "--repeats", "2", "--warmup", "1", "--link-gbps",
                             "1", "--out", str(out)], cwd=ROOT, env=dict(env, QCOMM_PROCESS_ID=str(r)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for r in range(2)]
  for p in procs:
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
  rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
  assert set(rows) == set(data.TORCH_METHODS)
  shapes = data.shapes(spec)
  for method, r in rows.items():
    assert r["wire_bytes_per_device"] == data.ring_sent(data.torch_payload_bytes(method, shapes), 2)
  assert rows["ddp_bf16"]["status"] == "refused" and "NCCL" in rows["ddp_bf16"]["error"]
  assert rows["allreduce_fp32"]["rel_error"] < 1e-6 and rows["ddp_fp32"]["rel_error"] < 1e-6
  assert 1e-5 < rows["ddp_fp16"]["rel_error"] < 1e-2  # fp16's rounding, not zero
  for m in ("ddp_powersgd1", "ddp_powersgd4"):
    assert rows[m]["status"] == "ok" and rows[m]["ddp_bucket_bytes"] and \
        len(rows[m]["ddp_bucket_bytes"]) == 1
    assert rows[m]["rel_error_first_compressed"] > 0.1  # low rank on random data: large error
  assert all(r["median_s"] is not None for m, r in rows.items() if m != "ddp_bf16")
