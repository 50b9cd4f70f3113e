"""QSGD's sharded reduce-scatter on the chunks in place (CPU): the kernel that encodes every leaf's
shards into the all-to-all's message, in the pieces it travels in, gives the bytes of the
per-payload composition (what GPUs run); the kernel that reduces the received pieces, a device's
own shard exact, gives its values and its non-finite mark. Leaves as P runs of D chunks: chunks of whole buckets (a payload each),
chunks that are not (a shard's runs end to end), chunks shorter than a bucket (a bucket spans
several runs), 0-d leaves (one value)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_qcomm as qcomm
from jax_qcomm.transport import _exchange
from jax_qcomm.native import _ffi, wire
from jax_qcomm.transport import cost as T

from test_qsgd_leaves import _cut, _widths

needs_kernels = pytest.mark.skipif(not _ffi.has_cpu_kernels(), reason="no CPU kernels built")

# (bits, bucket, scheme, rounding): a bucket above the kernels' stack scratch (4096) included.
CONFIGS = [(4, 128, "maxmin", "stochastic"), (3, 24, "norm", "stochastic"),
           (1, 8, "maxmin", "nearest"), (8, 4104, "maxmin", "stochastic"),
           (2, 64, "norm", "nearest")]


def _chunks(d: int, b: int, seed: int, nonfinite: bool = False) -> list[jax.Array]:
  """[P, D, c] leaves: whole buckets (P = 1 and 3), not whole (P = 2), shorter than a bucket
  (P = 4, c = 3), one value (a 0-d leaf), a partial last bucket (P = 1)."""
  r = np.random.default_rng(seed)
  shapes = [(1, 2 * b + 5), (3, b), (2, b + 3), (4, 3), (1, 1)]
  out = [(r.standard_normal((p, d, c)) * np.exp(r.uniform(-3, 3))).astype(np.float32)
         for p, c in shapes]
  if nonfinite:
    out[1][2, d - 1, 4] = np.inf  # the last device's shard
    out[2][0, 0, 1] = np.nan  # device 0's shard
  return [jnp.asarray(x) for x in out]


def _runs(chunks, b):
  return [wire.chunk_runs(x.shape[0], x.shape[2], b) for x in chunks]


def _travel(monkeypatch, how, row_bytes):
  """Messages whole ("whole": the ideal transport) or in about six pieces of whole 8-byte words
  ("pieces": a transport that bounds a message, as between two gloo processes)."""
  bound = None if how == "whole" else max(8, row_bytes // 6)
  monkeypatch.setattr(T, "current", lambda devices: T.Transport(message_bytes=bound))


def _row_bytes(chunks, b, bits, scheme):
  return _ffi.qsgd_chunks_row_bytes([x.shape[0] for x in chunks], [x.shape[2] for x in chunks],
                                    bits=bits, bucket_size=b, scheme=scheme)


def _how(config):
  """Every config's messages travel in pieces, but the last's whole (a whole message is one
  piece)."""
  return "whole" if config == CONFIGS[-1] else "pieces"


@needs_kernels
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("d,skip", [(1, None), (2, None), (3, None), (3, 1)],
                         ids=["d1", "d2", "d3", "d3-skip"])
def test_encode_chunks_equals_the_composition(monkeypatch, config, d, skip):
  """The kernel's message, written in the pieces it travels in, equals the composition's bytes
  cut alike: each leaf's shards encoded payload by payload (its key folded in, split over its
  payloads run-major), laid out row by row; row ``skip`` is zeros."""
  bits, b, scheme, rounding = config
  chunks = _chunks(d, b, seed=bits, nonfinite=True)
  runs = _runs(chunks, b)
  size = _row_bytes(chunks, b, bits, scheme)
  _travel(monkeypatch, how := _how(config), size)
  key = jax.random.key(5)
  out = {}
  for impl in ("ffi", "jax"):
    codec = qcomm.QSGD(bits, b, scheme, rounding, impl=impl)
    out[impl] = [np.asarray(p) for p in jax.jit(lambda xs, s, c=codec: c._encode_chunk_pieces(
        xs, runs, d, key, None if skip is None else s))(chunks, jnp.int32(-1 if skip is None
                                                                              else skip))]
  widths = _exchange.piece_widths(size, 1, d)
  assert (len(widths) > 1) == (how == "pieces")
  for got, want, w in zip(out["ffi"], out["jax"], widths, strict=True):
    assert got.shape == (d, w)
    np.testing.assert_array_equal(got, want)
  if skip is not None:
    assert not np.concatenate(out["ffi"], axis=1)[skip].any()


@needs_kernels
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_chunk_kernels_write_and_read_pieces_cut_anywhere(config):
  """Pieces of 1 to 37 bytes (cuts inside header words and codes), each piece whole or its rows
  apart: the encode writes the bytes of the whole message, and the reduction and the decode read
  them to the values of the whole message, bit for bit."""
  bits, b, scheme, rounding = config
  d = 3
  chunks = _chunks(d, b, seed=bits + 1, nonfinite=True)
  size = _row_bytes(chunks, b, bits, scheme)
  pre, chunk = [x.shape[0] for x in chunks], [x.shape[2] for x in chunks]
  fmt = dict(bits=bits, bucket_size=b, scheme=scheme)
  seeds = jax.vmap(qcomm.QSGD(bits, b, scheme, rounding)._seed)(
      jax.random.split(jax.random.key(3), sum(r for r, _ in _runs(chunks, b)) * d))
  flat = [x.reshape(-1) for x in chunks]
  encode = jax.jit(lambda xs, widths=None: _ffi.qsgd_encode_chunks(
      xs, seeds, jnp.int32(-1), devices=d, pre=pre, chunk=chunk, rounding=rounding,
      widths=widths, **fmt), static_argnames="widths")
  whole = np.asarray(encode(flat))
  cut = encode(flat, widths=tuple(_widths(size)))
  np.testing.assert_array_equal(np.concatenate([np.asarray(c) for c in cut], axis=1), whole)
  reduce = jax.jit(lambda m, xs: _ffi.qsgd_decode_sum_chunks(
      m, jnp.int32(1), xs, 0.5, devices=d, pre=pre, chunk=chunk, **fmt))
  decode = jax.jit(lambda m: _ffi.qsgd_decode_chunks(m, rows=d, pre=pre, chunk=chunk, **fmt))
  want_mark, want = reduce(jnp.asarray(whole), flat)
  want_rows = decode(jnp.asarray(whole))
  for how in ("pieces", "rows"):
    blocks = _cut(jnp.asarray(whole), how)
    mark, got = reduce(blocks, flat)
    assert np.isnan(mark) == np.isnan(want_mark)
    for g, w in zip(got + decode(blocks), want + want_rows, strict=True):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=how)


@needs_kernels
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("d,own,scale", [(1, 0, 1.0), (2, 0, 0.5), (3, 2, 1 / 3), (3, None, 1.0),
                                         (2, 1, 1e-30)],
                         ids=["d1", "d2-own0", "d3-own-last", "d3-no-own", "underflow"])
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nonfinite"])
def test_reduce_chunks_equals_the_composition(monkeypatch, config, d, own, scale, nonfinite):
  """The kernel's shards, read from the received pieces where they lie, equal the composition's
  bit for bit: per payload the in-order sum of the D decodes, device ``own``'s term its own
  shard, exact, times ``scale`` (sums that underflow flush alike); its mark is 0, or NaN where a
  value written is not finite, as the composition's ``nonfinite_mark``."""
  bits, b, scheme, rounding = config
  tiny = scale < 1e-20
  chunks = _chunks(d, b, seed=bits + d, nonfinite=nonfinite)
  if tiny:
    chunks = [x * jnp.float32(1e-36) for x in chunks]
  runs = _runs(chunks, b)
  _travel(monkeypatch, _how(config), _row_bytes(chunks, b, bits, scheme))
  sender = qcomm.QSGD(bits, b, scheme, rounding, impl="jax")
  received = jax.jit(lambda xs: [[p[j:j + 1] for j in range(d)] for p in sender._encode_chunk_pieces(
      xs, runs, d, jax.random.key(1), None)])(_chunks(d, b, seed=bits + 11, nonfinite=nonfinite))
  out = {}
  for impl in ("ffi", "jax"):
    codec = qcomm.QSGD(bits, b, scheme, rounding, impl=impl)
    out[impl] = jax.jit(lambda m, xs, o, c=codec: c._reduce_chunk_pieces(
        m, xs, runs, None if own is None else o, scale))(received, chunks, jnp.int32(own or 0))
  (got, got_mark), (want, want_mark) = out["ffi"], out["jax"]
  for g, w, x in zip(got, want, chunks):
    assert g.shape == (x.shape[0] * x.shape[2],)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  assert np.isnan(got_mark) == np.isnan(want_mark) == nonfinite
  if not nonfinite:
    assert float(got_mark) == 0.0


