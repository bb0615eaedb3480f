// dtrt::TreeAttentionPlanned as one ONNX Runtime CPU kernel (AVX2 + FMA), registered under the function's own
// domain and name: ONNX Runtime then runs it in place of the function body (dtrt/ops/functions/tree_attention.py),
// which stays the definition and the fallback. Each row sums its terms in one fixed order, the whole past and then
// its attended new columns in index order, with the same code whatever the call's rows and the row's place, so a
// tree's verify row equals plain decoding's row for the same token bit for bit (the order check). Inputs as the
// function's (both caches read at the layer's offset); the plan's outputs other than the grouped mask are not read.
//
// A call's work goes to ONNX Runtime's intra-op thread pool (KernelContext_ParallelFor) in tasks of a KV head's rows:
// every step of a row is the same whichever task runs it, so the thread count changes no bit.

#include <immintrin.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <new>
#include <vector>

using namespace dtrt_ort;

// exp(x) elementwise (a value's result does not depend on its lane): Cephes' range reduction and polynomial
static inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// a vector's lanes summed in one fixed tree: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))
static inline float tree8(__m256 a) {
  __m256 h = _mm256_hadd_ps(a, a);
  h = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// four keys against one query held in registers (nc chunks of 8): each key's dot product in one fixed order (its
// even and odd chunks in two lane-wise chains, added, then tree8's tree), whichever call and place it comes from
static inline void scores4q(const __m256* qv, int nc, const float* k0, const float* k1, const float* k2,
                            const float* k3, float* out) {
  __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
  for (int c = 0; c < nc; c += 2) {
    e0 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + 8 * c), e0);
    e1 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k1 + 8 * c), e1);
    e2 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k2 + 8 * c), e2);
    e3 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k3 + 8 * c), e3);
    if (c + 1 < nc) {
      o0 = _mm256_fmadd_ps(qv[c + 1], _mm256_loadu_ps(k0 + 8 * c + 8), o0);
      o1 = _mm256_fmadd_ps(qv[c + 1], _mm256_loadu_ps(k1 + 8 * c + 8), o1);
      o2 = _mm256_fmadd_ps(qv[c + 1], _mm256_loadu_ps(k2 + 8 * c + 8), o2);
      o3 = _mm256_fmadd_ps(qv[c + 1], _mm256_loadu_ps(k3 + 8 * c + 8), o3);
    }
  }
  __m256 a0 = _mm256_add_ps(e0, o0), a1 = _mm256_add_ps(e1, o1), a2 = _mm256_add_ps(e2, o2), a3 = _mm256_add_ps(e3, o3);
  __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// NR rows' value sums (their scores from S, their sums at acc, W and hd apart), lanes 8i .. 8i + 15 (8i .. 8i + 7
// where not `two`), over the keys [j0, j1) in order: as many rows as there are, so a decode step's 3 rows a head
// take 3 rows' work
template <int NR>
static inline void value_tile(const float* Vh, const float* S, int64_t W, float* acc, int64_t hd, int i, bool two,
                              int64_t j0, int64_t j1) {
  __m256 x[NR], y[NR];
  for (int u = 0; u < NR; ++u) {
    x[u] = _mm256_loadu_ps(acc + u * hd + 8 * i);
    y[u] = two ? _mm256_loadu_ps(acc + u * hd + 8 * i + 8) : _mm256_setzero_ps();
  }
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 v = _mm256_loadu_ps(Vh + j * hd + 8 * i);
    const __m256 w2 = two ? _mm256_loadu_ps(Vh + j * hd + 8 * i + 8) : _mm256_setzero_ps();
    for (int u = 0; u < NR; ++u) {
      const __m256 e = _mm256_broadcast_ss(S + u * W + j);
      x[u] = _mm256_fmadd_ps(e, v, x[u]);
      y[u] = _mm256_fmadd_ps(e, w2, y[u]);
    }
  }
  for (int u = 0; u < NR; ++u) {
    _mm256_storeu_ps(acc + u * hd + 8 * i, x[u]);
    if (two) _mm256_storeu_ps(acc + u * hd + 8 * i + 8, y[u]);
  }
}

