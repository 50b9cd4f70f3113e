// CUDA kernels of the QSGD codec: encode, decode-and-sum, and the fused decode-sum-reencode.
//
// All the math that decides a byte or a decoded value is kernels/qsgd_math.h, shared with the CPU
// kernels. What this file adds is the work split, chosen so that it cannot change a result:
//
//  * per-element work (quantisation, random bits, dequantisation, the in-order sum over payloads)
//    depends only on the element, never on which thread does it;
//  * maxmin reductions are min/max of integer order keys and an OR of NaN flags: exact, so the
//    shuffle tree gives the CPU's result;
//  * the norm scheme first reduces the largest |x| (an unsigned max of bits: exact), which sets the
//    bucket's scale 2^-k; its sum of squares (of the scaled values) is the format's fixed order:
//    lane j (elements j, j+8, ...) summed sequentially by one thread, read back from shared memory,
//    then the fixed tree ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7)), an xor butterfly with strides 4, 2, 1.
//
// Build flags (cmake/cuda/CMakeLists.txt): -ftz=true, so that float arithmetic flushes denormal
// inputs and results like the CPU kernels under FTZ/DAZ; -fmad=false (the header also uses
// __fmul_rn / __fadd_rn, which are never contracted); IEEE division and square root.
//
// Work split. Encode: a team of TEAM threads (4..32, a power of two, TEAM >= bucket/8 up to 32)
// per bucket; thread t owns the groups of 8 consecutive values g = t, t + TEAM, ... of the bucket:
// it loads them with two 16-byte loads (a warp reads 1 KiB contiguous), computes their 8 codes and
// stores the packed `bits` bytes (as one 8/4/2-byte store where aligned). Buckets of up to 256
// values keep their values in registers between the reductions and the quantisation pass; larger
// buckets read them again (from L1/L2): twice for maxmin, three times for norm. Decode-sum: one thread per group of 8 outputs, two 16-byte
// stores. The fused decode-sum-reencode is the encode kernel whose values come from decoding k
// payloads instead of from memory.
#include <cstdint>

#include "qsgd_cuda.h"
#include "qsgd_math.h"

namespace qcomm::cuda {
namespace {

constexpr int kThreads = 256;  // threads per block
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int64_t kMaxBlocksX = 1 << 30;
constexpr int64_t kMaxBlocksY = 65535;

// ---- unaligned-tolerant loads and stores --------------------------------------------------------
// Payload rows are `bytes` apart and `bytes` may be odd, so a payload's scales and codes are not
// always aligned: use the widest unit that the address and the size allow.

template <int NB, typename T>
__device__ __forceinline__ uint64_t load_units(const uint8_t* p) {
  uint64_t w = 0;
#pragma unroll
  for (int i = 0; i < NB / static_cast<int>(sizeof(T)); ++i)
    w |= static_cast<uint64_t>(__ldg(reinterpret_cast<const T*>(p) + i)) << (8 * sizeof(T) * i);
  return w;
}
template <int NB>
__device__ __forceinline__ uint64_t load_bytes(const uint8_t* p) {
  const unsigned a = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p));
  if constexpr (NB % 8 == 0) {
    if ((a & 7u) == 0) return load_units<NB, unsigned long long>(p);
  }
  if constexpr (NB % 4 == 0) {
    if ((a & 3u) == 0) return load_units<NB, unsigned int>(p);
  }
  if constexpr (NB % 2 == 0) {
    if ((a & 1u) == 0) return load_units<NB, unsigned short>(p);
  }
  return load_units<NB, unsigned char>(p);
}

template <int NB, typename T>
__device__ __forceinline__ void store_units(uint8_t* p, uint64_t w) {
#pragma unroll
  for (int i = 0; i < NB / static_cast<int>(sizeof(T)); ++i)
    reinterpret_cast<T*>(p)[i] = static_cast<T>(w >> (8 * sizeof(T) * i));
}
template <int NB>
__device__ __forceinline__ void store_bytes(uint8_t* p, uint64_t w) {
  const unsigned a = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p));
  if constexpr (NB % 8 == 0) {
    if ((a & 7u) == 0) return store_units<NB, unsigned long long>(p, w);
  }
  if constexpr (NB % 4 == 0) {
    if ((a & 3u) == 0) return store_units<NB, unsigned int>(p, w);
  }
  if constexpr (NB % 2 == 0) {
    if ((a & 1u) == 0) return store_units<NB, unsigned short>(p, w);
  }
  store_units<NB, unsigned char>(p, w);
}
__device__ __forceinline__ void store_f32(uint8_t* p, float v) { store_bytes<4>(p, __float_as_uint(v)); }

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Division by a run-time constant d >= 1 without a divide instruction, for x < 2^31 (Granlund and
// Montgomery: with l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d) + 1, x / d = (mulhi(x, m) + x)
// >> l). Set up on the host.
struct FastDiv {
  uint32_t d, m, l;
  static FastDiv make(uint32_t d) {
    uint32_t l = 0;
    while ((uint64_t{1} << l) < d) ++l;
    const uint64_t m = ((uint64_t{1} << 32) * ((uint64_t{1} << l) - d)) / d + 1;
    return FastDiv{d, static_cast<uint32_t>(m), l};
  }
  __device__ __forceinline__ uint32_t div(uint32_t x) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(__umulhi(x, m)) + x) >> l);
  }
};

