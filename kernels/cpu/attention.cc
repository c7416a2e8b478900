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
// has, and uneven context lengths balance themselves. The step's new K/V rows are written in place by the K/V
// write's target (WriteKV, kv_write.cc).
// Layouts (see attention/reference.py): q [T, Nq, H]; caches [L, P, S, K, H]; page_indices [Sb, PB];
// cu_q_lens [Sb + 1]; int8 caches' scales [L, P, S, K] (a second target, PagedAttentionInt8, takes them).

#include "common.h"

namespace {

// Pages ahead to prefetch, into L2 (locality 1): see AttendBlockT. No prefetch at all was 1.5x slower; into L1, 1.35x.
constexpr int64_t kPrefetchPages = 1;

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
  // Caches [L, P, S, K, H], or a latent pool [L, P, S, H] (MLA: one KV head, read as it is, never through a view).
  if (qd.size() != 3 || (cd.size() != 5 && cd.size() != 4) || pd.size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q must be rank 3, caches rank 5 or 4, page_indices rank 2");
  }
  const int64_t kv_heads = cd.size() == 5 ? cd[3] : 1;
  Geometry g{qd[0], qd[1], qd[2], cd[1], cd[2], kv_heads, pd[1], 0, 0, sm_scale, soft_cap, k_scales, v_scales};
  if (cd[cd.size() - 1] != g.head_dim || g.num_q_heads % g.kv_heads != 0) {
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
