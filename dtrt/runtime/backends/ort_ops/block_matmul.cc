// dtrt::BlockMatMul and dtrt::BlockMatMulMin as ONNX Runtime CPU kernels (AVX2 + FMA, and AVX-512F where the CPU has
// it), registered under the functions' own domain and names: ONNX Runtime then runs them in place of the function
// bodies (dtrt/ops/functions/block_matmul.py), which stay the definition and the fallback.
//
//   y[.., n] = sum_b scale[n, b] * sum_j (q[n, b*block + j] - zero) * x[.., b*block + j]
//              (+ sum_b min[n, b] * sum_j x[.., b*block + j] for BlockMatMulMin)
//
// on the file's integer codes (bits 4: two a byte, a block's code i in the low nibble of its byte i and code
// i + block/2 in the high one; bits 8: a byte a code), fp32 activations, fp32 arithmetic.
//
// Every output y[r, n] is computed in one fixed order, whatever the call's rows, the row's place among them and
// the thread that computes it, so a row of an M-row call equals the 1-row call on that row bit for bit. The order
// has L lanes, L = 16 on the AVX-512F path (where the CPU has AVX-512F, asked once per process, unless
// DTRT_BLOCK_ISA=avx2 when a session creates the kernel) and L = 8 on the AVX2 one, so an AVX-512 CPU and an
// AVX2-only one can differ in an output's last bits, as ONNX Runtime's own kernels do:
//   - the weights w[n, k] = scale[n, k/block] * float(q[n, k] - zero), rounded once (as blocks.scaled_codes);
//   - one L-lane accumulator: lane l takes fma(w[n, Li+l], x[r, Li+l], .) for i = 0, 1, .., K/L - 1 in order;
//   - BlockMatMulMin: then each block's sum of x (its chunks of 8 added lane-wise in order, then the tree below)
//     times min[n, b] into lane b % L of the same accumulator by fma, blocks in order (lanes past the last
//     block add 0 * 0);
//   - 16 lanes: lanes l and l + 8 added;
//   - the 8 lanes summed in the tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
// The code paths make these same operations on every output. AVX2: up to 4 rows, each block of a few columns
// decoded in registers and used at once by every row; more rows, a panel of columns decoded into an fp32 buffer a
// K-range at a time, then tiles of 4 rows by 3 columns of accumulators over it. AVX-512F: up to 8 rows, each block
// of a few columns decoded in registers (4 bits: picked by code from the block's 16 possible weights), then each 16
// of a row's x loaded once for them; more rows, 4 columns decoded a K-range at a time into a buffer, then tiles of
// up to 6 rows by the 4 columns over it, the mins' term one more range. Columns go in panels of 24 to ONNX
// Runtime's intra-op thread pool (KernelContext_ParallelFor); each output is computed by one task, so the thread
// count changes no bit. The library is built with -ffp-contract=off, and the arithmetic is written as intrinsics.

#include <immintrin.h>

#include "kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

using namespace dtrt_ort;

namespace {

// a vector's lanes summed in one fixed tree: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))
inline float tree8(__m256 a) {
  __m256 h = _mm256_hadd_ps(a, a);
  h = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// a hint to bring the line at base + offset into the cache: an address (never dereferenced; prefetches do not
// fault), so past the end of the weights it is only wasted
inline void prefetch(const void* base, int64_t offset) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + offset), _MM_HINT_T0);
}

// 8 codes as fp32 (q - zero), exact
template <bool ZERO>
inline __m256 codes8(__m128i bytes, __m256i zero) {
  __m256i i = _mm256_cvtepu8_epi32(bytes);
  if (ZERO) i = _mm256_sub_epi32(i, zero);
  return _mm256_cvtepi32_ps(i);
}

// one block of one column: its BLOCK/8 vectors of weights scale * (q - zero), k in order
template <int BITS, int BLOCK, bool ZERO>
__attribute__((always_inline)) inline void decode(const uint8_t* p, float scale, __m256i zero, __m256* w) {
  const __m256 s = _mm256_set1_ps(scale);
  if (BITS == 8) {
#pragma GCC unroll 4
    for (int c = 0; c < BLOCK / 8; ++c)
      w[c] = _mm256_mul_ps(s, codes8<ZERO>(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * c)), zero));
  } else if (BLOCK == 32) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    w[0] = _mm256_mul_ps(s, codes8<ZERO>(lo, zero));
    w[1] = _mm256_mul_ps(s, codes8<ZERO>(_mm_srli_si128(lo, 8), zero));
    w[2] = _mm256_mul_ps(s, codes8<ZERO>(hi, zero));
    w[3] = _mm256_mul_ps(s, codes8<ZERO>(_mm_srli_si128(hi, 8), zero));
  } else {  // 4 bits, blocks of 16: 8 bytes
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(0x0F);
    w[0] = _mm256_mul_ps(s, codes8<ZERO>(_mm_and_si128(b, m), zero));
    w[1] = _mm256_mul_ps(s, codes8<ZERO>(_mm_and_si128(_mm_srli_epi16(b, 4), m), zero));
  }
}

