// Fused CPU kernel for the Bellman backups of marft_jax.rl.backups (XLA FFI): the whole
// backup (validity, link factors, bootstrap, masked reverse GAE) in one custom call, so the
// jitted program is this call alone and XLA runs it inline on the calling thread.
//
// Layout: token-shaped arrays are [S, B, N, K] row-major (step, batch, agent, token); one
// "response" is the K contiguous tokens of (s, b, i). A row (one sequence of decision points)
// is a list of responses visited in reverse execution order:
//   chained (MARFT):  row b,        responses (s, b, i) for s = S-1..0, i = N-1..0;
//   independent:      row b*N + i,  responses (s, b, i) for s = S-1..0.
// Per row the recurrence carries the next valid value nv (starts at v_end[row]) and the next
// advantage na (starts at 0); at a valid point p with link factor c_p:
//   delta_p = r_p + gamma c_p nv - v_p,   A_p = delta_p + gamma lam c_p na,
//   adv_p = A_p, ret_p = A_p + v_p, then nv = v_p, na = A_p;
// invalid points get adv = ret = 0 and leave the carry alone. c_p is the response's
// chunk link at its last valid token, 1 elsewhere.
//
// Per-response logic, mirroring backups.py (_prepare, _marft_chunk_links, _step_cuts,
// _row_end, independent_gae), with t_s = terminal_s & step_mask_s:
// * validity = dp_mask & step_mask; span = K' if the validity is the prefix k < K'
//   (right-padded, the layout contract; 0 for an unplayed step), else -1 (>= 1 valid point).
// * cuts_s = t_s | (no valid point in step s+1 & cuts_{s+1}), cuts_{S-1} = t_{S-1} ("step" =
//   the row's responses of step s: all N agents chained, the row's agent independent). The
//   last response of step s with a valid point gets c = 0 iff cuts_s.
// * reference_semantics (chained only, quirk #10): c = 0 also for agents i < N-1 with a valid
//   point at a step s >= 1 with t_{s-1}.
// * v_end = v_boot[row] iff the row's last played step s* exists and (reference_semantics ?
//   !t_{s*} : truncated_{s*} & !t_{s*}); else 0.
//
// * Link tables (second handler, MarftBackupLinked; team graphs, marft_jax.rl.topology): row b
//   visits its chunks c = s N + i in a given order (every chunk after its successor and skip
//   target) and keeps, per chunk and for the end C, the value, advantage and "not cut" flag
//   seen at that link target: a chunk with a valid point stores its first valid point's
//   (V, A) and 1; an empty one forwards its skip target's, with the flag cleared if the skip
//   leaves a terminal step. A chunk with a valid point starts its response from its
//   successor's entry (c = 0 if that flag is clear or the successor link leaves a terminal
//   step). The end holds (v_end, 0, 1).
//
// Prefix responses take a vectorised path that never reads the mask or anything past the last
// valid token (pads may hold NaN); any other response takes a scalar path that selects on the
// mask point by point.
//
// The vectorised path, for a response of length L, works on blocks of W tokens (W = 16 with
// AVX-512F, 8 with AVX2+FMA, else 4; picked at run time, capped by the max_width attribute,
// so the library itself is built without -march).
// Inside a block the deltas are exact from the block's own tokens and the in-block suffix sum
// y_i = sum_{t>=i} gl^(t-i) d_t (gl = gamma lam) is a log-step shift scan in registers.
// * Head block [m, L), m = W floor((L-1)/W), holds the last valid token. Its link term
//   x = c (gamma nv + gl na) enters linearly: A_k = y_k + gl^(L-1-k) x, with y computed
//   without it, so the carry from the previous response feeds only one FMA per lane.
// * Full blocks from m down to 0: A = y + gl^(W-i) A_next. The carry A_next is the only
//   serial dependency; it advances U blocks per scalar FMA (a' = gl^(UW) a + Horner sum of
//   the U block heads, computed off the chain).

#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#define MARFT_INLINE inline __attribute__((always_inline))

