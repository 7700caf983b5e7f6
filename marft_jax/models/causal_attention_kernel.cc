// Causal attention over whole rows (training passes, critic features, prefills into an empty
// cache) on the CPU: forward and backward as two XLA FFI handlers.
//
// XLA:CPU runs the blocked causal attention of attention.py as ~25 small dots per layer, each
// against a copied slice of the keys, with the mask, max, exponential and sums as separate
// single-threaded passes between them; at SmolLM2's shape over 4 x 1,504-token rows that made
// attention half of the update's thread time for a fifth of its FLOPs. Here each task (row,
// kv head, query head of the group[, chunk of queries]) walks its queries four at a time:
// scores against the keys up to the block's end (register-blocked: 4 queries x 64 keys per
// step over the head width, keys read transposed [D, S]), the masked softmax, then the
// weighted values (4 queries x 64 value columns per step). Key blocks before the first key any
// of the four queries may see are skipped (a packed row's later segments never touch the
// earlier ones' keys). The backward is the flash-attention one: recompute the probabilities
// from the saved log-sum-exp, dS = P (dP - rowsum(dO O)); dQ = dS K, and each task
// accumulates dK = dS^T Q and dV = P^T dO for its query head, which the caller sums over the
// group (no two tasks write the same memory). Tasks are claimed from an atomic counter by the
// caller and XLA's intra-op threads.
//
// Shapes (the caller pads T to a multiple of 16 and scales q by 1/sqrt(D)):
//   q, o, do, dq [B, KV, G, T, D]; k, v [B, KV, T, D]; kt, vt [B, KV, D, T] (transposed);
//   mask [B, T, T] bool (query t may attend to key j; never j > t); lse [B, KV, G, T];
//   dk_part, dv_part [B, KV, G, T, D].
// D must be a multiple of 16. Fully masked query rows get o = 0, lse = 0 and no gradient.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#ifndef MARFT_CAUSAL_ATTENTION_BODY
#define MARFT_CAUSAL_ATTENTION_BODY

namespace {

constexpr int kR = 4;              // queries per block
constexpr float kMasked = -1e30f;  // the score of a masked key (its exponential is 0)
struct Dims {
  int64_t B, KV, G, T, D;
};

// The keys [j0, j1) a block of kR queries reads: from the first key any of them may see
// (`first`, rounded down to 16) to the block's end (rounded up to 16); j0 == j1 (== first)
// when none may see any. The backward writes dk / dv rows [first, block end) only.
struct KeyRange {
  int64_t j0, j1, first;
};

}  // namespace

// The kernel body below, compiled three times: for AVX-512, for AVX2 + FMA and portably (the
// file includes itself; the vector helpers must be compiled for the target they run on, so
// they live inside each target region rather than in target_clones functions).
#if defined(__clang__)   // clang ignores GCC's target pragma
#pragma clang attribute push(__attribute__((target("avx512f,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,fma")
#endif
#define MARFT_LANES 16
namespace isa_avx512 {
#include "causal_attention_kernel.cc"  // this file: the body below
}  // namespace isa_avx512
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
#undef MARFT_LANES
#define MARFT_LANES 8
namespace isa_avx2 {
#include "causal_attention_kernel.cc"  // this file: the body below
}  // namespace isa_avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#undef MARFT_LANES
#define MARFT_LANES 4
namespace isa_portable {
#include "causal_attention_kernel.cc"  // this file: the body below
}  // namespace isa_portable
#undef MARFT_LANES

