// Ragged paged attention for the CPU, as an XLA FFI custom call (jaxserve.kernels.attention.cpu): prefill chunks and
// decode tokens of one step in one call, with the contract of reference.py (padding tokens get zeros).
//
// Why C++: XLA's CPU backend moves gathered K/V at about 1 ns per float whatever the access pattern, so a
// 64-sequence decode step spent more time gathering context than in all its matmuls, and a mixed step's prefill
// blocks ~0.2 s. Here each page slot's K/V rows are read in place, with the page loop outermost, so a page's
// [page_size, kv_heads, head_dim] block is streamed from memory once per work item.
//
// A work item is up to 16 query tokens of one sequence (a decode token is an item of one). Per page, per KV head,
// per 16 keys, float32 throughout: few rows (decodes: AttendBlockT) get the scores of each (token, query head) row
// as one 16-lane vector over the keys (one accumulator per key, reduced by a shuffle tree); 16 rows or more
// (prefill chunks: AttendRowsT) put the rows in the lanes instead. Then the causal / window mask and one
// online-softmax update (max, rescale, exp, P.V). bfloat16, fp8 and int8 pools are widened to float32 once per
// 16-key group (int8 rows times their scale: Int8Pages, one float32 scale per token and KV head).
// Items are claimed, most expensive first, through an atomic counter by the calling thread and by helpers
// scheduled on XLA's own intra-op thread pool: no thread is created per call, no more threads run than XLA's pool
// has, and uneven context lengths balance themselves. The step's new K/V rows are written in place by a second
// target (WriteKV).
// Layouts (see reference.py): q [T, Nq, H]; caches [L, P, S, K, H]; page_indices [Sb, PB]; cu_q_lens [Sb + 1];
// int8 caches' scales [L, P, S, K] (a second target, PagedAttentionInt8, takes them).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Pages ahead to prefetch, into L2 (locality 1): see AttendBlockT. No prefetch at all was 1.5x slower; into L1, 1.35x.
constexpr int64_t kPrefetchPages = 1;

// 16 floats (one AVX-512 register, two AVX ones), unaligned loads and stores allowed: GCC/Clang vector extensions.
// head_dim runs 16 at a time; the last head_dim % 16 elements are scalar. Vectors are loaded and stored by
// dereference (may_alias: they read float / int arrays) and reinterpreted by casts, never through std::memcpy: GCC 12
// tuned for an Intel Xeon it takes for Rocket Lake / Ice Lake (-march=native) copies 64 bytes as two 32-byte halves
// through the stack, and the paged attention ran 3.6x slower (a stalled store forward on every key).
typedef float V16 __attribute__((vector_size(64), aligned(4), may_alias));
constexpr int kWide = 16;

#define AJ_INLINE inline __attribute__((always_inline))

inline V16 Load16(const float* p) { return *reinterpret_cast<const V16*>(p); }

inline void Store16(float* p, V16 v) { *reinterpret_cast<V16*>(p) = v; }

// K/V elements: float32, or bfloat16 as its 16 raw bits (uint16_t), widened to float32 (a shift) by Widen before
// any product reads them.
typedef uint16_t U16x16 __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint32_t U32x16 __attribute__((vector_size(64), aligned(4)));

inline V16 LoadKV16(const float* p) { return Load16(p); }

inline V16 LoadKV16(const uint16_t* p) {
  const U32x16 w = __builtin_convertvector(*reinterpret_cast<const U16x16*>(p), U32x16) << 16;
  return (V16)w;
}

inline float ToFloat(float x) { return x; }

inline float ToFloat(uint16_t x) {
  const uint32_t w = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

// fp8 K/V elements (float8_e4m3fn, float8_e5m2: pools stored without scales) as their raw byte, widened to float32
// through a 256-entry table, as bfloat16's are by a shift.
struct E4M3 {
  uint8_t bits;
};
struct E5M2 {
  uint8_t bits;
};

// exp_bits 4 (e4m3fn: bias 7, no infinities, S.1111.111 is NaN) or 5 (e5m2: bias 15, IEEE-style inf / NaN).
struct Fp8Table {
  float value[256];
  explicit Fp8Table(int exp_bits) {
    const int man_bits = 7 - exp_bits, bias = (1 << (exp_bits - 1)) - 1, top = (1 << exp_bits) - 1;
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> man_bits) & top, m = b & ((1 << man_bits) - 1);
      const float sign = (b & 0x80) ? -1.0f : 1.0f;
      float v;
      if (exp_bits == 4 && e == top && m == (1 << man_bits) - 1) {
        v = std::numeric_limits<float>::quiet_NaN();
      } else if (exp_bits == 5 && e == top) {
        v = m == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
      } else if (e == 0) {
        v = std::ldexp(static_cast<float>(m), 1 - bias - man_bits);  // subnormal
      } else {
        v = std::ldexp(static_cast<float>(m + (1 << man_bits)), e - bias - man_bits);
      }
      value[b] = sign * v;
    }
  }
};

const Fp8Table kE4M3(4), kE5M2(5);

inline float ToFloat(E4M3 x) { return kE4M3.value[x.bits]; }
inline float ToFloat(E5M2 x) { return kE5M2.value[x.bits]; }

template <typename F8>
inline V16 LoadFp8x16(const F8* p) {
  alignas(64) float w[kWide];
  for (int j = 0; j < kWide; ++j) w[j] = ToFloat(p[j]);
  return Load16(w);
}

inline V16 LoadKV16(const E4M3* p) { return LoadFp8x16(p); }
inline V16 LoadKV16(const E5M2* p) { return LoadFp8x16(p); }

// int8 K/V elements (Int8Pages pools): converted to float32 16 at a time; WidenScaled then multiplies each row by
// its scale. The sign extension goes int8 -> int16 -> int32 one step at a time: GCC 12 turns a direct int8 -> int32
// (or -> float) conversion of the vector into 16 scalar ones (decode attention then took 2.4x bfloat16's time; this
// way about the same).
typedef int8_t I8x16 __attribute__((vector_size(16), aligned(1), may_alias));
typedef int16_t I16x16 __attribute__((vector_size(32), aligned(2)));
typedef int32_t I32x16 __attribute__((vector_size(64), aligned(4)));

inline V16 LoadKV16(const int8_t* p) {
  const I8x16 b = *reinterpret_cast<const I8x16*>(p);
  return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(b, I16x16), I32x16), V16);
}

inline float ToFloat(int8_t x) { return static_cast<float>(x); }

typedef int32_t I16 __attribute__((vector_size(64), aligned(4)));

// Merge<W>(x, y): x and y each hold 16 / W keys' partial sums in groups of W lanes; returns x's then y's keys, W / 2
// lanes each, every pair of partials added. Four levels (W = 16, 8, 4, 2) take 16 accumulators to one vector of 16
// dot products. Lane j of the result takes, from x (j < 8) or y, group (j % 8) / (W / 2)'s partial (j % 8) % (W / 2)
// (lo) plus the one W / 2 lanes after it (hi).
constexpr int MergeLane(int W, int j, bool hi) {
  return (j / 8) * 16 + ((j % 8) / (W / 2)) * W + (j % 8) % (W / 2) + (hi ? W / 2 : 0);
}

template <int W, int... J>
inline V16 MergeLanes(V16 x, V16 y, std::integer_sequence<int, J...>) {
  return __builtin_shufflevector(x, y, MergeLane(W, J, false)...) +
         __builtin_shufflevector(x, y, MergeLane(W, J, true)...);
}

template <int W>
inline V16 Merge(V16 x, V16 y) {
  return MergeLanes<W>(x, y, std::make_integer_sequence<int, kWide>{});
}

