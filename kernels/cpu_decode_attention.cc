// Decode attention over the paged KV cache for the CPU, as an XLA FFI custom call (jaxserve.kernels.cpu_ffi).
//
// Only the sequences whose query chunk is one token (decode) are computed; every other output row is written as
// zeros, and the XLA path (ragged_paged_attention_xla.py) fills those. Why C++: XLA's CPU backend moves gathered
// K/V at about 1 ns per float whatever the access pattern, so a 64-sequence decode step spent more time gathering
// context than in all its matmuls. Here each page slot's K/V rows are read in place, once, with the page loop
// outermost, so a page's [page_size, kv_heads, head_dim] block is streamed from memory a single time.
//
// Per sequence, per page: scores for all query heads of all KV heads, one online-softmax update per page
// (max, rescale, exp, accumulate P.V), float32 throughout. Sequences are claimed one at a time, through an atomic
// counter, by the calling thread and by helpers scheduled on XLA's own intra-op thread pool: no thread is created
// per call, no more threads run than XLA's pool has, and uneven context lengths balance themselves.
// Layouts (see reference.py): q [T, Nq, H]; caches [L, P, S, K, H]; page_indices [Sb, PB]; cu_q_lens [Sb + 1].

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Pages ahead to prefetch, into L2 (locality 1): on the 2-core EPYC a 64-sequence decode layer read its scattered
// pages at 10-11 GB/s with a whole-page L1 prefetch one page ahead, 13-13.6 GB/s like this.
constexpr int64_t kPrefetchPages = 2;

// 16 floats (one AVX-512 register, two AVX ones), unaligned loads and stores allowed: GCC/Clang vector extensions.
// head_dim runs 16 at a time; the last head_dim % 16 elements are scalar.
typedef float V16 __attribute__((vector_size(64), aligned(4)));
constexpr int kWide = 16;

inline V16 Load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store16(float* p, V16 v) { std::memcpy(p, &v, sizeof(v)); }

inline float Sum16(V16 v) {
  float s = 0;
  for (int u = 0; u < kWide; ++u) s += v[u];
  return s;
}

// s[c] = q . k_c for the n keys k_c = k + c * stride; four keys at a time, so four FMA chains run in parallel.
// H: a multiple of 16 here (see Scores).
inline void Scores16(const float* q, const float* k, int64_t stride, int64_t n, int64_t H, float* s) {
  int64_t c = 0;
  for (; c + 4 <= n; c += 4) {
    const float *k0 = k + c * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
    V16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t j = 0; j < H; j += kWide) {
      const V16 qv = Load16(q + j);
      a0 += qv * Load16(k0 + j);
      a1 += qv * Load16(k1 + j);
      a2 += qv * Load16(k2 + j);
      a3 += qv * Load16(k3 + j);
    }
    s[c] = Sum16(a0);
    s[c + 1] = Sum16(a1);
    s[c + 2] = Sum16(a2);
    s[c + 3] = Sum16(a3);
  }
  for (; c < n; ++c) {
    V16 a = {};
    for (int64_t j = 0; j < H; j += kWide) a += Load16(q + j) * Load16(k + c * stride + j);
    s[c] = Sum16(a);
  }
}

// Scores16 over H rounded down to 16, then the scalar tail, kept out of the 16-wide loops (with it inside them the
// cache-hot benchmark of RESULTS.md ran 41-46 ms instead of 37).
inline void Scores(const float* q, const float* k, int64_t stride, int64_t n, int64_t H, float* s) {
  const int64_t hw = H - H % kWide;
  Scores16(q, k, stride, n, hw, s);
  for (int64_t c = 0; c < n && hw < H; ++c) {
    for (int64_t j = hw; j < H; ++j) s[c] += q[j] * k[c * stride + j];
  }
}

