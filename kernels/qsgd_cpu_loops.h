// The CPU loops of the QSGD codec, compiled once per instruction set.
//
// Included by qsgd_cpu_<isa>.cc inside `namespace qcomm::cpu::QCOMM_ISA`, each compiled with its own
// -m flags; qsgd_cpu.cc dispatches at run time. Everything here has internal linkage so copies
// built for different ISAs never mix. Loops are written for the auto-vectoriser: contiguous,
// fixed trip counts per bucket, selects instead of branches, 8 independent lanes in reductions.
#include <math.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "qsgd_cpu.h"
#include "qsgd_math.h"

namespace {

constexpr int kMaxBucketOnStack = 4096;

// The scales of one bucket. LEVELS is a template argument so that recip_levels(LEVELS) folds to a
// constant, and the function is inlined into each bit width's loop: out of line, one copy served
// every width and spent a division per bucket on 1 / L.
template <int SCHEME, uint32_t LEVELS>
__attribute__((always_inline)) inline qcomm::EncodeScales bucket_scales(const float* __restrict x,
                                                                        int64_t bucket) {
  if constexpr (SCHEME == qcomm::kMaxMin) {
    // Min and max over order-preserving integer keys of the float bits: integer min/max
    // vectorise without -ffast-math; a NaN is one of the extremes (qcomm::maxmin_scales).
    int32_t lo = INT32_MAX, hi = INT32_MIN;
    for (int64_t i = 0; i < bucket; ++i) {
      const int32_t k = qcomm::order_key(x[i]);
      lo = k < lo ? k : lo;
      hi = k > hi ? k : hi;
    }
    return qcomm::maxmin_scales(lo, hi, LEVELS);
  } else {
    // The largest |x| (an exact unsigned max of the bits) gives the scale 2^-k; then the squares
    // of the scaled values, in the format's 8 lanes.
    uint32_t max_abs = 0;
    for (int64_t i = 0; i < bucket; ++i) {
      const uint32_t a = qcomm::abs_bits(x[i]);
      max_abs = a > max_abs ? a : max_abs;
    }
    const float down = qcomm::pow2(-qcomm::scale_exponent(max_abs));
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t g = 0; g < bucket; g += 8) {
      for (int j = 0; j < 8; ++j) acc[j] += qcomm::norm_square(x[g + j] * down);
    }
    return qcomm::norm_scales(max_abs, qcomm::norm_tree(acc), LEVELS);
  }
}

// Codes of one bucket (one byte each, before packing), element indices base, base + 1, ...
// uint32 induction variables (no 64-bit lanes for the vectoriser to narrow), and the hash's
// index * kIndexMul + seed0 carried as a running sum h (one vector multiply fewer per element).
template <int BITS, int SCHEME, bool STOCHASTIC>
__attribute__((always_inline)) inline void bucket_codes(
    const float* __restrict x, uint32_t bucket, const qcomm::EncodeScales& s, uint32_t seed0,
    uint32_t seed1, uint32_t base, uint8_t* __restrict codes) {
  const float down = s.down, y_min = s.y_min, inv = s.inv;
  if constexpr (STOCHASTIC) {
    uint32_t h = base * qcomm::kIndexMul + seed0;
    for (uint32_t i = 0; i < bucket; ++i) {
      const float r = qcomm::uniform01(qcomm::random_bits_at(h, seed1));
      codes[i] = static_cast<uint8_t>(qcomm::encode_value<BITS, SCHEME>(x[i], down, y_min, inv, r));
      h += qcomm::kIndexMul;
    }
  } else {
    for (uint32_t i = 0; i < bucket; ++i)
      codes[i] = static_cast<uint8_t>(qcomm::encode_value<BITS, SCHEME>(x[i], down, y_min, inv, 0.5f));
  }
}

// pack8 on the 8 codes held in the bytes of w (code j in byte j, each < 2^BITS), in three SWAR
// steps that merge neighbouring fields (pairs of bytes, of 16-bit and of 32-bit halves): a few
// shifts and masks per 8 codes instead of 8 byte loads, shifts and ors.
template <int BITS>
inline uint64_t pack8_swar(uint64_t w) {
  if constexpr (BITS == 8) {
    return w;
  } else {
    w = (w & 0x00ff00ff00ff00ffull) | ((w & 0xff00ff00ff00ff00ull) >> (8 - BITS));
    w = (w & 0x0000ffff0000ffffull) | ((w & 0xffff0000ffff0000ull) >> (16 - 2 * BITS));
    return (w & 0x00000000ffffffffull) | ((w & 0xffffffff00000000ull) >> (32 - 4 * BITS));
  }
}