typedef float v4f __attribute__((vector_size(16)));
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#if defined(__clang__)
#define MARFT_SHUFFLE4(x, a, b, c, d) __builtin_shufflevector(x, x, a, b, c, d)
#define MARFT_SHUFFLE8(x, a, b, c, d, e, f, g, h) __builtin_shufflevector(x, x, a, b, c, d, e, f, g, h)
#define MARFT_SHUFFLE16(x, ...) __builtin_shufflevector(x, x, __VA_ARGS__)
#else
#define MARFT_SHUFFLE4(x, a, b, c, d) __builtin_shuffle(x, v4i{a, b, c, d})
#define MARFT_SHUFFLE8(x, a, b, c, d, e, f, g, h) __builtin_shuffle(x, v8i{a, b, c, d, e, f, g, h})
#define MARFT_SHUFFLE16(x, ...) __builtin_shuffle(x, v16i{__VA_ARGS__})
#endif

// In-block suffix scan y_i = sum_{t >= i} g^(t - i) d_t. coef[j] holds g^(2^j) on the lanes
// that have a partner 2^j to the right and 0 on the others (the shuffles' top lanes repeat the
// last lane; the zero coefficient drops them).
template <class V>
struct Scan;

template <>
struct Scan<v4f> {
  static constexpr int kWidth = 4;
  static MARFT_INLINE v4f Next(v4f y) { return MARFT_SHUFFLE4(y, 1, 2, 3, 3); }
  static MARFT_INLINE v4f Run(v4f y, const v4f* coef) {
    y += coef[0] * MARFT_SHUFFLE4(y, 1, 2, 3, 3);
    y += coef[1] * MARFT_SHUFFLE4(y, 2, 3, 3, 3);
    return y;
  }
};

template <>
struct Scan<v8f> {
  static constexpr int kWidth = 8;
  static MARFT_INLINE v8f Next(v8f y) { return MARFT_SHUFFLE8(y, 1, 2, 3, 4, 5, 6, 7, 7); }
  static MARFT_INLINE v8f Run(v8f y, const v8f* coef) {
    y += coef[0] * MARFT_SHUFFLE8(y, 1, 2, 3, 4, 5, 6, 7, 7);
    y += coef[1] * MARFT_SHUFFLE8(y, 2, 3, 4, 5, 6, 7, 7, 7);
    y += coef[2] * MARFT_SHUFFLE8(y, 4, 5, 6, 7, 7, 7, 7, 7);
    return y;
  }
};

template <>
struct Scan<v16f> {
  static constexpr int kWidth = 16;
  static MARFT_INLINE v16f Next(v16f y) {
    return MARFT_SHUFFLE16(y, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 15);
  }
  static MARFT_INLINE v16f Run(v16f y, const v16f* coef) {
    y += coef[0] * MARFT_SHUFFLE16(y, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 15);
    y += coef[1] * MARFT_SHUFFLE16(y, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 15, 15);
    y += coef[2] * MARFT_SHUFFLE16(y, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 15, 15, 15, 15);
    y += coef[3] * MARFT_SHUFFLE16(y, 8, 9, 10, 11, 12, 13, 14, 15, 15, 15, 15, 15, 15, 15, 15, 15);
    return y;
  }
};

template <class V>
MARFT_INLINE V Load(const float* p) {
  V x;
  std::memcpy(&x, p, sizeof(V));
  return x;
}

template <class V>
MARFT_INLINE void Store(float* p, V x) {
  std::memcpy(p, &x, sizeof(V));
}

// Blocks per step of the carry chain in the full-block loop (4 spills registers at W = 8;
// 1, 2 and 4 measured within noise of each other at the benchmark's shape).
constexpr int kUnroll = 2;

// Per-call constants of the vectorised path (gl = gamma * lam). Powers in double (repeated
// products, no pow: built once per Solve call), then rounded.
template <class V>
struct Consts {
  static constexpr int W = Scan<V>::kWidth;
  V gamma;             // broadcast gamma
  V coef[4];           // scan coefficients, see Scan
  V tail_pow;          // lane i: gl^(W - i), weight of the next block's first advantage
  V head_pow[W];       // [t] lane i: gl^(t - i) for i <= t, else 0 (link term, head block)
  V iota;              // lane i: i
  V not_top;           // 1, ..., 1, 0
  float gl_w[kUnroll + 1];  // gl^(W u)

