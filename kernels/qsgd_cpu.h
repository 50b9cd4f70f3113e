// CPU entry points of the QSGD codec. Arrays are contiguous; `n` counts float32 elements.
// The payload layout is docs/wire-format.md; qsgd_math.h holds the per-element math.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qsgd_math.h"

namespace qcomm::cpu {

struct Params {
  int32_t bits;      // 1..8 (norm: 2..8)
  int32_t bucket;    // positive multiple of 8
  int32_t scheme;    // Scheme
  int32_t rounding;  // Rounding
};

// x[n] -> payload[payload_bytes(n, ...)]; `seed` is two uint32 words derived from a JAX key.
void encode(const float* x, int64_t n, const uint32_t seed[2], const Params& p, uint8_t* payload);
// payload -> out[n].
void decode(const uint8_t* payload, int64_t n, const Params& p, float* out);
// Rows of payloads cut along their bytes, as a message travels in pieces: row j of piece q holds
// bytes [begin(q), end[q]) of row j, at row(q, j). The rows of a piece may lie in one
// [rows, width] buffer or apart. A whole [rows, bytes] buffer is one piece. The kernels read and
// write a bucket in place where its header, or its codes, lie inside one piece, and through a
// bucket-sized scratch otherwise.
struct Pieces {
  uint8_t* const* data;  // [count * rows]: row j of piece q at data[q * rows + j]
  const int64_t* end;    // [count], increasing; end[count - 1] = the bytes of a row
  int64_t count;
  int64_t rows;

  int64_t begin(int64_t q) const { return q == 0 ? 0 : end[q - 1]; }
  uint8_t* row(int64_t q, int64_t j) const { return data[q * rows + j]; }
};

// The storage of a whole [rows, stride] buffer (rows of `bytes` <= stride) seen as one piece.
struct WholeRows {
  std::vector<uint8_t*> data;
  int64_t end;
  Pieces pieces() const { return {data.data(), &end, 1, static_cast<int64_t>(data.size())}; }
};
// (static: each translation unit, built for its own instruction set, keeps its own copy)
static inline WholeRows whole_rows(const uint8_t* base, int64_t rows, int64_t stride,
                                   int64_t bytes) {
  WholeRows w{std::vector<uint8_t*>(static_cast<size_t>(rows)), bytes};
  for (int64_t j = 0; j < rows; ++j) w.data[j] = const_cast<uint8_t*>(base) + j * stride;
  return w;
}

// out[n] = sum over j < k of decode(row first + j of m), summed in order j = 0, 1, ...
void decode_sum(const Pieces& m, int64_t first, int64_t k, int64_t n, const Params& p, float* out);

// payload = encode(decode_sum(payloads) * scale, seed): the middle of a compressed allreduce. The
// multiplication is skipped where scale == 1; the bytes equal those of the three steps done apart.
void decode_sum_reencode(const uint8_t* payloads, int64_t k, int64_t stride, int64_t n, float scale,
                         const uint32_t seed[2], const Params& p, uint8_t* payload);

// ---- the summable codec (kernels/summable_math.h, docs/wire-format.md "Summable") ----------------
struct SummableParams {
  int32_t bits;      // 2..8
  int32_t bucket;    // positive multiple of 8
  int32_t devices;   // payloads summed (sets the field width); >= 1, 2 L devices < 2^32
  int32_t rounding;  // Rounding
};
// The buffer the summable kernels read or write: `count` leaves laid end to end, leaf i holding
// size[i] elements from data[i] and occupying the elements [start[i], start[i + 1]) of the
// buffer, the rest of its span padding (zeros on input, skipped on output). start[0] == 0 and
// start[count] is the buffer's length n; every start[i] with i > 0 is a multiple of the bucket,
// so that no bucket straddles two leaves. One leaf of n elements is a flat buffer; several leaves
// are what a packed communication buffer would hold, read and written in place (no packed copy).
template <typename T>
struct Leaves {
  T* const* data;
  const int64_t* size;
  const int64_t* start;  // count + 1 entries
  int64_t count;

  int64_t length() const { return start[count]; }
  // The leaf whose span holds element e (0 <= e < length()), searched from `hint` onwards.
  int64_t find(int64_t e, int64_t hint) const {
    if (hint >= 0 && hint < count && start[hint] <= e && e < start[hint + 1]) return hint;
    int64_t lo = 0, hi = count;  // start[lo] <= e < start[hi]
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (start[mid] <= e ? lo : hi) = mid;
    }
    return lo;
  }
};

// x (n = x.length() elements), shared[num_buckets(n)] (the bits of each bucket's largest |x| over
// all devices) -> words[ceil(n / fields)].
void summable_encode(const Leaves<const float>& x, const int32_t* shared, const uint32_t seed[2],
                     const SummableParams& p, uint32_t* words);
// x -> out[num_buckets(n)]: the bits of each bucket's largest |x| as int32 (NaN > Inf > finite).
void summable_scale(const Leaves<const float>& x, int32_t bucket, int32_t* out);
// words (the sum of `count` payloads) -> out (n = out.length()): the sum of their decodes times
// `scale`, written to the leaves' elements (padding is not written).
void summable_decode(const uint32_t* words, const int32_t* shared, const Leaves<float>& out,
                     int32_t count, float scale, const SummableParams& p);