struct Problem {
  const float* x;      // [M, K]
  const uint8_t* q;    // [N, K * bits / 8]
  const float* scale;  // [N, nb]
  const float* min;    // [N, nb] or nullptr
  const float* bsum;   // [M, nbp]: each row's block sums, zero past nb (BlockMatMulMin)
  float* y;            // [M, N]
  int64_t M, N, K, nb, nbp, row_bytes;
  int zero;
  std::atomic<bool> failed{false};  // a task could not get its buffer
};

constexpr int64_t kPanel = 24;               // columns per task (a multiple of every tile's columns)
constexpr int64_t kRange = 256;              // K per decoded range of many_rows' panel buffer (L1-sized)
constexpr int kTileRows = 4, kTileCols = 3;  // many_rows' tiles (finish4 takes up to 4 columns)

// tree8 of four vectors at once (the same sums in the same order): lane i = tree8(a_i)
inline __m128 tree8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// row r's outputs at columns n .. n + count - 1 (count <= 4) from their accumulators a0..a3. BlockMatMulMin: each
// accumulator first takes min[n, b] * bsum[r, b] in lane b % 8, blocks in order (the lanes past the last block
// add 0 * 0). Accumulators past count are not stored (their mins: column n's again).
template <bool MIN>
__attribute__((always_inline)) inline void finish4(const Problem& p, int64_t r, int64_t n, __m256 a0, __m256 a1,
                                                   __m256 a2, __m256 a3, int count) {
  if (MIN) {
    const float* bs = p.bsum + r * p.nbp;  // zero past nb
    const float* m0 = p.min + n * p.nb;
    const float* m1 = count > 1 ? m0 + p.nb : m0;
    const float* m2 = count > 2 ? m0 + 2 * p.nb : m0;
    const float* m3 = count > 3 ? m0 + 3 * p.nb : m0;
    int64_t b = 0;
    for (; b + 8 <= p.nb; b += 8) {
      const __m256 s = _mm256_loadu_ps(bs + b);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(m0 + b), s, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(m1 + b), s, a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(m2 + b), s, a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(m3 + b), s, a3);
    }
    if (b < p.nb) {
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(p.nb - b)), lane);
      const __m256 s = _mm256_loadu_ps(bs + b);
      a0 = _mm256_fmadd_ps(_mm256_maskload_ps(m0 + b, live), s, a0);
      a1 = _mm256_fmadd_ps(_mm256_maskload_ps(m1 + b, live), s, a1);
      a2 = _mm256_fmadd_ps(_mm256_maskload_ps(m2 + b, live), s, a2);
      a3 = _mm256_fmadd_ps(_mm256_maskload_ps(m3 + b, live), s, a3);
    }
  }
  const __m128 out = tree8x4(a0, a1, a2, a3);
  float* y = p.y + r * p.N + n;
  if (count == 4)
    _mm_storeu_ps(y, out);
  else
    _mm_maskstore_ps(y, _mm_cmpgt_epi32(_mm_set1_epi32(count), _mm_setr_epi32(0, 1, 2, 3)), out);
}

// row r's outputs at columns n .. n + count - 1 from accumulators a[0 .. C), C a multiple of 4 or below it
template <bool MIN, int C>
__attribute__((always_inline)) inline void finish(const Problem& p, int64_t r, int64_t n, const __m256* a,
                                                  int count) {
  const __m256 z = _mm256_setzero_ps();
  if (C < 4) {
    finish4<MIN>(p, r, n, a[0], C > 1 ? a[1] : z, C > 2 ? a[2] : z, z, count);
    return;
  }
#pragma GCC unroll 4
  for (int c = 0; c < C && c < count; c += 4)
    finish4<MIN>(p, r, n + c, a[c], a[c + 1 < C ? c + 1 : c], a[c + 2 < C ? c + 2 : c], a[c + 3 < C ? c + 3 : c],
                 count - c < 4 ? count - c : 4);
}

// rows [0, M), M <= 4: R rows by C columns of accumulators, each block of each column decoded once in
// registers and used at once by every row; columns further on are prefetched meanwhile
template <int BITS, int BLOCK, bool ZERO, bool MIN, int R, int C>
void few_rows(const Problem& p, int64_t n0, int64_t n1) {
  constexpr int64_t kBytes = BLOCK * BITS / 8;        // a block's codes
  constexpr int64_t kLines = (C * kBytes + 63) / 64;  // lines of the next C columns' codes per block
  const __m256i zero = _mm256_set1_epi32(p.zero);
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = p.x + r * p.K;
  // prefetched: the next group of C columns, or for weights past 4 MiB whose groups are short (an lm_head's small K)
  // the group about 16 KiB on, so that enough lines are in flight to stream them at the memory's rate
  const int64_t group = C * p.row_bytes, far = p.N * p.row_bytes > (4 << 20) ? (16384 + group - 1) / (group + 1) : 1;
  const int64_t ahead = C * std::min<int64_t>(8, std::max<int64_t>(1, far));
  for (int64_t c0 = n0; c0 < n1; c0 += C) {
    int64_t col[C];
    for (int c = 0; c < C; ++c) col[c] = c0 + c < n1 ? c0 + c : n1 - 1;  // past the panel: its last, not stored
    const int64_t next_q = (c0 + ahead) * p.row_bytes, next_s = (c0 + ahead) * p.nb * 4;
    __m256 acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < p.nb; ++b) {
#pragma GCC unroll 8
      for (int64_t l = 0; l < kLines; ++l) prefetch(p.q, next_q + (b * kLines + l) * 64);
      if (b % 2 == 0) {  // their scales and mins: C floats a block
        prefetch(p.scale, next_s + b * C * 4);
        if (MIN) prefetch(p.min, next_s + b * C * 4);
      }
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        __m256 w[BLOCK / 8];
        decode<BITS, BLOCK, ZERO>(p.q + col[c] * p.row_bytes + b * kBytes, p.scale[col[c] * p.nb + b], zero, w);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
          for (int i = 0; i < BLOCK / 8; ++i)
            acc[r][c] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr[r] + b * BLOCK + 8 * i), acc[r][c]);
      }
    }
    const int count = (int)(n1 - c0 < C ? n1 - c0 : C);
    for (int r = 0; r < R; ++r) finish<MIN, C>(p, r, c0, acc[r], count);
  }
}

