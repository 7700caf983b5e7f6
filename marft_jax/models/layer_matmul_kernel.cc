// A decode step's projection, y[M, N] = x[M, K] @ W[layer], reading the layer's [K, N] block
// where it lies in the stacked [L, K, N] weights (XLA FFI, CPU, float32).
//
// Inside the decoder's layer scan XLA:CPU copies each layer's weight slice out of the stack
// before its dot (a dynamic-slice fusion per weight and layer): at decode's few rows the step is
// bound by reading the weights, and the copy reads and writes every byte once more. This handler
// streams the block once. The work is cut into (column tile, row chunk) pieces: column tiles
// whose accumulators [M, tile] stay in L1 while four rows of W at a time stream past, and, when
// there are fewer tiles than threads (a 576-column projection is one tile), chunks of the K rows
// whose partial sums are added at the end. The caller and the intra-op pool's threads claim
// pieces from an atomic counter (the caller alone can finish them all, so a busy pool never
// blocks it); the caller then waits for the pieces a helper claimed.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 16;         // rows per pass over a tile of W
constexpr int64_t kAccFloats = 4096;     // accumulator floats per tile (16 KiB, in L1)

template <int kM>
constexpr int64_t TileCols() {
  return (kAccFloats / kM) / 16 * 16;
}

// y[m, n0:n1] = x[m, :K] @ w[:K, n0:n1] (x rows ldx apart, w and y rows N apart)
template <int kM>
__attribute__((target_clones("avx512f", "avx2", "default"))) void Tile(
    const float* x, int64_t ldx, int64_t K, const float* w, int64_t N, int64_t n0, int64_t n1, float* y) {
  constexpr int64_t kCols = TileCols<kM>();
  float acc[kM][kCols];
  const int64_t len = n1 - n0;
  for (int m = 0; m < kM; ++m)
    for (int64_t j = 0; j < len; ++j) acc[m][j] = 0.f;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const float* w0 = w + k * N + n0;
    const float* w1 = w0 + N;
    const float* w2 = w1 + N;
    const float* w3 = w2 + N;
    float c[kM][4];
    for (int m = 0; m < kM; ++m)
      for (int u = 0; u < 4; ++u) c[m][u] = x[m * ldx + k + u];
    // rows of x innermost: each vector of W is loaded once for all kM rows (a one-call 100 MB
    // block streams at ~22 GB/s this way, ~16 GB/s with the rows outermost)
    for (int64_t j = 0; j < len; ++j) {
      const float a0 = w0[j], a1 = w1[j], a2 = w2[j], a3 = w3[j];
#pragma GCC unroll 16
      for (int m = 0; m < kM; ++m) acc[m][j] += c[m][0] * a0 + c[m][1] * a1 + c[m][2] * a2 + c[m][3] * a3;
    }
  }
  for (; k < K; ++k) {
    const float* w0 = w + k * N + n0;
    for (int m = 0; m < kM; ++m) {
      const float c = x[m * ldx + k];
      float* a = acc[m];
      for (int64_t j = 0; j < len; ++j) a[j] += c * w0[j];
    }
  }
  for (int m = 0; m < kM; ++m)
    for (int64_t j = 0; j < len; ++j) y[m * N + n0 + j] = acc[m][j];
}

using TileFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, float*);

template <int kM>
constexpr TileFn TileFor() { return &Tile<kM>; }

constexpr TileFn kTiles[kMaxRows + 1] = {
    nullptr, TileFor<1>(), TileFor<2>(), TileFor<3>(), TileFor<4>(), TileFor<5>(), TileFor<6>(),
    TileFor<7>(), TileFor<8>(), TileFor<9>(), TileFor<10>(), TileFor<11>(), TileFor<12>(),
    TileFor<13>(), TileFor<14>(), TileFor<15>(), TileFor<16>()};

template <int kM>
constexpr int64_t ColsFor() { return TileCols<kM>(); }

constexpr int64_t kCols[kMaxRows + 1] = {
    0, ColsFor<1>(), ColsFor<2>(), ColsFor<3>(), ColsFor<4>(), ColsFor<5>(), ColsFor<6>(),
    ColsFor<7>(), ColsFor<8>(), ColsFor<9>(), ColsFor<10>(), ColsFor<11>(), ColsFor<12>(),
    ColsFor<13>(), ColsFor<14>(), ColsFor<15>(), ColsFor<16>()};

// The tiles of one call, claimed by the caller and its helpers (shared: a helper that starts
// after the caller returned finds no tile left and touches nothing but this object).
struct Work {
  const float* x;
  const float* w;
  float* y;
  int64_t M, K, N, cols, tiles, chunk, chunks;
  TileFn tile;
  std::vector<float> partial;        // [chunks, M, N] when chunks > 1
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  int64_t pieces() const { return tiles * chunks; }

  void Drain() {
    for (int64_t p; (p = next.fetch_add(1, std::memory_order_relaxed)) < pieces();) {
      const int64_t n0 = (p % tiles) * cols, c = p / tiles, k0 = c * chunk;
      float* out = chunks > 1 ? partial.data() + c * M * N : y;
      tile(x + k0, K, std::min(K, k0 + chunk) - k0, w + k0 * N, N, n0, std::min(N, n0 + cols), out);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

constexpr int64_t kMinChunk = 128;   // rows of W per chunk at least (partial sums cost M x N each)

ffi::Error LayerMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::BufferR0<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1]) {
    return ffi::Error::InvalidArgument("layer_matmul: x must be [M, K] and w [L, K, N]");
  }
  const int64_t M = xd[0], K = xd[1], L = wd[0], N = wd[2];
  if (M < 1 || M > kMaxRows) return ffi::Error::InvalidArgument("layer_matmul: 1 <= M <= 16 rows");
  const int32_t li = *layer.typed_data();
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("layer_matmul: layer out of range");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data() + static_cast<int64_t>(li) * K * N;
  work->y = y->typed_data();
  work->M = M;
  work->K = K;
  work->N = N;
  work->cols = kCols[M];
  work->tiles = (N + work->cols - 1) / work->cols;
  work->tile = kTiles[M];
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 0) + 1;
  int64_t chunks = work->tiles >= threads ? 1 : (threads + work->tiles - 1) / work->tiles;
  chunks = std::max<int64_t>(1, std::min(chunks, K / kMinChunk));
  work->chunk = ((K + chunks - 1) / chunks + 3) / 4 * 4;
  work->chunks = (K + work->chunk - 1) / work->chunk;
  if (work->chunks > 1) work->partial.assign(work->chunks * M * N, 0.f);
  const int64_t helpers = std::min<int64_t>(threads - 1, work->pieces() - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->pieces()) std::this_thread::yield();
  if (work->chunks > 1) {
    float* out = y->typed_data();
    const float* part = work->partial.data();
    const int64_t size = M * N;
    for (int64_t i = 0; i < size; ++i) out[i] = part[i];
    for (int64_t c = 1; c < work->chunks; ++c)
      for (int64_t i = 0; i < size; ++i) out[i] += part[c * size + i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MarftLayerMatmul, LayerMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // w [L, K, N], the stack
                                  .Arg<ffi::BufferR0<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());   // y [M, N]
