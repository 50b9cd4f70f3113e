"""QSGD: per-bucket quantisation to 1..8 bits (C++/CUDA FFI kernels and a pure-JAX reference)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_qcomm.transport import _exchange
from jax_qcomm.native import _ffi, _reference, wire
from jax_qcomm._checks import check_int, check_int_in
from jax_qcomm.codecs.base import _sum_in_order
from jax_qcomm.codecs.bucketed import _Bucketed


@dataclasses.dataclass(frozen=True)
class QSGD(_Bucketed):
  """QSGD: quantisation of each bucket of ``bucket_size`` values to ``bits`` bits.

  Each bucket is scaled by the power of two that brings its largest magnitude to [1, 2) (exact),
  quantised there, and stores its step in those units with the exponent (docs/wire-format.md), so
  every magnitude is handled alike. With ``L = 2**bits - 1`` (maxmin) or ``2**(bits-1) - 1``
  (norm) levels and ``step`` the bucket's stored step:

  * Valid range: any finite float32, from the smallest normal (2**-126 ~ 1.2e-38) to the largest
    finite (3.4e38), mixed freely within a bucket; every decoded value is then finite.
  * Error bound, per element: ``|decoded - x| <= step`` (stochastic; ``E[decoded] = x`` but for
    values that clamp to the top level, within 2**-11 of the bucket's largest ``|x|``) or
    ``<= step / 2`` (nearest), up to float32 rounding (2**-20 of the bucket's largest ``|x|``)
    and the flush below 2**-126 (next point), where ``step <= (max - min) / L`` (maxmin) or
    ``step <= min(||bucket||_2, 3.4e38) / L`` (norm), each times ``1 + 2**-14`` (the step has
    16 significant bits, rounded up). For ``"norm"`` this is
    QSGD's bound: ``||decoded - x||^2 <= n * step^2 ~ n / L^2 * ||x||^2`` per bucket of ``n``
    values, and ``E||decoded - x||^2 <= min(n / L^2, sqrt(n) / L) * ||x||^2`` when stochastic.
  * Below the smallest normal, all implementations flush denormals as XLA's CPU runtime does
    (FTZ/DAZ): a subnormal input reads as 0 (a bucket of subnormals and zeros decodes to zeros) and
    a decoded value below 2**-126 in magnitude is 0, so the bound above holds up to an absolute
    2**-126. Values more than 2**126 times smaller than their bucket's largest count as 0.
  * A bucket holding NaN or +-Inf decodes to NaN throughout (never to finite values).

  The C++ kernels (each ISA), the CUDA kernels and the pure-JAX reference give the same payload
  bytes and the same decoded float32 values for the same key.

  Its allreduce is the scatter-reduce-allgather (:class:`Codec`), except that a device does not
  encode the chunk it keeps: it adds its own values, unquantised, to the decodes of the D - 1
  chunks it received (in device order), then re-encodes the sum once. A value is quantised once
  on the device that reduces its chunk and twice on the others, and each device runs one encode
  and one decode of a chunk fewer. The error-feedback residual of its own chunk is 0. On CPU the
  first encode and the reduction read a pytree's leaves where they lie (no packed copy).

  Args:
    bits: 1..8 bits per value (``"norm"`` needs at least 2: one is the sign).
    bucket_size: values sharing one set of scales; a positive multiple of 8.
    scheme: ``"maxmin"`` (CGX: levels spread between the bucket's min and max) or ``"norm"`` (QSGD
      paper: sign + level in units of the bucket's L2 norm).
    rounding: ``"stochastic"`` (unbiased; needs a key) or ``"nearest"``.
    impl: ``"auto"`` (FFI kernel where one is built for the platform, else pure JAX), ``"ffi"``
      or ``"jax"``.
  """

  bits: int = 4
  bucket_size: int = 128
  scheme: str = "maxmin"
  rounding: str = "stochastic"
  impl: str = "auto"

  def __post_init__(self):
    check_int_in("bits", self.bits, 1, 8)
    self._check_bucket_size()
    if self.scheme not in wire.SCHEMES:
      raise ValueError(f"scheme must be one of {wire.SCHEMES}, got {self.scheme!r}")
    if self.scheme == "norm" and self.bits < 2:
      raise ValueError("bits must be >= 2 for scheme='norm' (one bit is the sign), got 1")
    self._check_rounding_and_impl("kernels")

  @property
  def _fmt(self) -> dict:
    return dict(bits=self.bits, bucket_size=self.bucket_size, scheme=self.scheme)

  @property
  def name(self) -> str:
    rounding = "" if self.rounding == "stochastic" else f" {self.rounding}"
    return f"QSGD {self.bits}b/{self.bucket_size} {self.scheme}{rounding}"

  def pad_fill(self, x: jax.Array) -> jax.Array:
    # maxmin: repeating the last value keeps the bucket's min and max; norm: 0 keeps its norm.
    if self.scheme == "maxmin" and x.shape[0] > 0:
      return x[-1]
    return jnp.float32(0)

  def payload_size(self, n: int) -> int:
    return wire.qsgd_payload_bytes(check_int("n", n, 0), **self._fmt)

  def wire_bits(self, devices: int = 1) -> float:
    check_int("devices", devices)
    return 32.0 / wire.qsgd_compression_ratio(**self._fmt)

  def _kernel_platforms(self) -> tuple[str, ...]:
    return (("cpu",) if _ffi.has_cpu_kernels() else ()) + (("cuda",) if _ffi.has_cuda_kernels() else ())

  def wire_encode(self, x, key):
    n = x.shape[0]
    seed = self._seed(key)
    if n == 0:
      return jnp.zeros((0,), jnp.uint8)
    kw = dict(rounding=self.rounding, **self._fmt)
    return self._select(lambda a, s: _ffi.qsgd_encode(a, s, **kw),
                        lambda a, s: _reference.encode(a, s, **kw), x, seed)

  def wire_decode_sum(self, payloads, n):
    if n == 0:
      return jnp.zeros((0,), jnp.float32)
    kw = self._fmt
    return self._select(lambda p: _ffi.qsgd_decode_sum(p, n, **kw),
                        lambda p: _reference.decode_sum(p, n, **kw), payloads)

  # -- the sharded mode's collectives: a payload per leaf, read and written where the rows lie --
  def reduce_scatter_leaves(self, rows, axis_name, key, op="mean", exchange="auto"):
    return self._reduce_scatter_payloads(rows, axis_name, key, op, exchange)[:2]

  def reduce_scatter_leaves_marked(self, rows, axis_name, key, op="mean", exchange="auto"):
    return self._reduce_scatter_payloads(rows, axis_name, key, op, exchange)

  def _encode_chunk_pieces(self, chunks, runs, d, key, skip, devices=None):
    """On CPU one kernel reads every leaf's chunks where they lie and writes the message in the
    pieces it travels in (no copy of the gradient, no per-leaf call, no slices); elsewhere the
    composition, cut (the same bytes)."""
    composed = super()._encode_chunk_pieces
    if self.needs_key and key is None:  # (the composition says what is wrong)
      return composed(chunks, runs, d, key, skip, devices)
    seeds = self._chunk_seeds(runs, d, key)
    skip_ = jnp.int32(-1) if skip is None else jnp.asarray(skip, jnp.int32)
    widths = _exchange.piece_widths(sum(self._chunk_row_widths(runs)), 1, devices or d)
    kw = dict(devices=d, pre=[x.shape[0] for x in chunks], chunk=[x.shape[2] for x in chunks],
              rounding=self.rounding, widths=widths, **self._fmt)
    return self._select(
        lambda s, k, *xs: _ffi.qsgd_encode_chunks([x.reshape(-1) for x in xs], s, k, **kw),
        lambda s, k, *xs: composed(list(xs), runs, d, key, skip, devices), seeds, skip_, *chunks,
        only=("cpu",))

  def _decode_chunk_pieces(self, pieces, runs):
    """On CPU one kernel reads the rows where the pieces lie and writes every leaf's decodes (no
    joined copy of the message, no per-leaf slice of it)."""
    composed = super()._decode_chunk_pieces
    pieces, blocks, rows = _flat(pieces)
    kw = dict(rows=rows, pre=[r for r, _ in runs], chunk=[n for _, n in runs], **self._fmt)
    return self._select(lambda *bs: _ffi.qsgd_decode_chunks(bs, **kw),
                        lambda *bs: composed(_blocks_as_pieces(bs, pieces), runs), *blocks,
                        only=("cpu",))

  def _reduce_chunk_pieces(self, received, chunks, runs, own, scale):
    """On CPU one kernel: every leaf's shard, the received rows read where their pieces lie, its
    own term read where it lies, and the mark; elsewhere the composition (the same values)."""
    received, blocks, d = _flat(received)
    k = len(blocks)
    slot = jnp.int32(-1) if own is None else jnp.asarray(own, jnp.int32)
    kw = dict(devices=d, pre=[x.shape[0] for x in chunks], chunk=[x.shape[2] for x in chunks],
              **self._fmt)

    def kernel(s, *ops):
      mark, shards = _ffi.qsgd_decode_sum_chunks(
          ops[:k], s, [x.reshape(-1) for x in ops[k:]], scale, **kw)
      return shards, mark

    def composed(s, *ops):
      del s
      return super(QSGD, self)._reduce_chunk_pieces(_blocks_as_pieces(ops[:k], received),
                                                    list(ops[k:]), runs, own, scale)

    return self._select(kernel, composed, slot, *blocks, *chunks, only=("cpu",))

  def all_gather_leaves(self, parts, axis_name, key):
    return self._all_gather_payloads(parts, axis_name, key)

  def all_gather_differences(self, news, olds, index, axis_name, key):
    return self._all_gather_payloads(news, axis_name, key, minus=(olds, index))

  def _chunk_seeds(self, runs, d: int, key: jax.Array | None) -> jax.Array:
    """uint32[payloads, 2]: leaf i's key ``fold_in(key, i)`` split over its ``runs * d``
    payloads (zeros without a key), as :meth:`_encode_chunk_rows` keys them."""
    if key is None:
      return jnp.zeros((sum(r for r, _ in runs) * d, 2), jnp.uint32)
    # One batched derivation per distinct payload count, not one per leaf: a model's hundreds of
    # leaves would otherwise each lower to their own small threefry ops.
    counts = [r * d for r, _ in runs]
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(counts):
      groups.setdefault(n, []).append(i)
    seeds, start, offset = [], {}, 0
    for n, leaves in groups.items():
      keys = jax.vmap(lambda i, n=n: jax.random.split(jax.random.fold_in(key, i), n))(
          jnp.asarray(leaves, jnp.uint32))
      seeds.append(jax.vmap(self._seed)(keys.reshape(-1)))
      for i in leaves:
        start[i], offset = offset, offset + n
    seeds = jnp.concatenate(seeds)
    if len(groups) == 1:  # already in leaf order
      return seeds
    return seeds[np.concatenate([np.arange(start[i], start[i] + n) for i, n in enumerate(counts)])]

  def _encode_chunk_differences(self, flat, runs, olds, index, key):
    """On CPU one kernel reads the new values and the current ones where they lie (the
    differences are never written out) and writes the pieces the row travels in; elsewhere the
    composition, cut (the same bytes)."""
    composed = super()._encode_chunk_differences
    if self.needs_key and key is None:  # (the composition says what is wrong)
      return composed(flat, runs, olds, index, key)
    d = olds[0].shape[1]
    widths = _exchange.piece_widths(sum(self._chunk_row_widths(runs)), 1, d)
    kw = dict(devices=d, pre=[o.shape[0] for o in olds], chunk=[o.shape[2] for o in olds],
              rounding=self.rounding, widths=widths, **self._fmt)
    k = len(flat)
    return self._select(
        lambda s, i, *xs: _ffi.qsgd_encode_differences(
            [x.reshape(-1) for x in xs[:k]], [o.reshape(-1) for o in xs[k:]], s, i, **kw),
        lambda s, i, *xs: composed(list(xs[:k]), runs, list(xs[k:]), index, key),
        self._chunk_seeds(runs, 1, key), jnp.asarray(index, jnp.int32), *flat, *olds,
        only=("cpu",))

  # -- the allreduce of leaves, its first encode in place, its finite guard from the headers ------
  def allreduce_leaves(self, parts, axis_name, key, op="mean", exchange="auto"):
    """The scatter-reduce-allgather of the leaves' packed buffer, its rows encoded where the
    leaves lie (:meth:`_encode_packed_rows`)."""
    outs, lost, _, _ = self._scatter_reduce_allgather_leaves(parts, axis_name, key, op, exchange)
    return outs, lost

  def allreduce_leaves_marked(self, parts, axis_name, key, op="mean", exchange="auto"):
    """:meth:`allreduce_leaves`; the mark from the headers of the D gathered payloads: a bucket
    that is not finite stores the canonical NaN in its header words, and every other bucket
    decodes finite (the decode saturates at the largest float32), so the results are not read
    again."""
    outs, lost, gathered, c = self._scatter_reduce_allgather_leaves(
        parts, axis_name, key, op, exchange)
    return outs, lost, self._headers_mark(gathered, c)

  # Each device's own row of the SRA stays float32 until the sum: quantised once (in the
  # re-encode), where the other rows are quantised twice, and one encode and one decode fewer.
  _own_row_exact = True

  def _encode_packed_pieces(self, parts, d, c, key, skip=None):
    """On CPU one kernel reads the rows of the packed buffer from the leaves themselves (no
    packed copy: ResNet-50's 25.6M values take 10 ms to copy on one core), writes them in the
    pieces they travel in (no slices) and leaves row ``skip`` as zeros; elsewhere the packed
    rows' encode (every row: ``skip`` is not read), cut."""
    if c == 0 or self.needs_key and key is None:  # (the packed path says what is wrong)
      return super()._encode_packed_pieces(parts, d, c, key)
    seeds = (jnp.zeros((d, 2), jnp.uint32) if key is None
             else jax.vmap(self._seed)(jax.random.split(key, d)))
    skip = jnp.int32(-1) if skip is None else jnp.asarray(skip, jnp.int32)
    kw = dict(rounding=self.rounding, **self._fmt)
    widths = _exchange.piece_widths(self.payload_size(c), 1, d)
    return self._select(
        lambda s, k, *ps: _ffi.qsgd_encode_leaves(ps, s, c, k, widths=widths, **kw),
        lambda s, k, *ps: super(QSGD, self)._encode_packed_pieces(ps, d, c, key),
        seeds, skip, *parts, only=("cpu",))

  def _reduce_received(self, received, parts, chunks, me, c, key, scale):
    """encode((v_0 + ... + v_{D-1}) * scale), summed in order, v_s the decode of row s of the
    received pieces but v_me this device's own row, exact, cut as it travels. On CPU one kernel,
    reading the pieces and the leaves where they lie and writing the pieces; elsewhere the
    decodes, a select and the re-encode (the same bytes)."""
    if c == 0:
      return super()._reduce_received(received, parts, chunks, me, c, key, scale)
    d = chunks.shape[0]
    received, blocks, _ = _flat(received)
    k = len(blocks)
    widths = _exchange.piece_widths(self.payload_size(c), 1, d)
    kw = dict(rounding=self.rounding, **self._fmt)

    def composed(s, slot, *ops):
      del s
      own = lax.dynamic_index_in_dim(chunks, slot, keepdims=False)
      decoded = self._decode_rows(_exchange.joined(_blocks_as_pieces(ops[:k], received)), c)
      vals = jnp.where((jnp.arange(d) == slot)[:, None], own[None], decoded)
      reduced = _sum_in_order(vals)
      if scale != 1.0:
        reduced = reduced * jnp.float32(scale)
      return _exchange.cut(self.wire_encode(reduced, key), 0, d)

    if self.needs_key and key is None:
      return composed(None, me, *blocks)
    return self._select(
        lambda s, slot, *ops: _ffi.qsgd_decode_sum_reencode_own(
            ops[:k], s, slot, ops[k:], slot, c, scale, rows=d, widths=widths, **kw),
        composed, self._seed(key), jnp.asarray(me, jnp.int32), *blocks, *parts, only=("cpu",))

  def _decode_pieces(self, pieces, c):
    """On CPU one kernel reads the rows where the pieces lie (no joined copy of the message);
    elsewhere the rows joined and decoded."""
    if c == 0:
      return super()._decode_pieces(pieces, c)
    pieces, blocks, rows = _flat(pieces)
    return self._select(
        lambda *bs: _ffi.qsgd_decode_pieces(bs, c, rows=rows, **self._fmt),
        lambda *bs: super(QSGD, self)._decode_pieces(_blocks_as_pieces(bs, pieces), c), *blocks,
        only=("cpu",))

  def _headers_mark(self, pieces, n: int) -> jax.Array:
    """0, or NaN where a payload of ``n`` values (rows of the ``pieces``: the payloads cut along
    their bytes, as :func:`jax_qcomm.transport._exchange.gather_pieces` gives them) has a non-finite
    bucket: a header word whose float bits, the step word's low byte (its exponent k) cleared,
    are NaN or Inf (finite buckets store a finite min and a finite step there). Read in each
    piece that holds header words, where it lies."""
    head_bytes = 4 * wire.num_buckets(n, self.bucket_size) * (2 if self.scheme == "maxmin" else 1)
    pieces = _exchange.blocks_of(pieces)
    if any(p[0].shape[1] % 4 for p in pieces[:-1]):  # a piece splits a word: read them joined
      pieces = [[_exchange.joined(pieces)]]
    bad, start = [jnp.bool_(False)], 0
    for blocks in pieces:
      take = min(blocks[0].shape[1], head_bytes - start)
      for b in blocks if take > 0 else ():
        head = lax.bitcast_convert_type(b[:, :take].reshape(b.shape[0], take // 4, 4), jnp.uint32)
        bad.append(jnp.any((head & jnp.uint32(0x7FFFFF00)) >= jnp.uint32(0x7F800000)))
      start += blocks[0].shape[1]
    return jnp.where(jnp.any(jnp.stack(bad)), jnp.float32(jnp.nan), jnp.float32(0))

  def wire_decode_sum_reencode(self, payloads, n, key, scale=1.0):
    # One kernel on the FFI platforms (CPU, CUDA); the pure-JAX reference composes the three steps.
    # Same bytes either way (tests/test_codec.py).
    seed = self._seed(key)
    if n == 0:
      return jnp.zeros((0,), jnp.uint8)
    kw = dict(rounding=self.rounding, **self._fmt)

    def reference(p, s):
      reduced = _reference.decode_sum(p, n, **self._fmt)
      if scale != 1.0:
        reduced = reduced * jnp.float32(scale)
      return _reference.encode(reduced, s, **kw)

    return self._select(
        lambda p, s: _ffi.qsgd_decode_sum_reencode(p, s, n, scale, **kw), reference, payloads, seed)


def _flat(pieces):
  """Pieces of rows (as :func:`jax_qcomm.transport._exchange.joined` takes them) -> ``(nested, blocks,
  rows)``: each piece as its list of blocks, every block in order (a kernel's operands, which
  :func:`_blocks_as_pieces` nests again) and the rows of a piece."""
  nested = _exchange.blocks_of(pieces)
  return nested, [b for piece in nested for b in piece], sum(b.shape[0] for b in nested[0])


def _blocks_as_pieces(blocks, like):
  """The flat ``blocks`` back in the nested pieces of ``like`` (a list of lists of blocks)."""
  out, i = [], 0
  for piece in like:
    out.append(list(blocks[i:i + len(piece)]))
    i += len(piece)
  return out