  Consts(float g, float gl) : gamma(), coef(), tail_pow(), head_pow(), iota(), not_top() {
    double powers[W * kUnroll + 1];
    powers[0] = 1.0;
    for (int e = 1; e <= W * kUnroll; ++e) powers[e] = powers[e - 1] * gl;
    const auto pw = [&powers](int e) { return static_cast<float>(powers[e]); };
    for (int j = 0; (1 << j) < W; ++j) {
      for (int i = 0; i < W; ++i) coef[j][i] = (i + (1 << j) < W) ? pw(1 << j) : 0.f;
    }
    for (int i = 0; i < W; ++i) {
      gamma[i] = g;
      tail_pow[i] = pw(W - i);
      iota[i] = static_cast<float>(i);
      not_top[i] = i + 1 < W ? 1.f : 0.f;
      for (int t = 0; t < W; ++t) head_pow[t][i] = i <= t ? pw(t - i) : 0.f;
    }
    for (int u = 0; u <= kUnroll; ++u) gl_w[u] = pw(W * u);
  }
};

// Everything one call needs; pointers into XLA's buffers.
struct Problem {
  const float* r;
  const float* v;
  const bool* mask;         // dp_mask [S, B, N, K]
  const bool* step_mask;    // [S, B]
  const bool* terminal;     // [S, B]
  const bool* truncated;    // [S, B]
  const float* v_boot;      // [rows]
  float* adv;
  float* ret;
  int64_t S, B, N, K;
  float gamma, gl;
  bool independent;
  bool reference_semantics;
  int width;                // vector width of the prefix path (PickWidth)
  const int32_t* table = nullptr;   // [4, S N]: order, succ, skip, crossing flags (linked only)
};

// Valid-prefix length of a played response's K mask bytes: K' if the valid tokens are exactly
// k < K', else -1 (then it has >= 1 valid token).
MARFT_INLINE int64_t Span(const bool* mask, int64_t K) {
  const unsigned char* x = reinterpret_cast<const unsigned char*>(mask);
  const void* zero = std::memchr(x, 0, static_cast<size_t>(K));
  const int64_t len = zero ? static_cast<const unsigned char*>(zero) - x : K;
  unsigned char rest = 0;
  for (int64_t k = len; k < K; ++k) rest |= x[k];
  return rest ? -1 : len;
}

// V of the row's virtual end point (see the header).
MARFT_INLINE float EndValue(const Problem& p, int64_t b, int64_t row) {
  int64_t s_star = -1;
  for (int64_t s = p.S - 1; s >= 0; --s) {
    if (p.step_mask[s * p.B + b]) {
      s_star = s;
      break;
    }
  }
  if (s_star < 0) return 0.f;
  const int64_t sb = s_star * p.B + b;
  const bool boot = !p.terminal[sb] && (p.reference_semantics || p.truncated[sb]);
  return boot ? p.v_boot[row] : 0.f;
}

// Any mask: select point by point (invalid entries are never combined arithmetically).
MARFT_INLINE void ResponseMasked(const Problem& p, int64_t off, float c, float& nv, float& na) {
  const float *r = p.r + off, *v = p.v + off;
  const bool* u = p.mask + off;
  float *adv = p.adv + off, *ret = p.ret + off;
  for (int64_t k = p.K - 1; k >= 0; --k) {
    if (u[k]) {
      const float delta = r[k] + p.gamma * c * nv - v[k];
      const float a = delta + p.gl * c * na;
      adv[k] = a;
      ret[k] = a + v[k];
      nv = v[k];
      na = a;
      c = 1.f;
    } else {
      adv[k] = 0.f;
      ret[k] = 0.f;
    }
  }
}