// ---- one group of 8 consecutive values -----------------------------------------------------------

// The 8 values decoded from k payloads and summed in order (j = 0 first), as kernels/qsgd_cpu
// decode_sum computes them. p0: the row's first payload; group g of bucket b.
template <int BITS, int SCHEME>
__device__ __forceinline__ void decode_sum_group(const uint8_t* p0, int64_t k, int64_t bytes,
                                                 int64_t nb, int64_t code_bytes, int64_t b,
                                                 int64_t g, float v[8]) {
  constexpr int64_t S = SCHEME == kMaxMin ? 2 : 1;
  const int64_t scale_off = 4 * S * b;
  const int64_t code_off = 4 * S * nb + b * code_bytes + g * BITS;
  for (int64_t j = 0; j < k; ++j) {
    const uint8_t* pj = p0 + j * bytes;
    uint32_t header[2];
    header[0] = static_cast<uint32_t>(load_bytes<4>(pj + scale_off));
    header[1] = S == 2 ? static_cast<uint32_t>(load_bytes<4>(pj + scale_off + 4)) : 0u;
    const DecodeScales s = decode_scales<SCHEME>(header);
    const uint64_t w = load_bytes<BITS>(pj + code_off);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float d = decode_value<BITS, SCHEME>(unpack1<BITS>(w, i), s);
      v[i] = j == 0 ? d : add_rn(v[i], d);
    }
  }
}

// Value sources of the encode kernel. load8(row, b, g, v) sets v[i] for the elements
// e = b*B + 8g + i < n of the row (others: anything, but nothing out of bounds is read).

struct ArraySource {  // encode: the values are x[rows, n]
  const float* x;
  int64_t n, bucket;
  __device__ __forceinline__ void load8(int64_t row, int64_t b, int64_t g, float v[8]) const {
    const int64_t e0 = b * bucket + 8 * g;
    const float* p = x + row * n + e0;
    if (e0 + 8 <= n && aligned16(p)) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(p));
      const float4 c = __ldg(reinterpret_cast<const float4*>(p) + 1);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = c.x, v[5] = c.y, v[6] = c.z, v[7] = c.w;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = e0 + i < n ? __ldg(p + i) : 0.0f;
    }
  }
};

template <int BITS, int SCHEME>
struct DecodeSumSource {  // decode-sum-reencode: the values are decode_sum(payloads) [* scale]
  const uint8_t* payloads;
  int64_t k, bytes, nb, code_bytes;
  float scale;
  bool apply_scale;
  __device__ __forceinline__ void load8(int64_t row, int64_t b, int64_t g, float v[8]) const {
    decode_sum_group<BITS, SCHEME>(payloads + row * k * bytes, k, bytes, nb, code_bytes, b, g, v);
    if (apply_scale) {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = mul_rn(v[i], scale);
    }
  }
};

struct EncodeArgs {
  int64_t rows, n, bucket, nb, bytes;
  const uint32_t* seed;  // [rows, 2]
  bool stochastic;
  uint8_t* payload;      // [rows, bytes]
};