// R rows by C columns of accumulators (row r, column c at a + (r * C + c) * 8) over a decoded range of kr
template <int R, int C>
__attribute__((always_inline)) inline void tile(const float* const* xr, const float* const* wc, int64_t kr,
                                                float* a) {
  __m256 s[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) s[r][c] = _mm256_loadu_ps(a + (r * C + c) * 8);
  for (int64_t i = 0; i < kr; i += 8) {
    __m256 v[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) v[c] = _mm256_loadu_ps(wc[c] + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_loadu_ps(xr[r] + i);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) s[r][c] = _mm256_fmadd_ps(v[c], x, s[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(a + (r * C + c) * 8, s[r][c]);
}

// more rows: the panel's columns decoded a K-range at a time into `w` ([kPanel][kRange]), then every kTileRows by
// kTileCols tile of accumulators runs over that range, kept in `acc` between ranges (8 floats each)
template <int BITS, int BLOCK, bool ZERO, bool MIN>
void many_rows(const Problem& p, int64_t n0, int64_t n1, float* w, float* acc) {
  constexpr int TR = kTileRows, TC = kTileCols;
  const __m256i zero = _mm256_set1_epi32(p.zero);
  const int64_t cols = n1 - n0, groups = (cols + TC - 1) / TC, tiles = (p.M + TR - 1) / TR;
  std::fill(acc, acc + tiles * groups * TR * TC * 8, 0.f);
  for (int64_t k0 = 0; k0 < p.K; k0 += kRange) {
    const int64_t kr = p.K - k0 < kRange ? p.K - k0 : kRange;  // a multiple of BLOCK
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t* qc = p.q + (n0 + c) * p.row_bytes + k0 / BLOCK * (BLOCK * BITS / 8);
      const float* sc = p.scale + (n0 + c) * p.nb + k0 / BLOCK;
      float* wc = w + c * kRange;
      // the column's next range meanwhile, or the next panel's first one
      const int64_t kn = k0 + kRange < p.K ? k0 + kRange : 0, cn = kn ? n0 + c : n0 + c + kPanel;
      for (int64_t l = 0; l < kRange * BITS / 8; l += 64) prefetch(p.q, cn * p.row_bytes + kn * BITS / 8 + l);
      for (int64_t l = 0; l < kRange / BLOCK * 4; l += 64) {
        prefetch(p.scale, (cn * p.nb + kn / BLOCK) * 4 + l);
        if (MIN) prefetch(p.min, (cn * p.nb + kn / BLOCK) * 4 + l);
      }
      for (int64_t b = 0; b < kr / BLOCK; ++b) {
        __m256 v[BLOCK / 8];
        decode<BITS, BLOCK, ZERO>(qc + b * (BLOCK * BITS / 8), sc[b], zero, v);
#pragma GCC unroll 4
        for (int i = 0; i < BLOCK / 8; ++i) _mm256_storeu_ps(wc + b * BLOCK + 8 * i, v[i]);
      }
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const int live = (int)(p.M - t * TR < TR ? p.M - t * TR : TR);  // the last tile's rows: M % TR or TR
      const float* xr[TR];
#pragma GCC unroll 8
      for (int r = 0; r < TR; ++r) xr[r] = p.x + (t * TR + (r < live ? r : 0)) * p.K + k0;
      for (int64_t g = 0; g < groups; ++g) {
        const float* wc[TC];
#pragma GCC unroll 8
        for (int c = 0; c < TC; ++c) wc[c] = w + (g * TC + c < cols ? g * TC + c : cols - 1) * kRange;
        float* a = acc + (t * groups + g) * TR * TC * 8;
        switch (live) {
          case 1:
            tile<1, TC>(xr, wc, kr, a);
            break;
          case 2:
            tile<2, TC>(xr, wc, kr, a);
            break;
          case 3:
            tile<3, TC>(xr, wc, kr, a);
            break;
          default:
            tile<TR, TC>(xr, wc, kr, a);
        }
      }
    }
  }
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t g = 0; g < groups; ++g)
      for (int r = 0; r < TR && t * TR + r < p.M; ++r) {
        const float* a = acc + ((t * groups + g) * TR * TC + r * TC) * 8;
        const int count = (int)(cols - g * TC < TC ? cols - g * TC : TC);
        finish4<MIN>(p, t * TR + r, n0 + g * TC, _mm256_loadu_ps(a), _mm256_loadu_ps(a + 8),
                     _mm256_loadu_ps(a + 16), _mm256_setzero_ps(), count);
      }
}

// columns [n0, n1) for every row
template <int BITS, int BLOCK, bool ZERO, bool MIN>
void panel(Problem& p, int64_t n0, int64_t n1) {
  switch (p.M) {
    case 1:
      return few_rows<BITS, BLOCK, ZERO, MIN, 1, 8>(p, n0, n1);
    case 2:
      return few_rows<BITS, BLOCK, ZERO, MIN, 2, 6>(p, n0, n1);
    case 3:
      return few_rows<BITS, BLOCK, ZERO, MIN, 3, 3>(p, n0, n1);
    case 4:
      return few_rows<BITS, BLOCK, ZERO, MIN, 4, 2>(p, n0, n1);
  }
  // one buffer per thread, kept between calls: the decoded panel, then the accumulators
  thread_local std::vector<float> buffer;
  const int64_t tiles = (p.M + kTileRows - 1) / kTileRows;
  const size_t need = kPanel * kRange + tiles * (kPanel + kTileCols) * kTileRows * 8;
  if (buffer.size() < need) {
    try {
      buffer.resize(need);
    } catch (const std::bad_alloc&) {
      p.failed = true;
      return;
    }
  }
  many_rows<BITS, BLOCK, ZERO, MIN>(p, n0, n1, buffer.data(), buffer.data() + kPanel * kRange);
}

using PanelFn = void (*)(Problem&, int64_t, int64_t);

template <int BITS, int BLOCK, bool ZERO>
PanelFn pick_min(bool min) {
  return min ? panel<BITS, BLOCK, ZERO, true> : panel<BITS, BLOCK, ZERO, false>;
}

template <int BITS, int BLOCK>
PanelFn pick_zero(bool zero, bool min) {
  return zero ? pick_min<BITS, BLOCK, true>(min) : pick_min<BITS, BLOCK, false>(min);
}

PanelFn pick(int bits, int block, bool zero, bool min) {
  if (bits == 4) return block == 32 ? pick_zero<4, 32>(zero, min) : pick_zero<4, 16>(zero, min);
  return block == 32 ? pick_zero<8, 32>(zero, min) : pick_zero<8, 16>(zero, min);
}

// ---- the AVX-512F path: the same products with 16-lane accumulators (half the FMAs) ----
// Compiled for AVX-512F by the attribute below whatever the library's flags (AVX2 + FMA), and run only where
// use_avx512() says the CPU has it. AVX-512F instructions only (no BW, DQ or VL).

#define DTRT_AVX512 __attribute__((target("avx512f")))

constexpr int kRows16 = 6, kCols16 = 4;  // many_rows16's tiles: up to 6 rows by 4 columns of accumulators
constexpr int64_t kRange16 = 768;        // K per decoded range of many_rows16's columns

// lanes l and l + 8 added: the 8 lanes tree8 then sums
DTRT_AVX512 inline __m256 fold16(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// lane i = tree8(fold16(a_i)), the same sums in the same order
DTRT_AVX512 inline __m128 tree16x4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  return tree8x4(fold16(a0), fold16(a1), fold16(a2), fold16(a3));
}

// j - zero for j = 0..15 (exact: small integers)
DTRT_AVX512 inline __m512 lut16(int zero) {
  return _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                       _mm512_set1_ps((float)zero));
}