// Horizontal max and sum of 16 lanes: four shuffle-and-combine levels.
template <typename Op>
inline float Reduce16(V16 v, Op op) {
  v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

inline float Max16(V16 v) {
  return Reduce16(v, [](V16 x, V16 y) { return x > y ? x : y; });
}

inline float Sum16(V16 v) {
  return Reduce16(v, [](V16 x, V16 y) { return x + y; });
}

// a[c] += q[0 : 16 NS] . k_c[0 : 16 NS] for the 16 keys k_c = k + min(c, n - 1) * stride: the query slices stay
// in registers, one key row at a time is streamed through them (one pointer live, immediate offsets).
template <int NS>
AJ_INLINE void DotBlock(V16* a, const float* q, const float* k, int64_t stride, int64_t n) {
  V16 qv[NS];
  for (int u = 0; u < NS; ++u) qv[u] = Load16(q + u * kWide);
#pragma GCC unroll 16
  for (int c = 0; c < kWide; ++c) {
    const float* kc = k + (c < n ? c : n - 1) * stride;
    V16 d = qv[0] * Load16(kc);
    for (int u = 1; u < NS; ++u) d += qv[u] * Load16(kc + u * kWide);
    a[c] += d;
  }
}

// Lane c: q . k_c for the keys k_c = k + min(c, n - 1) * stride, c < 16 (lanes past n repeat the last key, so
// nothing past the n real keys is read). One accumulator per key, then the Merge tree instead of 16 horizontal sums.
AJ_INLINE V16 Scores16(const float* q, const float* k, int64_t stride, int64_t n, int64_t H) {
  const int64_t hw = H - H % kWide;
  V16 a[kWide] = {};
  int64_t j = 0;
  for (; j + 4 * kWide <= hw; j += 4 * kWide) DotBlock<4>(a, q + j, k + j, stride, n);
  switch ((hw - j) / kWide) {
    case 3: DotBlock<3>(a, q + j, k + j, stride, n); break;
    case 2: DotBlock<2>(a, q + j, k + j, stride, n); break;
    case 1: DotBlock<1>(a, q + j, k + j, stride, n); break;
    default: break;
  }
  V16 b[8], d[4], e[2];
  for (int i = 0; i < 8; ++i) b[i] = Merge<16>(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 4; ++i) d[i] = Merge<8>(b[2 * i], b[2 * i + 1]);
  for (int i = 0; i < 2; ++i) e[i] = Merge<4>(d[2 * i], d[2 * i + 1]);
  V16 s = Merge<2>(e[0], e[1]);
  for (j = hw; j < H; ++j) {  // the scalar tail of head_dim % 16
    for (int c = 0; c < kWide; ++c) s[c] += q[j] * k[(c < n ? c : n - 1) * stride + j];
  }
  return s;
}

// exp(x) for x <= 0 (scores minus their running max), 16 at a time: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2,
// p a degree-6 polynomial (relative error < 2e-7 over the range); x < -87 (and -inf) gives exactly 0.
AJ_INLINE V16 ExpNonPositive16(V16 x) {
  const float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  const float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer (round to nearest)
  const I16 tiny = x < -87.0f;
  const V16 zero = {};
  x = tiny ? zero : x;
  const V16 n = (x * kLog2e + kRound) - kRound;
  const V16 r = (x - n * kLn2Hi) - n * kLn2Lo;
  V16 p = r * (1.0f / 720) + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const V16 out = (V16)((I16)p + (__builtin_convertvector(n, I16) << 23));
  return tiny ? zero : out;
}

inline float ExpNonPositive(float x) {
  V16 v = {};
  v[0] = x;
  return ExpNonPositive16(v)[0];
}

// acc = acc * alpha + sum_c p[c] v_c for one block of NS 16-float slices: the slices stay in registers over all n
// keys, NS independent chains.
template <int NS>
AJ_INLINE void AccumulatePVBlock(float* acc, float alpha, const float* p, const float* v, int64_t stride,
                                 int64_t n) {
  V16 a[NS];
  for (int u = 0; u < NS; ++u) a[u] = Load16(acc + u * kWide) * alpha;
  for (int64_t c = 0; c < n; ++c) {
    const float* vc = v + c * stride;
    for (int u = 0; u < NS; ++u) a[u] += p[c] * Load16(vc + u * kWide);
  }
  for (int u = 0; u < NS; ++u) Store16(acc + u * kWide, a[u]);
}

// acc = acc * alpha + sum_c p[c] v_c over head_dim H: blocks of up to four slices, then the scalar tail.
AJ_INLINE void AccumulatePV(float* acc, float alpha, const float* p, const float* v, int64_t stride, int64_t n,
                            int64_t H) {
  const int64_t hw = H - H % kWide;
  int64_t j = 0;
  for (; j + 4 * kWide <= hw; j += 4 * kWide) AccumulatePVBlock<4>(acc + j, alpha, p, v + j, stride, n);
  switch ((hw - j) / kWide) {
    case 3: AccumulatePVBlock<3>(acc + j, alpha, p, v + j, stride, n); break;
    case 2: AccumulatePVBlock<2>(acc + j, alpha, p, v + j, stride, n); break;
    case 1: AccumulatePVBlock<1>(acc + j, alpha, p, v + j, stride, n); break;
    default: break;
  }
  for (j = hw; j < H; ++j) {
    float a = acc[j] * alpha;
    for (int64_t c = 0; c < n; ++c) a += p[c] * v[c * stride + j];
    acc[j] = a;
  }
}

// dst [n, H] (contiguous) = src rows n x H (row stride ``stride``), widened to float32.
template <typename T>
inline void Widen(const T* src, int64_t stride, int64_t n, int64_t H, float* dst) {
  const int64_t hw = H - H % kWide;
  for (int64_t c = 0; c < n; ++c) {
    for (int64_t j = 0; j < hw; j += kWide) Store16(dst + c * H + j, LoadKV16(src + c * stride + j));
    for (int64_t j = hw; j < H; ++j) dst[c * H + j] = ToFloat(src[c * stride + j]);
  }
}

// Widen for int8 rows: row c times its scale scales[c * sstride], one float32 product per element (as
// reference.py's dequantize_rows, so the widened rows are bit for bit the reference's).
inline void WidenScaled(const int8_t* src, int64_t stride, const float* scales, int64_t sstride, int64_t n, int64_t H,
                        float* dst) {
  const int64_t hw = H - H % kWide;
  for (int64_t c = 0; c < n; ++c) {
    const float s = scales[c * sstride];
    for (int64_t j = 0; j < hw; j += kWide) Store16(dst + c * H + j, LoadKV16(src + c * stride + j) * s);
    for (int64_t j = hw; j < H; ++j) dst[c * H + j] = ToFloat(src[c * stride + j]) * s;
  }
}

struct Geometry {
  int64_t num_tokens, num_q_heads, head_dim;
  int64_t num_pages, page_size, kv_heads;
  int64_t pages_per_seq;
  int64_t layer;
  int32_t window;
  float sm_scale, soft_cap;
  // int8 pools only (T = int8_t): the K and V scales [L, P, S, K]; the scale of row (page, slot, KV head) of the
  // layer is at ((layer * num_pages + page) * page_size + slot) * kv_heads + head.
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  // Attention sinks (gpt-oss): one logit per query head in every row's softmax denominator, no value; null: none.
  // A row starts as if it had seen one key of score sinks[head] and value 0: running max sinks[head], sum 1.
  const float* sinks = nullptr;

  // The first key a query token at ``pos`` sees: 0, or the start of its sliding window.
  int64_t FirstVisible(int64_t pos) const { return window > 0 ? std::max<int64_t>(pos - window + 1, 0) : 0; }
};

// Query tokens [tok0, tok0 + ntok) of one sequence, at context positions pos0, pos0 + 1, ...: writes their output
// rows. A decode token is a block of one. Token i sees the keys [lo_i, pos0 + i] (causal; lo_i from the sliding
// window). Pages are walked once, in order, 16 keys at a time; every (token, query head) row keeps its own online
// softmax, and the rows sharing a KV head reuse its keys from L1.
// HD: head_dim as a compile-time constant (the common sizes), or 0 for any head_dim.
template <int HD, typename T>
void AttendBlockT(const Geometry& g, const float* q, const T* k_cache, const T* v_cache, const int32_t* pages,
                  int64_t tok0, int64_t ntok, int64_t pos0, float* out, std::vector<float>& scratch) {
  const int64_t H = HD > 0 ? HD : g.head_dim, K = g.kv_heads, Nq = g.num_q_heads, S = g.page_size;
  const int64_t group = Nq / K, rows = ntok * Nq, stride = K * H;
  const int64_t last = pos0 + ntok - 1;  // the last token's position: no key past it is read
  // scratch: m [rows], l [rows], acc [rows, H], kbuf [16, H], vbuf [16, H]
  scratch.assign(rows * (2 + H) + 2 * kWide * H, 0.0f);
  float* m = scratch.data();
  float* l = m + rows;
  float* acc = l + rows;
  float* kbuf = acc + rows * H;
  float* vbuf = kbuf + kWide * H;
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  if (g.sinks != nullptr) {
    for (int64_t r = 0; r < rows; ++r) m[r] = g.sinks[r % Nq], l[r] = 1.0f;
  }
  const int64_t layer_base = g.layer * g.num_pages;
  const int64_t page_bytes = S * K * H * static_cast<int64_t>(sizeof(T));
  const I16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const V16 neg_inf = V16{} - std::numeric_limits<float>::infinity();
  alignas(64) float p[kWide];
  const int64_t start = std::max<int64_t>(g.FirstVisible(pos0), 0);
  for (int64_t first = (start / S) * S; first <= last; first += S) {
    const int64_t page = pages[first / S];
    const T* kp = k_cache + (layer_base + page) * S * stride;
    const T* vp = v_cache + (layer_base + page) * S * stride;
    const int64_t scale_base = (layer_base + page) * S * K;  // int8: the page's first scale
    // Fetch the page kPrefetchPages ahead into L2, one slice per (KV head, query head) row of this page's work, so
    // the requests spread over it: a 64-sequence decode from a pool in DRAM, one thread, took 132 ms with one burst
    // per KV head two pages ahead, 116 with a slice per row, 92-106 with a slice per row one page ahead.
    const int64_t ahead = first + kPrefetchPages * S;
    const char *kn = nullptr, *vn = nullptr;
    if (ahead <= last) {
      const int64_t next = pages[ahead / S];
      kn = reinterpret_cast<const char*>(k_cache + (layer_base + next) * S * stride);
      vn = reinterpret_cast<const char*>(v_cache + (layer_base + next) * S * stride);
      if constexpr (std::is_same_v<T, int8_t>) {  // the next page's scales (S * K floats) in one burst
        const char* ks = reinterpret_cast<const char*>(g.k_scales + (layer_base + next) * S * K);
        const char* vs = reinterpret_cast<const char*>(g.v_scales + (layer_base + next) * S * K);
        for (int64_t b = 0; b < S * K * static_cast<int64_t>(sizeof(float)); b += 64) {
          __builtin_prefetch(ks + b, 0, 1);
          __builtin_prefetch(vs + b, 0, 1);
        }
      }
    }
    for (int64_t kh = 0; kh < K; ++kh) {
      for (int64_t c0 = std::max(first, start); c0 < std::min(first + S, last + 1); c0 += kWide) {
        const int64_t nb = std::min<int64_t>({kWide, first + S - c0, last + 1 - c0});  // keys of this group
        const T* kg = kp + (c0 - first) * stride + kh * H;
        const T* vg = vp + (c0 - first) * stride + kh * H;
        // float32 rows of this group's keys and values: in place, or (bfloat16, fp8, int8) widened once into kbuf /
        // vbuf for all the rows that read them (widening on every load made a prefill chunk 1.9x slower than from
        // float32).
        const float *kf, *vf;
        int64_t fs;
        if constexpr (std::is_same_v<T, float>) {
          kf = kg, vf = vg, fs = stride;
        } else if constexpr (std::is_same_v<T, int8_t>) {
          const int64_t si = scale_base + (c0 - first) * K + kh;  // the group's first key's scale; then every K
          WidenScaled(kg, stride, g.k_scales + si, K, nb, H, kbuf);
          WidenScaled(vg, stride, g.v_scales + si, K, nb, H, vbuf);
          kf = kbuf, vf = vbuf, fs = H;
        } else {
          Widen(kg, stride, nb, H, kbuf);
          Widen(vg, stride, nb, H, vbuf);
          kf = kbuf, vf = vbuf, fs = H;
        }
        // The first rows to read this page's first group of this KV head each fetch one slice of the next page.
        bool fetch = kn != nullptr && c0 == std::max(first, start);
        for (int64_t i = 0; i < ntok; ++i) {
          const int64_t pos = pos0 + i;
          const int64_t vlo = std::max(g.FirstVisible(pos), c0), vhi = std::min(pos + 1, c0 + nb);  // visible keys
          if (vlo >= vhi) continue;
          const I16 visible = (lane >= static_cast<int32_t>(vlo - c0)) & (lane < static_cast<int32_t>(vhi - c0));
          for (int64_t gi = 0; gi < group; ++gi) {
            const int64_t r = i * Nq + kh * group + gi;
            if (fetch) {
              const int64_t slice = kh * group + gi, slices = K * group;
              for (int64_t b = page_bytes * slice / slices; b < page_bytes * (slice + 1) / slices; b += 64) {
                __builtin_prefetch(kn + b, 0, 1);
                __builtin_prefetch(vn + b, 0, 1);
              }
            }
            V16 x = Scores16(q + ((tok0 + i) * Nq + kh * group + gi) * H, kf, fs, nb, H) * g.sm_scale;
            if (g.soft_cap > 0) {
              for (int c = 0; c < kWide; ++c) x[c] = g.soft_cap * std::tanh(x[c] / g.soft_cap);
            }
            x = visible ? x : neg_inf;
            const float mx = std::max(m[r], Max16(x));
            const float alpha = ExpNonPositive(m[r] - mx);  // m[r] = -inf on the first keys: alpha = 0
            const V16 e = ExpNonPositive16(x - mx);
            Store16(p, e);
            l[r] = l[r] * alpha + Sum16(e);
            m[r] = mx;
            // P.V over the visible keys only: a slot past kv_len may hold anything (NaN), and 0 * NaN is NaN.
            AccumulatePV(acc + r * H, alpha, p + (vlo - c0), vf + (vlo - c0) * fs, fs, vhi - vlo, H);
          }
          fetch = false;
        }
      }
    }
  }
  for (int64_t i = 0; i < ntok; ++i) {
    for (int64_t h = 0; h < Nq; ++h) {
      const int64_t r = i * Nq + h;
      const float inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;
      float* o = out + ((tok0 + i) * Nq + h) * H;
      for (int64_t d = 0; d < H; ++d) o[d] = acc[r * H + d] * inv;
    }
  }
}

// Multi-token blocks (prefill chunks), head_dim HD known at compile time: the same online softmax with the rows in
// the lanes. Per KV head, the block's (token, query head) rows form lane groups of 16; a group keeps its queries
// transposed ([HD][16], pre-scaled), its running max / sum as vectors and its accumulator transposed ([HD][16]).
// Per 16 keys: s[c] = sum_h qT[h] * k_c[h] (one broadcast key element per product, no horizontal sums), the causal /
// window mask per lane, max / exp / sum across the 16 score vectors, then accT[h] += sum_c p[c] * v_c[h]. The keys and
// values of each 16-key group are first copied (widened) into contiguous float32 buffers, so every broadcast is at a
// compile-time offset. Same float32 products as AttendBlockT, without its per-row shuffle trees and scalar softmax.
template <int HD, typename T>
void AttendRowsT(const Geometry& g, const float* q, const T* k_cache, const T* v_cache, const int32_t* pages,
                 int64_t tok0, int64_t ntok, int64_t pos0, float* out, std::vector<float>& scratch) {
  const int64_t K = g.kv_heads, Nq = g.num_q_heads, S = g.page_size, group = Nq / K, stride = K * HD;
  const int64_t rows = ntok * group, lanes = (rows + kWide - 1) / kWide;  // per KV head
  const int64_t last = pos0 + ntok - 1;
  // scratch per (KV head, lane group): qT [HD][16], accT [HD][16], m [16], l [16]; then kbuf, vbuf [16][HD]
  const int64_t per = 2 * HD * kWide + 2 * kWide;
  scratch.assign(K * lanes * per + 2 * kWide * HD, 0.0f);
  float* kbuf = scratch.data() + K * lanes * per;
  float* vbuf = kbuf + kWide * HD;
  std::vector<I16> pos_v(lanes), lo_v(lanes);  // per lane group: each lane's position, first visible key
  std::vector<int64_t> max_pos(lanes), min_lo(lanes);  // and the group's bounds: its keys lie within them
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t lg = 0; lg < lanes; ++lg) {
    for (int u = 0; u < kWide; ++u) {
      const int64_t r = lg * kWide + u;
      pos_v[lg][u] = r < rows ? static_cast<int32_t>(pos0 + r / group) : -1;
      lo_v[lg][u] = r < rows ? static_cast<int32_t>(g.FirstVisible(pos0 + r / group)) : 0;
    }
    const int64_t r_last = std::min(rows, (lg + 1) * kWide) - 1;  // rows run in token order
    max_pos[lg] = pos0 + r_last / group;
    min_lo[lg] = g.FirstVisible(pos0 + lg * kWide / group);
  }
  for (int64_t kh = 0; kh < K; ++kh) {
    for (int64_t lg = 0; lg < lanes; ++lg) {
      float* base = scratch.data() + (kh * lanes + lg) * per;
      for (int u = 0; u < kWide; ++u) {
        const int64_t r = lg * kWide + u;
        if (r >= rows) continue;
        const float* qr = q + ((tok0 + r / group) * Nq + kh * group + r % group) * HD;
        for (int64_t h = 0; h < HD; ++h) base[h * kWide + u] = qr[h] * g.sm_scale;
      }
      std::fill(base + 2 * HD * kWide, base + 2 * HD * kWide + kWide, neg_inf);  // m
      if (g.sinks != nullptr) {  // m = the row's sink, l = 1
        for (int u = 0; u < kWide && lg * kWide + u < rows; ++u) {
          base[2 * HD * kWide + u] = g.sinks[kh * group + (lg * kWide + u) % group];
          base[2 * HD * kWide + kWide + u] = 1.0f;
        }
      }
    }
  }
  const int64_t layer_base = g.layer * g.num_pages;
  const int64_t start = std::max<int64_t>(g.FirstVisible(pos0), 0);
  const I16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const V16 ninf = V16{} + neg_inf, zero = {};
  for (int64_t first = (start / S) * S; first <= last; first += S) {
    const T* kp = k_cache + (layer_base + pages[first / S]) * S * stride;
    const T* vp = v_cache + (layer_base + pages[first / S]) * S * stride;
    const int64_t scale_base = (layer_base + pages[first / S]) * S * K;  // int8: the page's first scale
    for (int64_t kh = 0; kh < K; ++kh) {
      for (int64_t c0 = std::max(first, start); c0 < std::min(first + S, last + 1); c0 += kWide) {
        const int64_t nb = std::min<int64_t>({kWide, first + S - c0, last + 1 - c0});
        // rows past nb repeat the last key: finite data, masked out of the scores, zero weight in P.V
        for (int64_t c = 0; c < kWide; ++c) {
          const int64_t cc = std::min(c, nb - 1);
          if constexpr (std::is_same_v<T, int8_t>) {
            const int64_t si = scale_base + (c0 - first + cc) * K + kh;
            WidenScaled(kp + (c0 - first + cc) * stride + kh * HD, stride, g.k_scales + si, K, 1, HD, kbuf + c * HD);
            WidenScaled(vp + (c0 - first + cc) * stride + kh * HD, stride, g.v_scales + si, K, 1, HD, vbuf + c * HD);
          } else {
            Widen(kp + (c0 - first + cc) * stride + kh * HD, stride, 1, HD, kbuf + c * HD);
            Widen(vp + (c0 - first + cc) * stride + kh * HD, stride, 1, HD, vbuf + c * HD);
          }
        }
        for (int64_t lg = 0; lg < lanes; ++lg) {
          float* qT = scratch.data() + (kh * lanes + lg) * per;
          float* accT = qT + HD * kWide;
          float* m = accT + HD * kWide;
          float* l = m + kWide;
          if (c0 > max_pos[lg] || c0 + nb - 1 < min_lo[lg]) continue;  // every lane's keys are elsewhere
          const I16 pv = pos_v[lg], lv = lo_v[lg];
          V16 sc[kWide];
          for (int c = 0; c < kWide; ++c) sc[c] = zero;
          for (int64_t h = 0; h < HD; ++h) {
            const V16 qv = Load16(qT + h * kWide);
#pragma GCC unroll 16
            for (int c = 0; c < kWide; ++c) sc[c] += qv * kbuf[c * HD + h];
          }
          V16 mx = Load16(m);
          for (int c = 0; c < kWide; ++c) {
            if (g.soft_cap > 0) {
              for (int u = 0; u < kWide; ++u) sc[c][u] = g.soft_cap * std::tanh(sc[c][u] / g.soft_cap);
            }
            const int32_t key = static_cast<int32_t>(c0 + c);
            const I16 ok = (key <= pv) & (key >= lv) & (c < nb ? I16{} - 1 : I16{});
            sc[c] = ok ? sc[c] : ninf;
            mx = mx > sc[c] ? mx : sc[c];
          }
          const V16 m_old = Load16(m);
          const V16 m_safe = mx == ninf ? zero : mx;  // a lane that has seen nothing yet keeps zeros
          const V16 alpha = ExpNonPositive16(m_old - m_safe);
          V16 sum = zero;
          for (int c = 0; c < kWide; ++c) {
            sc[c] = ExpNonPositive16(sc[c] - m_safe);
            sum += sc[c];
          }
          Store16(l, Load16(l) * alpha + sum);
          Store16(m, mx);
          for (int64_t h0 = 0; h0 < HD; h0 += 8) {
            V16 a[8];
            for (int j = 0; j < 8; ++j) a[j] = Load16(accT + (h0 + j) * kWide) * alpha;
#pragma GCC unroll 16
            for (int c = 0; c < kWide; ++c) {
              for (int j = 0; j < 8; ++j) a[j] += sc[c] * vbuf[c * HD + h0 + j];
            }
            for (int j = 0; j < 8; ++j) Store16(accT + (h0 + j) * kWide, a[j]);
          }
        }
      }
    }
  }
  for (int64_t kh = 0; kh < K; ++kh) {
    for (int64_t lg = 0; lg < lanes; ++lg) {
      const float* accT = scratch.data() + (kh * lanes + lg) * per + HD * kWide;
      const float* l = accT + HD * kWide + kWide;
      for (int u = 0; u < kWide; ++u) {
        const int64_t r = lg * kWide + u;
        if (r >= rows) continue;
        const float inv = l[u] > 0 ? 1.0f / l[u] : 0.0f;
        float* o = out + ((tok0 + r / group) * Nq + kh * group + r % group) * HD;
        for (int64_t h = 0; h < HD; ++h) o[h] = accT[h * kWide + u] * inv;
      }
    }
  }
}

