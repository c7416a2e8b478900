// W8A8 products of a few float32 rows for the CPU, as an XLA FFI custom call (jaxserve.kernels.matmul.cpu).

#include "common.h"

namespace {

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulW8A8Rows, MatmulW8A8Rows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K], quantized per row here
                                  .Arg<ffi::Buffer<ffi::S8>>()  // w [(L,) K, N], or [N, K] transposed
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale: one per output channel (and layer)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Attr<bool>("transposed")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