template <int BITS>
__attribute__((always_inline)) inline void pack_codes(const uint8_t* __restrict codes,
                                                      int64_t bucket, uint8_t* __restrict out) {
  for (int64_t g = 0; g < bucket / 8; ++g) {
    uint64_t w;
    memcpy(&w, codes + 8 * g, 8);
    w = pack8_swar<BITS>(w);
    if constexpr (BITS == 1 || BITS == 2 || BITS == 4) {
      // A store of one whole integer per group: a loop the vectoriser can narrow and store.
      using Word = std::conditional_t<BITS == 1, uint8_t, std::conditional_t<BITS == 2, uint16_t, uint32_t>>;
      const Word v = static_cast<Word>(w);
      memcpy(out + g * BITS, &v, BITS);
    } else {
      memcpy(out + g * BITS, &w, BITS);  // little-endian hosts only (x86-64, aarch64)
    }
  }
}

// Encodes one whole bucket: xb[0, B) (padding already in place), its values' indices start,
// start + 1, ... (the stochastic rounding's counter), into its header words and packed codes.
// FIXED_B > 0 is B as a constant (encode_bucket's common sizes), so that the bucket's loops have
// fixed trip counts and unroll: at 64 values a bucket's setup costs as much as its values.
template <int BITS, int SCHEME, int64_t FIXED_B>
__attribute__((always_inline)) inline void encode_bucket_b(
    const float* __restrict xb, int64_t bucket, int64_t start, const uint32_t seed[2],
    bool stochastic, uint8_t* __restrict codes, int64_t valid, uint8_t* header,
    uint8_t* __restrict packed) {
  const int64_t B = FIXED_B > 0 ? FIXED_B : bucket;
  constexpr uint32_t levels =
      SCHEME == qcomm::kMaxMin ? (1u << BITS) - 1u : (1u << (BITS - 1)) - 1u;
  const qcomm::EncodeScales s = bucket_scales<SCHEME, levels>(xb, B);
  if (stochastic) {
    bucket_codes<BITS, SCHEME, true>(xb, static_cast<uint32_t>(B), s, seed[0], seed[1],
                                     static_cast<uint32_t>(start), codes);
  } else {
    bucket_codes<BITS, SCHEME, false>(xb, static_cast<uint32_t>(B), s, seed[0], seed[1],
                                      static_cast<uint32_t>(start), codes);
  }
  if (valid < B) std::fill(codes + valid, codes + B, uint8_t{0});  // padding codes are 0
  if constexpr (SCHEME == qcomm::kMaxMin) {
    const uint32_t words[2] = {qcomm::float_bits(s.min), s.word};
    memcpy(header, words, 8);
  } else {
    memcpy(header, &s.word, 4);
  }
  pack_codes<BITS>(codes, B, packed);
}

template <int BITS, int SCHEME>
inline void encode_bucket(const float* __restrict xb, int64_t B, int64_t start,
                          const uint32_t seed[2], bool stochastic, uint8_t* __restrict codes,
                          int64_t valid, uint8_t* header, uint8_t* __restrict packed) {
  switch (B) {
    case 64:
      return encode_bucket_b<BITS, SCHEME, 64>(xb, B, start, seed, stochastic, codes, valid,
                                                header, packed);
    case 128:
      return encode_bucket_b<BITS, SCHEME, 128>(xb, B, start, seed, stochastic, codes, valid,
                                                 header, packed);
    default:
      return encode_bucket_b<BITS, SCHEME, 0>(xb, B, start, seed, stochastic, codes, valid,
                                               header, packed);
  }
}

// The padding of a last, partial bucket (values [valid, B) of xb): its first value (maxmin), 0
// (norm), so that the bucket's scales stay those of its values.
template <int SCHEME>
inline void pad_bucket(float* xb, int64_t valid, int64_t B) {
  std::fill(xb + valid, xb + B, SCHEME == qcomm::kMaxMin ? xb[0] : 0.0f);
}

// Each bucket is read twice: the min/max scan brings it from memory, the code loop finds it in L1.
// Alone, the scan waits on memory while the code loop leaves the bus idle; prefetching the bucket
// kPrefetchFloats ahead overlaps the two. (Results do not change.)
constexpr int64_t kPrefetchFloats = 1024;  // 4 KiB

// Prefetches the B values kPrefetchFloats after x[from] that lie before x[end].
inline void prefetch_ahead(const float* x, int64_t from, int64_t B, int64_t end) {
  const int64_t ahead_end = std::min<int64_t>(from + kPrefetchFloats + B, end);
  for (int64_t e = from + kPrefetchFloats; e < ahead_end; e += 16) __builtin_prefetch(x + e, 0, 3);
}

