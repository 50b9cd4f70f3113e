"""QSGD's scatter-reduce-allgather on the leaves in place (CPU): the kernel that encodes the rows of
a pytree's packed buffer from the leaves themselves gives the bytes of the packed rows' encode;
the fused middle step that adds a device's own row exactly (read from the leaves) gives the bytes
of the decodes, the select and the re-encode; the allreduce of a tree through them equals the
pure-JAX reference on the packed buffer bit for bit, the same on every device, with no packed
copy in the compiled program, and its residual is 0 on the device's own row."""

from __future__ import annotations

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import jax_qcomm as qcomm
from jax_qcomm.native import _ffi, wire
from jax_qcomm.codecs import concat_leaves, seed_words

AX = "d"

needs_kernels = pytest.mark.skipif(not _ffi.has_cpu_kernels(), reason="no CPU kernels built")

# (bits, bucket, scheme, rounding): a bucket above the kernels' stack scratch (4096) included.
CONFIGS = [(4, 128, "maxmin", "stochastic"), (3, 24, "norm", "stochastic"),
           (1, 8, "maxmin", "nearest"), (8, 4104, "maxmin", "stochastic"),
           (2, 64, "norm", "nearest")]


def _leaves(sizes, seed):
  r = np.random.default_rng(seed)
  out = [(r.standard_normal(n) * np.exp(r.uniform(-3, 3))).astype(np.float32) for n in sizes]
  if sizes[0] > 3:
    out[0][3] = np.nan  # a non-finite value: its bucket's header says so, as in the packed path
  return [jnp.asarray(x) for x in out]


@needs_kernels
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("rows,extra,skip", [(1, 0, -1), (3, 0, -1), (3, 2, -1), (3, 0, 1)],
                         ids=["1row", "3rows", "zero-rows", "skip"])
