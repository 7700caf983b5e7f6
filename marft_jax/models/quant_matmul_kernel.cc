// A decode step's projection from llama.cpp's quantized blocks: y[M, N] = x[M, K] @ W[layer]^T,
// where W[layer] is the [N, K] weight stored as rows of K/32 GGUF blocks (XLA FFI, CPU).
//
// A decode step of a few rows is bound by reading the weights. The embedded SmolLM2-135M holds
// them as Q4_1 / Q8_0 blocks (96.6 MB); dequantized to float32 they are 538 MB, read once per
// step. This handler reads the blocks and dequantizes each in registers, once for all rows:
//   Q4_0: w = d * (q - 8)   Q4_1: w = d * q + m   Q8_0: w = d * q
// with d, m the block's float16 scale and minimum, as gguf.quants.dequantize does in float32
// (fused multiply-add for d * q + m: within one rounding of it). Each output row n is one dot
// product per row of x over its K/32 blocks; rows of x go in groups (AVX-512: 8, AVX2 and the
// portable loop: 4) whose accumulators stay in registers; the weight rows 8 ahead are
// prefetched (the hardware prefetcher alone left the layer scan waiting on memory, ~3 GB/s,
// twice the time). The scales convert with F16C. The output rows are cut into pieces
// that the caller and XLA's intra-op threads claim from an atomic counter (the caller alone can
// finish them all, so a busy pool never blocks it); the caller then waits for the pieces a
// helper claimed.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kQK = 32;              // weights per block
constexpr int64_t kMaxRows = 64;         // rows of x per call
constexpr int kGroup = 8;                // rows of x per pass over a weight row

// ggml's type ids
constexpr int32_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

template <int32_t F>
constexpr int64_t BlockBytes() {
  return F == kQ4_0 ? 18 : F == kQ4_1 ? 20 : 34;
}

inline float HalfToFloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {                                  // zero or subnormal: mant * 2^-24, exact
    const float f = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (exp == 31 ? (0x7f800000u | (mant << 13)) : (((exp + 112u) << 23) | (mant << 13)));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// weight rows prefetched ahead of the one being read
constexpr int64_t kAhead = 8;

inline void Prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

template <int32_t F>
inline void Dequantize(const uint8_t* blk, float* w) {
  const float d = HalfToFloat(blk);
  if constexpr (F == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(q[j]);
  } else if constexpr (F == kQ4_1) {
    const float m = HalfToFloat(blk + 2);
    const uint8_t* q = blk + 4;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(q[j] & 15) + m;
      w[j + 16] = d * static_cast<float>(q[j] >> 4) + m;
    }
  } else {
    const uint8_t* q = blk + 2;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(static_cast<int>(q[j] & 15) - 8);
      w[j + 16] = d * static_cast<float>(static_cast<int>(q[j] >> 4) - 8);
    }
  }
}

// y[m, n] = sum_k x[m, k] w[n, k] for m < kG, n0 <= n < n1 (x rows ldx apart, y rows ldy apart,
// weight rows row_bytes apart). Portable version (any CPU).
template <int32_t F, int kG>
void RowsPortable(const float* x, int64_t ldx, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0,
                  int64_t n1, float* y, int64_t ldy) {
  const int64_t blocks = K / kQK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* blk = w + n * row_bytes;
    float acc[kG][8] = {};
    for (int64_t b = 0; b < blocks; ++b, blk += BlockBytes<F>()) {
      float wv[kQK];
      Dequantize<F>(blk, wv);
      const float* xb = x + b * kQK;
      for (int m = 0; m < kG; ++m)
        for (int j = 0; j < kQK; ++j) acc[m][j & 7] += xb[m * ldx + j] * wv[j];
    }
    for (int m = 0; m < kG; ++m) {
      float s = 0.f;
      for (int j = 0; j < 8; ++j) s += acc[m][j];
      y[m * ldy + n] = s;
    }
  }
}