// A bucket-sized scratch buffer: on the stack up to kMaxBucketOnStack elements, else on the heap.
template <typename T>
struct BucketScratch {
  T stack[kMaxBucketOnStack];
  std::unique_ptr<T[]> heap;
  T* data;
  explicit BucketScratch(int64_t B) : data(stack) {
    if (B > kMaxBucketOnStack) {
      heap.reset(new T[B]);
      data = heap.get();
    }
  }
};

// Calls f(at, done, take) for each part of bytes [o, o + len) of row j of `m` that lies in one
// piece, from piece q on: `take` bytes at `at`, bytes [o + done, o + done + take) of the row.
template <typename F>
inline void piece_spans(const qcomm::cpu::Pieces& m, int64_t j, int64_t o, int64_t len, int64_t q,
                        F f) {
  for (int64_t done = 0; done < len; ++q) {
    const int64_t take = std::min(len - done, m.end[q] - (o + done));
    f(m.row(q, j) + (o + done - m.begin(q)), done, take);
    done += take;
  }
}

// Where bytes [o, o + len) of row j of `m` lie (o + len <= the bytes of a row): a pointer into the
// piece that holds them all, or `scratch` where they span several. `q` is a cursor, the piece of
// the previous access: the offsets accessed through one cursor must not decrease.
inline uint8_t* piece_target(const qcomm::cpu::Pieces& m, int64_t j, int64_t o, int64_t len,
                             int64_t* q, uint8_t* scratch) {
  while (m.end[*q] <= o) ++*q;
  if (o + len <= m.end[*q]) return m.row(*q, j) + (o - m.begin(*q));
  return scratch;
}

// Bytes [o, o + len) of row j of `m` to read: piece_target, the scratch filled from the pieces.
inline const uint8_t* piece_bytes(const qcomm::cpu::Pieces& m, int64_t j, int64_t o, int64_t len,
                                  int64_t* q, uint8_t* scratch) {
  const uint8_t* at = piece_target(m, j, o, len, q, scratch);
  if (at == scratch) {
    piece_spans(m, j, o, len, *q, [&](const uint8_t* p, int64_t done, int64_t take) {
      memcpy(scratch + done, p, take);
    });
  }
  return at;
}

// After writing bytes [o, o + len) of row j at `target` (piece_target's answer, cursor q): the
// scratch copied to the pieces they span.
inline void piece_write_back(const qcomm::cpu::Pieces& m, int64_t j, int64_t o, int64_t len,
                             int64_t q, const uint8_t* target, const uint8_t* scratch) {
  if (target != scratch) return;  // written in place
  piece_spans(m, j, o, len, q,
              [&](uint8_t* p, int64_t done, int64_t take) { memcpy(p, scratch + done, take); });
}

// Zeros in row j of every piece of `m`.
inline void piece_zero_row(const qcomm::cpu::Pieces& m, int64_t j) {
  for (int64_t q = 0; q < m.count; ++q)
    std::fill(m.row(q, j), m.row(q, j) + (m.end[q] - m.begin(q)), uint8_t{0});
}

// The cursors and scratch of accessing one bucket's header and codes in each row of Pieces.
struct PieceCursors {
  int64_t header = 0, codes = 0;
  uint8_t header_scratch[8];
  BucketScratch<uint8_t> code_scratch;
  explicit PieceCursors(int64_t B) : code_scratch(B) {}
  void rewind() { header = codes = 0; }
};

// Encodes the bucket xb into bucket b of the payload of nb buckets at byte `base` of row j of `m`.
template <int BITS, int SCHEME>
inline void encode_bucket_to(const float* __restrict xb, int64_t B, int64_t start,
                             const uint32_t* seed, bool stochastic, uint8_t* codes, int64_t valid,
                             const qcomm::cpu::Pieces& m, int64_t j, int64_t base, int64_t nb,
                             int64_t b, PieceCursors& c) {
  const int64_t S = qcomm::scales_per_bucket(SCHEME);
  const int64_t code_bytes = qcomm::code_bytes_per_bucket(B, BITS);
  const int64_t oh = base + 4 * S * b, oc = base + 4 * S * nb + b * code_bytes;
  uint8_t* h = piece_target(m, j, oh, 4 * S, &c.header, c.header_scratch);
  uint8_t* k = piece_target(m, j, oc, code_bytes, &c.codes, c.code_scratch.data);
  encode_bucket<BITS, SCHEME>(xb, B, start, seed, stochastic, codes, valid, h, k);
  piece_write_back(m, j, oh, 4 * S, c.header, h, c.header_scratch);
  piece_write_back(m, j, oc, code_bytes, c.codes, k, c.code_scratch.data);
}

