// Decode attention over one layer of the stacked KV cache, read in place (XLA FFI, CPU).
//
// Inside the decoder's layer scan, XLA:CPU copies each layer's [B, KV, P, D] key and value
// slice out of the [L, B, KV, S, D] cache before attending to it; at 800-slot contexts those
// copies cost more than the attention. This handler takes the whole cache and the layer index
// and reads the layer's slots where they lie. It returns the softmax partials over the cached
// slots (max, sum of exponentials, exponential-weighted values); the caller folds in the new
// tokens' own keys (cache_attention.py beside this file).
//
// The (row, kv head) pairs are split over the caller and XLA's intra-op threads (at contexts of
// kMinSlotsPerHelper slots and more). Per (row, kv head), three passes over the P read slots: scores of the G queries (one key
// read serves all G), their max and exponentials, then the weighted sum of the values. Built
// with -ffast-math so that the dot products and expf vectorize (glibc's libmvec); masked slots
// score -1e30, whose exponential is 0, so no infinities are involved.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMasked = -1e30f;

// kD > 0: the head width is the compile-time constant kD (64, 128: unrolled and vectorized);
// kD == 0: the run-time width D (any other head size).
template <int kD>
inline void Head(const float* q, const float* k, const float* v, const bool* ok, int64_t P,
                 int64_t G, int64_t d_rt, float* scores, float* m, float* l, float* acc) {
  const int64_t D = kD > 0 ? kD : d_rt;
  for (int64_t s = 0; s < P; ++s) {
    const float* ks = k + s * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float d = 0.f;
      for (int j = 0; j < D; ++j) d += qg[j] * ks[j];
      scores[g * P + s] = ok[s] ? d : kMasked;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * P;
    float mx = kMasked;
    for (int64_t s = 0; s < P; ++s) mx = sg[s] > mx ? sg[s] : mx;
    float sum = 0.f;
    for (int64_t s = 0; s < P; ++s) {
      const float e = expf(sg[s] - mx);
      sg[s] = e;
      sum += e;
    }
    const bool any = mx > 0.5f * kMasked;
    m[g] = mx;
    l[g] = any ? sum : 0.f;
    for (int j = 0; j < D; ++j) acc[g * D + j] = 0.f;
  }
  for (int64_t s = 0; s < P; ++s) {
    if (!ok[s]) continue;
    const float* vs = v + s * D;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * P + s];
      float* a = acc + g * D;
      for (int j = 0; j < D; ++j) a[j] += p * vs[j];
    }
  }
}

// One (row, kv head) pair: bh = b * KV + h.
template <int kD>
__attribute__((target_clones("avx512f", "avx2", "default"))) void RunHead(
    int64_t bh, const float* q, const float* kc, const float* vc, const bool* ok, int64_t KV,
    int64_t G, int64_t S, int64_t P, int64_t D, float* m, float* l, float* acc) {
  thread_local std::vector<float> scores;
  if (scores.size() < static_cast<size_t>(G * P)) scores.resize(G * P);
  const int64_t b = bh / KV;
  Head<kD>(q + bh * G * D, kc + bh * S * D, vc + bh * S * D, ok + b * P, P, G, D,
           scores.data(), m + bh * G, l + bh * G, acc + bh * G * D);
}

using HeadFn = void (*)(int64_t, const float*, const float*, const float*, const bool*, int64_t, int64_t,
                        int64_t, int64_t, int64_t, float*, float*, float*);

// The B * KV (row, kv head) pairs of one call, claimed by the caller and the intra-op pool's
// threads from an atomic counter (the caller alone can finish them all, so a busy pool never
// blocks it); the caller then waits for the pairs a helper claimed.
struct Work {
  HeadFn head;
  const float *q, *kc, *vc;
  const bool* ok;
  int64_t KV, G, S, P, D, pairs;
  float *m, *l, *acc;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (int64_t bh; (bh = next.fetch_add(1, std::memory_order_relaxed)) < pairs;) {
      head(bh, q, kc, vc, ok, KV, G, S, P, D, m, l, acc);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

constexpr int64_t kMinSlotsPerHelper = 256;   // below this a pair is cheaper than waking a thread

ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> ok,
                              ffi::BufferR0<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> m,
                              ffi::ResultBuffer<ffi::F32> l, ffi::ResultBuffer<ffi::F32> acc) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto od = ok.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || od.size() != 2) {
    return ffi::Error::InvalidArgument("cache_attention: q must be rank 4, the cache rank 5, ok rank 2");
  }
  const int64_t B = qd[0], KV = qd[1], G = qd[2], D = qd[3];
  const int64_t L = kd[0], S = kd[3], P = od[1];
  if (kd[1] != B || kd[2] != KV || kd[4] != D || od[0] != B || P > S ||
      v.dimensions().size() != 5 || v.element_count() != k.element_count()) {
    return ffi::Error::InvalidArgument("cache_attention: q [B, KV, G, D], k/v [L, B, KV, S, D], ok [B, P <= S]");
  }
  const int32_t li = *layer.typed_data();
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("cache_attention: layer out of range");
  const int64_t off = static_cast<int64_t>(li) * B * KV * S * D;
  const bool* okp = reinterpret_cast<const bool*>(ok.typed_data());
  const float* kl = k.typed_data() + off;
  const float* vl = v.typed_data() + off;
  float* mo = m->typed_data();
  float* lo = l->typed_data();
  float* ao = acc->typed_data();
  auto work = std::make_shared<Work>();
  work->head = D == 64 ? &RunHead<64> : D == 128 ? &RunHead<128> : &RunHead<0>;
  work->q = q.typed_data();
  work->kc = kl;
  work->vc = vl;
  work->ok = okp;
  work->KV = KV;
  work->G = G;
  work->S = S;
  work->P = P;
  work->D = D;
  work->pairs = B * KV;
  work->m = mo;
  work->l = lo;
  work->acc = ao;
  const int64_t worth = P >= kMinSlotsPerHelper ? work->pairs - 1 : 0;
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 0), worth);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->pairs) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MarftCacheAttention, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // q [B, KV, G, D], scaled
                                  .Arg<ffi::Buffer<ffi::F32>>()     // k cache [L, B, KV, S, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // v cache [L, B, KV, S, D]
                                  .Arg<ffi::Buffer<ffi::PRED>>()    // ok [B, P]: slot readable
                                  .Arg<ffi::BufferR0<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()     // m [B, KV, G]
                                  .Ret<ffi::Buffer<ffi::F32>>()     // l [B, KV, G]
                                  .Ret<ffi::Buffer<ffi::F32>>());   // acc [B, KV, G, D]