// one block of one column: its BLOCK/16 vectors of weights scale * (q - zero), k in order. 4 bits: the block's 16
// possible weights scale * (j - zero) (`lut` holds j - zero), each rounded once as it is for a code j, then picked
// by code (vpermps reads an index's low 4 bits, so a byte's high nibble needs only a shift)
template <int BITS, int BLOCK, bool ZERO>
DTRT_AVX512 __attribute__((always_inline)) inline void decode16(const uint8_t* p, float scale, __m512i zero,
                                                                 __m512 lut, __m512* w) {
  const __m512 s = _mm512_set1_ps(scale);
  if (BITS == 8) {
#pragma GCC unroll 2
    for (int c = 0; c < BLOCK / 16; ++c) {
      __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * c)));
      if (ZERO) i = _mm512_sub_epi32(i, zero);
      w[c] = _mm512_mul_ps(s, _mm512_cvtepi32_ps(i));
    }
  } else {
    const __m512 t = _mm512_mul_ps(s, lut);
    if (BLOCK == 32) {  // byte i: code i (low nibble) and code i + 16 (high)
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      w[0] = _mm512_permutexvar_ps(b, t);
      w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t);
    } else {  // blocks of 16: 8 bytes, codes 0..7 in the low nibbles, 8..15 in the high ones
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
      w[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(b, _mm_srli_epi16(b, 4))), t);
    }
  }
}