// Head block [m, L), 1 <= L - m <= W: writes its advantages/returns (and zeros up to the
// block's end), returns A_m. Pads are never combined: lanes >= L - m are selected to 0.
template <class V>
MARFT_INLINE float HeadBlock(const Problem& p, const Consts<V>& cs, const float* r,
                             const float* v, float* adv, float* ret, int64_t m, int64_t L,
                             float x) {
  constexpr int W = Consts<V>::W;
  const int h = static_cast<int>(L - m);
  const bool full = m + W <= p.K;        // a whole vector fits inside the response
  V rr, vv;
  if (full) {
    const auto lane = cs.iota < static_cast<float>(h);
    const V zero = {};
    rr = lane ? Load<V>(r + m) : zero;
    vv = lane ? Load<V>(v + m) : zero;
  } else {
    float br[W] = {}, bv[W] = {};
    for (int i = 0; i < h; ++i) {
      br[i] = r[m + i];
      bv[i] = v[m + i];
    }
    rr = Load<V>(br);
    vv = Load<V>(bv);
  }
  // Lane h-1 gets r - v (its successor lane is 0; the link term is x), lanes >= h get 0.
  const V d = rr + cs.gamma * (Scan<V>::Next(vv) * cs.not_top) - vv;
  const V y = Scan<V>::Run(d, cs.coef);
  const V out = y + cs.head_pow[h - 1] * x;
  const V rt = out + vv;
  if (full) {
    Store<V>(adv + m, out);
    Store<V>(ret + m, rt);
  } else {
    for (int i = 0; i < h; ++i) {
      adv[m + i] = out[i];
      ret[m + i] = rt[i];
    }
  }
  return y[0] + cs.head_pow[h - 1][0] * x;     // == out[0]
}

// Full blocks [0, m): every token's successor is valid. a: A_m; returns A_0.
template <class V>
MARFT_INLINE float FullBlocks(const Consts<V>& cs, const float* r, const float* v, float* adv,
                              float* ret, int64_t m, float a) {
  constexpr int W = Consts<V>::W;
  int64_t k0 = m;
  for (; k0 >= kUnroll * W; k0 -= kUnroll * W) {
    V y[kUnroll], vv[kUnroll];
    // A right after block u is head[u] + gl^(W u) a: a Horner sum of the block heads y[.][0]
    // that does not depend on a, so only the last line below is on the carry chain.
    float head[kUnroll + 1];
    head[0] = 0.f;
    for (int u = 0; u < kUnroll; ++u) {          // block u: [k0 - (u+1) W, k0 - u W)
      const int64_t b = k0 - (u + 1) * W;
      vv[u] = Load<V>(v + b);
      y[u] = Scan<V>::Run(Load<V>(r + b) + cs.gamma * Load<V>(v + b + 1) - vv[u], cs.coef);
      head[u + 1] = y[u][0] + cs.gl_w[1] * head[u];
    }
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t b = k0 - (u + 1) * W;
      const V out = y[u] + cs.tail_pow * (head[u] + cs.gl_w[u] * a);
      Store<V>(adv + b, out);
      Store<V>(ret + b, out + vv[u]);
    }
    a = head[kUnroll] + cs.gl_w[kUnroll] * a;
  }
  for (k0 -= W; k0 >= 0; k0 -= W) {
    const V vv = Load<V>(v + k0);
    const V y = Scan<V>::Run(Load<V>(r + k0) + cs.gamma * Load<V>(v + k0 + 1) - vv, cs.coef);
    const V out = y + cs.tail_pow * a;
    Store<V>(adv + k0, out);
    Store<V>(ret + k0, out + vv);
    a = y[0] + cs.gl_w[1] * a;     // == out[0], kept off the vector path's latency
  }
  return a;
}

// Valid points exactly k < L (L >= 0).
template <class V>
MARFT_INLINE void ResponsePrefix(const Problem& p, const Consts<V>& cs, int64_t off, int64_t L,
                                 float c, float& nv, float& na) {
  constexpr int W = Consts<V>::W;
  const float *r = p.r + off, *v = p.v + off;
  float *adv = p.adv + off, *ret = p.ret + off;
  const int64_t m = L > 0 ? ((L - 1) / W) * W : 0;
  // The head block writes zeros for its own lanes >= L when it is a whole vector.
  const int64_t zero_from = L == 0 ? 0 : (m + W <= p.K ? m + W : L);
  if (zero_from < p.K) {
    std::memset(adv + zero_from, 0, sizeof(float) * (p.K - zero_from));
    std::memset(ret + zero_from, 0, sizeof(float) * (p.K - zero_from));
  }
  if (L == 0) return;
  const float x = c * (p.gamma * nv + p.gl * na);      // link term at the last valid token
  const float a = HeadBlock<V>(p, cs, r, v, adv, ret, m, L, x);
  na = FullBlocks<V>(cs, r, v, adv, ret, m, a);
  nv = v[0];
}

