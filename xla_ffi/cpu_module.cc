// XLA FFI handlers for the QSGD CPU kernels, exported to Python as capsules (module _qcomm_cpu).
//
// The handlers only check shapes and attributes and loop over leading (vmap) batch rows; the
// codec math is in kernels/. Attribute types must match exactly what jax_qcomm/_ffi.py passes.
// xla_ffi/cuda_module.cc registers the same targets, with the same operands and attributes, for
// CUDA; the checks shared by both are in xla_ffi/qsgd_ffi_common.h.
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/qsgd_cpu.h"
#include "kernels/qsgd_math.h"
#include "kernels/summable_math.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/qsgd_ffi_common.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;
namespace common = qcomm::ffi_common;

namespace {

qcomm::cpu::Params CpuParams(const common::Params& p) {
  return qcomm::cpu::Params{p.bits, p.bucket, p.scheme, p.rounding};
}

// x[rows, n] f32, seed[rows, 2] u32 -> payload[rows, P] u8.
ffi::Error EncodeImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> seed,
                      ffi::ResultBuffer<ffi::U8> payload, int32_t bits, int32_t bucket_size,
                      int32_t scheme, int32_t rounding) {
  const common::Params p{bits, bucket_size, scheme, rounding};
  common::Sizes s;
  if (ffi::Error e = common::EncodeSizes(p, x.dimensions(), x.element_count(), seed.element_count(),
                                         payload->dimensions(), payload->element_count(), &s);
      e.failure())
    return e;
  for (int64_t r = 0; r < s.rows; ++r)
    qcomm::cpu::encode(x.typed_data() + r * s.n, s.n, seed.typed_data() + 2 * r, CpuParams(p),
                       payload->typed_data() + r * s.bytes);
  return ffi::Error::Success();
}

// payloads[rows, k, P] u8 -> out[rows, n] f32: the sum of the k decoded payloads.
ffi::Error DecodeSumImpl(ffi::Buffer<ffi::U8> payloads, ffi::ResultBuffer<ffi::F32> out,
                         int32_t bits, int32_t bucket_size, int32_t scheme) {
  const common::Params p{bits, bucket_size, scheme, qcomm::kNearest};
  const int64_t n = common::LastDim(out->dimensions());
  common::Sizes s;
  if (ffi::Error e = common::DecodeSumSizes(p, payloads.dimensions(), payloads.element_count(), n,
                                            n == 0 ? 0 : out->element_count() / n, &s);
      e.failure())
    return e;
  const qcomm::cpu::WholeRows whole =
      qcomm::cpu::whole_rows(payloads.typed_data(), s.rows * s.k, s.bytes, s.bytes);
  for (int64_t r = 0; r < s.rows; ++r)
    qcomm::cpu::decode_sum(whole.pieces(), r * s.k, s.k, s.n, CpuParams(p),
                           out->typed_data() + r * s.n);
  return ffi::Error::Success();
}

// payloads[rows, k, P] u8, seed[rows, 2] u32 -> payload[rows, P] u8:
// encode(decode_sum(payloads) * scale, seed), the multiplication skipped where scale == 1.
ffi::Error DecodeSumReencodeImpl(ffi::Buffer<ffi::U8> payloads, ffi::Buffer<ffi::U32> seed,
                                 ffi::ResultBuffer<ffi::U8> payload, int32_t bits,
                                 int32_t bucket_size, int32_t scheme, int32_t rounding, int64_t n,
                                 float scale) {
  const common::Params p{bits, bucket_size, scheme, rounding};
  common::Sizes s;
  if (ffi::Error e = common::ReencodeSizes(p, payloads.dimensions(), payloads.element_count(),
                                           seed.element_count(), n, payload->dimensions(),
                                           payload->element_count(), &s);
      e.failure())
    return e;
  for (int64_t r = 0; r < s.rows; ++r)
    qcomm::cpu::decode_sum_reencode(payloads.typed_data() + r * s.k * s.bytes, s.k, s.bytes, s.n,
                                    scale, seed.typed_data() + 2 * r, CpuParams(p),
                                    payload->typed_data() + r * s.bytes);
  return ffi::Error::Success();
}

// ---- the summable codec: x[rows, n] f32, shared[rows, nb] s32, seed[rows, 2] u32 -> words[rows, W]

ffi::Error CheckSummable(int32_t bits, int32_t bucket_size, int32_t devices, int32_t rounding,
                          qcomm::cpu::SummableParams* p) {
  if (bits < 2 || bits > 8)
    return ffi::Error::InvalidArgument("bits must be in 2..8, got " + std::to_string(bits));
  if (bucket_size <= 0 || bucket_size % 8 != 0)
    return ffi::Error::InvalidArgument("bucket_size must be a positive multiple of 8");
  if (devices < 1 || qcomm::summable::field_bits(bits, devices) > 32)
    return ffi::Error::InvalidArgument("devices must be >= 1 with 2 L devices < 2^32");
  if (rounding != qcomm::kStochastic && rounding != qcomm::kNearest)
    return ffi::Error::InvalidArgument("rounding must be 0 (stochastic) or 1 (nearest)");
  *p = qcomm::cpu::SummableParams{bits, bucket_size, devices, rounding};
  return ffi::Error::Success();
}

// One flat row as a buffer of one leaf.
template <typename T>
struct Flat {
  T* data;
  int64_t size, start[2];
  qcomm::cpu::Leaves<T> leaves;
  Flat(T* p, int64_t n) : data(p), size(n), start{0, n}, leaves{&data, &size, start, 1} {}
  Flat(const Flat&) = delete;
};