// finish4 with 16 lanes: BlockMatMulMin's term into lane b % 16 (few_rows16; many_rows16 adds it as one more
// range, MIN false here), then the lanes' tree
template <bool MIN>
DTRT_AVX512 __attribute__((always_inline)) inline void finish16x4(const Problem& p, int64_t r, int64_t n, __m512 a0,
                                                                   __m512 a1, __m512 a2, __m512 a3, int count) {
  if (MIN) {
    const float* bs = p.bsum + r * p.nbp;  // zero past nb, nbp a multiple of 16
    const float* m0 = p.min + n * p.nb;
    const float* m1 = count > 1 ? m0 + p.nb : m0;
    const float* m2 = count > 2 ? m0 + 2 * p.nb : m0;
    const float* m3 = count > 3 ? m0 + 3 * p.nb : m0;
    int64_t b = 0;
    for (; b + 16 <= p.nb; b += 16) {
      const __m512 s = _mm512_loadu_ps(bs + b);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(m0 + b), s, a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(m1 + b), s, a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(m2 + b), s, a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(m3 + b), s, a3);
    }
    if (b < p.nb) {
      const __mmask16 live = (__mmask16)((1u << (p.nb - b)) - 1);
      const __m512 s = _mm512_loadu_ps(bs + b);
      a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, m0 + b), s, a0);
      a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, m1 + b), s, a1);
      a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, m2 + b), s, a2);
      a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, m3 + b), s, a3);
    }
  }
  const __m128 out = tree16x4(a0, a1, a2, a3);
  float* y = p.y + r * p.N + n;
  if (count == 4)
    _mm_storeu_ps(y, out);
  else
    _mm_maskstore_ps(y, _mm_cmpgt_epi32(_mm_set1_epi32(count), _mm_setr_epi32(0, 1, 2, 3)), out);
}

// row r's outputs at columns n .. n + count - 1 from accumulators a[0 .. C), C a multiple of 4 or below it
template <bool MIN, int C>
DTRT_AVX512 __attribute__((always_inline)) inline void finish16(const Problem& p, int64_t r, int64_t n,
                                                                 const __m512* a, int count) {
  const __m512 z = _mm512_setzero_ps();
  if (C < 4) {
    finish16x4<MIN>(p, r, n, a[0], C > 1 ? a[1] : z, C > 2 ? a[2] : z, z, count);
    return;
  }
#pragma GCC unroll 4
  for (int c = 0; c < C && c < count; c += 4)
    finish16x4<MIN>(p, r, n + c, a[c], a[c + 1 < C ? c + 1 : c], a[c + 2 < C ? c + 2 : c],
                    a[c + 3 < C ? c + 3 : c], count - c < 4 ? count - c : 4);
}

// a loaded vector kept in a register: the compiler would otherwise fold its load into each FMA that uses it, and
// the loads, not the FMAs, would bound the loop
DTRT_AVX512 __attribute__((always_inline)) inline void in_register(__m512& v) { __asm__("" : "+v"(v)); }

// rows [0, M), M <= 8: R rows by C columns of accumulators; each block of the C columns decoded in registers, then
// each 16 of x loaded once for the C columns; columns further on are prefetched meanwhile (as few_rows)
template <int BITS, int BLOCK, bool ZERO, bool MIN, int R, int C>
DTRT_AVX512 void few_rows16(const Problem& p, int64_t n0, int64_t n1) {
  constexpr int64_t kBytes = BLOCK * BITS / 8;
  constexpr int64_t kLines = (C * kBytes + 63) / 64;
  const __m512i zero = _mm512_set1_epi32(p.zero);
  const __m512 lut = lut16(p.zero);
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = p.x + r * p.K;
  const int64_t group = C * p.row_bytes, far = p.N * p.row_bytes > (4 << 20) ? (16384 + group - 1) / (group + 1) : 1;
  const int64_t ahead = C * std::min<int64_t>(8, std::max<int64_t>(1, far));
  for (int64_t c0 = n0; c0 < n1; c0 += C) {
    int64_t col[C];
    for (int c = 0; c < C; ++c) col[c] = c0 + c < n1 ? c0 + c : n1 - 1;  // past the panel: its last, not stored
    const int64_t next_q = (c0 + ahead) * p.row_bytes, next_s = (c0 + ahead) * p.nb * 4;
    __m512 acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < p.nb; ++b) {
#pragma GCC unroll 8
      for (int64_t l = 0; l < kLines; ++l) prefetch(p.q, next_q + (b * kLines + l) * 64);
      if (b % 2 == 0) {
        prefetch(p.scale, next_s + b * C * 4);
        if (MIN) prefetch(p.min, next_s + b * C * 4);
      }
      __m512 w[C][BLOCK / 16];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        decode16<BITS, BLOCK, ZERO>(p.q + col[c] * p.row_bytes + b * kBytes, p.scale[col[c] * p.nb + b], zero, lut,
                                    w[c]);
#pragma GCC unroll 2
      for (int i = 0; i < BLOCK / 16; ++i)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          __m512 x = _mm512_loadu_ps(xr[r] + b * BLOCK + 16 * i);
          in_register(x);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w[c][i], x, acc[r][c]);
        }
    }
    const int count = (int)(n1 - c0 < C ? n1 - c0 : C);
    for (int r = 0; r < R; ++r) finish16<MIN, C>(p, r, c0, acc[r], count);
  }
}