// acc = acc * alpha + sum_c p[c] v_c, one 16-float slice of acc at a time kept in registers over all n keys
// (two chains, even and odd keys); the last H % 16 elements scalar.
inline void AccumulatePV(float* acc, float alpha, const float* p, const float* v, int64_t stride, int64_t n,
                         int64_t H) {
  const int64_t hw = H - H % kWide;
  for (int64_t j = 0; j < hw; j += kWide) {
    V16 a = Load16(acc + j) * alpha, b = {};
    int64_t c = 0;
    for (; c + 2 <= n; c += 2) {
      a += p[c] * Load16(v + c * stride + j);
      b += p[c + 1] * Load16(v + (c + 1) * stride + j);
    }
    if (c < n) a += p[c] * Load16(v + c * stride + j);
    Store16(acc + j, a + b);
  }
  for (int64_t j = hw; j < H; ++j) {  // the scalar tail
    float a = acc[j] * alpha;
    for (int64_t c = 0; c < n; ++c) a += p[c] * v[c * stride + j];
    acc[j] = a;
  }
}

// exp(x) for x <= 0 (scores minus their running max), vectorizable: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2,
// p a degree-6 polynomial (relative error < 2e-7 over the range); x < -87 (and -inf) gives exactly 0.
inline float ExpNonPositive(float x) {
  const float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  const bool tiny = x < -87.0f;
  x = tiny ? 0.0f : x;
  const float n = std::nearbyint(x * kLog2e);
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return tiny ? 0.0f : out;
}

struct Geometry {
  int64_t num_tokens, num_q_heads, head_dim;
  int64_t num_pages, page_size, kv_heads;
  int64_t pages_per_seq;
  int64_t layer;
  int32_t window;
  float sm_scale, soft_cap;
};

// One decode sequence: writes out[tok, :, :].
void AttendOne(const Geometry& g, const float* q, const float* k_cache, const float* v_cache, const int32_t* pages,
               int32_t kv_len, int64_t tok, float* out, std::vector<float>& scratch) {
  const int64_t H = g.head_dim, K = g.kv_heads, Nq = g.num_q_heads, S = g.page_size;
  const int64_t group = Nq / K;
  const float* qt = q + tok * Nq * H;
  float* ot = out + tok * Nq * H;
  if (kv_len <= 0) {
    std::fill(ot, ot + Nq * H, 0.0f);
    return;
  }
  const int64_t pos = kv_len - 1;
  const int64_t lo = g.window > 0 ? std::max<int64_t>(pos - g.window + 1, 0) : 0;
  // scratch: m [Nq], l [Nq], acc [Nq, H], scores [Nq, S]
  scratch.assign(Nq * (2 + H + S), 0.0f);
  float* m = scratch.data();
  float* l = m + Nq;
  float* acc = l + Nq;
  float* sc = acc + Nq * H;
  std::fill(m, m + Nq, -std::numeric_limits<float>::infinity());
  const int64_t layer_base = g.layer * g.num_pages;
  for (int64_t first = (lo / S) * S; first < kv_len; first += S) {
    const int64_t page = pages[std::min<int64_t>(first / S, g.pages_per_seq - 1)];
    const int64_t c0 = std::max(first, lo), c1 = std::min(first + S, static_cast<int64_t>(kv_len));
    const int64_t n = c1 - c0;
    const float* kp = k_cache + ((layer_base + page) * S + (c0 - first)) * K * H;
    const float* vp = v_cache + ((layer_base + page) * S + (c0 - first)) * K * H;
    // Start fetching the page kPrefetchPages ahead, a slice per KV head, so the requests spread over this page's work.
    const int64_t ahead = first + kPrefetchPages * S;
    const char *kn = nullptr, *vn = nullptr;
    const int64_t page_bytes = S * K * H * static_cast<int64_t>(sizeof(float));
    if (ahead < kv_len) {
      const int64_t next = pages[std::min<int64_t>(ahead / S, g.pages_per_seq - 1)];
      kn = reinterpret_cast<const char*>(k_cache + (layer_base + next) * S * K * H);
      vn = reinterpret_cast<const char*>(v_cache + (layer_base + next) * S * K * H);
    }
    for (int64_t kh = 0; kh < K; ++kh) {
      if (kn != nullptr) {
        for (int64_t b = page_bytes * kh / K; b < page_bytes * (kh + 1) / K; b += 64) {
          __builtin_prefetch(kn + b, 0, 1);
          __builtin_prefetch(vn + b, 0, 1);
        }
      }
      for (int64_t gi = 0; gi < group; ++gi) {
        const int64_t h = kh * group + gi;
        const float* qh = qt + h * H;
        float* s = sc + h * S;
        float mx = m[h];
        Scores(qh, kp + kh * H, K * H, n, H, s);
        for (int64_t c = 0; c < n; ++c) {
          float x = s[c] * g.sm_scale;
          if (g.soft_cap > 0) x = g.soft_cap * std::tanh(x / g.soft_cap);
          s[c] = x;
          mx = std::max(mx, x);
        }
        const float alpha = ExpNonPositive(m[h] - mx);  // m[h] = -inf on the first page: alpha = 0
        float sum = 0;
        for (int64_t c = 0; c < n; ++c) s[c] = ExpNonPositive(s[c] - mx);
        for (int64_t c = 0; c < n; ++c) sum += s[c];
        l[h] = l[h] * alpha + sum;
        m[h] = mx;
        float* a = acc + h * H;
        AccumulatePV(a, alpha, s, vp + kh * H, K * H, n, H);
      }
    }
  }
  for (int64_t h = 0; h < Nq; ++h) {
    const float inv = l[h] > 0 ? 1.0f / l[h] : 0.0f;
    for (int64_t d = 0; d < H; ++d) ot[h * H + d] = acc[h * H + d] * inv;
  }
}