// CheckSummable for a decode of the sum of `count` payloads (1 <= count <= devices).
ffi::Error CheckSummableDecode(int32_t bits, int32_t bucket_size, int32_t devices, int32_t count,
                               qcomm::cpu::SummableParams* p) {
  if (ffi::Error e = CheckSummable(bits, bucket_size, devices, qcomm::kNearest, p); e.failure())
    return e;
  if (count < 1 || count > devices)
    return ffi::Error::InvalidArgument("count must be in 1..devices");
  return ffi::Error::Success();
}

ffi::Error SummableEncodeImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> shared,
                              ffi::Buffer<ffi::U32> seed, ffi::ResultBuffer<ffi::U32> words,
                              int32_t bits, int32_t bucket_size, int32_t devices, int32_t rounding) {
  qcomm::cpu::SummableParams p;
  if (ffi::Error e = CheckSummable(bits, bucket_size, devices, rounding, &p); e.failure()) return e;
  const int64_t n = common::LastDim(x.dimensions());
  const int64_t rows = n == 0 ? 0 : x.element_count() / n;
  const int64_t nb = qcomm::num_buckets(n, bucket_size);
  const int64_t nw = qcomm::summable::num_words(n, qcomm::summable::fields_per_word(bits, devices));
  if (common::LastDim(words->dimensions()) != nw || words->element_count() != rows * nw)
    return ffi::Error::InvalidArgument("words shape does not match the input size");
  if (shared.element_count() != rows * nb)
    return ffi::Error::InvalidArgument("shared must hold one int32 per bucket and row");
  if (seed.element_count() != 2 * rows)
    return ffi::Error::InvalidArgument("seed must hold 2 uint32 words per row");
  for (int64_t r = 0; r < rows; ++r) {
    Flat<const float> row(x.typed_data() + r * n, n);
    qcomm::cpu::summable_encode(row.leaves, shared.typed_data() + r * nb, seed.typed_data() + 2 * r,
                                p, words->typed_data() + r * nw);
  }
  return ffi::Error::Success();
}

// x[rows, n] f32 -> shared[rows, nb] s32: the bits of each bucket's largest |x|.
ffi::Error SummableScaleImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out,
                             int32_t bucket_size) {
  if (bucket_size <= 0)
    return ffi::Error::InvalidArgument("bucket_size must be positive");
  const int64_t n = common::LastDim(x.dimensions());
  const int64_t rows = n == 0 ? 0 : x.element_count() / n;
  const int64_t nb = qcomm::num_buckets(n, bucket_size);
  if (common::LastDim(out->dimensions()) != nb || out->element_count() != rows * nb)
    return ffi::Error::InvalidArgument("output shape does not match the number of buckets");
  for (int64_t r = 0; r < rows; ++r) {
    Flat<const float> row(x.typed_data() + r * n, n);
    qcomm::cpu::summable_scale(row.leaves, bucket_size, out->typed_data() + r * nb);
  }
  return ffi::Error::Success();
}

// words[rows, W] u32, shared[rows, nb] s32 -> out[rows, n] f32.
ffi::Error SummableDecodeImpl(ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::S32> shared,
                              ffi::ResultBuffer<ffi::F32> out, int32_t bits, int32_t bucket_size,
                              int32_t devices, int32_t count, float scale) {
  qcomm::cpu::SummableParams p;
  if (ffi::Error e = CheckSummableDecode(bits, bucket_size, devices, count, &p); e.failure())
    return e;
  const int64_t n = common::LastDim(out->dimensions());
  const int64_t rows = n == 0 ? 0 : out->element_count() / n;
  const int64_t nb = qcomm::num_buckets(n, bucket_size);
  const int64_t nw = qcomm::summable::num_words(n, qcomm::summable::fields_per_word(bits, devices));
  if (common::LastDim(words.dimensions()) != nw || words.element_count() != rows * nw)
    return ffi::Error::InvalidArgument("words shape does not match the output size");
  if (shared.element_count() != rows * nb)
    return ffi::Error::InvalidArgument("shared must hold one int32 per bucket and row");
  for (int64_t r = 0; r < rows; ++r) {
    Flat<float> row(out->typed_data() + r * n, n);
    qcomm::cpu::summable_decode(words.typed_data() + r * nw, shared.typed_data() + r * nb,
                                row.leaves, count, scale, p);
  }
  return ffi::Error::Success();
}

// ---- the summable codec on a list of leaves, read and written in place of a packed buffer ------
// Leaf i is float32 of any shape, its span padded to whole buckets: the packed buffer's layout.

template <typename T>
struct LeafList {
  std::vector<T*> data;
  std::vector<int64_t> size, start{0};
  qcomm::cpu::Leaves<T> leaves() const {
    return {data.data(), size.data(), start.data(), static_cast<int64_t>(data.size())};
  }
  void add(T* p, int64_t n, int64_t bucket) {
    data.push_back(p);
    size.push_back(n);
    start.push_back(start.back() + qcomm::num_buckets(n, bucket) * bucket);
  }
};

ffi::Error InputLeaves(const ffi::RemainingArgs& args, int64_t bucket, LeafList<const float>* out,
                       size_t first = 0) {
  for (size_t i = first; i < args.size(); ++i) {
    ffi::ErrorOr<ffi::Buffer<ffi::F32>> leaf = args.get<ffi::Buffer<ffi::F32>>(i);
    if (leaf.has_error()) return leaf.error();
    out->add(leaf->typed_data(), static_cast<int64_t>(leaf->element_count()), bucket);
  }
  return ffi::Error::Success();
}

