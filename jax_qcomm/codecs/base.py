"""The codec protocol: :class:`Codec` (the helpers its implementations share: :mod:`._common`).

Every codec maps an array of any shape to one flat ``uint8`` payload (``encode``), back to an
array (``decode``), and sums several payloads in float32 (``decode_sum``, the middle of a
compressed allreduce). Payload layouts are specified in docs/wire-format.md. :class:`Codec` is the
interface, written down: what the collectives, the packing, the cost model and ``describe`` read
from a codec, and the four methods a new codec implements.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from jax_qcomm.transport import _exchange
from jax_qcomm.native import wire
from jax_qcomm.transport import cost as _transport
from jax_qcomm.transport.axes import AxisName, axis_size, device_key
from jax_qcomm._checks import as_array, check_array, check_key, check_real, check_shape

from jax_qcomm.codecs._common import (  # noqa: F401 (the helpers, importable from here too)
    Shape, FLOAT_DTYPES, IMPLS, is_float_dtype, _check_float, _check_out_dtype, _check_payload,
    seed_words, COLLECTIVES, _check_traffic, _pad_to, concat_leaves, split_leaves, _rows_of,
    _chunks_of, _run_rows, _shard_of, _concat_rows, reduce_packed, nonfinite_mark, bounded_mark,
    abs_max, _ring, _sum_in_order, DEFAULT_COMM_BUCKET)


class Codec(abc.ABC):
  """A codec: how values cross the wire, as array functions and as a reduction across devices.

  A codec is an immutable, hashable value (a frozen dataclass): the collectives group leaves by
  codec and ``jit`` sees it as a static part of the traced program. Every other module talks to a
  codec through the members below, and none looks at a codec's type: a new codec is one subclass.

  **Members, by what a subclass does with them** (the class body follows this order):

  * **(a) must write** (abstract; a frozen dataclass with these four is a codec):
    :meth:`payload_size`, :meth:`wire_bits`, :meth:`wire_encode`, :meth:`wire_decode_sum`.
  * **(b) optional overrides**: the stated attributes where the defaults (lossy, no key, no
    padding, ``uint8`` words, the class name) do not hold -- :attr:`exact`, :attr:`wire_dtype`,
    :attr:`needs_key`, :attr:`pad_multiple`, :meth:`pad_fill`, :attr:`name`; a fused middle step
    -- :meth:`wire_decode_sum_reencode` (QSGD's kernels); the SRA's first encode from the leaves
    where they lie -- :meth:`_encode_packed_rows` (QSGD's CPU kernel); the SRA's middle step --
    :meth:`_reduce_received` with :attr:`_own_row_exact` (QSGD); its own collectives, where
    the SRA is not how it should reduce -- :meth:`buffer_length`, :meth:`allreduce_flat`,
    :meth:`allreduce_leaves`, :meth:`reduce_scatter_flat`, :meth:`all_gather_flat` and
    :meth:`traffic` (together), :meth:`comm_buffer_size`, :meth:`resolve`; the sharded
    collectives on the leaves' own memory instead of a packed copy -- :meth:`reduce_scatter_leaves`,
    :meth:`all_gather_leaves` (same bytes; a payload codec calls :meth:`_reduce_scatter_payloads`,
    :meth:`_all_gather_payloads`), :meth:`reduce_scatter_leaves_marked` and
    :meth:`all_gather_differences` (a kernel's mark; differences read where they lie); a cheaper finite
    guard -- :meth:`allreduce_leaves_marked` (and :meth:`mark_traffic`); where a reduction needs
    each leaf's shape or state carried between calls -- :meth:`init_state`,
    :meth:`allreduce_leaves_with_state`, :meth:`leaves_traffic`, :meth:`leaf_payload_size`.
  * **(c) derived** (never overridden): :attr:`lossy`, :meth:`wire_size`, :meth:`sent_bytes`,
    :meth:`leaves_sent_bytes`, the
    array API (:meth:`encode`, :meth:`decode`, :meth:`decode_sum`, :meth:`decode_sum_reencode`,
    :meth:`roundtrip`) and its row and byte helpers.

  **What it states**

  * :attr:`exact` -- ``decode(encode(x)) == x`` bit for bit (:attr:`lossy` is its negation:
    error feedback and codec-time accounting apply only to lossy codecs).
  * :attr:`needs_key` -- :meth:`encode` needs a JAX PRNG key (stochastic rounding).
  * :attr:`pad_multiple` -- the quantisation bucket: a buffer is padded to a multiple of this many
    elements (per leaf in a packed communication buffer) so that no group of values sharing scales
    straddles two leaves. :meth:`pad_fill` is the value padding uses.
  * :attr:`wire_dtype` -- the word type the payload travels as inside the collectives.
  * :attr:`name` -- a short human-readable name.

  **Sizes**: :meth:`payload_size` (bytes of the payload of ``n`` elements), :meth:`wire_size`
  (the same in words of :attr:`wire_dtype`) and :meth:`wire_bits` (bits per element).

  **Array API** (public, any shape, ``uint8`` payloads in the documented wire format):
  :meth:`encode`, :meth:`decode`, :meth:`decode_sum`, :meth:`decode_sum_reencode`,
  :meth:`roundtrip`. Built here from the wire API; subclasses need not touch them.

  **Wire API** (flat float32 in, rows of :attr:`wire_dtype` words out):

  * ``wire_encode(x: float32[n], key) -> wire[wire_size(n)]``
  * ``wire_decode_sum(wires: wire[k, W], n) -> float32[n]``: the in-order float32 sum of the k
    decodes (``k = 1`` decodes);
  * ``wire_decode_sum_reencode(wires, n, key, scale) -> wire[W]``:
    ``wire_encode(wire_decode_sum(wires, n) * float32(scale), key)`` (no multiplication where
    ``scale == 1``); a codec may fuse it into one kernel with the same bytes (QSGD does).

  **The reduction protocol** (what :func:`jax_qcomm.allreduce`, :func:`jax_qcomm.reduce_scatter`,
  :func:`jax_qcomm.all_gather`, :func:`jax_qcomm.transforms.sync`, :func:`jax_qcomm.transforms.describe` and the cost
  model call; inside ``shard_map`` / ``pmap``, ``axis_name`` a bound name or tuple of names, D its
  size, x this device's flat float32 values):

  * ``allreduce_flat(x: float32[n], axis_name, key, op, exchange) -> (out: float32[n], residual:
    float32[n])``: the mean (``op="mean"``) or sum over the D devices, the same bits on every
    device, and ``residual``, what this device's own quantisation lost (x minus what it
    contributed; zeros for exact codecs), for error feedback.
  * ``allreduce_leaves(parts: [float32[n_i]], axis_name, key, op, exchange) -> (outs, residuals)``:
    the same for the leaves a communication buffer carries (lists of float32[n_i]): the result of
    ``allreduce_flat`` on :func:`concat_leaves` of them (each leaf padded to whole buckets),
    split again. The default builds that buffer; a codec may read and write the leaves in place
    of the packed copy instead, with the same bytes on the wire (:class:`Summable` on CPU does).
  * ``allreduce_leaves_marked(parts, axis_name, key, op, exchange) -> (outs, residuals, mark)``:
    the same and the results' :func:`nonfinite_mark` (0 where all are finite, else NaN; the same
    on every device), the finite guard of :func:`jax_qcomm.transforms.sync`; :meth:`mark_traffic` the bytes
    the mark sends, if any. The default reads the results
    once more; a codec whose shared scales bound its results answers from them
    (:func:`bounded_mark`: :class:`Summable`, :class:`Wire16`, :class:`PowerSGD`), :class:`QSGD`
    from the headers of the payloads it gathers; :class:`NoCompression` in one process has each
    device mark its own 1/D of the results.
  * ``reduce_scatter_flat(x: float32[D*m], axis_name, key, op, exchange) -> (block: float32[m],
    residual: float32[D*m])``: block i of the reduction lands on the device with axis index i.
    ``exchange`` is the schedule of an all-to-all (``jax_qcomm.transport._exchange``); codecs that use none
    ignore it.
  * ``all_gather_flat(x: float[m], axis_name, key) -> float[D, m]``: every device's values,
    decoded, the same bits everywhere (the sender's own row included); x may be any float dtype
    (an exact codec gathers it as it is; lossy ones encode float32 and return float32).
  * ``reduce_scatter_leaves(chunks: [float32[P_i, D, c_i]], axis_name, key, op, exchange) ->
    (blocks: [float32[P_i * c_i]], residuals: [float32[P_i, D, c_i]])`` and
    ``all_gather_leaves(parts: [float[m_i]], axis_name, key) -> [float[D, m_i]]``: the same for
    the leaves of one communication buffer of the sharded mode. Leaf i comes as P_i runs of D
    chunks, the leaf's own memory (:meth:`jax_qcomm.collectives.shard_layout.Layout.chunks`); device j's row of
    it, its shard, is ``chunks[i][:, j]`` in order. The bytes are those of the packed rows (each
    leaf padded to whole buckets; ``traffic`` of their length). The defaults build that buffer
    and call the flat collective; a codec whose flat collective is the payload exchange above
    sends each shard as :func:`jax_qcomm.native.wire.chunk_runs` payloads and a buffer's payloads in one
    message (:meth:`_reduce_scatter_payloads`, :meth:`_all_gather_payloads`: :class:`QSGD`,
    whose kernels read the chunks and write and read the message's pieces where they lie through
    :meth:`_encode_chunk_pieces`, :meth:`_reduce_chunk_pieces`, :meth:`_decode_chunk_pieces` and
    :meth:`_encode_chunk_differences`);
    :class:`NoCompression` where messages cost no latency scatters a list of the chunks.
    ``reduce_scatter_leaves_marked`` adds the blocks' :func:`nonfinite_mark` (this device's;
    default one pass over them) and ``all_gather_differences(news, olds, index, axis_name, key)``
    gathers ``news[i]`` less shard ``index`` of the chunks ``olds[i]``: the two the sharded
    ``sync`` calls.
  * ``traffic(n, devices, collective="allreduce") -> ((xla_collective, bytes), ...)``: the bytes
    each device sends for each XLA collective of one such call on a buffer of ``n`` elements, in
    the ring convention of nccl-tests (all-reduce ``2 (D-1)/D`` of its buffer, all-gather and
    all-to-all ``(D-1)/D`` of the gathered size, reduce-scatter ``(D-1)`` times its output).
    ``collective`` is ``"allreduce"``, ``"reduce_scatter"`` or ``"all_gather"``.
    :meth:`sent_bytes` is their sum: the one byte count of the library.
  * ``allreduce_leaves_with_state(parts, shapes, states, axis_name, key, op, exchange) -> (outs,
    residuals, new_states, mark)``, with :meth:`init_state` ``(shape, key)``: the marked allreduce
    of a communication buffer's leaves given their shapes and the state the codec carries between
    reductions (the same on every device); :meth:`leaves_traffic` ``(shapes, devices,
    collective)`` and :meth:`leaf_payload_size` ``(shape)`` count its bytes. What
    :func:`jax_qcomm.transforms.sync` and :func:`jax_qcomm.allreduce` call. The defaults need neither shapes
    nor state: :meth:`allreduce_leaves_marked`, :meth:`traffic` of the packed length.
    :class:`PowerSGD` overrides them (a leaf is a matrix; its warm start is the state).
  * ``comm_buffer_size(devices, collective="allreduce") -> int``: the most elements a
    communication buffer of this codec carries in ``collective`` where the caller leaves
    ``comm_bucket_size=None``; leaves of one codec are packed up to it (:data:`DEFAULT_COMM_BUCKET`
    here).

  The defaults implement the scatter-reduce-allgather (SRA) from the wire API: each device's
  buffer is padded to whole buckets per device chunk and cut into D chunks, chunk j encoded and
  sent to device j (an all-to-all), the owner decodes and sums the D payloads it received,
  re-encodes the scaled sum once and every device all-gathers and decodes all chunks: each value is
  quantised twice. A codec with :attr:`_own_row_exact` (QSGD) does not encode the chunk a device
  keeps: the owner adds its own values to the decoded others unquantised. :class:`NoCompression`
  overrides them with XLA's float32 ``psum`` / ``psum_scatter`` / ``all_gather``;
  :class:`Summable` with one ``pmax`` of the scales and one ``psum`` of summable words. A codec
  with another way of reducing overrides the three methods and :meth:`traffic` together.
  """

  # ================================================================================================
  # (a) MUST WRITE: sizes and the wire API (abstract)
  # ================================================================================================
  # -- sizes ---------------------------------------------------------------------------------------
  @abc.abstractmethod
  def payload_size(self, n: int) -> int:
    """Bytes of the payload of an array of n elements (what :meth:`encode` returns)."""

  @abc.abstractmethod
  def wire_bits(self, devices: int = 1) -> float:
    """Bits on the wire per element, for whole buckets, when ``devices`` payloads are reduced
    (1: the standalone payload); only codecs whose fields widen with the sum depend on it."""

  # -- wire API ------------------------------------------------------------------------------------
  @abc.abstractmethod
  def wire_encode(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """float32[n] -> wire_dtype[wire_size(n)]: the payload of x."""

  @abc.abstractmethod
  def wire_decode_sum(self, wires: jax.Array, n: int) -> jax.Array:
    """wire_dtype[k, wire_size(n)] -> float32[n]: the in-order float32 sum of the k decodes."""

  # ================================================================================================
  # (b) OPTIONAL OVERRIDES: the defaults hold for a lossy, keyless, unpadded codec of uint8 words
  # ================================================================================================
  # -- stated attributes ---------------------------------------------------------------------------
  #: True if decode(encode(x)) == x bit for bit.
  exact: bool = False
  #: True if a payload carries a small share of the values and error feedback the rest (TopK).
  #: Two defaults follow from it: :class:`qcomm.LeafPolicy` sends small and 1-D leaves through
  #: the codec too (error feedback loses nothing of them), and :func:`qcomm.diloco` with error
  #: feedback uses a lighter outer momentum (the residual already carries part of it).
  sparse: bool = False
  #: True if the codec is meant to run with error feedback (its compression is biased: TopK's
  #: sparsification, PowerSGD's low rank). :func:`qcomm.sync` and :func:`qcomm.diloco` turn error
  #: feedback on by default for such a codec (``error_feedback=None``).
  wants_error_feedback: bool = False
  #: Word type of the payload inside the collectives; its size divides every payload size.
  wire_dtype: Any = np.uint8

  @property
  def needs_key(self) -> bool:
    """True if :meth:`encode` needs a PRNG key (stochastic rounding)."""
    return False

  @property
  def pad_multiple(self) -> int:
    """Buffers are padded to a multiple of this many elements (the quantisation bucket)."""
    return 1

  @property
  def name(self) -> str:
    """A short human-readable name ('QSGD 4b/128 maxmin', 'Cast bfloat16', 'exact fp32')."""
    return type(self).__name__

  def pad_fill(self, x: jax.Array) -> jax.Array:
    """The float32 scalar that pads float32[n] ``x`` without changing its last group's scales."""
    del x
    return jnp.float32(0)

  # -- a fused middle step (default: the three steps apart) ----------------------------------------
  def wire_decode_sum_reencode(self, wires: jax.Array, n: int, key: jax.Array | None,
                               scale: float = 1.0) -> jax.Array:
    """wire[k, W] -> wire[W]: ``wire_encode(wire_decode_sum(wires, n) * float32(scale), key)``."""
    reduced = self.wire_decode_sum(wires, n)
    if scale != 1.0:
      reduced = reduced * jnp.float32(scale)
    return self.wire_encode(reduced, key)

  # -- the reduction protocol (default: scatter-reduce-allgather) ----------------------------------
  # A codec that reduces another way overrides the *_flat / *_leaves methods and traffic together.
  def buffer_length(self, n: int, devices: int) -> int:
    """Elements a flat buffer of ``n`` takes in :meth:`allreduce_flat` over ``devices``: here a
    multiple of ``devices * pad_multiple``, so that every device's chunk is whole buckets."""
    m = devices * self.pad_multiple
    return -(-n // m) * m

  def allreduce_flat(self, x: jax.Array, axis_name: AxisName, key: jax.Array | None,
                     op: str = "mean", exchange: str = "auto") -> tuple[jax.Array, jax.Array]:
    """float32[n] -> (mean or sum over the axis, this device's residual); see the class doc."""
    out, residual, _, _ = self._scatter_reduce_allgather(x, axis_name, key, op, exchange)
    return out, residual

  def _scatter_reduce_allgather(self, x, axis_name, key, op, exchange):
    """The SRA of :meth:`allreduce_flat`: ``(out, residual, gathered, c)``, ``gathered`` the D
    reduced chunk payloads of ``c`` values each that every device decodes (the same everywhere),
    as the pieces they travelled in."""
    n = x.shape[0]
    d = axis_size(axis_name)
    flat = _pad_to(x, self.buffer_length(n, d))  # one leaf of whole buckets: its own packed buffer
    out, residual, gathered, c = self._sra_rows([flat], d, flat.shape[0] // d, axis_name, key,
                                                op, exchange)
    return out[:n], residual[:n], gathered, c

  def _scatter_reduce_allgather_leaves(self, parts, axis_name, key, op, exchange):
    """:meth:`_scatter_reduce_allgather` of the parts' packed buffer (:func:`concat_leaves`), out
    and residual split per leaf: ``(outs, residuals, gathered, c)``."""
    sizes = [p.shape[0] for p in parts]
    d = axis_size(axis_name)
    c = self.buffer_length(wire.leaves_span(sizes, self.pad_multiple), d) // d
    out, residual, gathered, c = self._sra_rows(parts, d, c, axis_name, key, op, exchange)
    m = self.pad_multiple
    return split_leaves(out, sizes, m), split_leaves(residual, sizes, m), gathered, c

  def _sra_rows(self, parts, d, c, axis_name, key, op, exchange):
    """The SRA of the D rows of ``c`` values of the parts' packed buffer (:meth:`_packed_rows`):
    ``(out float32[D * c], residual float32[D * c], gathered, c)``, ``gathered`` the D reduced
    rows' payloads in the pieces they travelled in. Each device encodes the rows in the pieces
    they travel in (:meth:`_encode_packed_pieces`), sends row j to device j, reduces what it
    received (:meth:`_reduce_received`), gathers the reduced rows and decodes them
    (:meth:`_decode_pieces`). Where :attr:`_own_row_exact`, its own row is not encoded: the
    reduction adds it exactly, and its residual is 0."""
    me = lax.axis_index(axis_name)
    chunks = self._packed_rows(parts, d, c)  # read by the residual only, where it is wanted
    payloads = self._encode_packed_pieces(parts, d, c, device_key(key, axis_name, 0),
                                          skip=me if self._own_row_exact else None)
    residual = chunks - self._decode_rows(_exchange.joined(payloads), c)
    if self._own_row_exact:
      residual = jnp.where((jnp.arange(d) == me)[:, None], jnp.float32(0), residual)
    # row s: my chunk from device s, in the pieces it travelled in
    received = _exchange.exchange_pieces(payloads, axis_name, exchange)
    scale = 1.0 / d if op == "mean" else 1.0
    mine = self._reduce_received(received, parts, chunks, me, c,
                                 device_key(key, axis_name, 1), scale)
    gathered = _exchange.gather_pieces(mine, axis_name)  # [D, W] in pieces, the same everywhere
    return self._decode_pieces(gathered, c).reshape(-1), residual.reshape(-1), gathered, c

  #: Whether the SRA leaves each device's own row unquantised in its first half (QSGD); the
  #: default encodes every row and :meth:`_reduce_received` decodes all D.
  _own_row_exact = False

  def _reduce_received(self, received, parts, chunks, me, c, key, scale):
    """The SRA's middle: the D payloads this device received (row s from device s), as the pieces
    they travelled in (:func:`jax_qcomm.transport._exchange.exchange_pieces`) -> its reduced row's payload.
    Default: :meth:`wire_decode_sum_reencode` of all D, joined. A codec with
    :attr:`_own_row_exact` sums its own row (row ``me`` of ``chunks``, the packed rows of
    ``parts``) in place of ``received[me]``. The payload is cut as it travels
    (:func:`jax_qcomm.transport._exchange.cut`)."""
    del parts, me
    mine = self.wire_decode_sum_reencode(_exchange.joined(received), c, key, scale)
    return _exchange.cut(mine, 0, chunks.shape[0])

  def _decode_pieces(self, pieces, c: int) -> jax.Array:
    """Payload rows of ``c`` values as the pieces they travelled in (:func:`jax_qcomm.transport._exchange.
    gather_pieces`) -> float32[rows, c]. Default: :meth:`_decode_rows` of the rows joined; a codec
    whose kernel reads the pieces where they lie overrides it (QSGD on CPU)."""
    return self._decode_rows(_exchange.joined(pieces), c)

  def _packed_rows(self, parts: Sequence[jax.Array], d: int, c: int) -> jax.Array:
    """[float32[n_i]] -> float32[d, c]: :func:`concat_leaves` of the parts, zeros to d * c."""
    return _pad_to(concat_leaves(parts, self), d * c).reshape(d, c)

  def _encode_packed_pieces(self, parts: Sequence[jax.Array], d: int, c: int,
                            key: jax.Array | None, skip: jax.Array | None = None) -> list:
    """:meth:`_encode_packed_rows` cut as the rows travel (:func:`jax_qcomm.transport._exchange.cut`). A
    codec whose kernel writes the pieces where they travel from overrides it (QSGD on CPU)."""
    return _exchange.cut(self._encode_packed_rows(parts, d, c, key, skip), 1, d)

  def _encode_packed_rows(self, parts: Sequence[jax.Array], d: int, c: int,
                          key: jax.Array | None, skip: jax.Array | None = None) -> jax.Array:
    """wire[d, W]: :meth:`_encode_rows` of :meth:`_packed_rows`. Row ``skip`` (a traced index,
    or None) is never read: a codec may leave it unencoded. A codec whose kernel reads the leaves
    where they lie overrides :meth:`_encode_packed_pieces` with the same bytes (QSGD on CPU)."""
    del skip
    return self._encode_rows(self._packed_rows(parts, d, c), key)

  def allreduce_leaves(self, parts: Sequence[jax.Array], axis_name: AxisName,
                       key: jax.Array | None, op: str = "mean", exchange: str = "auto"
                       ) -> tuple[list[jax.Array], list[jax.Array]]:
    """[float32[n_i]] -> ([mean or sum], [residual]): :meth:`allreduce_flat` of the packed
    buffer (:func:`concat_leaves`), split per leaf."""
    return reduce_packed(
        parts, self, lambda flat: self.allreduce_flat(flat, axis_name, key, op, exchange))

  def mark_traffic(self, devices: int) -> tuple[tuple[str, float], ...]:
    """Bytes each device sends for :meth:`allreduce_leaves_marked`'s mark beyond the reduction's
    own :meth:`traffic`, per communication buffer (as ``traffic`` gives them). Default: none (the
    mark is read from what every device holds). Counted by :func:`jax_qcomm.transforms.describe` for a
    ``sync``, whose finite guard uses the mark."""
    del devices
    return ()

  def allreduce_leaves_marked(self, parts: Sequence[jax.Array], axis_name: AxisName,
                              key: jax.Array | None, op: str = "mean", exchange: str = "auto"
                              ) -> tuple[list[jax.Array], list[jax.Array], jax.Array]:
    """:meth:`allreduce_leaves` and the results' :func:`nonfinite_mark`: ``(outs, residuals,
    mark)``, the mark a float32 scalar, 0 where every result is finite and NaN otherwise, the same
    on every device. Default: the mark of the results, one pass over them. A codec that holds a
    bound on its results (a shared scale) overrides it with :func:`bounded_mark`."""
    outs, lost = self.allreduce_leaves(parts, axis_name, key, op, exchange)
    return outs, lost, nonfinite_mark(outs)

  def reduce_scatter_flat(self, x: jax.Array, axis_name: AxisName, key: jax.Array | None,
                          op: str = "mean", exchange: str = "auto") -> tuple[jax.Array, jax.Array]:
    """float32[D*m] -> (this device's block float32[m], residual float32[D*m]): the SRA's first
    half; each value is quantised once on its way to its owner."""
    d = axis_size(axis_name)
    rows = x.reshape(d, -1)
    m = rows.shape[1]
    payloads = self._encode_rows(rows, device_key(key, axis_name, 0))
    residual = (rows - self._decode_rows(payloads, m)).reshape(-1)
    block = self.wire_decode_sum(_exchange.exchange(payloads, axis_name, exchange), m)
    if op == "mean":
      block = block * jnp.float32(1.0 / d)
    return block, residual

  def all_gather_flat(self, x: jax.Array, axis_name: AxisName,
                      key: jax.Array | None) -> jax.Array:
    """float[m] -> float32[D, m]: every device's payload, decoded (the SRA's second half)."""
    payload = self.wire_encode(x.astype(jnp.float32), device_key(key, axis_name, 0))
    gathered = _exchange.gather(payload, axis_name)
    return self._decode_rows(gathered, x.shape[0])

  def reduce_scatter_leaves(self, chunks: Sequence[jax.Array], axis_name: AxisName,
                            key: jax.Array | None, op: str = "mean", exchange: str = "auto"
                            ) -> tuple[list[jax.Array], list[jax.Array]]:
    """[float32[P_i, D, c_i]] -> ([this device's block float32[P_i * c_i]], [residual
    float32[P_i, D, c_i]]): leaf i as P_i runs of D chunks (device j's row of it: its chunks
    ``[:, j]`` in order); :meth:`reduce_scatter_flat` of the packed rows (row j: every leaf's row
    j, each padded to whole buckets), split per leaf."""
    rows = [_rows_of(c) for c in chunks]
    sizes = [r.shape[1] for r in rows]
    packed = jax.vmap(lambda *r: concat_leaves(r, self))(*rows)
    block, residual = self.reduce_scatter_flat(packed.reshape(-1), axis_name, key, op, exchange)
    lost = split_leaves(residual.reshape(packed.shape), sizes, self.pad_multiple)
    return (split_leaves(block, sizes, self.pad_multiple),
            [_chunks_of(r, c.shape) for r, c in zip(lost, chunks)])

  def reduce_scatter_leaves_marked(self, chunks: Sequence[jax.Array], axis_name: AxisName,
                                   key: jax.Array | None, op: str = "mean", exchange: str = "auto"
                                   ) -> tuple[list[jax.Array], list[jax.Array], jax.Array]:
    """:meth:`reduce_scatter_leaves` and the :func:`nonfinite_mark` of this device's blocks:
    ``(blocks, residuals, mark)`` (the mark differs between devices; ``qcomm.sync`` sums it over
    them). Default: the blocks' mark, one pass over them. A codec whose kernel writes the blocks
    overrides it with the kernel's own mark (QSGD on CPU)."""
    blocks, lost = self.reduce_scatter_leaves(chunks, axis_name, key, op, exchange)
    return blocks, lost, nonfinite_mark(blocks)

  def all_gather_differences(self, news: Sequence[jax.Array], olds: Sequence[jax.Array],
                             index: jax.Array, axis_name: AxisName,
                             key: jax.Array | None) -> list[jax.Array]:
    """[float32[m_i]], [float32[P_i, D, c_i]] -> [float32[D, m_i]]: :meth:`all_gather_leaves` of
    ``news[i]`` less shard ``index`` of ``olds[i]`` (``olds[i][:, index]``, ``P_i * c_i = m_i``):
    what the sharded mode gathers, the new values of a device's shards less the current ones.
    Default: the differences, then :meth:`all_gather_leaves`; a codec whose kernel reads both
    where they lie overrides it (QSGD on CPU: no pass that writes the differences)."""
    parts = [x - _shard_of(o, index) for x, o in zip(news, olds)]
    return self.all_gather_leaves(parts, axis_name, key)

  def all_gather_leaves(self, parts: Sequence[jax.Array], axis_name: AxisName,
                        key: jax.Array | None) -> list[jax.Array]:
    """[float[m_i]] -> [float[D, m_i]]: :meth:`all_gather_flat` of :func:`concat_leaves` of the
    parts, split per leaf."""
    sizes = [p.shape[0] for p in parts]
    rows = self.all_gather_flat(concat_leaves(parts, self), axis_name, key)
    return split_leaves(rows, sizes, self.pad_multiple)

  def _reduce_scatter_payloads(self, chunks, axis_name, key, op, exchange):
    """:meth:`reduce_scatter_leaves_marked` as a payload codec runs it: device j's shard of each
    leaf as :func:`jax_qcomm.native.wire.chunk_runs` payloads (a key per leaf and payload), every leaf's
    payloads of shard j in row j of one message, one all-to-all (in the pieces the message
    travels in), and each leaf's reduced shard from its D received payloads. The chunks are read
    and the pieces written and read where they lie (:meth:`_encode_chunk_pieces`,
    :meth:`_reduce_chunk_pieces`). Where :attr:`_own_row_exact`, a device's own shard is not
    encoded: the reduction adds it exactly, and its residual is 0. ``(blocks, residuals,
    mark)``."""
    d = axis_size(axis_name)
    own = lax.axis_index(axis_name) if self._own_row_exact else None
    runs = [wire.chunk_runs(p, c, self.pad_multiple) for p, _, c in (x.shape for x in chunks)]
    message = self._encode_chunk_pieces(chunks, runs, d, device_key(key, axis_name, 0), own)
    residuals = []  # read only where wanted (error feedback): XLA drops it otherwise
    for x, rn, decoded in zip(chunks, runs, self._decode_chunk_pieces(message, runs)):
      lost = _run_rows(x, rn) - jnp.swapaxes(decoded.reshape(d, *rn), 0, 1)  # [runs, D, n]
      if own is not None:
        lost = jnp.where((jnp.arange(d) == own)[None, :, None], jnp.float32(0), lost)
      residuals.append(lost if lost.shape == x.shape else _chunks_of(lost[0], x.shape))
    received = _exchange.exchange_pieces(message, axis_name, exchange)
    scale = 1.0 / d if op == "mean" else 1.0
    blocks, mark = self._reduce_chunk_pieces(received, chunks, runs, own, scale)
    return blocks, residuals, mark

  def _chunk_row_widths(self, runs: Sequence[tuple[int, int]]) -> list[int]:
    """Words of :attr:`wire_dtype` each leaf takes in a row of :meth:`_encode_chunk_rows`."""
    return [r * self.wire_size(n) for r, n in runs]

  def _encode_chunk_rows(self, chunks, runs, d: int, key: jax.Array | None,
                         skip: jax.Array | None) -> jax.Array:
    """wire[D, W]: row j every leaf's payloads of shard j, leaf by leaf and run by run (leaf i's
    key ``fold_in(key, i)``, split over its ``runs * D`` payloads in run-major order). Row ``skip``
    (a traced index, or None) is zeros. The composition of per-payload encodes."""
    parts = []
    for i, (x, rn) in enumerate(zip(chunks, runs)):
      rows = _run_rows(x, rn)
      k = None if key is None else jax.random.fold_in(key, i)
      payloads = self._encode_rows(rows.reshape(rn[0] * d, rn[1]), k).reshape(rn[0], d, -1)
      parts.append(_rows_of(payloads))  # [D, runs * W]: device j's message, its runs in order
    message = _concat_rows(parts)
    if skip is not None:
      message = jnp.where((jnp.arange(d) == skip)[:, None], jnp.zeros((), message.dtype), message)
    return message

  def _encode_chunk_pieces(self, chunks, runs, d: int, key: jax.Array | None,
                           skip: jax.Array | None, devices: int | None = None) -> list:
    """:meth:`_encode_chunk_rows` cut as its rows travel among ``devices`` (default ``d``;
    :func:`jax_qcomm.transport._exchange.cut`). A codec whose kernel reads the chunks where they lie and
    writes the pieces overrides it with the same bytes (QSGD on CPU)."""
    return _exchange.cut(self._encode_chunk_rows(chunks, runs, d, key, skip), 1, devices or d)

  def _decode_chunk_pieces(self, pieces, runs) -> list[jax.Array]:
    """k rows laid out as :meth:`_encode_chunk_rows` lays one, in the pieces they travel in (as
    :func:`jax_qcomm.transport._exchange.cut`, ``exchange_pieces`` or ``gather_pieces`` give them) -> each
    leaf's decodes, float32[k, runs_i * n_i]. Default: the rows joined, each leaf's payloads
    decoded; a codec with a kernel that reads the pieces where they lie overrides it (QSGD on
    CPU)."""
    message = _exchange.joined(pieces)
    k = message.shape[0]
    return [self._decode_rows(m.reshape(k * r, -1), n).reshape(k, r * n)
            for (r, n), m in zip(runs, split_leaves(message, self._chunk_row_widths(runs), 1))]

  def _reduce_chunk_pieces(self, received, chunks, runs, own: jax.Array | None,
                           scale: float) -> tuple[list[jax.Array], jax.Array]:
    """The D received rows (row s from device s), in the pieces they travelled in -> (each
    leaf's reduced shard float32[P_i * c_i], its :func:`nonfinite_mark`): per payload the in-order
    sum of its D decodes, times ``scale``; with ``own``, the term of device ``own`` its own shard,
    exact. Default: the rows joined; a codec whose kernel reads the pieces where they lie
    overrides it (QSGD on CPU)."""
    received = _exchange.joined(received)
    d = received.shape[0]
    blocks = []
    for x, (r, n), m in zip(chunks, runs,
                            split_leaves(received, self._chunk_row_widths(runs), 1)):
      m = m.reshape(d, r, -1)
      if own is None:
        block = jax.vmap(lambda w: self.wire_decode_sum(w, n), in_axes=1)(m)
      else:
        vals = self._decode_rows(m.reshape(d * r, -1), n).reshape(d, r, n)
        mine = lax.dynamic_index_in_dim(_run_rows(x, (r, n)), own, axis=1, keepdims=False)
        block = _sum_in_order(jnp.where((jnp.arange(d) == own)[:, None, None], mine[None], vals))
      block = block.reshape(-1)
      blocks.append(block if scale == 1.0 else block * jnp.float32(scale))
    return blocks, nonfinite_mark(blocks)

  def _all_gather_payloads(self, parts, axis_name, key, minus=None):
    """:meth:`all_gather_leaves` as a payload codec runs it: each part its own payload (a key per
    part), written into one message in the pieces it travels in (:meth:`_encode_chunk_pieces` of
    the parts as one device's single chunks), one all-gather per piece, and each part's D rows
    decoded from the gathered pieces (:meth:`_decode_chunk_pieces`). With ``minus = (olds,
    index)`` the parts less shard ``index`` of the olds' chunks (:meth:`all_gather_differences`;
    :meth:`_encode_chunk_differences`)."""
    d = axis_size(axis_name)
    flat = [x.astype(jnp.float32).reshape(1, 1, -1) for x in parts]
    runs = [(1, x.shape[2]) for x in flat]
    k = device_key(key, axis_name, 0)
    message = (self._encode_chunk_pieces(flat, runs, 1, k, None, devices=d) if minus is None
               else self._encode_chunk_differences(flat, runs, *minus, k))
    gathered = _exchange.gather_pieces([p.reshape(-1) for p in message], axis_name)
    return self._decode_chunk_pieces(gathered, runs)

  def _encode_chunk_differences(self, flat, runs, olds, index, key) -> list:
    """:meth:`_encode_chunk_pieces` (one device's row, cut as it travels among the D devices of
    the olds) of ``flat[i]`` (float32[1, 1, m_i]) less shard ``index`` of ``olds[i]``
    (float32[P_i, D, c_i], P_i * c_i = m_i). A codec whose kernel reads both where they lie
    overrides it with the same bytes (QSGD on CPU)."""
    diffs = [x - _shard_of(o, index).reshape(x.shape) for x, o in zip(flat, olds)]
    return self._encode_chunk_pieces(diffs, runs, 1, key, None, devices=olds[0].shape[1])

  def traffic(self, n: int, devices: int,
              collective: str = "allreduce") -> tuple[tuple[str, float], ...]:
    """Bytes each device sends per XLA collective for one reduction of a buffer of ``n`` elements
    over ``devices`` (ring convention; see the class doc). SRA: an all-to-all of D chunk payloads
    and an all-gather of D reduced ones; reduce_scatter: the all-to-all, of blocks of n / D;
    all_gather: an all-gather of D payloads of n each."""
    n, d, collective = _check_traffic(n, devices, collective)
    f = (d - 1) / d
    if collective == "all_gather":
      return (("all-gather", f * d * self.payload_size(n)),)
    if collective == "reduce_scatter":
      return (("all-to-all", f * d * self.payload_size(-(-n // d))),)
    chunk = self.payload_size(self.buffer_length(n, d) // d)
    return (("all-to-all", f * d * chunk), ("all-gather", f * d * chunk))

  # -- the leaves' shapes and state carried between reductions (default: neither is needed) -------
  # A codec whose reduction depends on each leaf's shape (a low-rank codec views a leaf as a
  # matrix) or that carries state from one reduction to the next (PowerSGD's warm start)
  # overrides these four; every other codec inherits defaults built from the methods above.
  def init_state(self, shape: tuple[int, ...], key: jax.Array) -> Any:
    """The state this codec carries from one allreduce of a leaf of ``shape`` to the next, before
    the first (a pytree of arrays; ``key`` a PRNG key that is the same on every device). It must
    stay the same on every device: a codec computes its next state from the reduction's results
    only. Default: ``()`` (none)."""
    del shape, key
    return ()

  def allreduce_leaves_with_state(
      self, parts: Sequence[jax.Array], shapes: Sequence[tuple[int, ...]], states: Sequence[Any],
      axis_name: AxisName, key: jax.Array | None, op: str = "mean", exchange: str = "auto"
  ) -> tuple[list[jax.Array], list[jax.Array], list[Any], jax.Array]:
    """:meth:`allreduce_leaves_marked` of flat leaves whose shapes are ``shapes``, with each
    leaf's state (:meth:`init_state` before the first call): ``(outs, residuals, new_states,
    mark)``, every new state and the mark the same on every device. Default:
    :meth:`allreduce_leaves_marked`, the states passed through."""
    del shapes
    outs, lost, mark = self.allreduce_leaves_marked(parts, axis_name, key, op, exchange)
    return outs, lost, list(states), mark

  def leaves_traffic(self, shapes: Sequence[tuple[int, ...]], devices: int,
                     collective: str = "allreduce") -> tuple[tuple[str, float], ...]:
    """:meth:`traffic` of the one communication buffer that carries leaves of ``shapes`` (each
    padded to whole buckets). Default: ``traffic`` of the packed buffer's length."""
    n = wire.leaves_span([math.prod(s) for s in shapes], self.pad_multiple)
    return self.traffic(n, devices, collective)

  def leaf_payload_size(self, shape: tuple[int, ...]) -> int:
    """Bytes this device contributes for one leaf of ``shape`` (its payload, padded to whole
    buckets); what :func:`jax_qcomm.transforms.describe` shows per leaf. Default: :meth:`payload_size`."""
    return self.payload_size(wire.leaves_span([math.prod(shape)], self.pad_multiple))

  def comm_buffer_size(self, devices: int, collective: str = "allreduce") -> int:
    """The most float32 elements one communication buffer of this codec carries in ``collective``
    (``"allreduce"``, or ``"reduce_scatter"`` for the rows of sharded state) over ``devices``
    where the caller passes ``comm_bucket_size=None`` (the default of :func:`jax_qcomm.allreduce`,
    :func:`jax_qcomm.transforms.sync` and :func:`jax_qcomm.transforms.diloco`): :data:`DEFAULT_COMM_BUCKET`. Each buffer
    is one reduction, so fewer buffers mean fewer collectives; a bound keeps packed copies small."""
    return DEFAULT_COMM_BUCKET

  def resolve(self, devices: int, collective: str = "allreduce",
              transport: _transport.Transport | None = None) -> Codec:
    """The codec that carries out ``collective`` over ``devices`` devices on ``transport``
    (default: :func:`jax_qcomm.transport.current` for ``devices``): this codec itself;
    :class:`Auto` names the candidate it runs. What :func:`jax_qcomm.transforms.describe` shows."""
    _check_traffic(0, devices, collective)
    if transport is not None and not isinstance(transport, _transport.Transport):
      raise ValueError(f"transport must be a jax_qcomm.transport.Transport or None, "
                       f"got {transport!r}")
    return self

  # ================================================================================================
  # (c) DERIVED: built from (a) and (b); never overridden
  # ================================================================================================
  @property
  def lossy(self) -> bool:
    """True if the codec discards information (error feedback then has a residual to keep)."""
    return not self.exact

  def wire_size(self, n: int) -> int:
    """Words of :attr:`wire_dtype` in the payload of n elements."""
    return self.payload_size(n) // np.dtype(self.wire_dtype).itemsize

  def sent_bytes(self, n: int, devices: int, collective: str = "allreduce") -> float:
    """Bytes each device sends for one reduction of ``n`` elements over ``devices`` devices: the
    sum of :meth:`traffic`, equal to what the compiled program's collectives send."""
    return float(sum(b for _, b in self.traffic(n, devices, collective)))

  def leaves_sent_bytes(self, shapes: Sequence[tuple[int, ...]], devices: int,
                        collective: str = "allreduce") -> float:
    """Bytes each device sends for the one communication buffer that carries leaves of
    ``shapes``: the sum of :meth:`leaves_traffic` (what ``describe`` and the cost model count)."""
    return float(sum(b for _, b in self.leaves_traffic(shapes, devices, collective)))

  # -- array API -----------------------------------------------------------------------------------
  def encode(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """Encodes x (any shape; float32/bfloat16/float16) to uint8[payload_size(x.size)]."""
    x = as_array("x", x)
    _check_float(x)
    check_key("key", key)
    return self._to_bytes(self.wire_encode(x.reshape(-1).astype(jnp.float32), key))

  def decode(self, payload: jax.Array, shape: Shape, dtype: Any = jnp.float32) -> jax.Array:
    """Decodes a payload made by ``encode`` of an array of ``shape``; returns ``dtype``."""
    shape = check_shape("shape", shape)
    dtype = _check_out_dtype(dtype)
    n = math.prod(shape)
    _check_payload(payload, self.payload_size(n))
    return self.wire_decode_sum(self._from_bytes(payload[None]), n).reshape(shape).astype(dtype)

  def decode_sum(self, payloads: jax.Array, shape: Shape, dtype: Any = jnp.float32) -> jax.Array:
    """Sum of the decodes of payloads[k, P] (float32 accumulation, in order 0..k-1)."""
    shape = check_shape("shape", shape)
    dtype = _check_out_dtype(dtype)
    n = math.prod(shape)
    self._check_payloads(payloads, n)
    return self.wire_decode_sum(self._from_bytes(payloads), n).reshape(shape).astype(dtype)

  def decode_sum_reencode(self, payloads: jax.Array, shape: Shape, key: jax.Array | None = None,
                          scale: float = 1.0) -> jax.Array:
    """``encode(decode_sum(payloads, shape) * float32(scale), key)``: the middle of the compressed
    allreduce, where the owner of a chunk sums the k payloads it received and re-encodes the
    (scaled) sum. The bytes are those of the three steps done apart (the multiplication is skipped
    where ``scale == 1``, as the collectives do); a codec may fuse them (QSGD's FFI kernels do).
    """
    shape = check_shape("shape", shape)
    check_key("key", key)
    scale = check_real("scale", scale)
    n = math.prod(shape)
    self._check_payloads(payloads, n)
    wire = self.wire_decode_sum_reencode(self._from_bytes(payloads), n, key, scale)
    return self._to_bytes(wire)

  def roundtrip(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """decode(encode(x, key)): what the receiver sees, in x's shape and dtype."""
    x = as_array("x", x)
    return self.decode(self.encode(x, key), x.shape, x.dtype)

  # -- helpers of the reductions and the array API -------------------------------------------------
  def _encode_rows(self, rows: jax.Array, key: jax.Array | None) -> jax.Array:
    """float32[k, c] -> wire[k, W], a key per row."""
    if key is None:
      return jax.vmap(lambda r: self.wire_encode(r, None))(rows)
    return jax.vmap(self.wire_encode)(rows, jax.random.split(key, rows.shape[0]))

  def _decode_rows(self, wires: jax.Array, c: int) -> jax.Array:
    """wire[k, W] -> float32[k, c], each row decoded on its own."""
    return jax.vmap(lambda w: self.wire_decode_sum(w[None], c))(wires)

  def _to_bytes(self, wire: jax.Array) -> jax.Array:
    """wire[..., W] -> uint8[..., W * itemsize] (the same bytes, little-endian)."""
    if wire.dtype == jnp.uint8:
      return wire
    return lax.bitcast_convert_type(wire, jnp.uint8).reshape(wire.shape[:-1] + (-1,))

  def _from_bytes(self, payloads: jax.Array) -> jax.Array:
    """uint8[..., P] -> wire[..., P / itemsize]."""
    size = np.dtype(self.wire_dtype).itemsize
    if size == 1:
      return payloads
    words = payloads.reshape(payloads.shape[:-1] + (payloads.shape[-1] // size, size))
    return lax.bitcast_convert_type(words, self.wire_dtype)

  def _check_payloads(self, payloads: jax.Array, n: int) -> None:
    check_array("payloads", payloads)
    if payloads.ndim != 2 or payloads.shape[0] < 1:
      raise ValueError(f"payloads must have shape [k >= 1, {self.payload_size(n)}], "
                       f"got {payloads.shape}")
    _check_payload(payloads, self.payload_size(n), lead=(payloads.shape[0],))