template <typename T>
void AttendBlock(const Geometry& g, const float* q, const T* k_cache, const T* v_cache, const int32_t* pages,
                 int64_t tok0, int64_t ntok, int64_t pos0, float* out, std::vector<float>& scratch) {
  const bool rows = ntok * (g.num_q_heads / g.kv_heads) >= kWide;  // enough rows to fill the lanes
  switch (g.head_dim) {
    case 64:
      if (rows) return AttendRowsT<64, T>(g, q, k_cache, v_cache, pages, tok0, ntok, pos0, out, scratch);
      return AttendBlockT<64, T>(g, q, k_cache, v_cache, pages, tok0, ntok, pos0, out, scratch);
    case 128:
      if (rows) return AttendRowsT<128, T>(g, q, k_cache, v_cache, pages, tok0, ntok, pos0, out, scratch);
      return AttendBlockT<128, T>(g, q, k_cache, v_cache, pages, tok0, ntok, pos0, out, scratch);
    default: return AttendBlockT<0, T>(g, q, k_cache, v_cache, pages, tok0, ntok, pos0, out, scratch);
  }
}

// Claims chunks [0, chunks) on the calling thread and up to ``helpers`` of XLA's pool threads (no thread is created
// per call); returns when every claimed chunk is done. The shared state outlives the call: a helper that starts
// after it has returned finds no chunk left and touches nothing else.
template <typename Fn>
void RunChunks(ffi::ThreadPool& pool, int64_t chunks, int64_t helpers, Fn run) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto claim = [=](Shared& st) {
    for (int64_t c = st.next.fetch_add(1); c < chunks; c = st.next.fetch_add(1)) {
      run(c);
      st.done.fetch_add(1, std::memory_order_release);
    }
  };
  helpers = std::max<int64_t>(0, std::min<int64_t>(pool.num_threads() - 1, helpers));
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([shared, claim]() { claim(*shared); });
  claim(*shared);
  while (shared->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

// Query tokens per work item: a block's rows keep their softmax state in L1/L2 (16 x 9 heads x 64: 37 KB).
constexpr int64_t kBlockTokens = 16;

struct WorkItem {
  int64_t seq, tok0, ntok, pos0, cost;
};

// k_scales, v_scales: the [L, P, S, K] scales of int8 caches (T = int8_t, shapes checked by the caller), else null.
template <typename T>
ffi::Error PagedAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
                              ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window,
                              ffi::Buffer<ffi::F32> sinks, float sm_scale, float soft_cap, ffi::ThreadPool pool,
                              ffi::ResultBuffer<ffi::F32> out, const float* k_scales = nullptr,
                              const float* v_scales = nullptr) {
  auto qd = q.dimensions();
  auto cd = k_cache.dimensions();
  auto pd = page_indices.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || pd.size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q must be rank 3, caches rank 5, page_indices rank 2");
  }
  Geometry g{qd[0], qd[1], qd[2], cd[1], cd[2], cd[3], pd[1], 0, 0, sm_scale, soft_cap, k_scales, v_scales};
  if (cd[4] != g.head_dim || g.num_q_heads % g.kv_heads != 0) {
    return ffi::Error::InvalidArgument("paged attention: head_dim or head counts do not match");
  }
  g.layer = layer.typed_data()[0];
  g.window = window.typed_data()[0];
  if (sinks.element_count() != 0) {  // [num_q_heads] logits, or empty: no sinks
    if (sinks.element_count() != g.num_q_heads) {
      return ffi::Error::InvalidArgument("paged attention: sinks must hold one logit per query head");
    }
    g.sinks = sinks.typed_data();
  }
  if (g.layer < 0 || g.layer >= cd[0]) return ffi::Error::InvalidArgument("paged attention: layer out of range");
  const int64_t seqs = std::min<int64_t>(num_seqs.typed_data()[0], pd[0]);
  const int32_t* cu = cu_q_lens.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* table = page_indices.typed_data();
  float* o = out->typed_data();
  const float* qp = q.typed_data();
  const T* kc = reinterpret_cast<const T*>(k_cache.untyped_data());
  const T* vc = reinterpret_cast<const T*>(v_cache.untyped_data());

  std::vector<char> covered(g.num_tokens, 0);
  std::vector<WorkItem> work;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t q_len = cu[s + 1] - cu[s], kv_len = lens[s];
    if (q_len <= 0) continue;
    if (cu[s] < 0 || cu[s + 1] > g.num_tokens) {
      return ffi::Error::InvalidArgument("paged attention: cu_q_lens out of range");
    }
    if (kv_len > g.pages_per_seq * g.page_size) {
      return ffi::Error::InvalidArgument("paged attention: kv_len longer than the page table");
    }
    // a page table entry outside the pool would read out of bounds: refuse the call
    for (int64_t i = 0; i < (kv_len + g.page_size - 1) / g.page_size; ++i) {
      const int32_t p = table[s * g.pages_per_seq + i];
      if (p < 0 || p >= g.num_pages) return ffi::Error::InvalidArgument("paged attention: page index out of range");
    }
    std::fill(covered.begin() + cu[s], covered.begin() + cu[s + 1], 1);
    for (int64_t t = 0; t < q_len; t += kBlockTokens) {
      const int64_t ntok = std::min(kBlockTokens, q_len - t), pos0 = kv_len - q_len + t;
      // tokens before the context's start (a chunk longer than its kv_len) see nothing: zero rows
      const int64_t skip = std::min(ntok, std::max<int64_t>(-pos0, 0));
      std::fill(covered.begin() + cu[s] + t, covered.begin() + cu[s] + t + skip, 0);
      if (skip == ntok) continue;
      const int64_t ctx = g.window > 0 ? std::min<int64_t>(pos0 + ntok, g.window + ntok) : pos0 + ntok;
      work.push_back({s, cu[s] + t + skip, ntok - skip, pos0 + skip, ntok * ctx});
    }
  }
  const int64_t row = g.num_q_heads * g.head_dim;
  for (int64_t t = 0; t < g.num_tokens; ++t) {
    if (!covered[t]) std::fill(o + t * row, o + (t + 1) * row, 0.0f);
  }
  // The most expensive items first, so the last ones to be claimed are short and the threads finish together.
  std::stable_sort(work.begin(), work.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  const int64_t n = static_cast<int64_t>(work.size());
  RunChunks(pool, n, n / 2, [&](int64_t i) {
    thread_local std::vector<float> scratch;  // one per thread, kept between calls
    const WorkItem& w = work[i];
    AttendBlock(g, qp, kc, vc, table + w.seq * g.pages_per_seq, w.tok0, w.ntok, w.pos0, o, scratch);
  });
  return ffi::Error::Success();
}

// The step's new K/V rows into one layer of the pool, in place: the caches are aliased to the outputs
// (input_output_aliases), so with a donated pool only the T new rows move. XLA:CPU's scatter into the pool took
// ~1 ms per layer for 64 rows (57 ms of a 64-sequence decode step). Token t goes to slot_mapping[t] =
// page * page_size + offset; a negative slot, or one past the pool (as the reference's mode="drop"), writes nothing.
// Also [T, K] rows into [L, P, S, K]: an Int8Pages pool's scales, written in place beside its values (passing them
// as [L, P, S, K, 1] made XLA copy the whole scales pool on every call).
template <typename T>
ffi::Error WriteKVImpl(ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer new_k, ffi::AnyBuffer new_v,
                       ffi::Buffer<ffi::S32> slots, ffi::AnyBuffer k_out, ffi::AnyBuffer v_out) {
  auto cd = k_out.dimensions();
  auto nd = new_k.dimensions();
  const bool rank5 = cd.size() == 5 && nd.size() == 3 && nd[2] == cd[4];
  if (!(rank5 || (cd.size() == 4 && nd.size() == 2)) || nd[1] != cd[3] ||
      slots.element_count() != static_cast<size_t>(nd[0])) {
    return ffi::Error::InvalidArgument(
        "write_kv: shapes do not match ([T, K, H] rows into [L, P, S, K, H], or [T, K] into [L, P, S, K])");
  }
  const int64_t l = layer.typed_data()[0], pool = cd[1] * cd[2], row = cd[3] * (rank5 ? cd[4] : 1);
  if (l < 0 || l >= cd[0]) return ffi::Error::InvalidArgument("write_kv: layer out of range");
  const T* nk = reinterpret_cast<const T*>(new_k.untyped_data());
  const T* nv = reinterpret_cast<const T*>(new_v.untyped_data());
  T* kc = reinterpret_cast<T*>(k_out.untyped_data()) + l * pool * row;
  T* vc = reinterpret_cast<T*>(v_out.untyped_data()) + l * pool * row;
  const int32_t* sl = slots.typed_data();
  for (int64_t t = 0; t < nd[0]; ++t) {
    if (sl[t] < 0 || sl[t] >= pool) continue;
    std::memcpy(kc + sl[t] * row, nk + t * row, row * sizeof(T));
    std::memcpy(vc + sl[t] * row, nv + t * row, row * sizeof(T));
  }
  return ffi::Error::Success();
}