// Payload rows in pieces (kernels/qsgd_cpu.h, Pieces) from the buffers that hold them, operands or
// results, in order: each u8[r, width] (or u8[width], r = 1) is a whole piece (r = rows) or one
// row of a piece (r = 1), the rows of a piece consecutive and in order. `pieces` points into
// `data` and `end`.
struct PieceList {
  std::vector<uint8_t*> data;
  std::vector<int64_t> end;
  qcomm::cpu::Pieces pieces{};
  int64_t open = 0, width = 0;  // rows gathered of the piece being read, and its width

  ffi::Error add(uint8_t* buffer, ffi::Span<const int64_t> dims, int64_t rows) {
    const int64_t r = dims.size() == 2 ? dims[0] : 1;
    const int64_t w = dims.size() == 0 ? 0 : dims.back();
    if (dims.size() < 1 || dims.size() > 2 || w < 1 || (r != rows && r != 1))
      return ffi::Error::InvalidArgument(
          "each piece must be u8[rows, width >= 1], or u8[1, width] for one row of a piece");
    if (open > 0 && w != width)
      return ffi::Error::InvalidArgument("the rows of a piece must have the same width");
    for (int64_t j = 0; j < r; ++j) data.push_back(buffer + j * w);
    open += r;
    width = w;
    if (open == rows) {
      end.push_back((end.empty() ? 0 : end.back()) + w);
      open = 0;
    }
    return ffi::Error::Success();
  }
  ffi::Error finish(int64_t rows, int64_t bytes) {
    if (open != 0 || end.empty())
      return ffi::Error::InvalidArgument("a piece must have every row");
    if (end.back() != bytes)
      return ffi::Error::InvalidArgument("the pieces' widths must add up to the payload size");
    pieces = {data.data(), end.data(), static_cast<int64_t>(end.size()), rows};
    return ffi::Error::Success();
  }
};

// Operands [first, first + count): the pieces of `rows` payloads of `bytes` each.
ffi::Error InputPieces(const ffi::RemainingArgs& args, size_t first, size_t count, int64_t rows,
                       int64_t bytes, PieceList* out) {
  if (rows < 1) return ffi::Error::InvalidArgument("rows must be >= 1");
  if (count < 1 || first + count > args.size())
    return ffi::Error::InvalidArgument("the payloads must be in at least one operand");
  for (size_t q = first; q < first + count; ++q) {
    ffi::ErrorOr<ffi::Buffer<ffi::U8>> piece = args.get<ffi::Buffer<ffi::U8>>(q);
    if (piece.has_error()) return piece.error();
    if (ffi::Error e = out->add(piece->typed_data(), piece->dimensions(), rows); e.failure())
      return e;
  }
  return out->finish(rows, bytes);
}

// Every result: the pieces of `rows` payloads of `bytes` each.
ffi::Error OutputPieces(const ffi::RemainingRets& rets, int64_t rows, int64_t bytes,
                        PieceList* out) {
  if (rows < 1) return ffi::Error::InvalidArgument("rows must be >= 1");
  for (size_t q = 0; q < rets.size(); ++q) {
    ffi::ErrorOr<ffi::Result<ffi::Buffer<ffi::U8>>> piece = rets.get<ffi::Buffer<ffi::U8>>(q);
    if (piece.has_error()) return piece.error();
    if (ffi::Error e = out->add((*piece)->typed_data(), (*piece)->dimensions(), rows); e.failure())
      return e;
  }
  return out->finish(rows, bytes);
}

// pieces... (PieceList) -> out[rows, n] f32: each row's payload, its bytes the pieces' in order,
// decoded where the pieces lie.
ffi::Error QsgdDecodePiecesImpl(ffi::RemainingArgs pieces, ffi::ResultBuffer<ffi::F32> out,
                                int32_t bits, int32_t bucket_size, int32_t scheme) {
  const common::Params p{bits, bucket_size, scheme, qcomm::kNearest};
  if (ffi::Error e = common::CheckParams(p); e.failure()) return e;
  const auto dims = out->dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("out must be [rows, n]");
  PieceList m;
  if (ffi::Error e = InputPieces(pieces, 0, pieces.size(), dims[0],
                                 qcomm::payload_bytes(dims[1], bucket_size, bits, scheme), &m);
      e.failure())
    return e;
  for (int64_t r = 0; r < dims[0]; ++r)
    qcomm::cpu::decode_sum(m.pieces, r, 1, dims[1], CpuParams(p), out->typed_data() + r * dims[1]);
  return ffi::Error::Success();
}

// A scalar int32 operand (a row or slot index that the program computes, e.g. the axis index).
ffi::ErrorOr<int64_t> ScalarIndex(ffi::Buffer<ffi::S32> index, const char* name) {
  if (index.element_count() != 1)
    return ffi::Error::InvalidArgument(std::string(name) + " must be one int32");
  return static_cast<int64_t>(index.typed_data()[0]);
}

// The checks both QSGD handlers on leaves share: the format, the row length n (whole buckets) and
// the leaves themselves, operands `first` on (into `x`).
ffi::Error QsgdLeavesInput(const common::Params& p, int64_t n, const ffi::RemainingArgs& leaves,
                           LeafList<const float>* x, size_t first = 0) {
  if (ffi::Error e = common::CheckParams(p); e.failure()) return e;
  if (n <= 0 || n % p.bucket != 0)
    return ffi::Error::InvalidArgument("n must be a positive multiple of bucket_size");
  return InputLeaves(leaves, p.bucket, x, first);
}