// One team of TEAM threads per bucket; grid: x over the buckets of a row, y over rows.
// 4 blocks of 256 threads per SM: up to 64 registers (without it ptxas spills some sm_80 kernels).
template <int BITS, int SCHEME, int TEAM, class Src>
__global__ void __launch_bounds__(kThreads, 4) encode_kernel(Src src, EncodeArgs a) {
  static_assert(TEAM >= 1 && TEAM <= 32 && (TEAM & (TEAM - 1)) == 0, "TEAM: a power of two <= 32");
  constexpr uint32_t levels = SCHEME == kMaxMin ? (1u << BITS) - 1u : (1u << (BITS - 1)) - 1u;
  constexpr int kTeamsPerWarp = 32 / TEAM;
  constexpr int kLanesPerThread = TEAM >= 8 ? 1 : 8 / TEAM;  // norm lanes summed by one thread
  constexpr int64_t S = SCHEME == kMaxMin ? 2 : 1;
  // Squares of the threads' current groups, [thread][8] padded to 9 floats per thread so that
  // neither the writes (8 per thread) nor the lane sums' reads hit the same bank twice.
  constexpr int kSq = 9;
  __shared__ float squares[SCHEME == kNorm ? kThreads * kSq : 1];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int t = lane % TEAM;                 // position in the team
  const int team_lane0 = lane - t;           // first lane of the team
  const int G = static_cast<int>(a.bucket / 8);  // groups per bucket (in-bucket math is 32-bit)
  const int64_t code_bytes = a.bucket * BITS / 8;
  const bool cached = G <= TEAM;             // every thread holds at most one group

  for (int64_t row = blockIdx.y; row < a.rows; row += gridDim.y) {
    const uint32_t seed0 = __ldg(a.seed + 2 * row), seed1 = __ldg(a.seed + 2 * row + 1);
    uint8_t* out = a.payload + row * a.bytes;
    for (int64_t b0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kTeamsPerWarp; b0 < a.nb;
         b0 += static_cast<int64_t>(gridDim.x) * kWarps * kTeamsPerWarp) {
      // Warp-uniform loop: teams past the last bucket go along (shuffles need the whole warp).
      const int64_t b = b0 + lane / TEAM;
      const bool active = b < a.nb;
      const int64_t start = b * a.bucket;
      const int valid = active ? static_cast<int>(min(a.bucket, a.n - start)) : 0;
      // The last bucket is padded with its first value (maxmin) or 0 (norm).
      float fill = 0.0f;
      if (SCHEME == kMaxMin && active && valid < a.bucket) {
        float first[8];
        src.load8(row, b, 0, first);
        fill = first[0];
      }

      // -- pass 1: the bucket's reductions --
      // maxmin: min/max order keys (a NaN is one of them); norm: the largest |x| (bits), which sets the
      // scale 2^-k of the squares summed in pass 1b. All exact, reduced by shuffles.
      int32_t lo = INT32_MAX, hi = INT32_MIN;
      uint32_t max_abs = 0;
      float v[8];
      for (int c0 = 0; c0 < G; c0 += TEAM) {
        const int g = c0 + t;
        if (active && g < G) {
          src.load8(row, b, g, v);
          if (8 * g + 8 > valid) {
#pragma unroll
            for (int i = 0; i < 8; ++i)
              if (8 * g + i >= valid) v[i] = fill;
          }
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            if constexpr (SCHEME == kMaxMin) {
              const int32_t key = order_key(v[i]);
              lo = min(lo, key);
              hi = max(hi, key);
            } else {
              max_abs = max(max_abs, abs_bits(v[i]));
            }
          }
        }
      }
#pragma unroll
      for (int off = TEAM / 2; off >= 1; off >>= 1) {
        if constexpr (SCHEME == kMaxMin) {
          lo = min(lo, __shfl_xor_sync(kFull, lo, off));
          hi = max(hi, __shfl_xor_sync(kFull, hi, off));
        } else {
          max_abs = max(max_abs, __shfl_xor_sync(kFull, max_abs, off));
        }
      }

      EncodeScales es;
      if constexpr (SCHEME == kMaxMin) {
        es = maxmin_scales(lo, hi, levels);
      } else {
        // -- pass 1b (norm): the squares of the scaled values, in the format's 8 lanes --
        const float down = pow2(-scale_exponent(max_abs));
        float lane_sum[kLanesPerThread];
#pragma unroll
        for (int m = 0; m < kLanesPerThread; ++m) lane_sum[m] = 0.0f;
        for (int c0 = 0; c0 < G; c0 += TEAM) {
          const int g = c0 + t;
          if (active && g < G) {
            if (!cached) {
              src.load8(row, b, g, v);
              if (8 * g + 8 > valid) {
#pragma unroll
                for (int i = 0; i < 8; ++i)
                  if (8 * g + i >= valid) v[i] = fill;
              }
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) squares[threadIdx.x * kSq + i] = norm_square(mul_rn(v[i], down));
          }
          __syncwarp();
          const int groups = min(TEAM, G - c0);
          if (t < 8) {
            for (int q = 0; q < groups; ++q) {
              const float* sq = squares + (warp * 32 + team_lane0 + q) * kSq;
#pragma unroll
              for (int m = 0; m < kLanesPerThread; ++m)
                lane_sum[m] = add_rn(lane_sum[m], sq[t + TEAM * m]);
            }
          }
          __syncwarp();
        }
        // norm_tree as a butterfly: strides >= TEAM inside the thread, smaller ones by shuffles.
#pragma unroll
        for (int off = 4; off >= 1; off >>= 1) {
          if (off >= TEAM) {
#pragma unroll
            for (int m = 0; m < (off >= TEAM ? off / TEAM : 1); ++m)
              lane_sum[m] = add_rn(lane_sum[m], lane_sum[m + off / TEAM]);
          } else {
            lane_sum[0] = add_rn(lane_sum[0], __shfl_xor_sync(kFull, lane_sum[0], off));
          }
        }
        const float total = __shfl_sync(kFull, lane_sum[0], team_lane0);
        es = norm_scales(max_abs, total, levels);
      }
      if (!active) continue;  // no shuffles below
      if (t == 0) {
        if constexpr (SCHEME == kMaxMin) {
          store_f32(out + 8 * b, es.min);
          store_bytes<4>(out + 8 * b + 4, es.word);
        } else {
          store_bytes<4>(out + 4 * b, es.word);
        }
      }

      // -- pass 2: codes --
      uint8_t* codes = out + 4 * S * a.nb + b * code_bytes;
      const uint32_t index0 = static_cast<uint32_t>(start);  // element indices wrap at 2^32
      for (int g = t; g < G; g += TEAM) {
        const int nvalid = valid - 8 * g;  // values of this group before the padding
        if (!cached) {
          src.load8(row, b, g, v);
          if (nvalid < 8) {
#pragma unroll
            for (int i = 0; i < 8; ++i)
              if (i >= nvalid) v[i] = fill;
          }
        }
        const uint32_t index = index0 + 8u * static_cast<uint32_t>(g);
        uint64_t w = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float r = rounding_threshold(a.stochastic, seed0, seed1, index + i);
          w |= static_cast<uint64_t>(encode_value<BITS, SCHEME>(v[i], es.down, es.y_min, es.inv, r))
               << (i * BITS);
        }
        if (nvalid < 8)  // padding codes are 0
          w &= nvalid <= 0 ? 0 : (uint64_t{1} << (BITS * nvalid)) - 1;
        store_bytes<BITS>(codes + static_cast<int64_t>(g) * BITS, w);
      }
    }
  }
}