// The same with AVX-512: a block is two vectors of 16 weights; each row of x keeps two
// accumulators (independent FMA chains), so 8 rows use 16 of the 32 registers.
// A block's float16 scale in one instruction (F16C; every AVX2 / AVX-512 CPU has it).
__attribute__((target("f16c"), always_inline)) inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

template <int32_t F>
__attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c"), always_inline)) inline void Dequantize512(
    const uint8_t* blk, __m512& w0, __m512& w1) {
  const __m512 d = _mm512_set1_ps(Half(blk));
  if constexpr (F == kQ8_0) {
    const __m128i* q = reinterpret_cast<const __m128i*>(blk + 2);
    w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (F == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask)));
    if constexpr (F == kQ4_1) {
      const __m512 m = _mm512_set1_ps(Half(blk + 2));
      w0 = _mm512_fmadd_ps(d, lo, m);
      w1 = _mm512_fmadd_ps(d, hi, m);
    } else {
      const __m512 eight = _mm512_set1_ps(8.f);
      w0 = _mm512_mul_ps(d, _mm512_sub_ps(lo, eight));
      w1 = _mm512_mul_ps(d, _mm512_sub_ps(hi, eight));
    }
  }
}

template <int32_t F, int kG>
__attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c"))) void Rows512(
    const float* x, int64_t ldx, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
    float* y, int64_t ldy) {
  const int64_t blocks = K / kQK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* blk = w + n * row_bytes;
    Prefetch(blk + kAhead * row_bytes, row_bytes);
    __m512 a0[kG], a1[kG];
#pragma GCC unroll 8
    for (int m = 0; m < kG; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, blk += BlockBytes<F>()) {
      __m512 w0, w1;
      Dequantize512<F>(blk, w0, w1);
      const float* xb = x + b * kQK;
#pragma GCC unroll 8
      for (int m = 0; m < kG; ++m) {
        a0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + m * ldx), w0, a0[m]);
        a1[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + m * ldx + 16), w1, a1[m]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < kG; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
  }
}

// AVX2: a block is four vectors of 8 weights; each row of x keeps two accumulators (4 rows use
// 8 of the 16 registers).
template <int32_t F>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void Dequantize256(const uint8_t* blk, __m256* wv) {
  const __m256 d = _mm256_set1_ps(Half(blk));
  if constexpr (F == kQ8_0) {
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i));
      wv[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (F == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i) {
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
      if constexpr (F == kQ4_1) {
        wv[i] = _mm256_fmadd_ps(d, v, _mm256_set1_ps(Half(blk + 2)));
      } else {
        wv[i] = _mm256_mul_ps(d, _mm256_sub_ps(v, _mm256_set1_ps(8.f)));
      }
    }
  }
}

template <int32_t F, int kG>
__attribute__((target("avx2,fma,f16c"))) void Rows256(const float* x, int64_t ldx, int64_t K, const uint8_t* w,
                                                 int64_t row_bytes, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t blocks = K / kQK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* blk = w + n * row_bytes;
    Prefetch(blk + kAhead * row_bytes, row_bytes);
    __m256 a0[kG], a1[kG];
#pragma GCC unroll 8
    for (int m = 0; m < kG; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, blk += BlockBytes<F>()) {
      __m256 wv[4];
      Dequantize256<F>(blk, wv);
      const float* xb = x + b * kQK;
#pragma GCC unroll 8
      for (int m = 0; m < kG; ++m) {
        a0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + m * ldx), wv[0], a0[m]);
        a1[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + m * ldx + 8), wv[1], a1[m]);
        a0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + m * ldx + 16), wv[2], a0[m]);
        a1[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + m * ldx + 24), wv[3], a1[m]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < kG; ++m) {
      const __m256 s = _mm256_add_ps(a0[m], a1[m]);
      __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      r = _mm_add_ps(r, _mm_movehl_ps(r, r));
      r = _mm_add_ss(r, _mm_movehdup_ps(r));
      y[m * ldy + n] = _mm_cvtss_f32(r);
    }
  }
}

using RowsFn = void (*)(const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*, int64_t);

// One instruction set's row functions for a format, by group size (1..kGroup; rows of x per pass).
struct Kernels {
  RowsFn rows[kGroup + 1];
  int group;
};