ffi::Error WriteKV(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer,
                   ffi::AnyBuffer new_k, ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                   ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const auto dt = k_cache.element_type();
  if (v_cache.element_type() != dt || new_k.element_type() != dt || new_v.element_type() != dt) {
    return ffi::Error::InvalidArgument("write_kv: caches and new rows must share one dtype");
  }
  switch (ffi::ByteWidth(dt)) {
    case 4: return WriteKVImpl<uint32_t>(layer, new_k, new_v, slots, *k_out, *v_out);
    case 2: return WriteKVImpl<uint16_t>(layer, new_k, new_v, slots, *k_out, *v_out);
    case 1: return WriteKVImpl<uint8_t>(layer, new_k, new_v, slots, *k_out, *v_out);
    default: return ffi::Error::InvalidArgument("write_kv: 1-, 2- or 4-byte elements only");
  }
}

ffi::Error PagedAttention(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                          ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window,
                          ffi::Buffer<ffi::F32> sinks, float sm_scale, float soft_cap, ffi::ThreadPool pool,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto dt = k_cache.element_type();
  if (v_cache.element_type() != dt) return ffi::Error::InvalidArgument("paged attention: K and V dtypes differ");
  if (dt == ffi::DataType::F32) {
    return PagedAttentionImpl<float>(q, k_cache, v_cache, layer, kv_lens, page_indices, cu_q_lens, num_seqs, window,
                                     sinks, sm_scale, soft_cap, pool, out);
  }
  if (dt == ffi::DataType::BF16) {
    return PagedAttentionImpl<uint16_t>(q, k_cache, v_cache, layer, kv_lens, page_indices, cu_q_lens, num_seqs,
                                        window, sinks, sm_scale, soft_cap, pool, out);
  }
  if (dt == ffi::DataType::F8E4M3FN) {
    return PagedAttentionImpl<E4M3>(q, k_cache, v_cache, layer, kv_lens, page_indices, cu_q_lens, num_seqs, window,
                                    sinks, sm_scale, soft_cap, pool, out);
  }
  if (dt == ffi::DataType::F8E5M2) {
    return PagedAttentionImpl<E5M2>(q, k_cache, v_cache, layer, kv_lens, page_indices, cu_q_lens, num_seqs, window,
                                    sinks, sm_scale, soft_cap, pool, out);
  }
  return ffi::Error::InvalidArgument("paged attention: caches must be float32, bfloat16, float8_e4m3fn or float8_e5m2");
}

// PagedAttention over int8 caches (Int8Pages): the values [L, P, S, K, H] and their float32 scales [L, P, S, K].
ffi::Error PagedAttentionInt8(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                              ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
                              ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window,
                              ffi::Buffer<ffi::F32> sinks, float sm_scale, float soft_cap, ffi::ThreadPool pool,
                              ffi::ResultBuffer<ffi::F32> out) {
  if (k_cache.element_type() != ffi::DataType::S8 || v_cache.element_type() != ffi::DataType::S8) {
    return ffi::Error::InvalidArgument("paged attention (int8): caches must be int8");
  }
  auto cd = k_cache.dimensions(), vd = v_cache.dimensions();
  auto ks = k_scales.dimensions(), vs = v_scales.dimensions();
  if (cd.size() != 5 || vd.size() != 5 || ks.size() != 4 || vs.size() != 4) {
    return ffi::Error::InvalidArgument("paged attention (int8): caches must be rank 5, scales rank 4");
  }
  for (int i = 0; i < 5; ++i) {
    if (vd[i] != cd[i] || (i < 4 && (ks[i] != cd[i] || vs[i] != cd[i]))) {
      return ffi::Error::InvalidArgument("paged attention (int8): scales must be [L, P, S, K], caches [L, P, S, K, H]");
    }
  }
  return PagedAttentionImpl<int8_t>(q, k_cache, v_cache, layer, kv_lens, page_indices, cu_q_lens, num_seqs, window,
                                    sinks, sm_scale, soft_cap, pool, out, k_scales.typed_data(),
                                    v_scales.typed_data());
}

// Products of a few float32 rows (M <= kMaxRows: one step's decode tokens) by a weight matrix, float32
// accumulation, for the layer scan's matrices read in place: w is one matrix [K, N] or a stack of them [L, K, N] and
// the call takes the layer's index, so no per-layer slice is copied out of the stack first (a custom call's operand
// is a whole buffer: scan's dynamic slice of its weights copied each layer's matrix, every step).
// - MatmulRows: bfloat16 weights (or uint32 pairs of them, the same memory), or float32 ones. XLA:CPU's own
//   products on bfloat16 weights are pathological below 8 rows (a [1, 576] x [576, 3072] product reads its weights
//   at ~2 GB/s, against ~30 for float32 weights); this one reads each weight once. On float32 stacks it streams the
//   model's layers at twice XLA's rate (its product on the scan's slices: 19.4 against 9.9 ms a token here).
// - MatmulQuantRows: quantized weights (jaxserve.quant.QArray): int8 or 4-bit values packed two per byte along K
//   (k = 2i in the low nibble of byte i, 2i + 1 in the high one), a float16 / float32 scale per group of ``group``
//   values along K (or an 8-bit code times a float32 per output channel: GroupScales), an optional additive zero,
//   an ``offset`` subtracted from the values. w = (q - offset) * s + z,
//   and per group sum_k x_k w_k = s * sum_k x_k q_k + (z - s * offset) * sum_k x_k: the values are widened to float32
//   in registers and never written out, the scales applied once per group. Either layout: [K', N] (the layers'
//   [in, out] matrices, grouped along rows) or transposed [N, K'] (the [V, D] embedding as the tied output
//   projection, grouped along each row).
// Work is cut into chunks of output columns claimed by the calling thread and helpers on XLA's pool; a [K, N] chunk
// runs down all K rows once per strip of B x 16 columns, the strip's M x B accumulators in registers.
constexpr int64_t kMaxRows = 8;
// Rows ahead to prefetch in a [K, N] matrix: a strip reads one or two cache lines per row, a row apart, which the
// hardware prefetchers do not follow (measured on the whole model's matrices: int8 8.0 -> 6.5 ms per one-row step).
constexpr int64_t kQAhead = 16;

// The matrix ``layer`` of w [K, N] or [L, K, N] (any rank >= 2: the leading dimensions are the stack): its offset
// in elements, and its two dimensions. Returns false for a bad rank or layer.
bool LayerOf(ffi::Span<const int64_t> d, int64_t layer, int64_t* offset, int64_t* rows, int64_t* cols) {
  if (d.size() < 2) return false;
  int64_t stack = 1;
  for (size_t i = 0; i + 2 < d.size(); ++i) stack *= d[i];
  if (layer < 0 || layer >= stack) return false;
  *rows = d[d.size() - 2];
  *cols = d[d.size() - 1];
  *offset = layer * *rows * *cols;
  return true;
}

template <int M, int B, typename T>
void RowsTimes(const float* x, const T* w, int64_t K, int64_t N, int64_t n0, int64_t n1, float* out) {
  int64_t j = n0;
  for (; j + B * kWide <= n1; j += B * kWide) {
    V16 acc[M][B] = {};
    for (int64_t k = 0; k < K; ++k) {
      const T* row = w + k * N + j;
      constexpr int kPerLine = 64 / (kWide * sizeof(T)) > 0 ? 64 / (kWide * sizeof(T)) : 1;  // strips per line
      for (int b = 0; b < B; b += kPerLine) __builtin_prefetch(row + kQAhead * N + b * kWide, 0, 1);
      V16 wv[B];
      for (int b = 0; b < B; ++b) wv[b] = LoadKV16(row + b * kWide);
      for (int m = 0; m < M; ++m) {
        const float xv = x[m * K + k];
        for (int b = 0; b < B; ++b) acc[m][b] += xv * wv[b];
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int b = 0; b < B; ++b) Store16(out + m * N + j + b * kWide, acc[m][b]);
    }
  }
  for (; j < n1; ++j) {  // the last N % (B * 16) columns
    float acc[M] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float wf = ToFloat(w[k * N + j]);
      for (int m = 0; m < M; ++m) acc[m] += x[m * K + k] * wf;
    }
    for (int m = 0; m < M; ++m) out[m * N + j] = acc[m];
  }
}

// Strips of 4 x 16 columns for up to 4 rows (16 accumulators), of 2 x 16 for up to 8.
template <int M, typename T>
void RowsTimes(const float* x, const T* w, int64_t K, int64_t N, int64_t n0, int64_t n1, float* out) {
  RowsTimes<M, (M <= 4 ? 4 : 2), T>(x, w, K, N, n0, n1, out);
}

template <typename T>
void RowsTimesAny(int64_t M, const float* x, const T* w, int64_t K, int64_t N, int64_t n0, int64_t n1, float* out) {
  using Fn = void (*)(const float*, const T*, int64_t, int64_t, int64_t, int64_t, float*);
  constexpr Fn kFns[kMaxRows] = {RowsTimes<1, T>, RowsTimes<2, T>, RowsTimes<3, T>, RowsTimes<4, T>,
                                 RowsTimes<5, T>, RowsTimes<6, T>, RowsTimes<7, T>, RowsTimes<8, T>};
  kFns[M - 1](x, w, K, N, n0, n1, out);
}

ffi::Error MatmulRows(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer, ffi::ThreadPool pool,
                      ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  const auto type = w.element_type();
  if (type != ffi::DataType::U32 && type != ffi::DataType::BF16 && type != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("matmul_rows: w must be bfloat16, uint32 pairs of bfloat16 or float32");
  }
  int64_t off, K, N;
  if (!LayerOf(w.dimensions(), layer.typed_data()[0], &off, &K, &N) || xd.size() != 2 || xd[1] != K ||
      xd[0] > kMaxRows || xd[0] < 1) {
    return ffi::Error::InvalidArgument("matmul_rows: x must be [M <= 8, K], w [K, N] or [L, K, N], layer < L");
  }
  const int64_t M = xd[0], pairs = type == ffi::DataType::U32 ? 2 : 1;
  const float* xp = x.typed_data();
  N *= pairs;
  float* op = out->typed_data();
  constexpr int64_t kChunk = 128;  // a 576-column layer still splits in 5 (chunks of 512 left one thread streaming)
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  if (type == ffi::DataType::F32) {
    const float* wp = reinterpret_cast<const float*>(w.untyped_data()) + off;
    RunChunks(pool, chunks, chunks / 2, [=](int64_t c) {
      RowsTimesAny<float>(M, xp, wp, K, N, c * kChunk, std::min(N, (c + 1) * kChunk), op);
    });
  } else {
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.untyped_data()) + off * pairs;
    RunChunks(pool, chunks, chunks / 2, [=](int64_t c) {
      RowsTimesAny<uint16_t>(M, xp, wp, K, N, c * kChunk, std::min(N, (c + 1) * kChunk), op);
    });
  }
  return ffi::Error::Success();
}

// Quantized values, 16 at a time, widened to float32 in registers. 16 bytes of 4-bit pairs give the low nibbles
// (even k) and the high ones (odd k). With AVX-512 through its intrinsics: GCC 12's vector conversions from bytes
// (even one step at a time, as LoadKV16's) made the whole model's one-row products 1.35x slower.
typedef uint8_t U8x16 __attribute__((vector_size(16), aligned(1), may_alias));
typedef uint16_t U16x16u __attribute__((vector_size(32), aligned(1), may_alias));

AJ_INLINE void LoadNibbles(const uint8_t* p, V16* lo, V16* hi) {
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  *lo = (V16)_mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)));
  *hi = (V16)_mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
#else
  const U8x16 b = *reinterpret_cast<const U8x16*>(p);
  const I32x16 w = __builtin_convertvector(__builtin_convertvector(b, U16x16u), I32x16);
  *lo = __builtin_convertvector(w & 15, V16);
  *hi = __builtin_convertvector(w >> 4, V16);
#endif
}