// value_tile for 1 to 6 rows, by the rows
using ValueTile = void (*)(const float*, const float*, int64_t, float*, int64_t, int, bool, int64_t, int64_t);
static constexpr ValueTile kValueTiles[7] = {nullptr,       value_tile<1>, value_tile<2>, value_tile<3>,
                                             value_tile<4>, value_tile<5>, value_tile<6>};

// one call's inputs, outputs and scratch: the scores S ([KVH * R, W]), the past's value sums acc ([KVH * R, hd]) and
// the denominators den ([KVH * R]), row rr = g * N + r of KV head kh at kh * R + rr
struct Call {
  const float *Q, *KP, *VP, *KN, *VN;
  float* O;
  const int32_t* cols;  // each row's attended new columns, in index order, row after row
  const int64_t *cnt, *start;
  float *S, *acc, *den;
  float scale;
  int64_t N, P, G, R, W, hd, CK, C;
  int nc;
  int64_t chunk, chunks;  // a task's rows of one KV head, and the tasks a head takes
};

// KV head kh's rows [a, b): every step of a row as the 1-row call takes it, so the split changes no bit
static void attend(const Call& c, int64_t kh, int64_t a, int64_t b) {
  const int64_t N = c.N, P = c.P, G = c.G, R = c.R, W = c.W, hd = c.hd;
  const int nc = c.nc;
  const float* Kh = c.KP + kh * c.CK * hd;
  const float* Vh = c.VP + kh * c.C * hd;
  float* S = c.S + kh * R * W;
  float* acc = c.acc + kh * R * hd;
  float* den = c.den + kh * R;
  // scores: the past (every row attends all of it), 4 keys at a time, in blocks of keys that stay in the L1
  // cache while every row reads them (a long past read once per row would stream from memory R times)
  constexpr int64_t SB = 64;  // a multiple of 4
  for (int64_t j0 = 0; j0 < P; j0 += SB) {
    const int64_t j1 = j0 + SB < P ? j0 + SB : P;
    for (int64_t rr = a; rr < b; ++rr) {
      const int64_t g = rr / N, r = rr % N;
      const float* qr = c.Q + ((kh * G + g) * N + r) * hd;
      __m256 qv[16];
      for (int i = 0; i < nc; ++i) qv[i] = _mm256_loadu_ps(qr + 8 * i);
      float* srow = S + rr * W;
      for (int64_t j = j0; j < j1; j += 4) {
        const float* k0 = Kh + j * hd;
        const float* k1 = Kh + (j + 1 < P ? j + 1 : j) * hd;
        const float* k2 = Kh + (j + 2 < P ? j + 2 : j) * hd;
        const float* k3 = Kh + (j + 3 < P ? j + 3 : j) * hd;
        scores4q(qv, nc, k0, k1, k2, k3, srow + j);
      }
    }
  }
  for (int64_t rr = a; rr < b; ++rr) {
    const int64_t g = rr / N, r = rr % N;
    float* s = S + rr * W;
    const float* qr = c.Q + ((kh * G + g) * N + r) * hd;
    __m256 qv[16];
    for (int i = 0; i < nc; ++i) qv[i] = _mm256_loadu_ps(qr + 8 * i);
    for (int64_t t = 0; t < c.cnt[r]; t += 4) {
      const float* k[4];
      for (int u = 0; u < 4; ++u) k[u] = c.KN + (kh * N + c.cols[c.start[r] + (t + u < c.cnt[r] ? t + u : 0)]) * hd;
      scores4q(qv, nc, k[0], k[1], k[2], k[3], s + P + t);
    }
    const int64_t n = P + c.cnt[r];
    for (int64_t i = n; i < n + 8; ++i) s[i] = -INFINITY;  // padding: never the max
    const __m256 vs = _mm256_set1_ps(c.scale);
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + i), vs);
      _mm256_storeu_ps(s + i, x);
      vm = _mm256_max_ps(vm, x);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const __m256 vmx = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 vd = _mm256_setzero_ps();  // lane i % 8 of the row's sequence: the same in every call
    for (int64_t i = 0; i < n; i += 8) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx));
      if (i + 8 > n) {  // lanes past the row's end: exact zeros
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i)), lane);
        e = _mm256_and_ps(e, _mm256_castsi256_ps(live));
      }
      _mm256_storeu_ps(s + i, e);
      vd = _mm256_add_ps(vd, e);
    }
    den[rr] = tree8(vd);
  }
  // values over the past: the rows per key, 6 rows and 8 lanes of hd at a time, keys in order
  std::fill(acc + a * hd, acc + b * hd, 0.f);
  constexpr int64_t KB = 64;
  for (int64_t j0 = 0; j0 < P; j0 += KB) {
    const int64_t j1 = j0 + KB < P ? j0 + KB : P;
    for (int64_t r0 = a; r0 < b; r0 += 6) {
      const int64_t nr = b - r0 < 6 ? b - r0 : 6;
      const float* Sr = S + r0 * W;
      float* ar = acc + r0 * hd;
      for (int i = 0; i < nc; i += 2) {
        const bool two = i + 1 < nc;
        kValueTiles[nr](Vh, Sr, W, ar, hd, i, two, j0, j1);
      }
    }
  }
  // then each row's attended new columns, in index order, and the division
  for (int64_t rr = a; rr < b; ++rr) {
    const int64_t g = rr / N, r = rr % N;
    __m256 x[16];
    for (int i = 0; i < nc; ++i) x[i] = _mm256_loadu_ps(acc + rr * hd + 8 * i);
    for (int64_t t = 0; t < c.cnt[r]; ++t) {
      const __m256 w = _mm256_set1_ps(S[rr * W + P + t]);
      const float* v = c.VN + (kh * N + c.cols[c.start[r] + t]) * hd;
      for (int i = 0; i < nc; ++i) x[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), x[i]);
    }
    const __m256 dv = _mm256_set1_ps(den[rr]);
    float* o = c.O + ((kh * G + g) * N + r) * hd;
    for (int i = 0; i < nc; ++i) _mm256_storeu_ps(o + 8 * i, _mm256_div_ps(x[i], dv));
  }
}