// ---- QSGD on leaves, read in place of a packed buffer ------------------------------------------
// payloads[rows, payload_bytes(n)] = encode of each row of n values (seed seeds + 2 r for row r) of
// the buffer that `x` packs, extended with zeros to rows * n elements (x.length() <= rows * n);
// n is a multiple of the bucket. A leaf's span is padded with its last value (maxmin) or 0
// (norm), as jax_qcomm's concat_leaves pads a leaf; the bytes are those of encode on that buffer.
// Row `skip` (-1: none) is not encoded: its payload is zeros.
void encode_leaves(const Leaves<const float>& x, int64_t n, int64_t skip, const uint32_t* seeds,
                   const Params& p, const Pieces& payloads);
// payload = encode((v_0 + v_1 + ... + v_{k-1}) * scale, seed), summed in that order, where v_j is
// the decode of row j of `payloads` (k = payloads.rows) but v_slot is row `row` (n values) of the
// buffer that `own` packs (as encode_leaves reads it), exact: the middle of an allreduce in which a
// device's own chunk is never quantised before the sum. n is a multiple of the bucket.
void decode_sum_reencode_own(const Pieces& payloads, int64_t slot, const Leaves<const float>& own,
                             int64_t row, int64_t n, float scale, const uint32_t seed[2],
                             const Params& p, const Pieces& payload);

// ---- QSGD on the chunks of a sharded reduce-scatter, read and written in place ------------------
// `count` leaves over `devices` devices, leaf i the devices * pre[i] * chunk[i] values at data[i]:
// pre[i] runs of `devices` chunks of chunk[i] values, device j's shard the runs' chunk j. Shard j
// of leaf i (pre[i] * chunk[i] values, in that order) travels as runs[i] payloads of n[i] values:
// runs = pre, n = chunk where chunk is a multiple of the bucket or pre == 1, else runs = 1 and
// n = pre * chunk. A payload's last, partial bucket is padded as encode pads it.
struct Chunks {
  const float* const* data;
  const int64_t* pre;
  const int64_t* chunk;
  int64_t count;
  int64_t devices;
  int64_t bucket;

  int64_t runs(int64_t i) const {
    return pre[i] > 1 && chunk[i] % bucket != 0 ? 1 : pre[i];
  }
  int64_t n(int64_t i) const { return pre[i] * chunk[i] / runs(i); }
  // Payloads in one row of the message (every leaf's shard j): seeds hold 2 words for each.
  int64_t payloads() const {
    int64_t total = 0;
    for (int64_t i = 0; i < count; ++i) total += runs(i);
    return total;
  }
  // Bytes of one row of the message.
  int64_t row_bytes(int32_t bits, int32_t scheme) const {
    int64_t total = 0;
    for (int64_t i = 0; i < count; ++i) total += runs(i) * payload_bytes(n(i), bucket, bits, scheme);
    return total;
  }
};
// message (Pieces of `devices` rows of W bytes) = the payloads of every leaf's shard j in row j
// (leaf by leaf, run by run), payload (i, r, j) the encode of run r of shard j of leaf i with seed
// seeds + 2 * (s_i + r * devices + j), s_i the payloads of the leaves before i; W the sum of
// runs(i) * payload_bytes(n(i)). Row `skip` (-1: none) is not encoded: its bytes are zeros.
void encode_chunks(const Chunks& x, int64_t skip, const uint32_t* seeds, const Params& p,
                   const Pieces& message);
// encode_chunks of the differences x - (shard `shard` of `minus`), value by value: leaf i of
// `minus` holds minus.pre[i] * minus.chunk[i] values per shard, as many as a shard of leaf i of x.
// What the sharded mode all-gathers: the new values of a device's shards less the current ones,
// read where both lie.
void encode_chunk_differences(const Chunks& x, const Chunks& minus, int64_t shard,
                              const uint32_t* seeds, const Params& p, const Pieces& message);
// received (Pieces of `devices` rows; row s: the payloads of this device's shards that device s
// sent, laid out as encode_chunks lays a row) -> out[i] (pre[i] * chunk[i] values): the sum over s,
// in order, of the decodes of row s, times scale, but term `slot` (-1: none) shard `slot` of
// `own`, exact. *mark = 0 if every value written is finite, else NaN.
void decode_sum_chunks(const Pieces& received, int64_t slot, const Chunks& own, float scale,
                       const Params& p, float* const* out, float* mark);
// message (Pieces of `rows` rows, each laid out as encode_chunks lays one; x.devices == 1, x.data
// unread) -> out[i] (rows * pre[i] * chunk[i] values): row s's decodes of leaf i at
// s * pre[i] * chunk[i].
void decode_chunks(const Pieces& message, const Chunks& x, const Params& p, float* const* out);

// Name of the instruction set the kernels run ("avx512", "avx2" or "generic").
const char* isa();
// The widest instruction set this CPU supports (and this build has kernels for).
const char* detected_isa();
// Runs the kernels built for `name` ("avx512", "avx2" or "generic") from now on; it must be
// supported by this CPU (a narrower set than detected_isa() is fine). Returns "" on success, else
// why not (the ISA is unchanged). Call before any kernel runs (jax_qcomm does, at import).
std::string force_isa(const std::string& name);

}  // namespace qcomm::cpu