AJ_INLINE V16 LoadInt8(const int8_t* p) {
#if defined(__AVX512F__)
  return (V16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return LoadKV16(p);
#endif
}

// float16 scales as their raw bits (no compiler's _Float16 needed), widened exactly; 16 at a time by F16C's
// conversion where the build has it.
struct Half {
  uint16_t bits;
};

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  uint32_t w;
  if (e == 0x1f) {
    w = sign | 0x7f800000 | (m << 13);  // inf, NaN
  } else if (e != 0) {
    w = sign | ((e + 112) << 23) | (m << 13);
  } else {  // zero, subnormal: m * 2^-24, exact in float32
    const float f = std::ldexp(static_cast<float>(m), -24);
    std::memcpy(&w, &f, sizeof(w));
    w |= sign;
  }
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

AJ_INLINE V16 LoadScale16(const Half* p) {
#if defined(__AVX512F__)
  return (V16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  V16 v;
  for (int i = 0; i < kWide; ++i) v[i] = HalfToFloat(p[i].bits);
  return v;
#endif
}

AJ_INLINE V16 LoadScale16(const float* p) { return Load16(p); }
AJ_INLINE float ScaleAt(const float* p, int64_t i) { return p[i]; }
AJ_INLINE float ScaleAt(const Half* p, int64_t i) {
#if defined(__F16C__)
  return _cvtsh_ss(p[i].bits);  // one instruction: the transposed product reads a scale per row and group
#else
  return HalfToFloat(p[i].bits);
#endif
}

AJ_INLINE V16 LoadUint8(const uint8_t* p) {
#if defined(__AVX512F__)
  return (V16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return __builtin_convertvector(__builtin_convertvector(*reinterpret_cast<const U8x16*>(p), U16x16u), V16);
#endif
}

// The zeros' type beside scales of type S: coded scales (uint8 codes) have int8 codes for zeros.
template <typename S>
struct ZeroOf {
  using type = S;
};
template <>
struct ZeroOf<uint8_t> {
  using type = int8_t;
};

// A quantized matrix's scales and zeros (nullptr: none), [groups, N] or, transposed, [N, groups]: float32 or float16
// numbers, or (S = uint8_t) codes times a float32 multiplier per output channel (smul, zmul [N]): the product in
// float32, as jaxserve.quant.group_scales. Element i, of output channel c; 16 at a time: channels c to c + 15.
template <typename S>
struct GroupScales {
  const S* scale;
  const typename ZeroOf<S>::type* zero;
  const float* smul;
  const float* zmul;

  AJ_INLINE float Scale(int64_t i, int64_t c) const {
    if constexpr (std::is_same_v<S, uint8_t>) return static_cast<float>(scale[i]) * smul[c];
    else return ScaleAt(scale, i);
  }
  AJ_INLINE float Zero(int64_t i, int64_t c) const {
    if (!zero) return 0.0f;
    if constexpr (std::is_same_v<S, uint8_t>) return static_cast<float>(zero[i]) * zmul[c];
    else return ScaleAt(zero, i);
  }
  AJ_INLINE V16 Scale16(int64_t i, int64_t c) const {
    if constexpr (std::is_same_v<S, uint8_t>) return LoadUint8(scale + i) * Load16(smul + c);
    else return LoadScale16(scale + i);
  }
  AJ_INLINE V16 Zero16(int64_t i, int64_t c) const {
    if (!zero) return V16{};
    if constexpr (std::is_same_v<S, uint8_t>) return LoadInt8(zero + i) * Load16(zmul + c);
    else return LoadScale16(zero + i);
  }
};

AJ_INLINE float HSum(V16 v) {
  float lanes[kWide];
  std::memcpy(lanes, &v, sizeof(v));
  for (int w = kWide / 2; w > 0; w /= 2) {
    for (int i = 0; i < w; ++i) lanes[i] += lanes[i + w];
  }
  return lanes[0];
}

// One quantized matrix of a call: values (of this layer), its scales; x [M, K] and, per row and group, the sum of its
// x (``xsum`` [M, K / group], for zeros and offsets); for 4-bit transposed matrices x's even and odd elements apart
// (``xe``, ``xo`` [M, K / 2]).
template <typename S>
struct QMat {
  const void* q;
  GroupScales<S> sc;
  const float* x;
  const float* xsum;
  const float* xe;
  const float* xo;
  int64_t K, N, group, offset;
  float* out;
};

// Per group: s * part + (z - s * offset) * xsum.
template <typename S>
AJ_INLINE V16 ZeroTerm(const QMat<S>& a, V16 s, int64_t at, int64_t c) {
  return s * static_cast<float>(-a.offset) + a.sc.Zero16(at, c);
}

// [K', N] layout, columns [n0, n1): strips of B x 16 columns.
template <int M, int B, int Bits, typename S>
void QRowsKN(const QMat<S>& a, int64_t n0, int64_t n1) {
  const int64_t K = a.K, N = a.N, g = a.group, G = K / g;
  const bool affine = a.sc.zero != nullptr || a.offset != 0;
  const float* x = a.x;
  int64_t j = n0;
  for (; j + B * kWide <= n1; j += B * kWide) {
    V16 acc[M][B] = {};
    for (int64_t gi = 0; gi < G; ++gi) {
      V16 part[M][B] = {};
      if constexpr (Bits == 4) {
        for (int64_t i = gi * g / 2; i < (gi + 1) * g / 2; ++i) {  // byte row i: k = 2i and 2i + 1
          const uint8_t* row = static_cast<const uint8_t*>(a.q) + i * N + j;
          __builtin_prefetch(row + kQAhead * N, 0, 1);
          V16 lo[B], hi[B];
          for (int b = 0; b < B; ++b) LoadNibbles(row + b * kWide, &lo[b], &hi[b]);
          for (int m = 0; m < M; ++m) {
            const float x0 = x[m * K + 2 * i], x1 = x[m * K + 2 * i + 1];
            for (int b = 0; b < B; ++b) {
              part[m][b] += x0 * lo[b];  // two statements: two fused multiply-adds
              part[m][b] += x1 * hi[b];
            }
          }
        }
      } else {
        for (int64_t k = gi * g; k < (gi + 1) * g; ++k) {
          const int8_t* row = static_cast<const int8_t*>(a.q) + k * N + j;
          __builtin_prefetch(row + kQAhead * N, 0, 1);
          V16 v[B];
          for (int b = 0; b < B; ++b) v[b] = LoadInt8(row + b * kWide);
          for (int m = 0; m < M; ++m) {
            const float x0 = x[m * K + k];
            for (int b = 0; b < B; ++b) part[m][b] += x0 * v[b];
          }
        }
      }
      for (int b = 0; b < B; ++b) {
        const int64_t at = gi * N + j + b * kWide;
        const V16 s = a.sc.Scale16(at, j + b * kWide);
        const V16 z = affine ? ZeroTerm(a, s, at, j + b * kWide) : V16{};
        for (int m = 0; m < M; ++m) {
          acc[m][b] += part[m][b] * s;
          if (affine) acc[m][b] += z * a.xsum[m * G + gi];
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int b = 0; b < B; ++b) Store16(a.out + m * N + j + b * kWide, acc[m][b]);
    }
  }
  for (; j < n1; ++j) {  // the last N % (B * 16) columns
    float acc[M] = {};
    for (int64_t gi = 0; gi < G; ++gi) {
      float part[M] = {};
      for (int64_t k = gi * g; k < (gi + 1) * g; ++k) {
        float v;
        if constexpr (Bits == 4) {
          const uint8_t byte = static_cast<const uint8_t*>(a.q)[(k / 2) * N + j];
          v = static_cast<float>(k % 2 ? byte >> 4 : byte & 15);
        } else {
          v = static_cast<float>(static_cast<const int8_t*>(a.q)[k * N + j]);
        }
        for (int m = 0; m < M; ++m) part[m] += x[m * K + k] * v;
      }
      const float s = a.sc.Scale(gi * N + j, j);
      const float z = a.sc.Zero(gi * N + j, j) - s * static_cast<float>(a.offset);
      for (int m = 0; m < M; ++m) acc[m] += part[m] * s + z * a.xsum[m * G + gi];
    }
    for (int m = 0; m < M; ++m) a.out[m * N + j] = acc[m];
  }
}

// 4-bit [K', N] layout for up to kStreamRows rows, streamed: the work item is a range of groups [g0, g1) by a tile
// of columns [n0, n1) (all N up to kQTile), read two byte rows at a time, row after row: a range of whole rows is one
// contiguous block, prefetched kQStreamAhead bytes ahead. (QRowsKN's strips of 64 columns read 32 bytes a row down
// all K rows, each load waiting on memory: the whole model's one-row 4-bit products 13.7 -> 8.5 ms, one request's
// decode 14.7 -> 10.3 ms a token. From 5 rows QRowsKN's accumulators in registers win; 8-bit weights gained nothing.)
// Each group's partial sums wait in L1 (``part``, M x tile floats), then take the group's scales into ``acc``;
// ``out`` gets the item's sums at [M, N]: a partial over its groups, which the caller adds up.
constexpr int64_t kQTile = 2048;
constexpr int64_t kQStreamAhead = 4096;
constexpr int64_t kStreamRows = 4;

// Whether a [K', N] product of m rows by bits-bit weights streams (QRowsKNStream) or walks strips (QRowsKN).
constexpr bool Streams(int64_t bits, int64_t m) { return bits == 4 && m <= kStreamRows; }

// The work items of a streamed [K', N] product: ranges of its ``units`` blocks of whole rows (4-bit: groups; W8A8:
// 4 rows) by tiles of at most kQTile columns, ``align`` columns wide at a time; at least 4 items (a [576, N <= 2048]
// matrix in 4 ranges), so both threads share even one tile. Each range's partial sums are kept apart and added up
// after.
struct StreamSplit {
  int64_t N, units, tiles, width, ranges;
  StreamSplit(int64_t n, int64_t u, int64_t align)
      : N(n), units(u), tiles((n + kQTile - 1) / kQTile),
        width(((n + tiles - 1) / tiles + align - 1) / align * align), ranges(std::min(u, (4 + tiles - 1) / tiles)) {}
  // One range in chunks of ``chunk`` columns (the products that do not stream).
  static StreamSplit Chunks(int64_t n, int64_t chunk) {
    StreamSplit split(n, 1, chunk);
    split.tiles = (n + chunk - 1) / chunk;
    split.width = chunk;
    return split;
  }
  int64_t items() const { return tiles * ranges; }
  // Item c: range *r, its units [*u0, *u1), columns [*n0, *n1).
  void Item(int64_t c, int64_t* r, int64_t* u0, int64_t* u1, int64_t* n0, int64_t* n1) const {
    *r = c % ranges;
    *u0 = *r * units / ranges;
    *u1 = (*r + 1) * units / ranges;
    *n0 = (c / ranges) * width;
    *n1 = std::min(N, *n0 + width);
  }
};

template <int M, typename S>
void QRowsKNStream(const QMat<S>& a, int64_t g0, int64_t g1, int64_t n0, int64_t n1, float* out) {
  const int64_t K = a.K, N = a.N, g = a.group, G = K / g, W = n1 - n0, Wv = W / kWide * kWide;
  const bool affine = a.sc.zero != nullptr || a.offset != 0;
  thread_local std::vector<float> buffer;  // part, then acc: grown once per thread
  if (buffer.size() < 2 * M * kQTile) buffer.resize(2 * M * kQTile);
  float* part = buffer.data();
  float* acc = part + M * kQTile;
  for (int m = 0; m < M; ++m) std::fill(acc + m * kQTile, acc + m * kQTile + W, 0.0f);
  const float* x = a.x;
  for (int64_t gi = g0; gi < g1; ++gi) {
    for (int m = 0; m < M; ++m) std::fill(part + m * kQTile, part + m * kQTile + W, 0.0f);
    const int64_t i1 = (gi + 1) * g / 2;  // byte rows [gi * g / 2, i1): k = 2i and 2i + 1
    for (int64_t i = gi * g / 2; i < i1; i += 2) {
      const bool two = i + 1 < i1;
      const uint8_t* r0 = static_cast<const uint8_t*>(a.q) + i * N + n0;
      const uint8_t* r1 = two ? r0 + N : r0;
      float xk[4][M];
      for (int m = 0; m < M; ++m) {
        for (int d = 0; d < 4; ++d) xk[d][m] = d < 2 || two ? x[m * K + 2 * i + d] : 0.0f;
      }
      int64_t c = 0;
      for (; c < Wv; c += kWide) {
        V16 l0, h0, l1, h1;
        __builtin_prefetch(r0 + c + kQStreamAhead, 0, 1);
        __builtin_prefetch(r1 + c + kQStreamAhead, 0, 1);
        LoadNibbles(r0 + c, &l0, &h0);
        LoadNibbles(r1 + c, &l1, &h1);
        for (int m = 0; m < M; ++m) {
          V16 p = Load16(part + m * kQTile + c);
          p += xk[0][m] * l0;
          p += xk[1][m] * h0;
          p += xk[2][m] * l1;
          p += xk[3][m] * h1;
          Store16(part + m * kQTile + c, p);
        }
      }
      for (; c < W; ++c) {  // the last W % 16 columns
        const float v[4] = {static_cast<float>(r0[c] & 15), static_cast<float>(r0[c] >> 4),
                            static_cast<float>(r1[c] & 15), static_cast<float>(r1[c] >> 4)};
        for (int m = 0; m < M; ++m) {
          for (int d = 0; d < 4; ++d) part[m * kQTile + c] += xk[d][m] * v[d];
        }
      }
    }
    const int64_t at = gi * N + n0;
    int64_t c = 0;
    for (; c < Wv; c += kWide) {
      const V16 s = a.sc.Scale16(at + c, n0 + c);
      const V16 z = affine ? ZeroTerm(a, s, at + c, n0 + c) : V16{};
      for (int m = 0; m < M; ++m) {
        V16 r = Load16(acc + m * kQTile + c) + Load16(part + m * kQTile + c) * s;
        if (affine) r += z * a.xsum[m * G + gi];
        Store16(acc + m * kQTile + c, r);
      }
    }
    for (; c < W; ++c) {
      const float s = a.sc.Scale(at + c, n0 + c);
      const float z = a.sc.Zero(at + c, n0 + c) - s * static_cast<float>(a.offset);
      for (int m = 0; m < M; ++m) acc[m * kQTile + c] += part[m * kQTile + c] * s + z * a.xsum[m * G + gi];
    }
  }
  for (int m = 0; m < M; ++m) std::copy(acc + m * kQTile, acc + m * kQTile + W, out + m * N + n0);
}

// Transposed rows are read 16 bytes at a time: a group is a whole number of such chunks or, 8 bytes (int4's
// vocabulary groups of 16), half of one, two groups a chunk with their scales side by side in a vector.
constexpr bool TransposedGroupsFit(int64_t group_bytes, int64_t row_bytes) {
  return group_bytes % kWide == 0 || (group_bytes == kWide / 2 && row_bytes % kWide == 0);
}

// a in lanes 0-7, b in lanes 8-15.
AJ_INLINE V16 PairOfGroups(float a, float b) {
  return __builtin_shuffle(V16{} + a, V16{} + b, I32x16{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23});
}

// Transposed, 8-byte groups: rows [n0, n1), a 16-byte chunk (two groups) at a time.
template <int M, int Bits, typename S>
void QRowsNKPairs(const QMat<S>& a, int64_t n0, int64_t n1) {
  const int64_t K = a.K, N = a.N, g = a.group, G = K / g, row_bytes = K * Bits / 8;
  const bool affine = a.sc.zero != nullptr || a.offset != 0;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = static_cast<const uint8_t*>(a.q) + n * row_bytes;
    V16 acc[M] = {};
    float zacc[M] = {};
    for (int64_t gi = 0; gi < G; gi += 2) {
      const int64_t c = gi * g * Bits / 8;  // the chunk's first byte
      const V16 s = PairOfGroups(a.sc.Scale(n * G + gi, n), a.sc.Scale(n * G + gi + 1, n));
      if constexpr (Bits == 4) {
        V16 lo, hi;
        LoadNibbles(row + c, &lo, &hi);
        for (int m = 0; m < M; ++m) {
          acc[m] += (lo * Load16(a.xe + m * K / 2 + c) + hi * Load16(a.xo + m * K / 2 + c)) * s;
        }
      } else {
        const V16 v = LoadInt8(reinterpret_cast<const int8_t*>(row) + c);
        for (int m = 0; m < M; ++m) acc[m] += v * Load16(a.x + m * K + c) * s;
      }
      for (int64_t h = gi; affine && h < gi + 2; ++h) {
        const float sh = a.sc.Scale(n * G + h, n);
        const float z = a.sc.Zero(n * G + h, n) - sh * static_cast<float>(a.offset);
        for (int m = 0; m < M; ++m) zacc[m] += z * a.xsum[m * G + h];
      }
    }
    for (int m = 0; m < M; ++m) a.out[m * N + n] = HSum(acc[m]) + zacc[m];
  }
}

// Transposed [N, K'] layout, output columns (matrix rows) [n0, n1); see TransposedGroupsFit.
template <int M, int Bits, typename S>
void QRowsNK(const QMat<S>& a, int64_t n0, int64_t n1) {
  const int64_t K = a.K, N = a.N, g = a.group, G = K / g, row_bytes = K * Bits / 8;
  if (g * Bits / 8 == kWide / 2) return QRowsNKPairs<M, Bits, S>(a, n0, n1);
  const bool affine = a.sc.zero != nullptr || a.offset != 0;
  for (int64_t n = n0; n < n1; ++n) {
    V16 acc[M] = {};
    float zacc[M] = {};
    for (int64_t gi = 0; gi < G; ++gi) {
      V16 part[M] = {};
      if constexpr (Bits == 4) {
        const uint8_t* row = static_cast<const uint8_t*>(a.q) + n * row_bytes;
        for (int64_t i = gi * g / 2; i < (gi + 1) * g / 2; i += kWide) {
          V16 lo, hi;
          LoadNibbles(row + i, &lo, &hi);
          for (int m = 0; m < M; ++m) {
            part[m] += lo * Load16(a.xe + m * K / 2 + i);
            part[m] += hi * Load16(a.xo + m * K / 2 + i);
          }
        }
      } else {
        const int8_t* row = static_cast<const int8_t*>(a.q) + n * row_bytes;
        for (int64_t k = gi * g; k < (gi + 1) * g; k += kWide) {
          const V16 v = LoadInt8(row + k);
          for (int m = 0; m < M; ++m) part[m] += v * Load16(a.x + m * K + k);
        }
      }
      const float s = a.sc.Scale(n * G + gi, n);
      const float z = affine ? a.sc.Zero(n * G + gi, n) - s * static_cast<float>(a.offset) : 0.0f;
      for (int m = 0; m < M; ++m) {
        acc[m] += part[m] * s;
        if (affine) zacc[m] += z * a.xsum[m * G + gi];
      }
    }
    for (int m = 0; m < M; ++m) a.out[m * N + n] = HSum(acc[m]) + zacc[m];
  }
}

// One work item: [K', N] groups [g0, g1) by columns [n0, n1) into ``out``, or transposed rows [n0, n1) into a.out.
template <int M, int Bits, typename S>
void QRows(const QMat<S>& a, bool transposed, int64_t g0, int64_t g1, int64_t n0, int64_t n1, float* out) {
  if (transposed) return QRowsNK<M, Bits, S>(a, n0, n1);
  if (Streams(Bits, M)) return QRowsKNStream<M, S>(a, g0, g1, n0, n1, out);
  QRowsKN<M, (M <= 2 ? 4 : M <= 4 ? 2 : 1), Bits, S>(a, n0, n1);
}

template <int Bits, typename S>
void QRowsAny(int64_t M, const QMat<S>& a, bool transposed, int64_t g0, int64_t g1, int64_t n0, int64_t n1,
              float* out) {
  using Fn = void (*)(const QMat<S>&, bool, int64_t, int64_t, int64_t, int64_t, float*);
  constexpr Fn kFns[kMaxRows] = {QRows<1, Bits, S>, QRows<2, Bits, S>, QRows<3, Bits, S>, QRows<4, Bits, S>,
                                 QRows<5, Bits, S>, QRows<6, Bits, S>, QRows<7, Bits, S>, QRows<8, Bits, S>};
  kFns[M - 1](a, transposed, g0, g1, n0, n1, out);
}

// Matrix ``layer`` of a quantized stack, as both quantized targets read it: values, scales, zeros (nullptr: none),
// and its dimensions: K (along the groups), N, G = K / group.
template <typename S>
struct QuantLayer {
  const void* q;
  GroupScales<S> sc;
  int64_t K, N, G;
};

// Matrix ``layer`` of a stack of per-channel multipliers ([(L,) 1, N] or [(L,) N, 1]), or nullptr if it has no N.
const float* MultiplierOf(ffi::AnyBuffer mul, int64_t layer, int64_t N) {
  int64_t off, r, c;
  if (mul.element_type() != ffi::DataType::F32 || !LayerOf(mul.dimensions(), layer, &off, &r, &c) || r * c != N) {
    return nullptr;
  }
  return static_cast<const float*>(mul.untyped_data()) + off;
}

// Resolves matrix ``layer`` of q, scale (and zero, empty: none) into ``w``; uint8 scales are codes (int8 zeros) times
// smul (and zmul); returns nullptr, or what does not match.
template <typename S>
const char* ResolveQuant(ffi::AnyBuffer q, ffi::AnyBuffer scale, ffi::AnyBuffer zero, ffi::AnyBuffer smul,
                         ffi::AnyBuffer zmul, int64_t layer, int64_t bits, int64_t group, bool transposed,
                         QuantLayer<S>* w) {
  constexpr bool coded = std::is_same_v<S, uint8_t>;
  int64_t qoff, qr, qc, soff, sr, sc;
  const bool has_zero = zero.element_count() > 0;
  const auto zero_type = coded ? ffi::DataType::S8 : scale.element_type();
  if ((bits != 4 && bits != 8) || group < 1 || !LayerOf(q.dimensions(), layer, &qoff, &qr, &qc) ||
      !LayerOf(scale.dimensions(), layer, &soff, &sr, &sc) ||
      (has_zero && (zero.element_type() != zero_type || zero.element_count() != scale.element_count()))) {
    return "q, scale (and zero) must be [(L,) ., .] with layer < L, 4 or 8 bits (uint8 scales: int8 zeros)";
  }
  const int64_t per_byte = bits == 4 ? 2 : 1;
  const int64_t N = transposed ? qr : qc, K = (transposed ? qc : qr) * per_byte, G = K / group;
  const int64_t group_bytes = group * bits / 8;
  const bool ok = K % group == 0 && group % per_byte == 0 &&
                  (transposed ? sr == N && sc == G && TransposedGroupsFit(group_bytes, K * bits / 8)
                              : sr == G && sc == N) &&
                  (bits == 4 ? q.element_type() == ffi::DataType::U8 : q.element_type() == ffi::DataType::S8);
  if (!ok) {
    return "shapes or dtypes do not match (4-bit: uint8 pairs along K; 8-bit: int8; scales [K / group, N], "
           "transposed [N, K / group] with groups of a multiple of 16 bytes, or of 8 in rows of a multiple of 16)";
  }
  using Z = typename ZeroOf<S>::type;
  const float* sm = coded ? MultiplierOf(smul, layer, N) : nullptr;
  const float* zm = coded && has_zero ? MultiplierOf(zmul, layer, N) : nullptr;
  if (coded && (!sm || (has_zero && !zm))) {
    return "coded (uint8) scales need float32 multipliers [(L,) 1, N] (transposed [(L,) N, 1]) for scales and zeros";
  }
  *w = {static_cast<const uint8_t*>(q.untyped_data()) + qoff,
        {reinterpret_cast<const S*>(scale.untyped_data()) + soff,
         has_zero ? reinterpret_cast<const Z*>(zero.untyped_data()) + soff : nullptr, sm, zm},
        K, N, G};
  return nullptr;
}

// Calls fn(S{}) for the scales' type S: float32, float16 (Half), or uint8 codes.
template <typename Fn>
ffi::Error WithScaleType(ffi::DataType t, const char* what, Fn fn) {
  switch (t) {
    case ffi::DataType::F32:
      return fn(float{});
    case ffi::DataType::F16:
      return fn(Half{});
    case ffi::DataType::U8:
      return fn(uint8_t{});
    default:
      return ffi::Error::InvalidArgument(std::string(what) + ": scales must be float32, float16 or uint8 codes");
  }
}

template <typename S>
ffi::Error QuantRowsImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer scale, ffi::AnyBuffer zero,
                         ffi::AnyBuffer smul, ffi::AnyBuffer zmul, int64_t layer, int64_t bits, int64_t group,
                         int64_t offset, bool transposed, ffi::ThreadPool& pool, float* out) {
  QuantLayer<S> w;
  if (const char* bad = ResolveQuant(q, scale, zero, smul, zmul, layer, bits, group, transposed, &w)) {
    return ffi::Error::InvalidArgument(std::string("matmul_quant_rows: ") + bad);
  }
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[0] < 1 || xd[0] > kMaxRows || xd[1] != w.K) {
    return ffi::Error::InvalidArgument("matmul_quant_rows: x must be [M <= 8, K]");
  }
  const int64_t M = xd[0], K = w.K, N = w.N, G = w.G;
  // Per row: sums of x over each group, and (4-bit transposed) x's even and odd elements apart.
  std::vector<float> xsum(M * G, 0.0f), xe, xo;
  const float* xp = x.typed_data();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) xsum[m * G + k / group] += xp[m * K + k];
  }
  if (transposed && bits == 4) {
    xe.resize(M * K / 2);
    xo.resize(M * K / 2);
    for (int64_t i = 0; i < M * K / 2; ++i) {
      xe[i] = xp[2 * i];
      xo[i] = xp[2 * i + 1];
    }
  }
  QMat<S> a{w.q, w.sc, xp, xsum.data(), xe.data(), xo.data(), K, N, group, offset, out};
  // Streamed: see StreamSplit (ranges of groups). Otherwise one range, in chunks of 128 columns (transposed: 256
  // matrix rows, each contiguous).
  const StreamSplit split = !transposed && Streams(bits, M) ? StreamSplit(N, G, kWide)
                                                            : StreamSplit::Chunks(N, transposed ? 256 : 128);
  const int64_t ranges = split.ranges;
  std::vector<float> partial(ranges > 1 ? (ranges - 1) * M * N : 0);
  RunChunks(pool, split.items(), split.items() / 2, [&, M, transposed](int64_t c) {
    int64_t r, g0, g1, n0, n1;
    split.Item(c, &r, &g0, &g1, &n0, &n1);
    float* dst = r == 0 ? out : partial.data() + (r - 1) * M * N;
    if (bits == 4) {
      QRowsAny<4, S>(M, a, transposed, g0, g1, n0, n1, dst);
    } else {
      QRowsAny<8, S>(M, a, transposed, g0, g1, n0, n1, dst);
    }
  });
  for (int64_t r = 1; r < ranges; ++r) {
    const float* p = partial.data() + (r - 1) * M * N;
    for (int64_t i = 0; i < M * N; ++i) out[i] += p[i];
  }
  return ffi::Error::Success();
}