@needs_kernels
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("rows", [1, 3])
def test_decode_chunks_equals_the_composition(monkeypatch, config, rows):
  """The kernel that decodes each row of a message, read where its pieces lie, into every leaf's
  rows (what the all-gather and the residual read) equals the per-payload decodes, non-finite
  buckets included."""
  bits, b, scheme, rounding = config
  chunks = _chunks(rows, b, seed=bits, nonfinite=rows > 1)
  runs = _runs(chunks, b)
  _travel(monkeypatch, _how(config), _row_bytes(chunks, b, bits, scheme))
  sender = qcomm.QSGD(bits, b, scheme, rounding, impl="jax")
  message = jax.jit(lambda xs: sender._encode_chunk_pieces(xs, runs, rows, jax.random.key(2),
                                                           None))(chunks)
  out = {impl: jax.jit(qcomm.QSGD(bits, b, scheme, rounding, impl=impl)._decode_chunk_pieces,
                       static_argnums=1)(message, tuple(runs)) for impl in ("ffi", "jax")}
  for g, w, (r, n) in zip(out["ffi"], out["jax"], runs):
    assert g.shape == (rows, r * n)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@needs_kernels
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("d,index", [(1, 0), (2, 1), (3, 0), (3, 2)])
def test_encode_differences_equals_the_composition(monkeypatch, config, d, index):
  """The kernel that encodes each part less shard ``index`` of the current values' chunks (what
  the sharded mode all-gathers), in the pieces it travels in, gives the bytes of the
  differences' encode cut alike."""
  bits, b, scheme, rounding = config
  olds = _chunks(d, b, seed=bits, nonfinite=True)
  r = np.random.default_rng(bits)
  news = [jnp.asarray(r.standard_normal(x.shape[0] * x.shape[2]).astype(np.float32)) for x in olds]
  flat = [x.reshape(1, 1, -1) for x in news]
  runs = [(1, x.shape[2]) for x in flat]
  _travel(monkeypatch, how := _how(config), _row_bytes(flat, b, bits, scheme))
  key = jax.random.key(4)
  out = {impl: [np.asarray(p) for p in jax.jit(
      lambda f, o, i, c=qcomm.QSGD(bits, b, scheme, rounding, impl=impl):
      c._encode_chunk_differences(f, runs, o, i, key))(flat, olds, jnp.int32(index))]
         for impl in ("ffi", "jax")}
  plain = qcomm.QSGD(bits, b, scheme, rounding, impl="jax")
  diffs = [x - np.asarray(o)[:, index].reshape(-1) for x, o in zip(news, olds)]
  want = np.asarray(jax.jit(lambda f: plain._encode_chunk_rows(f, runs, 1, key, None))(
      [jnp.asarray(x).reshape(1, 1, -1) for x in diffs]))
  assert (len(out["ffi"]) > 1) == (how == "pieces")
  for impl in ("ffi", "jax"):
    np.testing.assert_array_equal(np.concatenate(out[impl], axis=1), want, err_msg=impl)
  for g, w in zip(out["ffi"], out["jax"], strict=True):
    assert g.shape == w.shape