template <int BITS, int SCHEME>
void encode_t(const float* x, int64_t n, const uint32_t seed[2], const qcomm::cpu::Params& p,
              uint8_t* payload) {
  const int64_t B = p.bucket;
  const int64_t nb = qcomm::num_buckets(n, B);
  const int64_t S = qcomm::scales_per_bucket(SCHEME);
  uint8_t* header = payload;  // rows of a vmapped call may start at any byte: words are memcpy'd
  uint8_t* packed = payload + 4 * S * nb;
  const int64_t code_bytes = qcomm::code_bytes_per_bucket(B, BITS);
  const bool stochastic = p.rounding == qcomm::kStochastic;
  BucketScratch<uint8_t> codes(B);
  BucketScratch<float> pad(B);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, n - start);
    const float* xb = x + start;
    prefetch_ahead(x, start, B, n);
    if (valid < B) {
      std::copy(xb, xb + valid, pad.data);
      pad_bucket<SCHEME>(pad.data, valid, B);
      xb = pad.data;
    }
    encode_bucket<BITS, SCHEME>(xb, B, start, seed, stochastic, codes.data, valid,
                                header + 4 * S * b, packed + b * code_bytes);
  }
}

// The B values from element e (a multiple of B) of the buffer that x packs (qsgd_cpu.h, Leaves):
// where the bucket lies whole inside a leaf, a pointer into it (its next values prefetched);
// otherwise `pad` filled as the packed buffer holds it: the leaf's last values padded with its
// last value (maxmin) or 0 (norm), or zeros past the leaves. `leaf` is the search hint.
template <int SCHEME>
inline const float* leaves_bucket(const qcomm::cpu::Leaves<const float>& x, int64_t e, int64_t B,
                                  int64_t* leaf, float* __restrict pad) {
  if (e >= x.length()) {
    std::fill(pad, pad + B, 0.0f);
    return pad;
  }
  *leaf = x.find(e, *leaf);
  const int64_t off = e - x.start[*leaf], size = x.size[*leaf];
  const float* data = x.data[*leaf];
  const int64_t valid = std::min<int64_t>(B, size - off);
  if (valid < B) {
    std::copy(data + off, data + size, pad);
    const float fill = SCHEME == qcomm::kMaxMin ? data[size - 1] : 0.0f;
    std::fill(pad + valid, pad + B, fill);
    return pad;
  }
  prefetch_ahead(data, off, B, size);
  return data + off;
}

// encode_t of each row of the buffer that x packs (qsgd_cpu.h, encode_leaves), but row `skip`,
// whose payload is zeros. Every bucket is whole (n and the leaves' spans are multiples of B), so
// its codes are those of encode_t on the packed row.
template <int BITS, int SCHEME>
void encode_leaves_t(const qcomm::cpu::Leaves<const float>& x, int64_t n, int64_t skip,
                     const uint32_t* seeds, const qcomm::cpu::Params& p,
                     const qcomm::cpu::Pieces& payloads) {
  const int64_t B = p.bucket;
  const int64_t nb = n / B;
  const bool stochastic = p.rounding == qcomm::kStochastic;
  BucketScratch<uint8_t> codes(B);
  BucketScratch<float> pad(B);
  PieceCursors writes(B);
  int64_t leaf = 0;
  for (int64_t r = 0; r < payloads.rows; ++r) {
    if (r == skip) {
      piece_zero_row(payloads, r);
      continue;
    }
    writes.rewind();
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = leaves_bucket<SCHEME>(x, r * n + b * B, B, &leaf, pad.data);
      encode_bucket_to<BITS, SCHEME>(xb, B, b * B, seeds + 2 * r, stochastic, codes.data, B,
                                     payloads, r, 0, nb, b, writes);
    }
  }
}

template <int BITS>
inline void unpack_codes(const uint8_t* __restrict packed, int64_t bucket, uint8_t* __restrict codes) {
  constexpr uint32_t mask = (1u << BITS) - 1u;
  if constexpr (8 % BITS == 0) {
    // Codes never straddle a byte: a plain loop over bytes that the compiler vectorises.
    constexpr int per_byte = 8 / BITS;
    for (int64_t k = 0; k < bucket / per_byte; ++k)
      for (int s = 0; s < per_byte; ++s) codes[k * per_byte + s] = (packed[k] >> (s * BITS)) & mask;
  } else {
    for (int64_t g = 0; g < bucket / 8; ++g) {
      uint64_t w = 0;
      memcpy(&w, packed + g * BITS, BITS);
      for (int j = 0; j < 8; ++j) codes[8 * g + j] = static_cast<uint8_t>(qcomm::unpack1<BITS>(w, j));
    }
  }
}