// seed[rows, 2] u32, skip[] s32, leaves... f32 -> the pieces (PieceList) of payloads[rows, P] u8:
// QSGD's encode of the rows of n values of the packed buffer that the leaves span (each padded to
// whole buckets), zeros after them; row `skip` (-1: none) is zeros.
ffi::Error QsgdEncodeLeavesImpl(ffi::Buffer<ffi::U32> seed, ffi::Buffer<ffi::S32> skip,
                                ffi::RemainingArgs leaves, ffi::RemainingRets payloads,
                                int32_t bits, int32_t bucket_size, int32_t scheme, int32_t rounding,
                                int64_t n, int64_t rows) {
  const common::Params p{bits, bucket_size, scheme, rounding};
  LeafList<const float> x;
  if (ffi::Error e = QsgdLeavesInput(p, n, leaves, &x); e.failure()) return e;
  PieceList out;
  if (ffi::Error e = OutputPieces(payloads, rows, qcomm::payload_bytes(n, bucket_size, bits, scheme),
                                  &out);
      e.failure())
    return e;
  if (x.start.back() > rows * n)
    return ffi::Error::InvalidArgument("the leaves hold more than rows * n elements");
  if (seed.element_count() != 2 * rows)
    return ffi::Error::InvalidArgument("seed must hold 2 uint32 words per row");
  ffi::ErrorOr<int64_t> skipped = ScalarIndex(skip, "skip");
  if (skipped.has_error()) return skipped.error();
  if (*skipped < -1 || *skipped >= rows)
    return ffi::Error::InvalidArgument("skip must be -1 or a row index");
  qcomm::cpu::encode_leaves(x.leaves(), n, *skipped, seed.typed_data(), CpuParams(p), out.pieces);
  return ffi::Error::Success();
}

// seed[2] u32, slot[] s32, row[] s32, then the first `pieces` operands the pieces (PieceList) of
// k = `rows` payloads, then leaves... f32 -> the pieces of payload[P] u8 (one row):
// encode((v_0 + ... + v_{k-1}) * scale), v_j the decode of payload j but v_slot row `row` of the
// leaves' packed buffer (n values per row), exact.
ffi::Error QsgdDecodeSumReencodeOwnImpl(ffi::Buffer<ffi::U32> seed, ffi::Buffer<ffi::S32> slot,
                                        ffi::Buffer<ffi::S32> row, ffi::RemainingArgs operands,
                                        ffi::RemainingRets payload, int32_t bits,
                                        int32_t bucket_size, int32_t scheme, int32_t rounding,
                                        int64_t n, float scale, int64_t rows, int64_t pieces) {
  const common::Params p{bits, bucket_size, scheme, rounding};
  if (pieces < 1) return ffi::Error::InvalidArgument("pieces must be >= 1");
  LeafList<const float> own;
  if (ffi::Error e = QsgdLeavesInput(p, n, operands, &own, static_cast<size_t>(pieces));
      e.failure())
    return e;
  const int64_t bytes = qcomm::payload_bytes(n, bucket_size, bits, scheme);
  PieceList m, out;
  if (ffi::Error e = InputPieces(operands, 0, static_cast<size_t>(pieces), rows, bytes, &m);
      e.failure())
    return e;
  if (ffi::Error e = OutputPieces(payload, 1, bytes, &out); e.failure()) return e;
  if (seed.element_count() != 2)
    return ffi::Error::InvalidArgument("seed must hold 2 uint32 words");
  ffi::ErrorOr<int64_t> s = ScalarIndex(slot, "slot"), r = ScalarIndex(row, "row");
  if (s.has_error()) return s.error();
  if (r.has_error()) return r.error();
  if (*s < 0 || *s >= rows) return ffi::Error::InvalidArgument("slot must index a payload");
  if (*r < 0) return ffi::Error::InvalidArgument("row must be >= 0");  // past the leaves: zeros
  qcomm::cpu::decode_sum_reencode_own(m.pieces, *s, own.leaves(), *r, n, scale, seed.typed_data(),
                                      CpuParams(p), out.pieces);
  return ffi::Error::Success();
}

// ---- QSGD on the chunks of a sharded reduce-scatter (kernels/qsgd_cpu.h, Chunks) ----------------

// The chunks that leaves[first + i] hold (leaf i: devices * pre[i] * chunk[i] float32 values),
// checked.
struct ChunkList {
  std::vector<const float*> data;
  qcomm::cpu::Chunks chunks;
};

ffi::Error InputChunks(const common::Params& p, int64_t devices, ffi::Span<const int64_t> pre,
                       ffi::Span<const int64_t> chunk, const ffi::RemainingArgs& leaves,
                       size_t first, ChunkList* out) {
  if (ffi::Error e = common::CheckParams(p); e.failure()) return e;
  if (devices < 1) return ffi::Error::InvalidArgument("devices must be >= 1");
  if (chunk.size() != pre.size() || first + pre.size() > leaves.size())
    return ffi::Error::InvalidArgument("pre and chunk must have one entry per leaf");
  for (size_t i = 0; i < pre.size(); ++i) {
    ffi::ErrorOr<ffi::Buffer<ffi::F32>> leaf = leaves.get<ffi::Buffer<ffi::F32>>(first + i);
    if (leaf.has_error()) return leaf.error();
    if (pre[i] < 1 || chunk[i] < 1 ||
        static_cast<int64_t>(leaf->element_count()) != devices * pre[i] * chunk[i])
      return ffi::Error::InvalidArgument("leaf i must hold devices * pre[i] * chunk[i] values");
    out->data.push_back(leaf->typed_data());
  }
  out->chunks = qcomm::cpu::Chunks{out->data.data(), pre.begin(), chunk.begin(),
                                   static_cast<int64_t>(pre.size()), devices, p.bucket};
  return ffi::Error::Success();
}