template <int32_t F>
constexpr Kernels kAvx512 = {{nullptr, &Rows512<F, 1>, &Rows512<F, 2>, &Rows512<F, 3>, &Rows512<F, 4>,
                              &Rows512<F, 5>, &Rows512<F, 6>, &Rows512<F, 7>, &Rows512<F, 8>}, 8};
template <int32_t F>
constexpr Kernels kAvx2 = {{nullptr, &Rows256<F, 1>, &Rows256<F, 2>, &Rows256<F, 3>, &Rows256<F, 4>,
                            nullptr, nullptr, nullptr, nullptr}, 4};
template <int32_t F>
constexpr Kernels kPortable = {{nullptr, &RowsPortable<F, 1>, &RowsPortable<F, 2>, &RowsPortable<F, 3>,
                                &RowsPortable<F, 4>, nullptr, nullptr, nullptr, nullptr}, 4};

template <int32_t F>
const Kernels* KernelsFor() {
  static const Kernels* chosen = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c"))
      return &kAvx512<F>;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return &kAvx2<F>;
    return &kPortable<F>;
  }();
  return chosen;
}

// The pieces of one call (ranges of output rows), claimed by the caller and its helpers (shared:
// a helper that starts after the caller returned finds none left and touches only this object).
struct Work {
  const float* x;
  const uint8_t* w;
  float* y;
  int64_t M, K, N, row_bytes, piece, pieces;
  const Kernels* kernels;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (int64_t p; (p = next.fetch_add(1, std::memory_order_relaxed)) < pieces;) {
      const int64_t n0 = p * piece, n1 = std::min(N, n0 + piece);
      for (int64_t m0 = 0; m0 < M; m0 += kernels->group) {
        const int64_t g = std::min<int64_t>(kernels->group, M - m0);
        kernels->rows[g](x + m0 * K, K, K, w, row_bytes, n0, n1, y + m0 * N, N);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                           ffi::BufferR0<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int32_t format) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3) {
    return ffi::Error::InvalidArgument("quant_matmul: x must be [M, K] and w [L, N, K/32 * block bytes]");
  }
  const int64_t M = xd[0], K = xd[1], L = wd[0], N = wd[1], row_bytes = wd[2];
  const Kernels* kernels = nullptr;
  int64_t block = 0;
  switch (format) {
    case kQ4_0: kernels = KernelsFor<kQ4_0>(); block = BlockBytes<kQ4_0>(); break;
    case kQ4_1: kernels = KernelsFor<kQ4_1>(); block = BlockBytes<kQ4_1>(); break;
    case kQ8_0: kernels = KernelsFor<kQ8_0>(); block = BlockBytes<kQ8_0>(); break;
    default: return ffi::Error::InvalidArgument("quant_matmul: format must be Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  }
  if (K % kQK != 0 || row_bytes != K / kQK * block) {
    return ffi::Error::InvalidArgument("quant_matmul: K must be a multiple of 32 and w's rows K/32 blocks");
  }
  if (M < 1 || M > kMaxRows) return ffi::Error::InvalidArgument("quant_matmul: 1 <= M <= 64 rows");
  const int32_t li = *layer.typed_data();
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("quant_matmul: layer out of range");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data() + static_cast<int64_t>(li) * N * row_bytes;
  work->y = y->typed_data();
  work->M = M;
  work->K = K;
  work->N = N;
  work->row_bytes = row_bytes;
  work->kernels = kernels;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 0) + 1;
  // a few pieces per thread (a late helper still finds work), each at least 16 rows
  work->piece = std::max<int64_t>(16, (N + 4 * threads - 1) / (4 * threads));
  work->pieces = (N + work->piece - 1) / work->piece;
  const int64_t helpers = std::min<int64_t>(threads - 1, work->pieces - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->pieces) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MarftQuantMatmul, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()      // w [L, N, K/32 * block bytes]
                                  .Arg<ffi::BufferR0<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()     // y [M, N]
                                  .Attr<int32_t>("format"));        // ggml type id