ffi::Error MatmulQuantRows(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer scale, ffi::AnyBuffer zero,
                           ffi::AnyBuffer smul, ffi::AnyBuffer zmul, ffi::Buffer<ffi::S32> layer, int64_t bits,
                           int64_t group, int64_t offset, bool transposed, ffi::ThreadPool pool,
                           ffi::ResultBuffer<ffi::F32> out) {
  const int64_t l = layer.typed_data()[0];
  return WithScaleType(scale.element_type(), "matmul_quant_rows", [&](auto tag) {
    return QuantRowsImpl<decltype(tag)>(x, q, scale, zero, smul, zmul, l, bits, group, offset, transposed, pool,
                                        out->typed_data());
  });
}

// ---- Dequantization for steps of more than 8 rows: the layer's float weight, written once for XLA's product (its own
// dequantizing fusion made a whole-model 4-bit step 36 ms slower than float32 weights at 64 rows).

// One product and one sum, rounded apart (as the checkpoints' reference dequantizers and quant.dequantize compute
// them): the empty asm keeps the compiler from fusing them into one multiply-add.
AJ_INLINE V16 Affine(V16 v, V16 s, V16 z) {
  V16 w = v * s;
#if defined(__AVX512F__)
  asm("" : "+v"(w));
#else
  asm("" : "+m"(w));
#endif
  return w + z;
}