@needs_kernels
def test_chunk_kernels_reject_bad_sizes():
  """Attributes that do not fit the leaves or the pieces: a clear error, not a read past them."""
  x = jnp.ones((2 * 3 * 8,), jnp.float32)
  kw = dict(bits=4, bucket_size=8, scheme="maxmin")
  seeds = jnp.zeros((3 * 2, 2), jnp.uint32)
  with pytest.raises(ValueError, match="pre and chunk must have one entry per leaf"):
    _ffi.qsgd_encode_chunks([x], seeds, jnp.int32(-1), devices=2, pre=[3, 1], chunk=[8],
                            rounding="nearest", **kw)
  with pytest.raises(Exception, match=r"devices \* pre\[i\] \* chunk\[i\]"):
    jax.block_until_ready(_ffi.qsgd_encode_chunks(
        [x], seeds, jnp.int32(-1), devices=2, pre=[3], chunk=[9], rounding="nearest", **kw))
  with pytest.raises(Exception, match="skip must be -1 or a device index"):
    jax.block_until_ready(_ffi.qsgd_encode_chunks(
        [x], seeds, jnp.int32(2), devices=2, pre=[3], chunk=[8], rounding="nearest", **kw))
  with pytest.raises(Exception, match="seed must hold 2 uint32 words per payload"):
    jax.block_until_ready(_ffi.qsgd_encode_chunks(
        [x], seeds[:5], jnp.int32(-1), devices=2, pre=[3], chunk=[8], rounding="nearest", **kw))
  message = _ffi.qsgd_encode_chunks([x], seeds, jnp.int32(-1), devices=2, pre=[3], chunk=[8],
                                    rounding="nearest", **kw)
  size = message.shape[1]
  with pytest.raises(Exception, match="add up to the payload size"):
    jax.block_until_ready(_ffi.qsgd_encode_chunks(
        [x], seeds, jnp.int32(-1), devices=2, pre=[3], chunk=[8], rounding="nearest",
        widths=[size - 1], **kw))
  with pytest.raises(Exception, match="slot must be -1 or a device index"):
    jax.block_until_ready(_ffi.qsgd_decode_sum_chunks(
        message, jnp.int32(2), [x], 0.5, devices=2, pre=[3], chunk=[8], **kw))
  with pytest.raises(Exception, match="add up to the payload size"):
    jax.block_until_ready(_ffi.qsgd_decode_sum_chunks(
        message[:, 1:], jnp.int32(0), [x], 0.5, devices=2, pre=[3], chunk=[8], **kw))
  with pytest.raises(Exception, match="every row"):
    jax.block_until_ready(_ffi.qsgd_decode_sum_chunks(
        [message[:, :8], message[:1, 8:]], jnp.int32(0), [x], 0.5, devices=2, pre=[3],
        chunk=[8], **kw))
  with pytest.raises(Exception, match="new i must hold pre"):
    jax.block_until_ready(_ffi.qsgd_encode_differences(
        [x[:23]], [x], seeds[:1], jnp.int32(0), devices=2, pre=[3], chunk=[8],
        rounding="nearest", **kw))
  with pytest.raises(Exception, match="shard must be a device index"):
    jax.block_until_ready(_ffi.qsgd_encode_differences(
        [x[:24]], [x], seeds[:1], jnp.int32(2), devices=2, pre=[3], chunk=[8],
        rounding="nearest", **kw))
  with pytest.raises(Exception, match="add up to the payload size"):
    jax.block_until_ready(_ffi.qsgd_decode_chunks(message, rows=2, pre=[2], chunk=[8], **kw))
  with pytest.raises(Exception, match=r"each piece must be u8\[rows, width >= 1\]"):
    jax.block_until_ready(_ffi.qsgd_decode_chunks(message, rows=3, pre=[3], chunk=[8], **kw))
  assert _ffi.qsgd_decode_chunks(message, rows=2, pre=[3], chunk=[8], **kw)[0].shape == (2, 24)


@pytest.mark.parametrize("d", [1, 3])
def test_chunk_seeds_key_each_leaf_as_the_composition(d):
  """The seeds, derived in one batch per distinct payload count, are the composition's: leaf i's
  key fold_in(key, i) split over its runs * D payloads, in leaf order (counts interleaved)."""
  codec = qcomm.QSGD(4)
  runs = [(9, 64), (1, 128), (9, 8), (2, 256), (1, 1), (4, 32)]
  key = jax.random.key(5)
  want = np.concatenate([np.asarray(jax.vmap(codec._seed)(
      jax.random.split(jax.random.fold_in(key, i), r * d))) for i, (r, _) in enumerate(runs)])
  got = np.asarray(codec._chunk_seeds(runs, d, key))
  assert got.shape == (sum(r for r, _ in runs) * d, 2) and got.dtype == np.uint32
  np.testing.assert_array_equal(got, want)
  assert len(np.unique(got, axis=0)) == len(got)  # every payload its own seed