ffi::Error DecodeAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                               ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
                               ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window, float sm_scale,
                               float soft_cap, ffi::ThreadPool pool, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto cd = k_cache.dimensions();
  auto pd = page_indices.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || pd.size() != 2) {
    return ffi::Error::InvalidArgument("decode attention: q must be rank 3, caches rank 5, page_indices rank 2");
  }
  Geometry g{qd[0], qd[1], qd[2], cd[1], cd[2], cd[3], pd[1], 0, 0, sm_scale, soft_cap};
  if (cd[4] != g.head_dim || g.num_q_heads % g.kv_heads != 0) {
    return ffi::Error::InvalidArgument("decode attention: head_dim or head counts do not match");
  }
  g.layer = layer.typed_data()[0];
  g.window = window.typed_data()[0];
  if (g.layer < 0 || g.layer >= cd[0]) return ffi::Error::InvalidArgument("decode attention: layer out of range");
  const int64_t seqs = std::min<int64_t>(num_seqs.typed_data()[0], pd[0]);
  const int32_t* cu = cu_q_lens.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* table = page_indices.typed_data();
  float* o = out->typed_data();
  const float* qp = q.typed_data();
  const float* kc = k_cache.typed_data();
  const float* vc = v_cache.typed_data();

  std::vector<char> is_decode(g.num_tokens, 0);
  std::vector<int64_t> work;  // sequence ids with exactly one query token
  for (int64_t s = 0; s < seqs; ++s) {
    if (cu[s + 1] - cu[s] == 1 && cu[s] >= 0 && cu[s] < g.num_tokens) {
      work.push_back(s);
      is_decode[cu[s]] = 1;
    }
  }
  const int64_t row = g.num_q_heads * g.head_dim;
  for (int64_t t = 0; t < g.num_tokens; ++t) {
    if (!is_decode[t]) std::fill(o + t * row, o + (t + 1) * row, 0.0f);
  }
  for (int64_t s : work) {  // a page table entry outside the pool would read out of bounds: refuse the call
    const int64_t used = std::min<int64_t>((lens[s] + g.page_size - 1) / g.page_size, g.pages_per_seq);
    if (lens[s] > g.pages_per_seq * g.page_size) {
      return ffi::Error::InvalidArgument("decode attention: kv_len longer than the page table");
    }
    for (int64_t i = 0; i < used; ++i) {
      const int32_t p = table[s * g.pages_per_seq + i];
      if (p < 0 || p >= g.num_pages) return ffi::Error::InvalidArgument("decode attention: page index out of range");
    }
  }
  const int64_t n = static_cast<int64_t>(work.size());
  // Shared with the helpers, which may start after this call has returned: they then find no work left and touch
  // nothing but this state. Every claimed sequence is finished before the call returns.
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto claim = [=, &g, &work](Shared& st) {
    std::vector<float> scratch;
    for (int64_t i = st.next.fetch_add(1); i < n; i = st.next.fetch_add(1)) {
      const int64_t s = work[i];
      AttendOne(g, qp, kc, vc, table + s * g.pages_per_seq, lens[s], cu[s], o, scratch);
      st.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n / 2);
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([shared, claim]() { claim(*shared); });
  }
  claim(*shared);
  while (shared->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