AJ_INLINE void StoreOut(float* p, V16 v) { Store16(p, v); }

// float32 -> bfloat16, rounded to nearest even.
AJ_INLINE void StoreOut(uint16_t* p, V16 v) {
  U32x16 b = (U32x16)v;
  b = (b + 0x7fff + ((b >> 16) & 1)) >> 16;
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)b));
#else
  *reinterpret_cast<U16x16*>(p) = __builtin_convertvector(b, U16x16);
#endif
}

AJ_INLINE void StoreOne(float* p, float v) { *p = v; }
AJ_INLINE void StoreOne(uint16_t* p, float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  *p = static_cast<uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

// Rows [g0, g1) of groups of a [K', N] matrix (not transposed) or rows [g0, g1) of an [N, K'] one (transposed).
template <int Bits, typename S, typename O>
void DequantRows(const void* q, const GroupScales<S>& sc, int64_t K, int64_t N, int64_t group, int64_t offset,
                 bool transposed, int64_t r0, int64_t r1, O* out) {
  const int64_t G = K / group;
  const V16 off = V16{} + static_cast<float>(offset);
  if (!transposed) {
    for (int64_t gi = r0; gi < r1; ++gi) {
      for (int64_t k = gi * group; k < (gi + 1) * group; k += Bits == 4 ? 2 : 1) {
        int64_t j = 0;
        for (; j + kWide <= N; j += kWide) {
          const V16 s = sc.Scale16(gi * N + j, j), z = sc.Zero16(gi * N + j, j);
          if constexpr (Bits == 4) {
            V16 lo, hi;
            LoadNibbles(static_cast<const uint8_t*>(q) + (k / 2) * N + j, &lo, &hi);
            StoreOut(out + k * N + j, Affine(lo - off, s, z));
            StoreOut(out + (k + 1) * N + j, Affine(hi - off, s, z));
          } else {
            StoreOut(out + k * N + j, Affine(LoadInt8(static_cast<const int8_t*>(q) + k * N + j) - off, s, z));
          }
        }
        for (; j < N; ++j) {  // the last N % 16 columns
          const float s = sc.Scale(gi * N + j, j), z = sc.Zero(gi * N + j, j);
          for (int64_t t = 0; t < (Bits == 4 ? 2 : 1); ++t) {
            float v;
            if constexpr (Bits == 4) {
              const uint8_t byte = static_cast<const uint8_t*>(q)[(k / 2) * N + j];
              v = static_cast<float>(t ? byte >> 4 : byte & 15);
            } else {
              v = static_cast<float>(static_cast<const int8_t*>(q)[k * N + j]);
            }
            V16 w = {};
            w[0] = v - static_cast<float>(offset);
            StoreOne(out + (k + t) * N + j, Affine(w, V16{} + s, V16{} + z)[0]);
          }
        }
      }
    }
    return;
  }
  const int64_t row_bytes = K * Bits / 8, chunks = row_bytes / kWide, per_group = group * Bits / 8;
  for (int64_t n = r0; n < r1; ++n) {
    const uint8_t* row = static_cast<const uint8_t*>(q) + n * row_bytes;
    V16 s = {}, z = {};
    for (int64_t c = 0; c < chunks; ++c) {  // 16 bytes: within one group, or two (8-byte groups)
      const int64_t gi = c * kWide / per_group;
      if (per_group == kWide / 2) {
        s = PairOfGroups(sc.Scale(n * G + gi, n), sc.Scale(n * G + gi + 1, n));
        z = PairOfGroups(sc.Zero(n * G + gi, n), sc.Zero(n * G + gi + 1, n));
      } else if (c * kWide % per_group == 0) {
        s = V16{} + sc.Scale(n * G + gi, n);
        z = V16{} + sc.Zero(n * G + gi, n);
      }
      if constexpr (Bits == 4) {  // byte i: elements 2i and 2i + 1, interleaved back
        V16 lo, hi;
        LoadNibbles(row + c * kWide, &lo, &hi);
        lo = Affine(lo - off, s, z);
        hi = Affine(hi - off, s, z);
        O* dst = out + n * K + 2 * c * kWide;
        StoreOut(dst, __builtin_shuffle(lo, hi, I32x16{0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23}));
        StoreOut(dst + kWide, __builtin_shuffle(lo, hi, I32x16{8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                                               15, 31}));
      } else {
        const V16 v = LoadInt8(reinterpret_cast<const int8_t*>(row) + c * kWide);
        StoreOut(out + n * K + c * kWide, Affine(v - off, s, z));
      }
    }
  }
}

template <typename S, typename O>
ffi::Error DequantImpl(ffi::AnyBuffer q, ffi::AnyBuffer scale, ffi::AnyBuffer zero, ffi::AnyBuffer smul,
                       ffi::AnyBuffer zmul, int64_t layer, int64_t bits, int64_t group, int64_t offset, bool transposed,
                       ffi::ThreadPool& pool, ffi::Result<ffi::AnyBuffer> out) {
  QuantLayer<S> w;
  if (const char* bad = ResolveQuant(q, scale, zero, smul, zmul, layer, bits, group, transposed, &w)) {
    return ffi::Error::InvalidArgument(std::string("dequantize: ") + bad);
  }
  const int64_t K = w.K, N = w.N, G = w.G;
  auto od = out->dimensions();
  if (od.size() != 2 || od[0] != (transposed ? N : K) || od[1] != (transposed ? K : N)) {
    return ffi::Error::InvalidArgument("dequantize: out must be [K, N], transposed [N, K]");
  }
  O* op = reinterpret_cast<O*>(out->untyped_data());
  // Work items: one group of rows each ([K', N]), or 64 matrix rows (transposed).
  const int64_t per = transposed ? 64 : 1, rows = transposed ? N : G, chunks = (rows + per - 1) / per;
  RunChunks(pool, chunks, chunks / 2, [=](int64_t c) {
    const int64_t r0 = c * per, r1 = std::min(rows, r0 + per);
    if (bits == 4) {
      DequantRows<4, S, O>(w.q, w.sc, K, N, group, offset, transposed, r0, r1, op);
    } else {
      DequantRows<8, S, O>(w.q, w.sc, K, N, group, offset, transposed, r0, r1, op);
    }
  });
  return ffi::Error::Success();
}

ffi::Error Dequantize(ffi::AnyBuffer q, ffi::AnyBuffer scale, ffi::AnyBuffer zero, ffi::AnyBuffer smul,
                      ffi::AnyBuffer zmul, ffi::Buffer<ffi::S32> layer, int64_t bits, int64_t group, int64_t offset,
                      bool transposed, ffi::ThreadPool pool, ffi::Result<ffi::AnyBuffer> out) {
  const int64_t l = layer.typed_data()[0];
  const auto ot = out->element_type();
  if (ot != ffi::DataType::F32 && ot != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("dequantize: out must be float32 or bfloat16");
  }
  return WithScaleType(scale.element_type(), "dequantize", [&](auto tag) {
    using S = decltype(tag);
    return ot == ffi::DataType::F32
               ? DequantImpl<S, float>(q, scale, zero, smul, zmul, l, bits, group, offset, transposed, pool, out)
               : DequantImpl<S, uint16_t>(q, scale, zero, smul, zmul, l, bits, group, offset, transposed, pool, out);
  });
}


// ---- W8A8 rows: int8 activations (quantized per row here) times int8 weights per output channel. The
// int32 sums are exact, then (acc * xs) * scale in float32, as quant._matmul_w8a8 computes it. AVX-512 VNNI's
// vpdpbusd multiplies unsigned by signed bytes, four per 32-bit lane: the weights go in as w ^ 0x80 = w + 128
// (unsigned), the activations signed, and 128 * sum(xq) comes back off each row's sums.

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Four rows of 64 weight bytes (r: unsigned) regrouped for vpdpbusd: per 128-bit lane l, u[q] holds, for columns
// 16 l + 4 q + c (c < 4), the bytes of the four rows.
AJ_INLINE void Regroup4(const __m512i r[4], __m512i u[4]) {
  const __m512i t0 = _mm512_unpacklo_epi8(r[0], r[1]), t1 = _mm512_unpackhi_epi8(r[0], r[1]);
  const __m512i t2 = _mm512_unpacklo_epi8(r[2], r[3]), t3 = _mm512_unpackhi_epi8(r[2], r[3]);
  u[0] = _mm512_unpacklo_epi16(t0, t2);
  u[1] = _mm512_unpackhi_epi16(t0, t2);
  u[2] = _mm512_unpacklo_epi16(t1, t3);
  u[3] = _mm512_unpackhi_epi16(t1, t3);
}

// The sums of 64 columns in Regroup4's order (a[q]), written to dst[0, 64) in column order.
AJ_INLINE void StoreRegrouped(const __m512i a[4], int32_t* dst) {
  int32_t lanes[4][16];
  for (int q = 0; q < 4; ++q) _mm512_storeu_si512(lanes[q], a[q]);
  for (int l = 0; l < 4; ++l) {
    for (int q = 0; q < 4; ++q) {
      for (int c = 0; c < 4; ++c) dst[16 * l + 4 * q + c] = lanes[q][4 * l + c];
    }
  }
}
#endif

// Rows [0, M) of xq [M, K] by columns [n0, n1) of w [K, N]: the int32 sums, column n of row m at acc[m * S + n - n0]
// (of the unsigned weights).
template <int M>
void W8A8SumsKN(const int8_t* xq, const int8_t* w, int64_t K, int64_t N, int64_t n0, int64_t n1, int32_t* acc,
                int64_t S) {
  int64_t j = n0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int64_t K4 = K / 4 * 4;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (; j + 64 <= n1; j += 64) {  // 64 columns: four rows of 64 bytes regrouped as 16 x 4 bytes, four times
    __m512i a[M][4];
    for (int m = 0; m < M; ++m) {
      for (int q = 0; q < 4; ++q) a[m][q] = _mm512_setzero_si512();
    }
    for (int64_t k = 0; k < K4; k += 4) {
      __m512i r[4];
      for (int i = 0; i < 4; ++i) {
        const int8_t* row = w + (k + i) * N + j;
        __builtin_prefetch(row + kQAhead * N, 0, 1);
        r[i] = _mm512_xor_si512(_mm512_loadu_si512(row), flip);
      }
      __m512i u[4];
      Regroup4(r, u);
      for (int m = 0; m < M; ++m) {
        int32_t x4;
        std::memcpy(&x4, xq + m * K + k, sizeof(x4));
        const __m512i xb = _mm512_set1_epi32(x4);
        for (int q = 0; q < 4; ++q) a[m][q] = _mm512_dpbusd_epi32(a[m][q], u[q], xb);
      }
    }
    for (int m = 0; m < M; ++m) {
      StoreRegrouped(a[m], acc + m * S + j - n0);
      for (int64_t k = K4; k < K; ++k) {  // the last K % 4 rows, unsigned as above
        for (int64_t c = j; c < j + 64; ++c) acc[m * S + c - n0] += xq[m * K + k] * (w[k * N + c] + 128);
      }
    }
  }
#endif
  for (; j < n1; ++j) {  // the rest (every column without VNNI), unsigned as above
    for (int m = 0; m < M; ++m) {
      int32_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += xq[m * K + k] * (w[k * N + j] + 128);
      acc[m * S + j - n0] = s;
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kW8A8Streams = true;
// Rows [k0, k1) (multiples of 4) of w [K, N] by columns [n0, n1) (a multiple of 64 wide, at most kQTile), for up to
// kStreamRows rows, streamed as QRowsKNStream: four whole rows at a time, row after row (each a contiguous run),
// prefetched kQStreamAhead bytes ahead, the sums in L1 in the regrouped order of W8A8SumsKN's registers. Writes the
// range's int32 sums (of the unsigned weights) to out [M, N].
template <int M>
void W8A8SumsKNStream(const int8_t* xq, const int8_t* w, int64_t K, int64_t N, int64_t k0, int64_t k1, int64_t n0,
                      int64_t n1, int32_t* out) {
  const int64_t W = n1 - n0, V = W / 16;  // V registers of sums per row
  thread_local std::vector<__m512i> buffer;
  if (static_cast<int64_t>(buffer.size()) < M * kQTile / 16) buffer.resize(M * kQTile / 16);
  __m512i* acc = buffer.data();
  for (int64_t i = 0; i < M * V; ++i) acc[i] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t k = k0; k < k1; k += 4) {
    const int8_t* r0 = w + k * N + n0;
    __m512i xb[M];
    for (int m = 0; m < M; ++m) {
      int32_t x4;
      std::memcpy(&x4, xq + m * K + k, sizeof(x4));
      xb[m] = _mm512_set1_epi32(x4);
    }
    for (int64_t c = 0; c < W; c += 64) {
      __m512i r[4];
      for (int i = 0; i < 4; ++i) {
        __builtin_prefetch(r0 + i * N + c + kQStreamAhead, 0, 1);
        r[i] = _mm512_xor_si512(_mm512_loadu_si512(r0 + i * N + c), flip);
      }
      __m512i u[4];
      Regroup4(r, u);
      for (int m = 0; m < M; ++m) {
        __m512i* a = acc + m * V + c / 16;
        for (int q = 0; q < 4; ++q) a[q] = _mm512_dpbusd_epi32(a[q], u[q], xb[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int64_t c = 0; c < W; c += 64) StoreRegrouped(acc + m * V + c / 16, out + m * N + n0 + c);
  }
}

void W8A8SumsStream(int64_t M, const int8_t* xq, const int8_t* w, int64_t K, int64_t N, int64_t k0, int64_t k1,
                    int64_t n0, int64_t n1, int32_t* out) {
  using Fn = void (*)(const int8_t*, const int8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int32_t*);
  constexpr Fn kFns[kStreamRows] = {W8A8SumsKNStream<1>, W8A8SumsKNStream<2>, W8A8SumsKNStream<3>,
                                    W8A8SumsKNStream<4>};
  kFns[M - 1](xq, w, K, N, k0, k1, n0, n1, out);
}
#else
constexpr bool kW8A8Streams = false;
void W8A8SumsStream(int64_t, const int8_t*, const int8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    int32_t*) {}
#endif

// Rows [n0, n1) of the transposed w [N, K] (the [V, D] embedding as the output projection), acc as above.
template <int M>
void W8A8SumsNK(const int8_t* xq, const int8_t* w, int64_t K, int64_t, int64_t n0, int64_t n1, int32_t* acc,
                int64_t S) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * K;
    int32_t s[M] = {};
    int64_t k = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i a[M];
    for (int m = 0; m < M; ++m) a[m] = _mm512_setzero_si512();
    for (; k + 64 <= K; k += 64) {
      const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(row + k), flip);
      for (int m = 0; m < M; ++m) a[m] = _mm512_dpbusd_epi32(a[m], v, _mm512_loadu_si512(xq + m * K + k));
    }
    for (int m = 0; m < M; ++m) s[m] = _mm512_reduce_add_epi32(a[m]);
#endif
    for (; k < K; ++k) {
      for (int m = 0; m < M; ++m) s[m] += xq[m * K + k] * (row[k] + 128);
    }
    for (int m = 0; m < M; ++m) acc[m * S + n - n0] = s[m];
  }
}

// Up to 4 rows at a time (their 16 accumulators and the regrouped bytes fit the 32 registers).
void W8A8Sums(int64_t M, const int8_t* xq, const int8_t* w, int64_t K, int64_t N, bool transposed, int64_t n0,
              int64_t n1, int32_t* acc, int64_t S) {
  using Fn = void (*)(const int8_t*, const int8_t*, int64_t, int64_t, int64_t, int64_t, int32_t*, int64_t);
  constexpr Fn kKN[4] = {W8A8SumsKN<1>, W8A8SumsKN<2>, W8A8SumsKN<3>, W8A8SumsKN<4>};
  constexpr Fn kNK[4] = {W8A8SumsNK<1>, W8A8SumsNK<2>, W8A8SumsNK<3>, W8A8SumsNK<4>};
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t rows = std::min<int64_t>(4, M - m0);
    (transposed ? kNK : kKN)[rows - 1](xq + m0 * K, w, K, N, n0, n1, acc + m0 * S, S);
  }
}

// x [M, K] float32 rows to int8 as quant.quantize_rows: scale max |row| * float32(1 / 127) (1 for a zero row),
// values x / scale rounded half to even (the default rounding mode) and clipped to +-127.
void QuantizeRows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xs) {
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[m * K + k]));
    xs[m] = amax > 0.0f ? amax * static_cast<float>(1.0 / 127.0) : 1.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::nearbyint(x[m * K + k] / xs[m]);
      xq[m * K + k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
    }
  }
}