namespace {

// The body compiled for the best instruction set this CPU has.
struct Isa {
  decltype(&isa_portable::ForwardTask) forward;
  decltype(&isa_portable::BackwardTask) backward;
};

// $MARFT_JAX_CAUSAL_ATTENTION_ISA = avx512 | avx2 | portable caps the choice (tests run every body).
const Isa& Chosen() {
  static const Isa isa = [] {
    const char* cap = std::getenv("MARFT_JAX_CAUSAL_ATTENTION_ISA");
    const std::string limit = cap ? cap : "";
    const bool avx512 = (limit.empty() || limit == "avx512") && __builtin_cpu_supports("avx512f");
    const bool avx2 = limit != "portable" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return avx512 ? Isa{&isa_avx512::ForwardTask, &isa_avx512::BackwardTask}
           : avx2 ? Isa{&isa_avx2::ForwardTask, &isa_avx2::BackwardTask}
                  : Isa{&isa_portable::ForwardTask, &isa_portable::BackwardTask};
  }();
  return isa;
}

// Tasks claimed from an atomic counter by the caller and the pool's threads (the caller alone
// can finish them all, so a busy pool never blocks it); the caller then waits for the claimed.
template <typename Fn>
void RunTasks(ffi::ThreadPool& pool, int64_t tasks, Fn fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto st = std::make_shared<State>();
  auto drain = [st, tasks, fn] {
    for (int64_t i; (i = st->next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      fn(i);
      st->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 0), tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([drain] { drain(); });
  drain();
  while (st->done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
}

bool Dims4(ffi::Span<const int64_t> d, int64_t a, int64_t b, int64_t c, int64_t e) {
  return d.size() == 4 && d[0] == a && d[1] == b && d[2] == c && d[3] == e;
}

bool Dims5(ffi::Span<const int64_t> d, const Dims& n) {
  return d.size() == 5 && d[0] == n.B && d[1] == n.KV && d[2] == n.G && d[3] == n.T && d[4] == n.D;
}

ffi::Error CheckCommon(const Dims& n, ffi::Span<const int64_t> kt, ffi::Span<const int64_t> mask) {
  if (n.T % 16 != 0 || n.D % 16 != 0)
    return ffi::Error::InvalidArgument("causal_attention: T and D must be multiples of 16");
  if (!Dims4(kt, n.B, n.KV, n.D, n.T))
    return ffi::Error::InvalidArgument("causal_attention: kt must be [B, KV, D, T]");
  if (mask.size() != 3 || mask[0] != n.B || mask[1] != n.T || mask[2] != n.T)
    return ffi::Error::InvalidArgument("causal_attention: mask must be [B, T, T]");
  return ffi::Error::Success();
}

constexpr int64_t kQueryChunk = 128;  // queries per forward task

// Every block's KeyRange, [B, T / kR], from the mask rows (memchr: the scan up to a later
// segment's first key is a few bytes a cycle). Once per call: every head reads the same mask.
std::vector<KeyRange> KeyRanges(const bool* mask, int64_t B, int64_t T) {
  std::vector<KeyRange> out(B * (T / kR));
  for (int64_t b = 0; b < B; ++b) {
    const bool* m = mask + b * T * T;
    for (int64_t t0 = 0; t0 < T; t0 += kR) {
      const int64_t end = std::min<int64_t>(T, (t0 + kR + 15) / 16 * 16);
      int64_t first = end;
      for (int r = 0; r < kR; ++r) {
        const bool* row = m + (t0 + r) * T;
        const void* hit = std::memchr(row, 1, std::min(first, t0 + r + 1));
        if (hit) first = static_cast<const bool*>(hit) - row;
      }
      out[b * (T / kR) + t0 / kR] = first >= end ? KeyRange{end, end, end} : KeyRange{first / 16 * 16, end, first};
    }
  }
  return out;
}

// The backward's query spans [begin, end) of each row: cut between blocks where no later
// query sees a key before the cut (a packed row's segments, when they start at multiples of
// kR), merged into pieces of about `pieces`-th of the row's work (keys read), so that each
// piece alone writes its keys' dk / dv rows.
struct Span {
  int64_t b, begin, end;
};

std::vector<Span> Spans(const std::vector<KeyRange>& ranges, int64_t B, int64_t T, int64_t pieces) {
  std::vector<Span> out;
  const int64_t blocks = T / kR;
  std::vector<int64_t> reach(blocks + 1);   // reach[i]: the least j0 of the blocks i, i + 1, ...
  for (int64_t b = 0; b < B; ++b) {
    const KeyRange* rr = ranges.data() + b * blocks;
    reach[blocks] = T;
    int64_t work = 0;
    for (int64_t i = blocks - 1; i >= 0; --i) {
      reach[i] = std::min(reach[i + 1], rr[i].first);
      work += rr[i].j1 - rr[i].j0;
    }
    const int64_t target = std::max<int64_t>(1, work / std::max<int64_t>(pieces, 1));
    int64_t begin = 0, acc = 0;
    for (int64_t i = 0; i < blocks; ++i) {
      acc += rr[i].j1 - rr[i].j0;
      const int64_t cut = (i + 1) * kR;   // a cut after block i
      if (cut < T && reach[i + 1] >= cut && acc >= target) {
        out.push_back({b, begin, cut});
        begin = cut;
        acc = 0;
      }
    }
    out.push_back({b, begin, T});
  }
  return out;
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kt,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> o,
                       ffi::ResultBuffer<ffi::F32> lse) {
  auto qd = q.dimensions();
  if (qd.size() != 5) return ffi::Error::InvalidArgument("causal_attention: q must be [B, KV, G, T, D]");
  const Dims n{qd[0], qd[1], qd[2], qd[3], qd[4]};
  if (auto e = CheckCommon(n, kt.dimensions(), mask.dimensions()); e.failure()) return e;
  if (!Dims4(v.dimensions(), n.B, n.KV, n.T, n.D) || !Dims5(o->dimensions(), n) ||
      lse->dimensions().size() != 4 || lse->element_count() != n.B * n.KV * n.G * n.T)
    return ffi::Error::InvalidArgument("causal_attention: v [B, KV, T, D], o like q, lse [B, KV, G, T]");
  const int64_t chunks = (n.T + kQueryChunk - 1) / kQueryChunk;
  const float* qp = q.typed_data();
  const float* ktp = kt.typed_data();
  const float* vp = v.typed_data();
  const bool* mp = reinterpret_cast<const bool*>(mask.typed_data());
  float* op = o->typed_data();
  float* lp = lse->typed_data();
  auto ranges = std::make_shared<const std::vector<KeyRange>>(KeyRanges(mp, n.B, n.T));
  const KeyRange* rp = ranges->data();
  // later chunks first: they hold the most keys, so the tail of the queue is the short ones
  const auto forward = Chosen().forward;
  RunTasks(pool, n.B * n.KV * n.G * chunks, [n, chunks, qp, ktp, vp, mp, rp, ranges, op, lp, forward](int64_t i) {
    const int64_t c = chunks - 1 - i % chunks, rest = i / chunks;
    const int64_t g = rest % n.G, h = (rest / n.G) % n.KV, b = rest / (n.G * n.KV);
    forward(n, b, h, g, c * kQueryChunk, std::min(n.T, (c + 1) * kQueryChunk), qp, ktp, vp, mp, rp, op, lp);
  });
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kt,
                        ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> vt, ffi::Buffer<ffi::PRED> mask,
                        ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout,
                        ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dkp,
                        ffi::ResultBuffer<ffi::F32> dvp) {
  auto qd = q.dimensions();
  if (qd.size() != 5) return ffi::Error::InvalidArgument("causal_attention: q must be [B, KV, G, T, D]");
  const Dims n{qd[0], qd[1], qd[2], qd[3], qd[4]};
  if (auto e = CheckCommon(n, kt.dimensions(), mask.dimensions()); e.failure()) return e;
  if (!Dims4(k.dimensions(), n.B, n.KV, n.T, n.D) || !Dims4(vt.dimensions(), n.B, n.KV, n.D, n.T) ||
      !Dims5(o.dimensions(), n) || !Dims5(dout.dimensions(), n) || !Dims5(dq->dimensions(), n) ||
      !Dims5(dkp->dimensions(), n) || !Dims5(dvp->dimensions(), n) || lse.dimensions().size() != 4 ||
      lse.element_count() != n.B * n.KV * n.G * n.T)
    return ffi::Error::InvalidArgument(
        "causal_attention: k [B, KV, T, D], vt [B, KV, D, T], o / d_out / dq / dk / dv like q, lse [B, KV, G, T]");
  const float *qp = q.typed_data(), *ktp = kt.typed_data(), *kp = k.typed_data(), *vtp = vt.typed_data();
  const float *opp = o.typed_data(), *lp = lse.typed_data(), *dop = dout.typed_data();
  const bool* mp = reinterpret_cast<const bool*>(mask.typed_data());
  float *dqp = dq->typed_data(), *dkpp = dkp->typed_data(), *dvpp = dvp->typed_data();
  const auto backward = Chosen().backward;
  auto ranges = std::make_shared<const std::vector<KeyRange>>(KeyRanges(mp, n.B, n.T));
  const KeyRange* rp = ranges->data();
  // Enough pieces per row for every thread to have about four tasks, where the row allows.
  const int64_t heads = n.B * n.KV * n.G;
  const int64_t pieces = (4 * (std::max<int64_t>(pool.num_threads(), 0) + 1) + heads - 1) / heads;
  auto spans = std::make_shared<const std::vector<Span>>(Spans(*ranges, n.B, n.T, pieces));
  const int64_t per_head = static_cast<int64_t>(spans->size());   // spans of all rows
  RunTasks(pool, per_head * n.KV * n.G, [=, keep = ranges](int64_t i) {
    const Span& sp = (*spans)[i % per_head];
    const int64_t g = (i / per_head) % n.G, h = i / (per_head * n.G);
    backward(n, sp.b, h, g, sp.begin, sp.end, qp, ktp, kp, vtp, mp, rp, opp, lp, dop, dqp, dkpp, dvpp);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MarftCausalAttentionFwd, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // q [B, KV, G, T, D], scaled
                                  .Arg<ffi::Buffer<ffi::F32>>()     // kt [B, KV, D, T]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // v [B, KV, T, D]
                                  .Arg<ffi::Buffer<ffi::PRED>>()    // mask [B, T, T]
                                  .Ret<ffi::Buffer<ffi::F32>>()     // o [B, KV, G, T, D]
                                  .Ret<ffi::Buffer<ffi::F32>>());   // lse [B, KV, G, T]

XLA_FFI_DEFINE_HANDLER_SYMBOL(MarftCausalAttentionBwd, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // q [B, KV, G, T, D], scaled
                                  .Arg<ffi::Buffer<ffi::F32>>()     // kt [B, KV, D, T]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // k [B, KV, T, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // vt [B, KV, D, T]
                                  .Arg<ffi::Buffer<ffi::PRED>>()    // mask [B, T, T]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // o [B, KV, G, T, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // lse [B, KV, G, T]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // d_out [B, KV, G, T, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()     // dq [B, KV, G, T, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()     // dk per query head [B, KV, G, T, D]
                                  .Ret<ffi::Buffer<ffi::F32>>());   // dv per query head [B, KV, G, T, D]


#else  // MARFT_CAUSAL_ATTENTION_BODY: the kernel body, once per instruction set

// MARFT_LANES floats a vector (16: AVX-512, 8: AVX2, 4: SSE2 / NEON) and kC vectors a tile
// (the accumulators of 4 queries x kC vectors fit the register file: 32 zmm, 16 ymm / xmm).
constexpr int kW = MARFT_LANES;
constexpr int kC = kW == 16 ? 4 : 2;
constexpr int kTile = kW * kC;     // keys (or value columns) per tile
typedef float vf __attribute__((vector_size(4 * kW)));
typedef float vfu __attribute__((vector_size(4 * kW), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * kW)));
typedef int8_t vb __attribute__((vector_size(kW), aligned(1)));

__attribute__((always_inline)) inline vf Load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
__attribute__((always_inline)) inline void Store(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }
__attribute__((always_inline)) inline vf Splat(float x) { return (vf){} + x; }

// kW mask bytes (bool) as lanes: -1 where true, 0 where false.
__attribute__((always_inline)) inline vi MaskLanes(const bool* m) {
  return __builtin_convertvector(*reinterpret_cast<const vb*>(m), vi) != 0;
}

// exp(x) for x <= ~0 (a softmax's shifted scores): 2^n * 2^f with f in [-1/2, 1/2], 2^f by its
// degree-6 Taylor polynomial (relative error < 2e-7); x below -87 gives ~0.
__attribute__((always_inline)) inline vf Exp(vf x) {
  const vf lo = Splat(-87.f), hi = Splat(88.f);   // masked lanes may hold anything: keep n in range
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf t = x * Splat(1.44269504088896341f);
  // n = t rounded to the nearest integer (half away from zero; the conversion truncates)
  const vi ni = __builtin_convertvector(t + (t < Splat(0.f) ? Splat(-0.5f) : Splat(0.5f)), vi);
  const vf f = (t - __builtin_convertvector(ni, vf)) * Splat(0.693147180559945309f);
  vf p = Splat(1.f / 720.f);
  p = p * f + Splat(1.f / 120.f);
  p = p * f + Splat(1.f / 24.f);
  p = p * f + Splat(1.f / 6.f);
  p = p * f + Splat(0.5f);
  p = p * f + Splat(1.f);
  p = p * f + Splat(1.f);
  const vi bits = (ni + 127) << 23;
  return p * (vf)bits;   // a vector cast reinterprets the bits
}

__attribute__((always_inline)) inline float HorizontalMax(vf x) {
  float m = x[0];
  for (int i = 1; i < kW; ++i) m = std::max(m, x[i]);
  return m;
}

__attribute__((always_inline)) inline float HorizontalSum(vf x) {
  float s = 0.f;
  for (int i = 0; i < kW; ++i) s += x[i];
  return s;
}

// out[r][j - j0] = sum_d a[r][d] * bt[d][j] for the kR rows of a (stride D) and keys
// j in [j0, j1) (j1 - j0 a multiple of 16); bt is [D, T]; out rows have stride T.
template <int NV>   // keys [j, j + NV * kW)
__attribute__((always_inline)) inline void RowsByColsTile(const float* a, const float* bt, int64_t T, int64_t D,
                                                          int64_t j, float* out) {
  vf c[kR][NV] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* br = bt + d * T + j;
    vf b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = Load(br + kW * v);
#pragma GCC unroll 4
    for (int r = 0; r < kR; ++r) {
      const vf x = Splat(a[r * D + d]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] += x * b[v];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) Store(out + r * T + kW * v, c[r][v]);
}

__attribute__((always_inline)) inline void RowsByCols(const float* a, const float* bt, int64_t T, int64_t D,
                                                      int64_t j0, int64_t j1, float* out) {
  int64_t j = j0;
  for (; j + kTile <= j1; j += kTile) RowsByColsTile<kC>(a, bt, T, D, j, out + (j - j0));
  for (; j < j1; j += kW) RowsByColsTile<1>(a, bt, T, D, j, out + (j - j0));
}

// out[r][:] = sum_{j in [j0, j1)} w[r][j - j0] * m[j][:] for kR rows of weights (stride T) and
// the rows of m ([T, D]); out rows have stride D.
template <int NV>   // columns [c0, c0 + NV * kW)
__attribute__((always_inline)) inline void WeightsByRowsTile(const float* w, const float* m, int64_t T, int64_t D,
                                                             int64_t j0, int64_t j1, int64_t c0, float* out) {
  vf acc[kR][NV] = {};
  for (int64_t j = j0; j < j1; ++j) {
    const float* mr = m + j * D + c0;
    vf mv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) mv[v] = Load(mr + kW * v);
#pragma GCC unroll 4
    for (int r = 0; r < kR; ++r) {
      const vf x = Splat(w[r * T + (j - j0)]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += x * mv[v];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) Store(out + r * D + c0 + kW * v, acc[r][v]);
}

__attribute__((always_inline)) inline void WeightsByRows(const float* w, const float* m, int64_t T, int64_t D,
                                                         int64_t j0, int64_t j1, float* out) {
  int64_t c0 = 0;
  for (; c0 + kTile <= D; c0 += kTile) WeightsByRowsTile<kC>(w, m, T, D, j0, j1, c0, out);
  for (; c0 < D; c0 += kW) WeightsByRowsTile<1>(w, m, T, D, j0, j1, c0, out);   // D is a multiple of kW
}

// acc[j][:] += sum_r w[r][j - j0] * x[r][:] for keys j in [j0, j1): the kR rows of x (stride
// D), weights with stride T, acc [T, D].
template <int NV>   // columns [c0, c0 + NV * kW)
__attribute__((always_inline)) inline void AddOuterTile(const float* w, const float* x, int64_t T, int64_t D,
                                                        int64_t j0, int64_t j1, int64_t c0, float* acc) {
  vf xs[kR][NV];
#pragma GCC unroll 4
  for (int r = 0; r < kR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) xs[r][v] = Load(x + r * D + c0 + kW * v);
  for (int64_t j = j0; j < j1; ++j) {
    float* ar = acc + j * D + c0;
    vf a[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) a[v] = Load(ar + kW * v);
#pragma GCC unroll 4
    for (int r = 0; r < kR; ++r) {
      const vf s = Splat(w[r * T + (j - j0)]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) a[v] += s * xs[r][v];
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) Store(ar + kW * v, a[v]);
  }
}

__attribute__((always_inline)) inline void AddOuter(const float* w, const float* x, int64_t T, int64_t D,
                                                    int64_t j0, int64_t j1, float* acc) {
  int64_t c0 = 0;
  for (; c0 + kTile <= D; c0 += kTile) AddOuterTile<kC>(w, x, T, D, j0, j1, c0, acc);
  for (; c0 < D; c0 += kW) AddOuterTile<1>(w, x, T, D, j0, j1, c0, acc);
}

// One task of the forward: queries [t_begin, t_end) of (row b, kv head h, query head g).
void ForwardTask(
    const Dims& n, int64_t b, int64_t h, int64_t g, int64_t t_begin, int64_t t_end, const float* q,
    const float* kt, const float* v, const bool* mask, const KeyRange* ranges, float* o, float* lse) {
  const int64_t T = n.T, D = n.D;
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(kR * T)) buf.resize(kR * T);
  float* s = buf.data();
  const int64_t bh = b * n.KV + h, row = bh * n.G + g;
  const float* qr = q + row * T * D;
  const float* ktr = kt + bh * D * T;
  const float* vr = v + bh * T * D;
  const bool* mr = mask + b * T * T;
  float* orow = o + row * T * D;
  float* lrow = lse + row * T;
  const KeyRange* rr = ranges + b * (T / kR);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kR) {
    const int64_t j0 = rr[t0 / kR].j0, j1 = rr[t0 / kR].j1;
    float inv[kR];
    if (j0 < j1) {
      RowsByCols(qr + t0 * D, ktr, T, D, j0, j1, s);
      for (int r = 0; r < kR; ++r) {
        float* sr = s + r * T;
        const bool* mk = mr + (t0 + r) * T + j0;
        const int64_t w = j1 - j0;
        vf vmax = Splat(kMasked);
        for (int64_t j = 0; j < w; j += kW) {
          const vf x = Load(sr + j);
          vmax = (MaskLanes(mk + j) != 0) & (x > vmax) ? x : vmax;
        }
        const float mx = HorizontalMax(vmax);
        vf vsum = {};
        for (int64_t j = 0; j < w; j += kW) {
          const vf e = MaskLanes(mk + j) != 0 ? Exp(Load(sr + j) - Splat(mx)) : Splat(0.f);
          Store(sr + j, e);
          vsum += e;
        }
        const float sum = HorizontalSum(vsum);
        const bool any = mx > 0.5f * kMasked && sum > 0.f;
        inv[r] = any ? 1.f / sum : 0.f;
        lrow[t0 + r] = any ? mx + logf(sum) : 0.f;
      }
      WeightsByRows(s, vr, T, D, j0, j1, orow + t0 * D);
      for (int r = 0; r < kR; ++r)
        for (int64_t d = 0; d < D; ++d) orow[(t0 + r) * D + d] *= inv[r];
    } else {
      std::memset(orow + t0 * D, 0, sizeof(float) * kR * D);
      for (int r = 0; r < kR; ++r) lrow[t0 + r] = 0.f;
    }
  }
}

// One task of the backward: the queries [t_begin, t_end) of (row b, kv head h, query head g),
// a span no other query sees into (Spans); writes dq for them and this query head's share of
// dk, dv over the span's keys (zeroed here).
void BackwardTask(
    const Dims& n, int64_t b, int64_t h, int64_t g, int64_t t_begin, int64_t t_end, const float* q,
    const float* kt, const float* k, const float* vt, const bool* mask, const KeyRange* ranges, const float* o,
    const float* lse, const float* dout, float* dq, float* dkp, float* dvp) {
  const int64_t T = n.T, D = n.D;
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(2 * kR * T)) buf.resize(2 * kR * T);
  float* p = buf.data();
  float* ds = p + kR * T;
  const int64_t bh = b * n.KV + h, row = bh * n.G + g;
  const float* qr = q + row * T * D;
  const float* orow = o + row * T * D;
  const float* dor = dout + row * T * D;
  const float* lrow = lse + row * T;
  const float* ktr = kt + bh * D * T;
  const float* kr = k + bh * T * D;
  const float* vtr = vt + bh * D * T;
  const bool* mr = mask + b * T * T;
  float* dqr = dq + row * T * D;
  float* dk = dkp + row * T * D;
  float* dv = dvp + row * T * D;
  std::memset(dk + t_begin * D, 0, sizeof(float) * (t_end - t_begin) * D);
  std::memset(dv + t_begin * D, 0, sizeof(float) * (t_end - t_begin) * D);
  const KeyRange* rr = ranges + b * (T / kR);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kR) {
    const int64_t j0 = rr[t0 / kR].j0, j1 = rr[t0 / kR].j1;
    if (j0 >= j1) {
      std::memset(dqr + t0 * D, 0, sizeof(float) * kR * D);
      continue;
    }
    const int64_t w = j1 - j0;
    RowsByCols(qr + t0 * D, ktr, T, D, j0, j1, p);       // scores
    RowsByCols(dor + t0 * D, vtr, T, D, j0, j1, ds);     // dP = dO V^T
    for (int r = 0; r < kR; ++r) {
      const int64_t t = t0 + r;
      float delta = 0.f;
      for (int64_t d = 0; d < D; ++d) delta += dor[t * D + d] * orow[t * D + d];
      const float l = lrow[t];
      const bool* mk = mr + t * T + j0;
      float* pr = p + r * T;
      float* dsr = ds + r * T;
      for (int64_t j = 0; j < w; j += kW) {
        const vf e = MaskLanes(mk + j) != 0 ? Exp(Load(pr + j) - Splat(l)) : Splat(0.f);
        Store(pr + j, e);
        Store(dsr + j, e * (Load(dsr + j) - Splat(delta)));
      }
    }
    WeightsByRows(ds, kr, T, D, j0, j1, dqr + t0 * D);   // dQ = dS K
    // dK += dS^T Q, dV += P^T dO over the keys these queries see: [first, t0 + kR)
    const int64_t a = rr[t0 / kR].first, e = std::min(j1, t0 + kR);
    AddOuter(ds + (a - j0), qr + t0 * D, T, D, a, e, dk);
    AddOuter(p + (a - j0), dor + t0 * D, T, D, a, e, dv);
  }
}


#endif  // MARFT_CAUSAL_ATTENTION_BODY