// R rows by C columns of accumulators (row r, column c at a + (r * C + c) * 16, zero when `first`) over kr of the
// rows xr and the decoded columns wc
template <int R, int C>
DTRT_AVX512 __attribute__((always_inline)) inline void tile16(const float* const* xr, const float* const* wc,
                                                               int64_t kr, float* a, bool first) {
  __m512 s[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) s[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(a + (r * C + c) * 16);
  for (int64_t i = 0; i < kr; i += 16) {
    __m512 v[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      v[c] = _mm512_loadu_ps(wc[c] + i);
      in_register(v[c]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 x = _mm512_loadu_ps(xr[r] + i);
      in_register(x);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) s[r][c] = _mm512_fmadd_ps(v[c], x, s[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(a + (r * C + c) * 16, s[r][c]);
}

// a tile of `live` rows, 1 <= live <= R
template <int R, int C>
DTRT_AVX512 void tile16_rows(int live, const float* const* xr, const float* const* wc, int64_t kr, float* a,
                             bool first) {
  if constexpr (R > 1) {
    if (live < R) return tile16_rows<R - 1, C>(live, xr, wc, kr, a, first);
  }
  tile16<R, C>(xr, wc, kr, a, first);
}

// every tile of rows over kr of the decoded columns `w` (column stride kRange16), row r of the range at
// base + r * stride; the rows go in ceil(M / kRows16) tiles of nearly equal rows
DTRT_AVX512 void tiles16(const Problem& p, int64_t cols, const float* base, int64_t stride, const float* w,
                         int64_t kr, float* acc, bool first) {
  constexpr int TR = kRows16, TC = kCols16;
  const int64_t tiles = (p.M + TR - 1) / TR;
  const float* wc[TC];
  for (int c = 0; c < TC; ++c) wc[c] = w + (c < cols ? c : cols - 1) * kRange16;  // past the panel: its last
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r0 = t * p.M / tiles, live = (t + 1) * p.M / tiles - r0;
    const float* xr[TR];
    for (int r = 0; r < TR; ++r) xr[r] = base + (r0 + (r < live ? r : 0)) * stride;
    tile16_rows<TR, TC>((int)live, xr, wc, kr, acc + t * TR * TC * 16, first);
  }
}

// more rows: kCols16 columns at a time, decoded a K-range at a time (nearly equal ranges of at most kRange16, each
// a multiple of BLOCK) into `w` ([kCols16][kRange16]), then every tile of rows runs over that range, its
// accumulators kept in `acc` between ranges. BlockMatMulMin's term is one more range after K: the columns' mins
// (zero past nb) against the rows' block sums, so into lane b % 16 in block order as in few_rows16
template <int BITS, int BLOCK, bool ZERO, bool MIN>
DTRT_AVX512 void many_rows16(const Problem& p, int64_t n0, int64_t n1, float* w, float* acc) {
  constexpr int TR = kRows16, TC = kCols16;
  const __m512i zero = _mm512_set1_epi32(p.zero);
  const __m512 lut = lut16(p.zero);
  const int64_t tiles = (p.M + TR - 1) / TR;
  const int64_t ranges = std::max<int64_t>(1, (p.K + kRange16 - 1) / kRange16);
  const int64_t step = (p.nb + ranges - 1) / ranges * BLOCK;
  for (int64_t s0 = n0; s0 < n1; s0 += TC) {
    const int64_t cols = n1 - s0 < TC ? n1 - s0 : TC;
    if (p.K == 0) std::fill(acc, acc + tiles * TR * TC * 16, 0.f);  // no range to start the accumulators
    for (int64_t k0 = 0; k0 < p.K; k0 += step) {
      const int64_t kr = p.K - k0 < step ? p.K - k0 : step;
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t* qc = p.q + (s0 + c) * p.row_bytes + k0 / BLOCK * (BLOCK * BITS / 8);
        const float* sc = p.scale + (s0 + c) * p.nb + k0 / BLOCK;
        float* wc = w + c * kRange16;
        // the column's next range meanwhile, or the next columns' first one (and their mins)
        const int64_t kn = k0 + step < p.K ? k0 + step : 0, cn = kn ? s0 + c : s0 + c + TC;
        for (int64_t l = 0; l < step * BITS / 8; l += 64) prefetch(p.q, cn * p.row_bytes + kn * BITS / 8 + l);
        for (int64_t l = 0; l < step / BLOCK * 4; l += 64) prefetch(p.scale, (cn * p.nb + kn / BLOCK) * 4 + l);
        if (MIN && kn == 0)
          for (int64_t l = 0; l < p.nb * 4; l += 64) prefetch(p.min, cn * p.nb * 4 + l);
        for (int64_t b = 0; b < kr / BLOCK; ++b) {
          __m512 v[BLOCK / 16];
          decode16<BITS, BLOCK, ZERO>(qc + b * (BLOCK * BITS / 8), sc[b], zero, lut, v);
#pragma GCC unroll 2
          for (int i = 0; i < BLOCK / 16; ++i) _mm512_storeu_ps(wc + b * BLOCK + 16 * i, v[i]);
        }
      }
      tiles16(p, cols, p.x + k0, p.K, w, kr, acc, k0 == 0);
    }
    if (MIN)
      for (int64_t b0 = 0; b0 < p.nbp; b0 += kRange16) {
        const int64_t br = p.nbp - b0 < kRange16 ? p.nbp - b0 : kRange16;  // a multiple of 16
        for (int64_t c = 0; c < cols; ++c)
          for (int64_t b = 0; b < br; b += 16) {
            const int64_t left = p.nb - b0 - b;
            const __mmask16 live = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            const float* m = p.min + (s0 + c) * p.nb + b0 + b;
            _mm512_storeu_ps(w + c * kRange16 + b, live ? _mm512_maskz_loadu_ps(live, m) : _mm512_setzero_ps());
          }
        tiles16(p, cols, p.bsum + b0, p.nbp, w, br, acc, false);
      }
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = t * p.M / tiles, live = (t + 1) * p.M / tiles - r0;
      for (int64_t r = 0; r < live; ++r) {
        const float* a = acc + (t * TR + r) * TC * 16;
        finish16x4<false>(p, r0 + r, s0, _mm512_loadu_ps(a), _mm512_loadu_ps(a + 16), _mm512_loadu_ps(a + 32),
                          _mm512_loadu_ps(a + 48), (int)cols);
      }
    }
  }
}

// one buffer per thread, kept between calls, 64-byte aligned; nullptr when it cannot grow
float* panel_buffer(size_t need) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < need + 16) {
    try {
      buffer.resize(need + 16);
    } catch (const std::bad_alloc&) {
      return nullptr;
    }
  }
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
}