ffi::Error MatmulW8A8Rows(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scale,
                          ffi::Buffer<ffi::S32> layer, bool transposed, ffi::ThreadPool pool,
                          ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  int64_t off, rows, cols;
  if (xd.size() != 2 || xd[0] < 1 || xd[0] > kMaxRows || !LayerOf(w.dimensions(), layer.typed_data()[0], &off, &rows,
                                                                   &cols)) {
    return ffi::Error::InvalidArgument("matmul_w8a8_rows: x must be [M <= 8, K], w [(L,) K, N] or [N, K]");
  }
  const int64_t M = xd[0], K = xd[1], N = transposed ? rows : cols;
  if ((transposed ? cols : rows) != K || scale.element_count() % N != 0 ||
      scale.element_count() / N != w.element_count() / (rows * cols)) {
    return ffi::Error::InvalidArgument("matmul_w8a8_rows: scale must be one per output channel (per layer)");
  }
  std::vector<int8_t> xq(M * K);
  float xsp[kMaxRows];
  QuantizeRows(x.typed_data(), M, K, xq.data(), xsp);
  const int8_t* xp = xq.data();
  const int8_t* wp = w.typed_data() + off;
  const float* sp = scale.typed_data() + off / (rows * cols) * N;
  float* op = out->typed_data();
  int32_t x128[kMaxRows] = {};  // 128 * sum(xq) per row: what the unsigned weights added
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) x128[m] += 128 * xp[m * K + k];
  }
  if (kW8A8Streams && !transposed && M <= kStreamRows && N % 64 == 0 && K % 4 == 0) {
    // As the 4-bit products of few rows (StreamSplit: ranges of 4-row steps, tiles 64 columns at a time); the
    // ranges' int32 sums are added up after (exactly: integers).
    const StreamSplit split(N, K / 4, 64);
    const int64_t ranges = split.ranges;
    std::vector<int32_t> sums(ranges * M * N);
    RunChunks(pool, split.items(), split.items() / 2, [&](int64_t c) {
      int64_t r, s0, s1, n0, n1;
      split.Item(c, &r, &s0, &s1, &n0, &n1);
      W8A8SumsStream(M, xp, wp, K, N, 4 * s0, 4 * s1, n0, n1, sums.data() + r * M * N);
    });
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        int32_t total = -x128[m];
        for (int64_t r = 0; r < ranges; ++r) total += sums[(r * M + m) * N + n];
        op[m * N + n] = static_cast<float>(total) * xsp[m] * sp[n];
      }
    }
    return ffi::Error::Success();
  }
  const int64_t chunk = transposed ? 256 : 128, chunks = (N + chunk - 1) / chunk;
  RunChunks(pool, chunks, chunks / 2, [&](int64_t c) {
    const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
    int32_t acc[kMaxRows * 256];
    W8A8Sums(M, xp, wp, K, N, transposed, n0, n1, acc, chunk);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = n0; n < n1; ++n) {
        const float a = static_cast<float>(acc[m * chunk + n - n0] - x128[m]);
        op[m * N + n] = a * xsp[m] * sp[n];
      }
    }
  });
  return ffi::Error::Success();
}
}  // namespace

// What both attention targets take after their caches: the batch description, the attributes, the output.
template <typename Binding>
auto BindBatch(Binding b) {
  return std::move(b).template Arg<ffi::Buffer<ffi::S32>>()  // layer
      .template Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
      .template Arg<ffi::Buffer<ffi::S32>>()  // page_indices
      .template Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
      .template Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
      .template Arg<ffi::Buffer<ffi::S32>>()  // window
      .template Arg<ffi::Buffer<ffi::F32>>()  // sinks: [num_q_heads], or [0] for none
      .template Attr<float>("sm_scale")
      .template Attr<float>("soft_cap")
      .template Ctx<ffi::ThreadPool>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, PagedAttention,
                              BindBatch(ffi::Ffi::Bind()
                                            .Arg<ffi::Buffer<ffi::F32>>()  // q
                                            .Arg<ffi::AnyBuffer>()  // k_cache: float32, bfloat16 or fp8
                                            .Arg<ffi::AnyBuffer>()));  // v_cache

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttentionInt8, PagedAttentionInt8,
                              BindBatch(ffi::Ffi::Bind()
                                            .Arg<ffi::Buffer<ffi::F32>>()  // q
                                            .Arg<ffi::AnyBuffer>()  // k_cache: int8 values [L, P, S, K, H]
                                            .Arg<ffi::AnyBuffer>()  // v_cache
                                            .Arg<ffi::Buffer<ffi::F32>>()  // k_scales [L, P, S, K]
                                            .Arg<ffi::Buffer<ffi::F32>>()));  // v_scales

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKV, WriteKV,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // k_cache (aliased to the first output), or scales
                                  .Arg<ffi::AnyBuffer>()  // v_cache (aliased to the second)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::AnyBuffer>()  // new_k
                                  .Arg<ffi::AnyBuffer>()  // new_v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulRows, MatmulRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // w [(L,) K, N] bfloat16, or [(L,) K, N / 2] uint32 pairs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// What both quantized-weight targets take: the weight (values, scales, zeros), the layer, its format, the pool.
template <typename Binding>
auto BindQuantized(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // q [(L,) K', N] or [(L,) N, K']: int8, or uint8 pairs
      .template Arg<ffi::AnyBuffer>()  // scale: float16 or float32, or uint8 codes
      .template Arg<ffi::AnyBuffer>()  // zero: as scale (int8 codes beside uint8 ones), or empty
      .template Arg<ffi::AnyBuffer>()  // coded scales' float32 multipliers [(L,) 1, N] or [(L,) N, 1], or empty
      .template Arg<ffi::AnyBuffer>()  // coded zeros' multipliers, or empty
      .template Arg<ffi::Buffer<ffi::S32>>()  // layer
      .template Attr<int64_t>("bits")
      .template Attr<int64_t>("group")
      .template Attr<int64_t>("offset")
      .template Attr<bool>("transposed")
      .template Ctx<ffi::ThreadPool>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulQuantRows, MatmulQuantRows,
                              BindQuantized(ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>())  // x [M, K]
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDequantize, Dequantize,
                              BindQuantized(ffi::Ffi::Bind())
                                  .Ret<ffi::AnyBuffer>());  // [K, N] or [N, K]: float32 or bfloat16

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulW8A8Rows, MatmulW8A8Rows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K], quantized per row here
                                  .Arg<ffi::Buffer<ffi::S8>>()  // w [(L,) K, N], or [N, K] transposed
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale: one per output channel (and layer)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Attr<bool>("transposed")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