// The float32 results `out` (result i: rows * pre[i] * chunk[i] values), checked, into `parts`.
ffi::Error ResultParts(const ffi::RemainingRets& out, int64_t rows, ffi::Span<const int64_t> pre,
                       ffi::Span<const int64_t> chunk, std::vector<float*>* parts) {
  if (pre.size() != out.size() || chunk.size() != out.size())
    return ffi::Error::InvalidArgument("pre and chunk must have one entry per result");
  for (size_t i = 0; i < out.size(); ++i) {
    ffi::ErrorOr<ffi::Result<ffi::Buffer<ffi::F32>>> part = out.get<ffi::Buffer<ffi::F32>>(i);
    if (part.has_error()) return part.error();
    if (pre[i] < 1 || chunk[i] < 1 ||
        static_cast<int64_t>((*part)->element_count()) != rows * pre[i] * chunk[i])
      return ffi::Error::InvalidArgument("result i must hold rows * pre[i] * chunk[i] values");
    parts->push_back((*part)->typed_data());
  }
  return ffi::Error::Success();
}

// seed[payloads, 2] u32, skip[] s32, leaves... f32 -> the pieces (PieceList) of message[devices,
// W] u8: every leaf's payloads of shard j in row j, row `skip` (-1: none) zeros.
ffi::Error QsgdEncodeChunksImpl(ffi::Buffer<ffi::U32> seed, ffi::Buffer<ffi::S32> skip,
                                ffi::RemainingArgs leaves, ffi::RemainingRets message,
                                int32_t bits, int32_t bucket_size, int32_t scheme, int32_t rounding,
                                int64_t devices, ffi::Span<const int64_t> pre,
                                ffi::Span<const int64_t> chunk) {
  const common::Params p{bits, bucket_size, scheme, rounding};
  ChunkList x;
  if (leaves.size() != pre.size())
    return ffi::Error::InvalidArgument("pre and chunk must have one entry per leaf");
  if (ffi::Error e = InputChunks(p, devices, pre, chunk, leaves, 0, &x); e.failure()) return e;
  PieceList out;
  if (ffi::Error e = OutputPieces(message, devices, x.chunks.row_bytes(bits, scheme), &out);
      e.failure())
    return e;
  if (static_cast<int64_t>(seed.element_count()) != 2 * x.chunks.payloads() * devices)
    return ffi::Error::InvalidArgument("seed must hold 2 uint32 words per payload");
  ffi::ErrorOr<int64_t> skipped = ScalarIndex(skip, "skip");
  if (skipped.has_error()) return skipped.error();
  if (*skipped < -1 || *skipped >= devices)
    return ffi::Error::InvalidArgument("skip must be -1 or a device index");
  qcomm::cpu::encode_chunks(x.chunks, *skipped, seed.typed_data(), CpuParams(p), out.pieces);
  return ffi::Error::Success();
}

// seed[n, 2] u32, shard[] s32, news... f32 (n), olds... f32 (n) -> the pieces (PieceList) of
// message[1, W] u8: one payload per leaf, of new[i] - (shard `shard` of old[i]), old[i] held as
// pre[i] runs of `devices` chunks of chunk[i] values and new[i] as pre[i] * chunk[i] values; read
// where both lie.
ffi::Error QsgdEncodeDifferencesImpl(ffi::Buffer<ffi::U32> seed, ffi::Buffer<ffi::S32> shard,
                                     ffi::RemainingArgs leaves, ffi::RemainingRets message,
                                     int32_t bits, int32_t bucket_size, int32_t scheme,
                                     int32_t rounding, int64_t devices, ffi::Span<const int64_t> pre,
                                     ffi::Span<const int64_t> chunk) {
  const common::Params p{bits, bucket_size, scheme, rounding};
  const size_t n = pre.size();
  if (leaves.size() != 2 * n)
    return ffi::Error::InvalidArgument(
        "pre and chunk must have one entry per leaf, and the operands a new and an old per leaf");
  if (ffi::Error e = common::CheckParams(p); e.failure()) return e;
  if (devices < 1) return ffi::Error::InvalidArgument("devices must be >= 1");
  // leaves[:n] the news (one device's single chunk each), leaves[n:] the olds' chunks.
  std::vector<int64_t> ones(n, 1), sizes(n);
  for (size_t i = 0; i < n; ++i) sizes[i] = pre[i] * chunk[i];
  ChunkList x, old;
  if (InputChunks(p, 1, ones, sizes, leaves, 0, &x).failure() ||
      InputChunks(p, devices, pre, chunk, leaves, n, &old).failure())
    return ffi::Error::InvalidArgument(
        "new i must hold pre[i] * chunk[i] values and old i devices times as many");
  PieceList out;
  if (ffi::Error e = OutputPieces(message, 1, x.chunks.row_bytes(bits, scheme), &out); e.failure())
    return e;
  if (static_cast<int64_t>(seed.element_count()) != 2 * x.chunks.payloads())
    return ffi::Error::InvalidArgument("seed must hold 2 uint32 words per payload");
  ffi::ErrorOr<int64_t> s = ScalarIndex(shard, "shard");
  if (s.has_error()) return s.error();
  if (*s < 0 || *s >= devices) return ffi::Error::InvalidArgument("shard must be a device index");
  qcomm::cpu::encode_chunk_differences(x.chunks, old.chunks, *s, seed.typed_data(), CpuParams(p),
                                       out.pieces);
  return ffi::Error::Success();
}