// Decodes (ACCUM=false: out = v) or accumulates (ACCUM=true: out += v) one bucket.
template <int BITS, int SCHEME, bool ACCUM>
inline void decode_bucket(const uint8_t* header, const uint8_t* __restrict codes, int64_t bucket,
                          float* __restrict out) {
  uint32_t words[2] = {0, 0};
  memcpy(words, header, 4 * qcomm::scales_per_bucket(SCHEME));  // rows may start at any byte
  const qcomm::DecodeScales s = qcomm::decode_scales<SCHEME>(words);
  for (int64_t i = 0; i < bucket; ++i) {
    const float v = qcomm::decode_value<BITS, SCHEME>(codes[i], s);
    if constexpr (ACCUM) {
      out[i] += v;
    } else {
      out[i] = v;
    }
  }
}

// Decodes bucket b of the payloads of nb buckets at byte `base` of rows first .. first + k - 1 of
// `m` into ob[0, B) (the first written, the rest added, in order j = 0, 1, ...); term `slot` (-1:
// none) is `exact`, B float32 values, instead of the decode of row first + slot. Buckets are read
// in increasing b (the cursors of `reads`).
template <int BITS, int SCHEME>
inline void decode_sum_bucket(const qcomm::cpu::Pieces& m, int64_t first, int64_t k, int64_t base,
                              int64_t nb, int64_t b, int64_t B, PieceCursors& reads,
                              uint8_t* __restrict codes, float* __restrict ob, int64_t slot = -1,
                              const float* __restrict exact = nullptr) {
  const int64_t S = qcomm::scales_per_bucket(SCHEME);
  const int64_t code_bytes = qcomm::code_bytes_per_bucket(B, BITS);
  for (int64_t j = 0; j < k; ++j) {
    if (j == slot) {
      if (j == 0) {
        std::copy(exact, exact + B, ob);
      } else {
        for (int64_t i = 0; i < B; ++i) ob[i] += exact[i];
      }
      continue;
    }
    const uint8_t* header = piece_bytes(m, first + j, base + 4 * S * b, 4 * S, &reads.header,
                                        reads.header_scratch);
    const uint8_t* packed = piece_bytes(m, first + j, base + 4 * S * nb + b * code_bytes,
                                        code_bytes, &reads.codes, reads.code_scratch.data);
    unpack_codes<BITS>(packed, B, codes);
    if (j == 0) {
      decode_bucket<BITS, SCHEME, false>(header, codes, B, ob);
    } else {
      decode_bucket<BITS, SCHEME, true>(header, codes, B, ob);
    }
  }
}

template <int BITS, int SCHEME>
void decode_sum_t(const qcomm::cpu::Pieces& m, int64_t first, int64_t k, int64_t n,
                  const qcomm::cpu::Params& p, float* out) {
  const int64_t B = p.bucket;
  const int64_t nb = qcomm::num_buckets(n, B);
  BucketScratch<float> tail(B);
  BucketScratch<uint8_t> codes(B);
  PieceCursors reads(B);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, n - start);
    float* ob = valid == B ? out + start : tail.data;
    decode_sum_bucket<BITS, SCHEME>(m, first, k, 0, nb, b, B, reads, codes.data, ob);
    if (valid < B) std::copy(tail.data, tail.data + valid, out + start);
  }
}

// encode_t(decode_sum_t(payloads) * scale) bucket by bucket: each bucket's sum is made in a
// bucket-sized buffer that stays in L1 and is encoded from there, so the reduced values never go
// to memory. The same bytes as the steps apart: the same operations on every value, the same
// padding of the last bucket, the same stochastic-rounding counter (the value's index).
// With `own` (qsgd_cpu.h, decode_sum_reencode_own; n a multiple of B), term `slot` of the sum is
// row `row` of the buffer that `own` packs, exact, instead of the decode of payload `slot`.
template <int BITS, int SCHEME>
void decode_sum_reencode_t(const qcomm::cpu::Pieces& m, int64_t n, float scale,
                           const uint32_t seed[2], const qcomm::cpu::Params& p,
                           const qcomm::cpu::Pieces& payload,
                           const qcomm::cpu::Leaves<const float>* own = nullptr,
                           int64_t slot = -1, int64_t row = 0) {
  const int64_t B = p.bucket;
  const int64_t nb = qcomm::num_buckets(n, B);
  const bool stochastic = p.rounding == qcomm::kStochastic;
  BucketScratch<float> sum(B);
  BucketScratch<float> pad(B);
  BucketScratch<uint8_t> codes(B);
  PieceCursors reads(B), writes(B);
  int64_t leaf = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, n - start);
    float* __restrict xb = sum.data;
    const float* exact =
        own == nullptr ? nullptr : leaves_bucket<SCHEME>(*own, row * n + start, B, &leaf, pad.data);
    decode_sum_bucket<BITS, SCHEME>(m, 0, m.rows, 0, nb, b, B, reads, codes.data, xb,
                                    own == nullptr ? -1 : slot, exact);
    if (scale != 1.0f) {
      for (int64_t i = 0; i < valid; ++i) xb[i] *= scale;
    }
    if (valid < B) pad_bucket<SCHEME>(xb, valid, B);
    encode_bucket_to<BITS, SCHEME>(xb, B, start, seed, stochastic, codes.data, valid, payload, 0,
                                   0, nb, b, writes);
  }
}