template <class V>
MARFT_INLINE void SolveRows(const Problem& p, int64_t row0, int64_t row1) {
  const Consts<V> cs(p.gamma, p.gl);
  const int64_t agents = p.independent ? 1 : p.N;
  const bool quirk = p.reference_semantics && !p.independent;
  for (int64_t row = row0; row < row1; ++row) {
    const int64_t b = p.independent ? row / p.N : row;
    const int64_t first_agent = p.independent ? row % p.N : 0;
    float nv = EndValue(p, b, row), na = 0.f;
    bool pending = false;              // no valid point in step s+1 and cuts_{s+1}
    for (int64_t s = p.S - 1; s >= 0; --s) {
      const int64_t sb = s * p.B + b;
      const bool played = p.step_mask[sb];
      const bool cut = (played && p.terminal[sb]) || pending;      // cuts_s
      const bool after_terminal =
          quirk && s >= 1 && p.step_mask[sb - p.B] && p.terminal[sb - p.B];
      bool seen = false;               // a later response of this step has a valid point
      for (int64_t j = agents - 1; j >= 0; --j) {
        const int64_t agent = first_agent + j;
        const int64_t idx = sb * p.N + agent;
        const int64_t len = played ? Span(p.mask + idx * p.K, p.K) : 0;
        float c = 1.f;
        if (len != 0) {
          if (!seen && cut) c = 0.f;
          if (after_terminal && agent < p.N - 1) c = 0.f;
          seen = true;
        }
        if (len >= 0) {
          ResponsePrefix<V>(p, cs, idx * p.K, len, c, nv, na);
        } else {
          ResponseMasked(p, idx * p.K, c, nv, na);
        }
      }
      pending = cut && !seen;
    }
  }
}

// Link-table rows (see the header): chained rows b, chunks visited in the table's order.
template <class V>
MARFT_INLINE void SolveRowsLinked(const Problem& p, int64_t row0, int64_t row1) {
  const Consts<V> cs(p.gamma, p.gl);
  const int64_t C = p.S * p.N;
  const int32_t *order = p.table, *succ = p.table + C, *skip = p.table + 2 * C,
                *flags = p.table + 3 * C;
  std::vector<float> v_in(C + 1), a_in(C + 1);
  std::vector<unsigned char> keep(C + 1);
  for (int64_t row = row0; row < row1; ++row) {
    const int64_t b = row;
    v_in[C] = EndValue(p, b, row);
    a_in[C] = 0.f;
    keep[C] = 1;
    for (int64_t t = 0; t < C; ++t) {
      const int64_t d = order[t], s = d / p.N, sb = s * p.B + b;
      const int64_t idx = sb * p.N + d % p.N;
      const bool played = p.step_mask[sb];
      const bool term = played && p.terminal[sb];
      const int64_t len = played ? Span(p.mask + idx * p.K, p.K) : 0;
      if (len == 0) {
        ResponsePrefix<V>(p, cs, idx * p.K, 0, 0.f, v_in[d], a_in[d]);   // zeros the outputs
        const int64_t e = skip[d];
        v_in[d] = v_in[e];
        a_in[d] = a_in[e];
        keep[d] = keep[e] && !(term && (flags[d] & 2));
        continue;
      }
      const int64_t e = succ[d];
      float nv = v_in[e], na = a_in[e];
      const float c = keep[e] && !(term && (flags[d] & 1)) ? 1.f : 0.f;
      if (len > 0) {
        ResponsePrefix<V>(p, cs, idx * p.K, len, c, nv, na);
      } else {
        ResponseMasked(p, idx * p.K, c, nv, na);
      }
      v_in[d] = nv;
      a_in[d] = na;
      keep[d] = 1;
    }
  }
}

// One instantiation per vector width, each compiled for its instruction set and picked at run
// time (the library itself is built for the baseline ISA).
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx512f,avx2,fma"), flatten)) void SolveRows16(const Problem& p,
                                                                      int64_t r0, int64_t r1) {
  if (p.table) return SolveRowsLinked<v16f>(p, r0, r1);
  SolveRows<v16f>(p, r0, r1);
}

__attribute__((target("avx2,fma"), flatten)) void SolveRows8(const Problem& p, int64_t r0,
                                                             int64_t r1) {
  if (p.table) return SolveRowsLinked<v8f>(p, r0, r1);
  SolveRows<v8f>(p, r0, r1);
}
#endif