// columns [n0, n1) for every row
template <int BITS, int BLOCK, bool ZERO, bool MIN>
DTRT_AVX512 void panel16(Problem& p, int64_t n0, int64_t n1) {
  switch (p.M) {
    case 1:
      return few_rows16<BITS, BLOCK, ZERO, MIN, 1, 8>(p, n0, n1);
    case 2:
      return few_rows16<BITS, BLOCK, ZERO, MIN, 2, 4>(p, n0, n1);
    case 3:
      return few_rows16<BITS, BLOCK, ZERO, MIN, 3, 4>(p, n0, n1);
    case 4:
      return few_rows16<BITS, BLOCK, ZERO, MIN, 4, 4>(p, n0, n1);
    case 5:
      return few_rows16<BITS, BLOCK, ZERO, MIN, 5, 4>(p, n0, n1);
    case 6:
      return few_rows16<BITS, BLOCK, ZERO, MIN, 6, 3>(p, n0, n1);
    case 7:
      return few_rows16<BITS, BLOCK, ZERO, MIN, 7, 3>(p, n0, n1);
    case 8:
      return few_rows16<BITS, BLOCK, ZERO, MIN, 8, 3>(p, n0, n1);
  }
  const int64_t tiles = (p.M + kRows16 - 1) / kRows16;
  float* buffer = panel_buffer(kCols16 * kRange16 + tiles * kRows16 * kCols16 * 16);
  if (buffer == nullptr) {
    p.failed = true;
    return;
  }
  many_rows16<BITS, BLOCK, ZERO, MIN>(p, n0, n1, buffer, buffer + kCols16 * kRange16);
}

template <int BITS, int BLOCK, bool ZERO>
PanelFn pick16_min(bool min) {
  return min ? panel16<BITS, BLOCK, ZERO, true> : panel16<BITS, BLOCK, ZERO, false>;
}

PanelFn pick16(int bits, int block, bool zero, bool min) {
  // 4 bits: the zero is in the decoding's table, one instance for any
  if (bits == 4) return block == 32 ? pick16_min<4, 32, false>(min) : pick16_min<4, 16, false>(min);
  if (block == 32) return zero ? pick16_min<8, 32, true>(min) : pick16_min<8, 32, false>(min);
  return zero ? pick16_min<8, 16, true>(min) : pick16_min<8, 16, false>(min);
}

// the AVX-512F path: where the CPU has AVX-512F (asked once per process), unless DTRT_BLOCK_ISA=avx2 (read when a
// session creates the kernel)
bool use_avx512() {
  static const bool cpu = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  const char* isa = std::getenv("DTRT_BLOCK_ISA");
  return cpu && !(isa != nullptr && std::strcmp(isa, "avx2") == 0);
}

struct Task {
  Problem* p;
  PanelFn fn;
};

void run_panel(void* data, size_t i) {
  const Task* t = static_cast<const Task*>(data);
  const int64_t n0 = (int64_t)i * kPanel, n1 = n0 + kPanel < t->p->N ? n0 + kPanel : t->p->N;
  t->fn(*t->p, n0, n1);
}

struct Kernel {
  Calls ort;
  bool with_min;
  int64_t bits, block, zero;
  bool wide;  // the AVX-512F path

  Status* fail(const char* what) const {
    char msg[256];
    std::snprintf(msg, sizeof msg, "%s: %s", with_min ? "BlockMatMulMin" : "BlockMatMul", what);
    return ort.error(kInvalidArgument, msg);
  }