// ---- the chunks of a sharded reduce-scatter (qsgd_cpu.h, Chunks) ----------------------------------

// The values [u, u + valid) of shard j of leaf i in a bucket of B (valid <= B): a pointer into the
// leaf where they fill the bucket inside one chunk (the next values prefetched); otherwise `pad`
// holding them, gathered from the chunks they span, and after them the padding of a last, partial
// bucket (pad_bucket).
template <int SCHEME>
inline const float* shard_bucket(const qcomm::cpu::Chunks& x, int64_t i, int64_t j, int64_t u,
                                 int64_t valid, int64_t B, float* __restrict pad) {
  const int64_t c = x.chunk[i];
  int64_t run = u / c, off = u % c;
  const float* chunk = x.data[i] + (run * x.devices + j) * c;
  if (valid == B && off + B <= c) {
    prefetch_ahead(chunk, off, B, c);
    return chunk + off;
  }
  for (int64_t t = 0; t < valid; off = 0) {
    const int64_t take = std::min<int64_t>(valid - t, c - off);
    chunk = x.data[i] + (run++ * x.devices + j) * c;
    std::copy(chunk + off, chunk + off + take, pad + t);
    t += take;
  }
  if (valid < B) pad_bucket<SCHEME>(pad, valid, B);
  return pad;
}

// With `minus`, each value is x's less the value at the same place of shard `shard` of `minus`
// (qsgd_cpu.h, encode_chunk_differences), the bucket padded as encode pads the differences.
template <int BITS, int SCHEME>
void encode_chunks_t(const qcomm::cpu::Chunks& x, int64_t skip, const uint32_t* seeds,
                     const qcomm::cpu::Params& p, const qcomm::cpu::Pieces& message,
                     const qcomm::cpu::Chunks* minus = nullptr, int64_t shard = 0) {
  const int64_t B = p.bucket;
  const bool stochastic = p.rounding == qcomm::kStochastic;
  BucketScratch<uint8_t> codes(B);
  BucketScratch<float> pad(B);
  BucketScratch<float> pad_minus(B);
  BucketScratch<float> diff(B);
  PieceCursors writes(B);
  for (int64_t j = 0; j < message.rows; ++j) {
    if (j == skip) {
      piece_zero_row(message, j);
      continue;
    }
    writes.rewind();
    int64_t base = 0;  // payload (i, r) of row j
    const uint32_t* seed_i = seeds;  // leaf i's seeds: its runs(i) * D payloads, run-major
    for (int64_t i = 0; i < x.count; ++i) {
      const int64_t runs = x.runs(i), n = x.n(i), nb = qcomm::num_buckets(n, B);
      for (int64_t r = 0; r < runs; ++r) {
        const uint32_t* seed = seed_i + 2 * (r * x.devices + j);
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t valid = std::min<int64_t>(B, n - b * B);
          const float* xb = shard_bucket<SCHEME>(x, i, j, r * n + b * B, valid, B, pad.data);
          if (minus != nullptr) {
            const float* mb =
                shard_bucket<SCHEME>(*minus, i, shard, r * n + b * B, valid, B, pad_minus.data);
            for (int64_t k = 0; k < valid; ++k) diff.data[k] = xb[k] - mb[k];
            if (valid < B) pad_bucket<SCHEME>(diff.data, valid, B);
            xb = diff.data;
          }
          encode_bucket_to<BITS, SCHEME>(xb, B, b * B, seed, stochastic, codes.data, valid,
                                         message, j, base, nb, b, writes);
        }
        base += qcomm::payload_bytes(n, B, BITS, SCHEME);
      }
      seed_i += 2 * runs * x.devices;
    }
  }
}