__attribute__((flatten)) void SolveRows4(const Problem& p, int64_t r0, int64_t r1) {
  if (p.table) return SolveRowsLinked<v4f>(p, r0, r1);
  SolveRows<v4f>(p, r0, r1);
}

// The widest supported width <= max_width (0: no limit); 4 is always available.
int PickWidth(int32_t max_width) {
  const int limit = max_width > 0 ? max_width : 16;
#if defined(__x86_64__) || defined(__i386__)
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (limit >= 16 && avx512) return 16;
  if (limit >= 8 && avx2) return 8;
#endif
  return 4;
}

void Solve(const Problem& p, int64_t row0, int64_t row1) {
#if defined(__x86_64__) || defined(__i386__)
  if (p.width == 16) return SolveRows16(p, row0, row1);
  if (p.width == 8) return SolveRows8(p, row0, row1);
#endif
  SolveRows4(p, row0, row1);
}

bool SameDims(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Handler.

ffi::Error BackupImpl(ffi::Buffer<ffi::F32> reward, ffi::Buffer<ffi::F32> value,
                      ffi::Buffer<ffi::PRED> dp, ffi::Buffer<ffi::PRED> step_mask,
                      ffi::Buffer<ffi::PRED> terminal, ffi::Buffer<ffi::PRED> truncated,
                      ffi::Buffer<ffi::F32> v_boot, ffi::BufferR0<ffi::F32> gamma,
                      ffi::BufferR0<ffi::F32> lam, int32_t independent,
                      int32_t reference_semantics, int32_t max_width,
                      ffi::ResultBuffer<ffi::F32> adv, ffi::ResultBuffer<ffi::F32> ret) {
  const auto d = value.dimensions();
  if (d.size() != 4) return ffi::Error::InvalidArgument("backup: value must be [S, B, N, K]");
  if (!SameDims(reward.dimensions(), d) || !SameDims(dp.dimensions(), d) ||
      !SameDims(adv->dimensions(), d) || !SameDims(ret->dimensions(), d)) {
    return ffi::Error::InvalidArgument("backup: reward, dp_mask and outputs must match value");
  }
  const int64_t S = d[0], B = d[1], N = d[2], K = d[3];
  const int64_t per_step[2] = {S, B};
  const ffi::Span<const int64_t> sb(per_step, 2);
  if (!SameDims(step_mask.dimensions(), sb) || !SameDims(terminal.dimensions(), sb) ||
      !SameDims(truncated.dimensions(), sb)) {
    return ffi::Error::InvalidArgument("backup: step_mask, terminal, truncated must be [S, B]");
  }
  const int64_t rows = independent ? B * N : B;
  const auto ed = v_boot.dimensions();
  if (ed.size() != 1 || ed[0] != rows) {
    return ffi::Error::InvalidArgument(
        "backup: v_boot must be [B] (chained) or [B*N] (independent)");
  }
  const float g = *gamma.typed_data();
  const Problem p{reward.typed_data(), value.typed_data(), dp.typed_data(),
                  step_mask.typed_data(), terminal.typed_data(), truncated.typed_data(),
                  v_boot.typed_data(), adv->typed_data(), ret->typed_data(),
                  S, B, N, K, g, g * *lam.typed_data(), independent != 0,
                  reference_semantics != 0, PickWidth(max_width)};
  Solve(p, 0, rows);
  return ffi::Error::Success();
}

// The chained backup along a link table (MarftBackupLinked): table [4, S N] int32 as in the
// header; rows are the batch rows (v_boot [B]).
ffi::Error BackupLinkedImpl(ffi::Buffer<ffi::F32> reward, ffi::Buffer<ffi::F32> value,
                            ffi::Buffer<ffi::PRED> dp, ffi::Buffer<ffi::PRED> step_mask,
                            ffi::Buffer<ffi::PRED> terminal, ffi::Buffer<ffi::PRED> truncated,
                            ffi::Buffer<ffi::F32> v_boot, ffi::Buffer<ffi::S32> table,
                            ffi::BufferR0<ffi::F32> gamma, ffi::BufferR0<ffi::F32> lam,
                            int32_t max_width, ffi::ResultBuffer<ffi::F32> adv,
                            ffi::ResultBuffer<ffi::F32> ret) {
  const auto d = value.dimensions();
  if (d.size() != 4) return ffi::Error::InvalidArgument("backup: value must be [S, B, N, K]");
  if (!SameDims(reward.dimensions(), d) || !SameDims(dp.dimensions(), d) ||
      !SameDims(adv->dimensions(), d) || !SameDims(ret->dimensions(), d)) {
    return ffi::Error::InvalidArgument("backup: reward, dp_mask and outputs must match value");
  }
  const int64_t S = d[0], B = d[1], N = d[2], K = d[3];
  const int64_t per_step[2] = {S, B};
  const ffi::Span<const int64_t> sb(per_step, 2);
  if (!SameDims(step_mask.dimensions(), sb) || !SameDims(terminal.dimensions(), sb) ||
      !SameDims(truncated.dimensions(), sb)) {
    return ffi::Error::InvalidArgument("backup: step_mask, terminal, truncated must be [S, B]");
  }
  const auto ed = v_boot.dimensions();
  if (ed.size() != 1 || ed[0] != B) {
    return ffi::Error::InvalidArgument("backup: v_boot must be [B] with a link table");
  }
  const int64_t C = S * N;
  const int64_t table_dims[2] = {4, C};
  if (!SameDims(table.dimensions(), ffi::Span<const int64_t>(table_dims, 2))) {
    return ffi::Error::InvalidArgument("backup: the link table must be [4, S*N] int32");
  }
  const int32_t* t = table.typed_data();
  for (int64_t c = 0; c < C; ++c) {
    if (t[c] < 0 || t[c] >= C || t[C + c] < 0 || t[C + c] > C || t[2 * C + c] < 0 ||
        t[2 * C + c] > C) {
      return ffi::Error::InvalidArgument("backup: link table index out of range");
    }
  }
  const float g = *gamma.typed_data();
  Problem p{reward.typed_data(), value.typed_data(), dp.typed_data(),
            step_mask.typed_data(), terminal.typed_data(), truncated.typed_data(),
            v_boot.typed_data(), adv->typed_data(), ret->typed_data(),
            S, B, N, K, g, g * *lam.typed_data(), false, false, PickWidth(max_width)};
  p.table = t;
  Solve(p, 0, B);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MarftBackup, BackupImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // reward [S, B, N, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // value [S, B, N, K]
                                  .Arg<ffi::Buffer<ffi::PRED>>()    // dp_mask [S, B, N, K]
                                  .Arg<ffi::Buffer<ffi::PRED>>()    // step_mask [S, B]
                                  .Arg<ffi::Buffer<ffi::PRED>>()    // terminal [S, B]
                                  .Arg<ffi::Buffer<ffi::PRED>>()    // truncated [S, B]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // v_boot [rows]
                                  .Arg<ffi::BufferR0<ffi::F32>>()   // gamma
                                  .Arg<ffi::BufferR0<ffi::F32>>()   // lam
                                  .Attr<int32_t>("independent")
                                  .Attr<int32_t>("reference_semantics")
                                  .Attr<int32_t>("max_width")       // 0: widest supported
                                  .Ret<ffi::Buffer<ffi::F32>>()     // advantages
                                  .Ret<ffi::Buffer<ffi::F32>>());   // returns

XLA_FFI_DEFINE_HANDLER_SYMBOL(MarftBackupLinked, BackupLinkedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // reward [S, B, N, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // value [S, B, N, K]
                                  .Arg<ffi::Buffer<ffi::PRED>>()    // dp_mask [S, B, N, K]
                                  .Arg<ffi::Buffer<ffi::PRED>>()    // step_mask [S, B]
                                  .Arg<ffi::Buffer<ffi::PRED>>()    // terminal [S, B]
                                  .Arg<ffi::Buffer<ffi::PRED>>()    // truncated [S, B]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // v_boot [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()     // link table [4, S*N]
                                  .Arg<ffi::BufferR0<ffi::F32>>()   // gamma
                                  .Arg<ffi::BufferR0<ffi::F32>>()   // lam
                                  .Attr<int32_t>("max_width")       // 0: widest supported
                                  .Ret<ffi::Buffer<ffi::F32>>()     // advantages
                                  .Ret<ffi::Buffer<ffi::F32>>());   // returns