// pieces... (PieceList of `rows` rows of W bytes) -> out... f32[rows, pre[i] * chunk[i]]: each
// row's decodes, leaf by leaf (one device's chunks: the rows of an all-gather of encode_chunks'
// messages), read where the pieces lie.
ffi::Error QsgdDecodeChunksImpl(ffi::RemainingArgs message, ffi::RemainingRets out, int32_t bits,
                                int32_t bucket_size, int32_t scheme, ffi::Span<const int64_t> pre,
                                ffi::Span<const int64_t> chunk, int64_t rows) {
  const common::Params p{bits, bucket_size, scheme, qcomm::kNearest};
  if (ffi::Error e = common::CheckParams(p); e.failure()) return e;
  std::vector<float*> parts;
  if (ffi::Error e = ResultParts(out, rows, pre, chunk, &parts); e.failure()) return e;
  const qcomm::cpu::Chunks x{nullptr, pre.begin(), chunk.begin(), static_cast<int64_t>(out.size()),
                             1, bucket_size};
  PieceList m;
  if (ffi::Error e = InputPieces(message, 0, message.size(), rows, x.row_bytes(bits, scheme), &m);
      e.failure())
    return e;
  qcomm::cpu::decode_chunks(m.pieces, x, CpuParams(p), parts.data());
  return ffi::Error::Success();
}

// slot[] s32, then the first `pieces` operands the pieces (PieceList) of received[devices, W] u8
// (row s: device s's row of encode_chunks for this device), then leaves... f32 -> mark[] f32,
// out... f32[pre[i] * chunk[i]]: the reduced shard of each leaf (term `slot` this device's own
// shard of the leaves, exact), and 0 or NaN where a value written is not finite.
ffi::Error QsgdDecodeSumChunksImpl(ffi::Buffer<ffi::S32> slot, ffi::RemainingArgs operands,
                                   ffi::ResultBuffer<ffi::F32> mark, ffi::RemainingRets out,
                                   int32_t bits, int32_t bucket_size, int32_t scheme,
                                   int64_t devices, ffi::Span<const int64_t> pre,
                                   ffi::Span<const int64_t> chunk, float scale, int64_t pieces) {
  const common::Params p{bits, bucket_size, scheme, qcomm::kNearest};
  if (pieces < 1 || static_cast<size_t>(pieces) > operands.size())
    return ffi::Error::InvalidArgument("pieces must be >= 1 and at most the operands");
  ChunkList own;
  if (operands.size() - static_cast<size_t>(pieces) != pre.size())
    return ffi::Error::InvalidArgument("pre and chunk must have one entry per leaf");
  if (ffi::Error e = InputChunks(p, devices, pre, chunk, operands, static_cast<size_t>(pieces),
                                 &own);
      e.failure())
    return e;
  PieceList received;
  if (ffi::Error e = InputPieces(operands, 0, static_cast<size_t>(pieces), devices,
                                 own.chunks.row_bytes(bits, scheme), &received);
      e.failure())
    return e;
  if (mark->element_count() != 1 || out.size() != pre.size())
    return ffi::Error::InvalidArgument("the results must be the mark and one shard per leaf");
  std::vector<float*> shards;
  if (ffi::Error e = ResultParts(out, 1, pre, chunk, &shards); e.failure()) return e;
  ffi::ErrorOr<int64_t> s = ScalarIndex(slot, "slot");
  if (s.has_error()) return s.error();
  if (*s < -1 || *s >= devices) return ffi::Error::InvalidArgument("slot must be -1 or a device index");
  qcomm::cpu::decode_sum_chunks(received.pieces, *s, own.chunks, scale, CpuParams(p),
                                shards.data(), mark->typed_data());
  return ffi::Error::Success();
}

// The words and the shared statistics of the packed buffer that the leaves span.
template <typename T>
ffi::Error CheckLeavesWords(const LeafList<T>& leaves, int32_t bits, int32_t bucket_size,
                            int32_t devices, int64_t words, int64_t shared) {
  const int64_t n = leaves.start.back();
  const int64_t nw = qcomm::summable::num_words(n, qcomm::summable::fields_per_word(bits, devices));
  if (words != nw)
    return ffi::Error::InvalidArgument("words shape does not match the leaves' padded size");
  if (shared != qcomm::num_buckets(n, bucket_size))
    return ffi::Error::InvalidArgument("shared must hold one int32 per bucket");
  return ffi::Error::Success();
}

// shared[nb] s32, seed[2] u32, leaves... f32 -> words[W] u32.
ffi::Error SummableEncodeLeavesImpl(ffi::Buffer<ffi::S32> shared, ffi::Buffer<ffi::U32> seed,
                                    ffi::RemainingArgs leaves, ffi::ResultBuffer<ffi::U32> words,
                                    int32_t bits, int32_t bucket_size, int32_t devices,
                                    int32_t rounding) {
  qcomm::cpu::SummableParams p;
  if (ffi::Error e = CheckSummable(bits, bucket_size, devices, rounding, &p); e.failure()) return e;
  LeafList<const float> x;
  if (ffi::Error e = InputLeaves(leaves, bucket_size, &x); e.failure()) return e;
  if (ffi::Error e = CheckLeavesWords(x, bits, bucket_size, devices, words->element_count(),
                                      shared.element_count());
      e.failure())
    return e;
  if (seed.element_count() != 2)
    return ffi::Error::InvalidArgument("seed must hold 2 uint32 words");
  qcomm::cpu::summable_encode(x.leaves(), shared.typed_data(), seed.typed_data(), p,
                              words->typed_data());
  return ffi::Error::Success();
}