// The reduced shards of every leaf from rows first .. first + k - 1 of `m` (row first + `slot`:
// this device's own values, read where they lie); with `mark`, 0 or NaN as the results are all
// finite or not (nullptr: none).
template <int BITS, int SCHEME>
void decode_sum_chunks_t(const qcomm::cpu::Pieces& m, int64_t first, int64_t k, int64_t slot,
                         const qcomm::cpu::Chunks& own, float scale, const qcomm::cpu::Params& p,
                         float* const* out, float* mark) {
  const int64_t B = p.bucket;
  BucketScratch<float> tail(B);
  BucketScratch<float> pad(B);
  BucketScratch<uint8_t> codes(B);
  PieceCursors reads(B);
  uint32_t nonfinite = 0;  // an integer OR, which vectorises where a float sum would not
  int64_t base = 0;  // payload (i, r) of each row
  for (int64_t i = 0; i < own.count; ++i) {
    const int64_t runs = own.runs(i), n = own.n(i), nb = qcomm::num_buckets(n, B);
    for (int64_t r = 0; r < runs; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t start = b * B, valid = std::min<int64_t>(B, n - start);
        const float* exact =
            slot < 0 ? nullptr : shard_bucket<SCHEME>(own, i, slot, r * n + start, valid, B, pad.data);
        float* dst = out[i] + r * n + start;
        float* __restrict ob = valid == B ? dst : tail.data;
        decode_sum_bucket<BITS, SCHEME>(m, first, k, base, nb, b, B, reads, codes.data, ob, slot,
                                        exact);
        if (scale != 1.0f) {
          for (int64_t t = 0; t < valid; ++t) ob[t] *= scale;
        }
        if (mark != nullptr) {
          for (int64_t t = 0; t < valid; ++t) {
            const uint32_t exponent = qcomm::float_bits(ob[t]) & 0x7F800000u;
            nonfinite |= static_cast<uint32_t>(exponent == 0x7F800000u);
          }
        }
        if (valid < B) std::copy(ob, ob + valid, dst);
      }
      base += qcomm::payload_bytes(n, B, BITS, SCHEME);
    }
  }
  if (mark != nullptr) *mark = nonfinite ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
}

// Each row on its own: decode_sum_chunks_t of one payload per value (x.devices == 1, no own term),
// written at row s of each leaf's result.
template <int BITS, int SCHEME>
void decode_chunks_t(const qcomm::cpu::Pieces& m, const qcomm::cpu::Chunks& x,
                     const qcomm::cpu::Params& p, float* const* out) {
  std::vector<float*> row(x.count);
  for (int64_t s = 0; s < m.rows; ++s) {
    for (int64_t i = 0; i < x.count; ++i) row[i] = out[i] + s * x.pre[i] * x.chunk[i];
    decode_sum_chunks_t<BITS, SCHEME>(m, s, 1, -1, x, 1.0f, p, row.data(), nullptr);
  }
}

template <template <int, int> class F, typename... Args>
void dispatch(const qcomm::cpu::Params& p, Args... args) {
#define QCOMM_CASE(BITS)                                         \
  case BITS:                                                     \
    if (p.scheme == qcomm::kMaxMin) {                            \
      F<BITS, qcomm::kMaxMin>::run(args...);                     \
    } else {                                                     \
      F<BITS, qcomm::kNorm>::run(args...);                       \
    }                                                            \
    break;
  switch (p.bits) {
    QCOMM_CASE(1) QCOMM_CASE(2) QCOMM_CASE(3) QCOMM_CASE(4)
    QCOMM_CASE(5) QCOMM_CASE(6) QCOMM_CASE(7) QCOMM_CASE(8)
  }
#undef QCOMM_CASE
}