// One thread per group of 8 outputs; grid: x over the groups of a row, y over rows.
template <int BITS, int SCHEME>
__global__ void __launch_bounds__(kThreads)
    decode_sum_kernel(const uint8_t* payloads, int64_t rows, int64_t k, int64_t n, int64_t bucket,
                      int64_t nb, int64_t bytes, FastDiv gdiv, float* out) {
  const int64_t G = bucket / 8;
  const int64_t groups = nb * G;
  const int64_t code_bytes = bucket * BITS / 8;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const uint8_t* p0 = payloads + row * k * bytes;
    float* o = out + row * n;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < groups;
         i += static_cast<int64_t>(gridDim.x) * kThreads) {
      // Bucket of group i: a multiply-shift while the index fits 31 bits (n < 2^34), else divide.
      const int64_t b = i < (int64_t{1} << 31) ? static_cast<int64_t>(gdiv.div(static_cast<uint32_t>(i)))
                                                 : i / G;
      const int64_t g = i - b * G;
      const int64_t e0 = b * bucket + 8 * g;
      if (e0 >= n) continue;  // a group of padding
      float v[8];
      decode_sum_group<BITS, SCHEME>(p0, k, bytes, nb, code_bytes, b, g, v);
      float* p = o + e0;
      if (e0 + 8 <= n && aligned16(p)) {
        reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (e0 + j < n) p[j] = v[j];
      }
    }
  }
}

// ---- launches ----------------------------------------------------------------------------------

dim3 grid_of(int64_t items_per_row, int64_t items_per_block, int64_t rows) {
  const int64_t x = (items_per_row + items_per_block - 1) / items_per_block;
  return dim3(static_cast<unsigned>(x < 1 ? 1 : (x > kMaxBlocksX ? kMaxBlocksX : x)),
              static_cast<unsigned>(rows > kMaxBlocksY ? kMaxBlocksY : rows));
}

int team_for(int64_t bucket) {
  const int64_t groups = bucket / 8;
  int team = 4;  // smallest team: fewer would leave norm lanes to one thread in long loops
  while (team < 32 && team < groups) team *= 2;
  return team;
}