// leaves... f32 -> shared[nb] s32.
ffi::Error SummableScaleLeavesImpl(ffi::RemainingArgs leaves, ffi::ResultBuffer<ffi::S32> out,
                                   int32_t bucket_size) {
  if (bucket_size <= 0) return ffi::Error::InvalidArgument("bucket_size must be positive");
  LeafList<const float> x;
  if (ffi::Error e = InputLeaves(leaves, bucket_size, &x); e.failure()) return e;
  if (out->element_count() != qcomm::num_buckets(x.start.back(), bucket_size))
    return ffi::Error::InvalidArgument("output shape does not match the number of buckets");
  qcomm::cpu::summable_scale(x.leaves(), bucket_size, out->typed_data());
  return ffi::Error::Success();
}

// words[W] u32, shared[nb] s32 -> leaves... f32.
ffi::Error SummableDecodeLeavesImpl(ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::S32> shared,
                                    ffi::RemainingRets leaves, int32_t bits, int32_t bucket_size,
                                    int32_t devices, int32_t count, float scale) {
  qcomm::cpu::SummableParams p;
  if (ffi::Error e = CheckSummableDecode(bits, bucket_size, devices, count, &p); e.failure())
    return e;
  LeafList<float> out;
  for (size_t i = 0; i < leaves.size(); ++i) {
    ffi::ErrorOr<ffi::Result<ffi::Buffer<ffi::F32>>> leaf = leaves.get<ffi::Buffer<ffi::F32>>(i);
    if (leaf.has_error()) return leaf.error();
    out.add((*leaf)->typed_data(), static_cast<int64_t>((*leaf)->element_count()), bucket_size);
  }
  if (ffi::Error e = CheckLeavesWords(out, bits, bucket_size, devices, words.element_count(),
                                      shared.element_count());
      e.failure())
    return e;
  qcomm::cpu::summable_decode(words.typed_data(), shared.typed_data(), out.leaves(), count, scale, p);
  return ffi::Error::Success();
}

}  // namespace

// The summable handlers' attributes: encode (bits, bucket_size, devices, rounding) and decode
// (bits, bucket_size, devices, count, scale), after their operands, flat or on leaves.
template <typename B>
auto SummableAttrs(B&& binding) {
  return std::move(binding)
      .template Attr<int32_t>("bits")
      .template Attr<int32_t>("bucket_size")
      .template Attr<int32_t>("devices");
}

template <typename B>
auto SummableEncodeAttrs(B&& binding) {
  return SummableAttrs(std::move(binding)).template Attr<int32_t>("rounding");
}