template <int BITS, int SCHEME>
struct EncodeF {
  static void run(const float* x, int64_t n, const uint32_t* seed, const qcomm::cpu::Params* p,
                  uint8_t* payload) {
    encode_t<BITS, SCHEME>(x, n, seed, *p, payload);
  }
};
template <int BITS, int SCHEME>
struct EncodeLeavesF {
  static void run(const qcomm::cpu::Leaves<const float>* x, int64_t n, int64_t skip,
                  const uint32_t* seeds, const qcomm::cpu::Params* p,
                  const qcomm::cpu::Pieces* payloads) {
    encode_leaves_t<BITS, SCHEME>(*x, n, skip, seeds, *p, *payloads);
  }
};
template <int BITS, int SCHEME>
struct DecodeSumReencodeOwnF {
  static void run(const qcomm::cpu::Pieces* payloads, int64_t slot,
                  const qcomm::cpu::Leaves<const float>* own, int64_t row, int64_t n, float scale,
                  const uint32_t* seed, const qcomm::cpu::Params* p,
                  const qcomm::cpu::Pieces* payload) {
    decode_sum_reencode_t<BITS, SCHEME>(*payloads, n, scale, seed, *p, *payload, own, slot, row);
  }
};
template <int BITS, int SCHEME>
struct EncodeChunksF {
  static void run(const qcomm::cpu::Chunks* x, int64_t skip, const uint32_t* seeds,
                  const qcomm::cpu::Params* p, const qcomm::cpu::Pieces* message) {
    encode_chunks_t<BITS, SCHEME>(*x, skip, seeds, *p, *message);
  }
};
template <int BITS, int SCHEME>
struct EncodeChunkDifferencesF {
  static void run(const qcomm::cpu::Chunks* x, const qcomm::cpu::Chunks* minus, int64_t shard,
                  const uint32_t* seeds, const qcomm::cpu::Params* p,
                  const qcomm::cpu::Pieces* message) {
    encode_chunks_t<BITS, SCHEME>(*x, -1, seeds, *p, *message, minus, shard);
  }
};
template <int BITS, int SCHEME>
struct DecodeChunksF {
  static void run(const qcomm::cpu::Pieces* message, const qcomm::cpu::Chunks* x,
                  const qcomm::cpu::Params* p, float* const* out) {
    decode_chunks_t<BITS, SCHEME>(*message, *x, *p, out);
  }
};
template <int BITS, int SCHEME>
struct DecodeSumChunksF {
  static void run(const qcomm::cpu::Pieces* received, int64_t slot, const qcomm::cpu::Chunks* own,
                  float scale, const qcomm::cpu::Params* p, float* const* out, float* mark) {
    decode_sum_chunks_t<BITS, SCHEME>(*received, 0, received->rows, slot, *own, scale, *p, out,
                                      mark);
  }
};
template <int BITS, int SCHEME>
struct DecodeSumReencodeF {
  static void run(const uint8_t* payloads, int64_t k, int64_t stride, int64_t n, float scale,
                  const uint32_t* seed, const qcomm::cpu::Params* p, uint8_t* payload) {
    // k rows of `stride` bytes, each holding a payload at its start
    const int64_t bytes = qcomm::payload_bytes(n, p->bucket, BITS, SCHEME);
    const qcomm::cpu::WholeRows in = qcomm::cpu::whole_rows(payloads, k, stride, bytes);
    const qcomm::cpu::WholeRows out = qcomm::cpu::whole_rows(payload, 1, bytes, bytes);
    decode_sum_reencode_t<BITS, SCHEME>(in.pieces(), n, scale, seed, *p, out.pieces());
  }
};
template <int BITS, int SCHEME>
struct DecodeSumF {
  static void run(const qcomm::cpu::Pieces* m, int64_t first, int64_t k, int64_t n,
                  const qcomm::cpu::Params* p, float* out) {
    decode_sum_t<BITS, SCHEME>(*m, first, k, n, *p, out);
  }
};

}  // namespace

namespace qcomm::cpu::QCOMM_ISA {

void encode(const float* x, int64_t n, const uint32_t seed[2], const Params& p, uint8_t* payload) {
  dispatch<EncodeF>(p, x, n, seed, &p, payload);
}

void decode_sum(const Pieces& m, int64_t first, int64_t k, int64_t n, const Params& p, float* out) {
  dispatch<DecodeSumF>(p, &m, first, k, n, &p, out);
}

void encode_leaves(const Leaves<const float>& x, int64_t n, int64_t skip, const uint32_t* seeds,
                   const Params& p, const Pieces& payloads) {
  dispatch<EncodeLeavesF>(p, &x, n, skip, seeds, &p, &payloads);
}

void decode_sum_reencode_own(const Pieces& payloads, int64_t slot, const Leaves<const float>& own,
                             int64_t row, int64_t n, float scale, const uint32_t seed[2],
                             const Params& p, const Pieces& payload) {
  dispatch<DecodeSumReencodeOwnF>(p, &payloads, slot, &own, row, n, scale, seed, &p, &payload);
}

void encode_chunks(const Chunks& x, int64_t skip, const uint32_t* seeds, const Params& p,
                   const Pieces& message) {
  dispatch<EncodeChunksF>(p, &x, skip, seeds, &p, &message);
}

void encode_chunk_differences(const Chunks& x, const Chunks& minus, int64_t shard,
                              const uint32_t* seeds, const Params& p, const Pieces& message) {
  dispatch<EncodeChunkDifferencesF>(p, &x, &minus, shard, seeds, &p, &message);
}

void decode_chunks(const Pieces& message, const Chunks& x, const Params& p, float* const* out) {
  dispatch<DecodeChunksF>(p, &message, &x, &p, out);
}

void decode_sum_chunks(const Pieces& received, int64_t slot, const Chunks& own, float scale,
                       const Params& p, float* const* out, float* mark) {
  dispatch<DecodeSumChunksF>(p, &received, slot, &own, scale, &p, out, mark);
}

void decode_sum_reencode(const uint8_t* payloads, int64_t k, int64_t stride, int64_t n, float scale,
                         const uint32_t seed[2], const Params& p, uint8_t* payload) {
  dispatch<DecodeSumReencodeF>(p, payloads, k, stride, n, scale, seed, &p, payload);
}

}  // namespace qcomm::cpu::QCOMM_ISA