  Status* Compute(KernelContext* context) {
    Tensor x, q, sc, mn;
    Tensor* in[4] = {&x, &q, &sc, &mn};
    for (size_t i = 0; i < (with_min ? 4u : 3u); ++i)
      if (Status* s = read_input(ort, context, i, in[i])) return s;
    char what[200];
    if (x.shape.empty() || q.shape.size() != 2 || sc.shape.size() != 2)
      return fail("x must be [..., K], q and scale 2-D");
    const int64_t K = x.shape.back(), N = q.shape[0];
    int64_t M = 1;
    for (size_t i = 0; i + 1 < x.shape.size(); ++i) M *= x.shape[i];
    if (K % block) {
      std::snprintf(what, sizeof what, "K = %lld is not a multiple of block %lld", (long long)K, (long long)block);
      return fail(what);
    }
    const int64_t nb = K / block, row_bytes = K * bits / 8;
    if (q.shape[1] != row_bytes || sc.shape[0] != N || sc.shape[1] != nb ||
        (with_min && (mn.shape.size() != 2 || mn.shape[0] != N || mn.shape[1] != nb))) {
      std::snprintf(what, sizeof what,
                    "x [..., %lld] and bits %lld, block %lld need q [N, %lld] and scale%s [N, %lld]", (long long)K,
                    (long long)bits, (long long)block, (long long)row_bytes, with_min ? " and min" : "", (long long)nb);
      return fail(what);
    }
    std::vector<int64_t> dims(x.shape.begin(), x.shape.end() - 1);
    dims.push_back(N);
    Value* out = nullptr;
    void* o = nullptr;
    if (Status* s = ort.output(context, 0, dims.data(), dims.size(), &out)) return s;
    if (M == 0 || N == 0) return nullptr;
    if (Status* s = ort.data(out, &o)) return s;
    const float* X = static_cast<const float*>(x.data);
    // AVX-512F: x copied to 64-byte alignment where it is not (so that no load splits a line), and the block sums
    // aligned too
    std::vector<float> xa, bsum;
    const auto aligned = [](std::vector<float>& v) {
      return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
    };
    if (wide && (reinterpret_cast<uintptr_t>(X) & 63)) {
      xa.resize(M * K + 16);
      std::copy(X, X + M * K, aligned(xa));
      X = aligned(xa);
    }
    const int64_t nbp = (nb + 15) / 16 * 16;
    float* bs = nullptr;
    if (with_min) {  // each row's block sums: the block's chunks of 8 added lane-wise in order, then the tree
      bsum.assign(M * nbp + 16, 0.f);
      bs = aligned(bsum);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t b = 0; b < nb; ++b) {
          const float* xb = X + r * K + b * block;
          __m256 s = _mm256_loadu_ps(xb);
          for (int64_t i = 8; i < block; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xb + i));
          bs[r * nbp + b] = tree8(s);
        }
    }
    Problem p;
    p.x = X;
    p.q = static_cast<const uint8_t*>(q.data);
    p.scale = static_cast<const float*>(sc.data);
    p.min = with_min ? static_cast<const float*>(mn.data) : nullptr;
    p.bsum = bs;
    p.y = static_cast<float*>(o);
    p.M = M, p.N = N, p.K = K, p.nb = nb, p.nbp = nbp, p.row_bytes = row_bytes, p.zero = (int)zero;
    Task task{&p, (wide ? pick16 : pick)((int)bits, (int)block, zero != 0, with_min)};
    const size_t panels = (size_t)((N + kPanel - 1) / kPanel);
    if (panels == 1) {
      run_panel(&task, 0);
    } else if (Status* s = ort.parallel_for(context, run_panel, panels, 0, &task)) {
      return s;
    }
    if (p.failed) return fail("out of memory for a decoded panel");
    return nullptr;
  }
};

Status* create(const CustomOp*, Api api, const KernelInfo* info, void** kernel, bool with_min) {
  const Calls ort{api};
  const char* name = with_min ? "BlockMatMulMin" : "BlockMatMul";
  int64_t v[3];
  const char* attrs[3] = {"bits", "block", "zero"};
  char msg[256];
  for (int i = 0; i < 3; ++i)
    if (Status* s = ort.attribute(info, attrs[i], &v[i])) {
      ort.release(s);
      std::snprintf(msg, sizeof msg, "%s: no integer attribute '%s'", name, attrs[i]);
      return ort.error(kInvalidArgument, msg);
    }
  if ((v[0] != 4 && v[0] != 8) || (v[1] != 16 && v[1] != 32) || v[2] < 0 || v[2] > 255) {
    std::snprintf(msg, sizeof msg,
                  "%s: bits %lld, block %lld, zero %lld (it takes bits 4 or 8, block 16 or 32, zero 0..255)", name,
                  (long long)v[0], (long long)v[1], (long long)v[2]);
    return ort.error(kInvalidArgument, msg);
  }
  *kernel = new Kernel{ort, with_min, v[0], v[1], v[2], use_avx512()};
  return nullptr;
}

template <bool MIN>
CustomOp make_op() {
  CustomOp op = cpu_op<Kernel>();
  op.GetName = [](const CustomOp*) { return MIN ? "BlockMatMulMin" : "BlockMatMul"; };
  op.GetInputType = [](const CustomOp*, size_t i) -> int { return i == 1 ? kUInt8 : kFloat; };
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return MIN ? 4 : 3; };
  op.CreateKernelV2 = [](const CustomOp* o, Api api, const KernelInfo* info, void** kernel) -> Status* {
    return create(o, api, info, kernel, MIN);
  };
  return op;
}

}  // namespace

const CustomOp* dtrt_ort::block_matmul_op() {
  static const CustomOp op = make_op<false>();
  return &op;
}

const CustomOp* dtrt_ort::block_matmul_min_op() {
  static const CustomOp op = make_op<true>();
  return &op;
}