static void attend_task(void* data, size_t i) {
  const Call& c = *static_cast<const Call*>(data);
  const int64_t kh = (int64_t)i / c.chunks, a = (int64_t)i % c.chunks * c.chunk;
  attend(c, kh, a, a + c.chunk < c.R ? a + c.chunk : c.R);
}

// a task's rows of one KV head: whole 6-row tiles of the values' loop, or all of a head's rows where they fit one
// (each task reads its head's past once, which makes the cost of a long past)
static int64_t task_rows(int64_t R) { return R > 6 ? 6 : R; }

struct Kernel {
  Calls ort;
  Status* Compute(KernelContext* context) {
    Tensor q, kp, kn, vc, lay, vn, sc, mk;
    Tensor* in[8] = {&q, &kp, &kn, &vc, &lay, &vn, &sc, &mk};
    for (size_t i = 0; i < 8; ++i)
      if (Status* s = read_input(ort, context, i, in[i])) return s;
    const auto &qs = q.shape, &ms = mk.shape, &cs = vc.shape, &ks = kp.shape;  // [H, N, hd], [N, M], the V and K
    if (qs.size() != 3 || ms.size() != 2 || cs.size() != 4 || ks.size() != 4)  // caches [L, KVH, C or CK, hd]
      return ort.error(kInvalidArgument, "TreeAttentionPlanned: an input of the wrong rank");
    const int64_t H = qs[0], N = qs[1], KVH = cs[1], M = ms[1], P = M - N, C = cs[2], G = H / KVH, R = G * N;
    const int64_t hd = qs[2];
    const int64_t l = static_cast<const int64_t*>(lay.data)[0];
    const int64_t CK = ks[2];
    if (l < 0 || l >= cs[0] || l >= ks[0] || P > C || P > CK)
      return ort.error(kInvalidArgument, "TreeAttentionPlanned: the layer or the past is outside the caches");
    const bool* mask = static_cast<const bool*>(mk.data);
    Value* out = nullptr;
    void* o = nullptr;
    if (Status* s = ort.output(context, 0, qs.data(), qs.size(), &out)) return s;
    if (Status* s = ort.data(out, &o)) return s;
    const int64_t W = M + 8;  // a row of scores, padded for the 4- and 8-wide loops
    // the scores, value sums and denominators, in a buffer the calling thread keeps between calls (a long past's
    // scores are megabytes a layer, which a fresh buffer would fault in and zero every call); every entry a row
    // reads is written first
    thread_local std::vector<float> scratch;
    const size_t need = (size_t)(KVH * R * (W + hd + 1));
    if (scratch.size() < need) {
      try {
        scratch.resize(need);
      } catch (const std::bad_alloc&) {
        return ort.error(kInvalidArgument, "TreeAttentionPlanned: out of memory for the scores");
      }
    }
    std::vector<int64_t> cnt(N), start(N + 1);
    std::vector<int32_t> cols;
    for (int64_t r = 0; r < N; ++r) {
      for (int64_t j = 0; j < P; ++j)
        if (!mask[r * M + j])
          return ort.error(kInvalidArgument, "TreeAttentionPlanned: a row that does not attend its whole past");
      start[r] = (int64_t)cols.size();
      for (int64_t t = 0; t < N; ++t)
        if (mask[r * M + P + t]) cols.push_back((int32_t)t);
      cnt[r] = (int64_t)cols.size() - start[r];
    }
    Call c;
    c.Q = static_cast<const float*>(q.data);
    c.KP = static_cast<const float*>(kp.data) + l * KVH * CK * hd;
    c.VP = static_cast<const float*>(vc.data) + l * KVH * C * hd;
    c.KN = static_cast<const float*>(kn.data);
    c.VN = static_cast<const float*>(vn.data);
    c.O = static_cast<float*>(o);
    c.cols = cols.data(), c.cnt = cnt.data(), c.start = start.data();
    c.S = scratch.data(), c.acc = c.S + KVH * R * W, c.den = c.acc + KVH * R * hd;
    c.scale = static_cast<const float*>(sc.data)[0];
    c.N = N, c.P = P, c.G = G, c.R = R, c.W = W, c.hd = hd, c.CK = CK, c.C = C;
    c.nc = (int)(hd / 8);  // hd: a multiple of 8, at most 128 (checked before registering)
    c.chunk = task_rows(R), c.chunks = R ? (R + c.chunk - 1) / c.chunk : 0;
    const size_t tasks = (size_t)(KVH * c.chunks);
    if (tasks == 1) {
      attend_task(&c, 0);
    } else if (tasks > 1) {
      if (Status* s = ort.parallel_for(context, attend_task, tasks, 0, &c)) return s;
    }
    return nullptr;
  }
};

// the op as ONNX Runtime sees it: 23 inputs (the function's), one float output, on the CPU provider
static int input_type(const CustomOp*, size_t i) {
  if (i == 7) return kBool;
  if (i == 0 || i == 1 || i == 2 || i == 3 || i == 5 || i == 6 || i == 10) return kFloat;
  return kInt64;
}

static CustomOp make_op() {
  CustomOp op = cpu_op<Kernel>();
  op.GetName = [](const CustomOp*) { return "TreeAttentionPlanned"; };
  op.GetInputType = input_type;
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return 23; };
  op.CreateKernelV2 = [](const CustomOp*, Api api, const KernelInfo*, void** kernel) -> Status* {
    *kernel = new Kernel{Calls{api}};
    return nullptr;
  };
  return op;
}

const CustomOp* dtrt_ort::tree_attention_op() {
  static const CustomOp op = make_op();
  return &op;
}