def test_encode_leaves_equals_the_packed_rows(config, rows, extra, skip):
  """The kernel's payloads equal the FFI and the reference encode of the packed rows (each leaf
  padded to whole buckets with its last value (maxmin) or 0 (norm), zeros to rows * n), rows
  past the leaves included; leaves of 0, 1, B - 1, B and B + 1 values; row ``skip`` is zeros;
  written in pieces along their bytes, the same bytes."""
  bits, b, scheme, rounding = config
  sizes = [5 * b + 3, 0, 1, b - 1 if b > 1 else 1, b, b + 1]
  parts = _leaves(sizes, seed=bits)
  span = wire.leaves_span(sizes, b)
  n = -(-span // (rows * b)) * b + extra * b  # whole buckets per row; `extra` more of zeros
  keys = jax.random.split(jax.random.key(7), rows)
  seeds = jax.vmap(seed_words)(keys)
  kw = dict(bits=bits, bucket_size=b, scheme=scheme, rounding=rounding)
  got = np.asarray(jax.jit(lambda s, k, ps: _ffi.qsgd_encode_leaves(ps, s, n, k, **kw))(
      seeds, jnp.int32(skip), parts))
  widths = _widths(got.shape[1])  # written in pieces, each row apart: the same bytes
  cut = jax.jit(lambda s, k, ps: _ffi.qsgd_encode_leaves(ps, s, n, k, widths=widths, **kw))(
      seeds, jnp.int32(skip), parts)
  assert [c.shape for c in cut] == [(rows, w) for w in widths]
  np.testing.assert_array_equal(np.concatenate([np.asarray(c) for c in cut], axis=1), got)
  for impl in ("ffi", "jax"):
    codec = qcomm.QSGD(bits, b, scheme, rounding, impl=impl)
    packed = jnp.pad(concat_leaves(parts, codec), (0, rows * n - span)).reshape(rows, n)
    want = np.array(jax.jit(jax.vmap(codec.wire_encode))(packed, keys))
    if skip >= 0:
      want[skip] = 0
    np.testing.assert_array_equal(got, want, err_msg=impl)


@needs_kernels
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("k,slot,row,scale", [(1, 0, 0, 1.0), (3, 0, 1, 1 / 3), (3, 2, 2, 1 / 3),
                                              (4, 1, 5, 0.25), (2, 1, 0, 1e-30)],
                         ids=["k1", "slot0", "slot-last", "row-past-leaves", "underflow"])
@pytest.mark.parametrize("cut", ["whole", "pieces", "rows"])
def test_reencode_own_equals_the_composition(config, k, slot, row, scale, cut):
  """The fused middle step with the own row exact equals the FFI and the reference composition:
  decode every payload, put row ``row`` of the leaves' packed buffer in place of term ``slot``,
  sum in order, scale, encode; rows past the leaves are zeros; sums that underflow flush alike.
  With the payloads cut along their bytes into pieces (as a message travels in pieces, the cuts
  inside header words and codes; each piece whole or its rows apart), and the result written in
  pieces, the same bytes."""
  bits, b, scheme, rounding = config
  sizes = [3 * b + 1, 1, b]
  parts = _leaves(sizes, seed=bits + k)
  span = wire.leaves_span(sizes, b)
  n = 2 * b
  rows_total = max(-(-span // n), row + 1)
  kw = dict(bits=bits, bucket_size=b, scheme=scheme, rounding=rounding)
  key = jax.random.key(3)
  codec = qcomm.QSGD(bits, b, scheme, rounding, impl="ffi")
  r = np.random.default_rng(k)
  xs = (r.standard_normal((k, n)) * (1e-36 if scale < 1e-20 else 2.0)).astype(np.float32)
  payloads = jax.jit(jax.vmap(codec.wire_encode))(jnp.asarray(xs),
                                                  jax.random.split(jax.random.key(k), k))
  size = wire.qsgd_payload_bytes(n, bits, b, scheme)
  widths = None if cut == "whole" else _widths(size)
  got = jax.jit(lambda p, ps: _ffi.qsgd_decode_sum_reencode_own(
      _cut(p, cut), seed_words(key), jnp.int32(slot), ps, jnp.int32(row), n, scale, rows=k,
      widths=widths, **kw))(payloads, parts)
  got = np.asarray(got if widths is None else jnp.concatenate(got))
  for impl in ("ffi", "jax"):
    c = qcomm.QSGD(bits, b, scheme, rounding, impl=impl)
    packed = jnp.pad(concat_leaves(parts, c), (0, rows_total * n - span)).reshape(-1, n)

    def composed(p, packed=packed, c=c):
      vals = jax.vmap(lambda w: c.wire_decode_sum(w[None], n))(p).at[slot].set(packed[row])
      out = vals[0]
      for j in range(1, k):
        out = out + vals[j]
      if scale != 1.0:
        out = out * jnp.float32(scale)
      return c.wire_encode(out, key)

    np.testing.assert_array_equal(got, np.asarray(jax.jit(composed)(payloads)), err_msg=impl)


def _widths(size):
  """Widths 1, 3, 5, ..., 37, 1, 3, ... summing to ``size``: a header word, a bucket's codes and a
  row's last byte each split somewhere, and pieces of 1 byte. Past 1 KiB each width but the
  first is the step times an odd factor (about 50 pieces): every cut still falls at an odd byte,
  and a large payload does not become thousands of operands."""
  scale = max(1, size // 1024) | 1
  widths, step = [], 1
  while sum(widths) < size:
    widths.append(min(step if not widths else step * scale, size - sum(widths)))
    step = step + 2 if step < 37 else 1
  return widths


def _cut(payloads, cut):
  """[k, P] -> the blocks of its pieces along P: one piece ("whole"), pieces of :func:`_widths`
  ("pieces"), or the same pieces each as k rows [1, w] apart ("rows")."""
  if cut == "whole":
    return [payloads]
  ends = np.cumsum(_widths(payloads.shape[1]))
  pieces = [payloads[:, a:b] for a, b in zip([0, *ends[:-1]], ends)]
  if cut == "rows":
    return [p[j:j + 1] for p in pieces for j in range(payloads.shape[0])]
  return pieces


@needs_kernels
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_decode_pieces_equals_the_decode_of_each_row(config):
  """Rows of payloads cut into pieces along their bytes decode, read where the pieces lie, to
  the decode of each whole row (FFI and reference), a non-finite bucket included."""
  bits, b, scheme, rounding = config
  n = 3 * b + 5
  kw = dict(bits=bits, bucket_size=b, scheme=scheme)
  r = np.random.default_rng(bits)
  xs = (r.standard_normal((3, n)) * np.exp(r.uniform(-3, 3))).astype(np.float32)
  xs[1, 2] = np.inf
  codec = qcomm.QSGD(bits, b, scheme, rounding, impl="ffi")
  payloads = jax.jit(jax.vmap(codec.wire_encode))(jnp.asarray(xs),
                                                  jax.random.split(jax.random.key(1), 3))
  for cut in ("whole", "pieces", "rows"):
    got = np.asarray(jax.jit(lambda p: _ffi.qsgd_decode_pieces(_cut(p, cut), n, rows=3, **kw))(
        payloads))
    for impl in ("ffi", "jax"):
      c = qcomm.QSGD(bits, b, scheme, rounding, impl=impl)
      want = np.asarray(jax.jit(jax.vmap(lambda w, c=c: c.wire_decode_sum(w[None], n)))(payloads))
      np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32),
                                    err_msg=f"{cut} {impl}")


@needs_kernels
def test_pieces_are_checked():
  """The pieces' widths, in and out, must add up to one payload, and every piece has every row,
  of one width."""
  kw = dict(bits=4, bucket_size=128, scheme="maxmin")
  size = wire.qsgd_payload_bytes(256, 4, 128, "maxmin")
  p = jnp.zeros((2, size), jnp.uint8)
  with pytest.raises(Exception, match="add up to the payload size"):
    jax.block_until_ready(_ffi.qsgd_decode_pieces([p[:, :10], p[:, 11:]], 256, rows=2, **kw))
  with pytest.raises(Exception, match="every row"):
    jax.block_until_ready(_ffi.qsgd_decode_pieces([p[:, :10], p[:1, 10:]], 256, rows=2, **kw))
  with pytest.raises(Exception, match="same width"):
    jax.block_until_ready(_ffi.qsgd_decode_pieces([p[:1, :10], p[1:, :9], p[:, 9:]], 256,
                                                  rows=2, **kw))
  parts = _leaves([300], seed=0)
  with pytest.raises(Exception, match="add up to the payload size"):
    jax.block_until_ready(_ffi.qsgd_decode_sum_reencode_own(
        [p[:, 1:]], jnp.zeros(2, jnp.uint32), jnp.int32(0), parts, jnp.int32(0), 256, 0.5,
        rows=2, rounding="nearest", **kw))
  with pytest.raises(Exception, match="add up to the payload size"):
    jax.block_until_ready(_ffi.qsgd_decode_sum_reencode_own(
        [p], jnp.zeros(2, jnp.uint32), jnp.int32(0), parts, jnp.int32(0), 256, 0.5,
        rows=2, rounding="nearest", widths=[size - 1], **kw))


@needs_kernels
def test_encode_leaves_rejects_bad_sizes():
  """n must be a positive multiple of the bucket, and the rows must hold every leaf."""
  parts = _leaves([300], seed=0)
  seeds = jnp.zeros((2, 2), jnp.uint32)
  kw = dict(bits=4, bucket_size=128, scheme="maxmin", rounding="nearest")
  with pytest.raises(Exception, match="multiple of bucket_size"):
    jax.block_until_ready(_ffi.qsgd_encode_leaves(parts, seeds, 100, jnp.int32(-1), **kw))
  with pytest.raises(Exception, match="more than rows"):
    jax.block_until_ready(_ffi.qsgd_encode_leaves(parts, seeds[:1], 128, jnp.int32(-1), **kw))
  with pytest.raises(Exception, match="skip must be"):
    jax.block_until_ready(_ffi.qsgd_encode_leaves(parts, seeds, 256, jnp.int32(2), **kw))
  payloads = jnp.zeros((2, wire.qsgd_payload_bytes(256, 4, 128, "maxmin")), jnp.uint8)
  with pytest.raises(Exception, match="slot must"):
    jax.block_until_ready(_ffi.qsgd_decode_sum_reencode_own(
        [payloads], seeds[0], jnp.int32(2), parts, jnp.int32(0), 256, 0.5, rows=2, **kw))


@needs_kernels
@pytest.mark.parametrize("d", [2, 3, 6])
@pytest.mark.parametrize("residual", [False, True], ids=["no-residual", "residual"])
def test_allreduce_of_leaves_in_place_equals_the_packed_reference(d, residual):
  """``qcomm.allreduce`` of a tree with QSGD: results (and residuals) bit for bit those of the
  pure-JAX reference on the packed buffer, the same on every device; the compiled program reads
  the leaves in place (no packed copy where no residual is asked for)."""
  shapes = {"a": (7, 300), "b": (5000,), "c": (33, 129), "d": (128,), "e": (1,), "g": (2, 3, 200)}
  r = np.random.default_rng(d)
  tree = {k: (r.standard_normal((d,) + s) * np.exp(r.uniform(-3, 3))).astype(np.float32)
          for k, s in shapes.items()}
  tree["b"][1, 17] = np.inf
  policy = qcomm.LeafPolicy(min_size=0, compress_1d=True)  # every leaf compressed
  mesh = Mesh(np.array(jax.devices("cpu")[:d]), (AX,))
  got = {}
  for impl in ("ffi", "jax"):
    codec = qcomm.QSGD(4, 128, impl=impl)

    def body(t, codec=codec):
      out = qcomm.allreduce(jax.tree_util.tree_map(lambda a: a[0], t), AX, codec=codec,
                            key=jax.random.key(9), policy=policy, return_residual=residual)
      return jax.tree_util.tree_map(lambda a: a[None], out)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AX), out_specs=P(AX)))
    got[impl] = jax.tree_util.tree_map(np.asarray, f(tree))
    if impl == "ffi":
      hlo = f.lower(tree).compile().as_text()
      assert "qcomm_qsgd_encode_leaves" in hlo
      if not residual:
        # no packed copy (the exchange's concatenates of uint8 payload rows are not one)
        assert not re.search(r"= f32\[[0-9,]*\]\{[0-9,]*\} concatenate\(", hlo)
  for a, b in zip(jax.tree_util.tree_leaves(got["ffi"]), jax.tree_util.tree_leaves(got["jax"])):
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
  out = got["ffi"][0] if residual else got["ffi"]
  for leaf in jax.tree_util.tree_leaves(out):
    for j in range(1, d):
      np.testing.assert_array_equal(leaf[j].view(np.uint32), leaf[0].view(np.uint32))
  assert np.all(np.isnan(out["b"][:, :128])) and np.all(np.isfinite(out["b"][:, 128:]))
  if residual:
    # The residual is what the device's own first quantisation lost: 0 on the row it owns (its
    # own values enter the sum exactly), not elsewhere.
    res = got["ffi"][1]
    names = sorted(shapes)
    span = wire.leaves_span([int(np.prod(shapes[k])) for k in names], 128)
    c = qcomm.QSGD(4, 128).buffer_length(span, d) // d
    for dev in range(d):
      leaves = [res[k][dev].reshape(-1) for k in names]
      packed = np.concatenate([np.pad(x, (0, -x.size % 128)) for x in leaves])
      rows = np.pad(packed, (0, d * c - packed.size)).reshape(d, c)
      np.testing.assert_array_equal(rows[dev], 0)
      assert np.any(rows[(dev + 1) % d] != 0)