template <typename B>
auto SummableDecodeAttrs(B&& binding) {
  return SummableAttrs(std::move(binding))
      .template Attr<int32_t>("count")
      .template Attr<float>("scale");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommSummableEncode, SummableEncodeImpl,
                              SummableEncodeAttrs(ffi::Ffi::Bind()
                                                      .Arg<ffi::Buffer<ffi::F32>>()
                                                      .Arg<ffi::Buffer<ffi::S32>>()
                                                      .Arg<ffi::Buffer<ffi::U32>>()
                                                      .Ret<ffi::Buffer<ffi::U32>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommSummableScale, SummableScaleImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("bucket_size"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommSummableDecode, SummableDecodeImpl,
                              SummableDecodeAttrs(ffi::Ffi::Bind()
                                                      .Arg<ffi::Buffer<ffi::U32>>()
                                                      .Arg<ffi::Buffer<ffi::S32>>()
                                                      .Ret<ffi::Buffer<ffi::F32>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommSummableEncodeLeaves, SummableEncodeLeavesImpl,
                              SummableEncodeAttrs(ffi::Ffi::Bind()
                                                      .Arg<ffi::Buffer<ffi::S32>>()
                                                      .Arg<ffi::Buffer<ffi::U32>>()
                                                      .RemainingArgs()
                                                      .Ret<ffi::Buffer<ffi::U32>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommSummableScaleLeaves, SummableScaleLeavesImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("bucket_size"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommSummableDecodeLeaves, SummableDecodeLeavesImpl,
                              SummableDecodeAttrs(ffi::Ffi::Bind()
                                                      .Arg<ffi::Buffer<ffi::U32>>()
                                                      .Arg<ffi::Buffer<ffi::S32>>()
                                                      .RemainingRets()));

// The QSGD handlers on leaves: the format's attributes and the row length n, after their operands.
template <typename B>
auto QsgdLeavesAttrs(B&& binding) {
  return std::move(binding)
      .template Attr<int32_t>("bits")
      .template Attr<int32_t>("bucket_size")
      .template Attr<int32_t>("scheme")
      .template Attr<int32_t>("rounding")
      .template Attr<int64_t>("n");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdEncodeLeaves, QsgdEncodeLeavesImpl,
                              QsgdLeavesAttrs(ffi::Ffi::Bind()
                                                  .Arg<ffi::Buffer<ffi::U32>>()
                                                  .Arg<ffi::Buffer<ffi::S32>>()
                                                  .RemainingArgs()
                                                  .RemainingRets())
                                  .Attr<int64_t>("rows"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdDecodeSumReencodeOwn, QsgdDecodeSumReencodeOwnImpl,
                              QsgdLeavesAttrs(ffi::Ffi::Bind()
                                                  .Arg<ffi::Buffer<ffi::U32>>()
                                                  .Arg<ffi::Buffer<ffi::S32>>()
                                                  .Arg<ffi::Buffer<ffi::S32>>()
                                                  .RemainingArgs()
                                                  .RemainingRets())
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("pieces"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdDecodePieces, QsgdDecodePiecesImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("bucket_size")
                                  .Attr<int32_t>("scheme"));
// The QSGD handlers on chunks: the format's attributes, the devices and each leaf's (pre, chunk).
template <typename B>
auto QsgdChunksAttrs(B&& binding) {
  return std::move(binding)
      .template Attr<int64_t>("devices")
      .template Attr<ffi::Span<const int64_t>>("pre")
      .template Attr<ffi::Span<const int64_t>>("chunk");
}

// The two encodes on chunks: seed[payloads, 2] u32, an index s32[], the leaves -> the message's
// pieces u8.
auto BindEncodeChunks() {
  return QsgdChunksAttrs(ffi::Ffi::Bind()
                             .Arg<ffi::Buffer<ffi::U32>>()
                             .Arg<ffi::Buffer<ffi::S32>>()
                             .RemainingArgs()
                             .RemainingRets()
                             .Attr<int32_t>("bits")
                             .Attr<int32_t>("bucket_size")
                             .Attr<int32_t>("scheme")
                             .Attr<int32_t>("rounding"));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdEncodeChunks, QsgdEncodeChunksImpl, BindEncodeChunks());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdEncodeDifferences, QsgdEncodeDifferencesImpl,
                              BindEncodeChunks());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdDecodeChunks, QsgdDecodeChunksImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("bucket_size")
                                  .Attr<int32_t>("scheme")
                                  .Attr<ffi::Span<const int64_t>>("pre")
                                  .Attr<ffi::Span<const int64_t>>("chunk")
                                  .Attr<int64_t>("rows"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdDecodeSumChunks, QsgdDecodeSumChunksImpl,
                              QsgdChunksAttrs(ffi::Ffi::Bind()
                                                  .Arg<ffi::Buffer<ffi::S32>>()
                                                  .RemainingArgs()
                                                  .Ret<ffi::Buffer<ffi::F32>>()
                                                  .RemainingRets()
                                                  .Attr<int32_t>("bits")
                                                  .Attr<int32_t>("bucket_size")
                                                  .Attr<int32_t>("scheme"))
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("pieces"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdEncode, EncodeImpl,
                              common::BindEncode(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdDecodeSum, DecodeSumImpl,
                              common::BindDecodeSum(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QcommQsgdDecodeSumReencode, DecodeSumReencodeImpl,
                              common::BindDecodeSumReencode(ffi::Ffi::Bind()));

NB_MODULE(_qcomm_cpu, m) {
  m.doc() = "QSGD codec CPU kernels as XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict d;
    d["qcomm_qsgd_encode"] = nb::capsule(reinterpret_cast<void*>(QcommQsgdEncode));
    d["qcomm_qsgd_decode_sum"] = nb::capsule(reinterpret_cast<void*>(QcommQsgdDecodeSum));
    d["qcomm_qsgd_encode_leaves"] = nb::capsule(reinterpret_cast<void*>(QcommQsgdEncodeLeaves));
    d["qcomm_qsgd_decode_sum_reencode_own"] =
        nb::capsule(reinterpret_cast<void*>(QcommQsgdDecodeSumReencodeOwn));
    d["qcomm_qsgd_decode_pieces"] = nb::capsule(reinterpret_cast<void*>(QcommQsgdDecodePieces));
    d["qcomm_qsgd_encode_chunks"] = nb::capsule(reinterpret_cast<void*>(QcommQsgdEncodeChunks));
    d["qcomm_qsgd_encode_differences"] =
        nb::capsule(reinterpret_cast<void*>(QcommQsgdEncodeDifferences));
    d["qcomm_qsgd_decode_chunks"] = nb::capsule(reinterpret_cast<void*>(QcommQsgdDecodeChunks));
    d["qcomm_qsgd_decode_sum_chunks"] =
        nb::capsule(reinterpret_cast<void*>(QcommQsgdDecodeSumChunks));
    d["qcomm_qsgd_decode_sum_reencode"] =
        nb::capsule(reinterpret_cast<void*>(QcommQsgdDecodeSumReencode));
    d["qcomm_summable_encode"] = nb::capsule(reinterpret_cast<void*>(QcommSummableEncode));
    d["qcomm_summable_decode"] = nb::capsule(reinterpret_cast<void*>(QcommSummableDecode));
    d["qcomm_summable_scale"] = nb::capsule(reinterpret_cast<void*>(QcommSummableScale));
    d["qcomm_summable_encode_leaves"] =
        nb::capsule(reinterpret_cast<void*>(QcommSummableEncodeLeaves));
    d["qcomm_summable_decode_leaves"] =
        nb::capsule(reinterpret_cast<void*>(QcommSummableDecodeLeaves));
    d["qcomm_summable_scale_leaves"] =
        nb::capsule(reinterpret_cast<void*>(QcommSummableScaleLeaves));
    return d;
  });
  m.def("isa", []() { return std::string(qcomm::cpu::isa()); },
        "Instruction set the CPU kernels run (the widest this CPU has, unless force_isa chose one).");
  m.def("detected_isa", []() { return std::string(qcomm::cpu::detected_isa()); },
        "The widest instruction set this CPU supports (and this build has kernels for).");
  m.def(
      "force_isa",
      [](const std::string& name) {
        const std::string error = qcomm::cpu::force_isa(name);
        if (!error.empty()) throw nb::value_error(error.c_str());
      },
      nb::arg("name"),
      "Runs the kernels built for `name` ('avx512', 'avx2', 'generic') from now on; ValueError if "
      "the name is unknown or this CPU lacks that instruction set.");
  // Sanitizers this module was built with (CMake option QCOMM_SANITIZE): "" in a normal build.
#if defined(QCOMM_SANITIZERS)
  m.attr("sanitizers") = QCOMM_SANITIZERS;
#else
  m.attr("sanitizers") = "";
#endif
}