template <int BITS, int SCHEME, class Src>
void launch_encode(cudaStream_t stream, const Src& src, const EncodeArgs& a) {
  const int team = team_for(a.bucket);
  const dim3 grid = grid_of(a.nb, kThreads / team, a.rows);
  switch (team) {
    case 4: encode_kernel<BITS, SCHEME, 4, Src><<<grid, kThreads, 0, stream>>>(src, a); break;
    case 8: encode_kernel<BITS, SCHEME, 8, Src><<<grid, kThreads, 0, stream>>>(src, a); break;
    case 16: encode_kernel<BITS, SCHEME, 16, Src><<<grid, kThreads, 0, stream>>>(src, a); break;
    default: encode_kernel<BITS, SCHEME, 32, Src><<<grid, kThreads, 0, stream>>>(src, a); break;
  }
}

struct EncodeOp {
  const float* x;
  template <int BITS, int SCHEME>
  void run(cudaStream_t stream, const EncodeArgs& a) const {
    launch_encode<BITS, SCHEME>(stream, ArraySource{x, a.n, a.bucket}, a);
  }
};

struct ReencodeOp {
  const uint8_t* payloads;
  int64_t k;
  float scale;
  template <int BITS, int SCHEME>
  void run(cudaStream_t stream, const EncodeArgs& a) const {
    const DecodeSumSource<BITS, SCHEME> src{payloads, k, a.bytes, a.nb, a.bucket * BITS / 8,
                                            scale, scale != 1.0f};
    launch_encode<BITS, SCHEME>(stream, src, a);
  }
};

struct DecodeSumOp {
  const uint8_t* payloads;
  int64_t rows, k, n, bucket, nb, bytes;
  float* out;
  template <int BITS, int SCHEME>
  void run(cudaStream_t stream) const {
    const dim3 grid = grid_of(nb * (bucket / 8), kThreads, rows);
    const FastDiv gdiv = FastDiv::make(static_cast<uint32_t>(bucket / 8));
    decode_sum_kernel<BITS, SCHEME><<<grid, kThreads, 0, stream>>>(payloads, rows, k, n, bucket, nb,
                                                                   bytes, gdiv, out);
  }
};

template <class Op, typename... Args>
cudaError_t dispatch(const Params& p, const Op& op, Args... args) {
#define QCOMM_CASE(BITS)                                              \
  case BITS:                                                          \
    if (p.scheme == kMaxMin) {                                        \
      op.template run<BITS, kMaxMin>(args...);                        \
    } else if (BITS >= 2) {                                           \
      op.template run<(BITS >= 2 ? BITS : 2), kNorm>(args...);        \
    }                                                                 \
    break;
  switch (p.bits) {
    QCOMM_CASE(1) QCOMM_CASE(2) QCOMM_CASE(3) QCOMM_CASE(4)
    QCOMM_CASE(5) QCOMM_CASE(6) QCOMM_CASE(7) QCOMM_CASE(8)
    default: return cudaErrorInvalidValue;
  }
#undef QCOMM_CASE
  return cudaGetLastError();
}

EncodeArgs encode_args(int64_t rows, int64_t n, const uint32_t* seed, const Params& p,
                       uint8_t* payload) {
  return EncodeArgs{rows, n, p.bucket, num_buckets(n, p.bucket),
                    payload_bytes(n, p.bucket, p.bits, p.scheme), seed,
                    p.rounding == kStochastic, payload};
}

}  // namespace

cudaError_t encode(cudaStream_t stream, const float* x, int64_t rows, int64_t n,
                   const uint32_t* seed, const Params& p, uint8_t* payload) {
  if (rows == 0 || n == 0) return cudaSuccess;
  return dispatch(p, EncodeOp{x}, stream, encode_args(rows, n, seed, p, payload));
}

cudaError_t decode_sum(cudaStream_t stream, const uint8_t* payloads, int64_t rows, int64_t k,
                       int64_t n, const Params& p, float* out) {
  if (rows == 0 || n == 0) return cudaSuccess;
  const DecodeSumOp op{payloads, rows, k, n, p.bucket, num_buckets(n, p.bucket),
                       payload_bytes(n, p.bucket, p.bits, p.scheme), out};
  return dispatch(p, op, stream);
}

cudaError_t decode_sum_reencode(cudaStream_t stream, const uint8_t* payloads, int64_t rows,
                                int64_t k, int64_t n, float scale, const uint32_t* seed,
                                const Params& p, uint8_t* payload) {
  if (rows == 0 || n == 0) return cudaSuccess;
  return dispatch(p, ReencodeOp{payloads, k, scale}, stream, encode_args(rows, n, seed, p, payload));
}

}  // namespace qcomm::cuda
