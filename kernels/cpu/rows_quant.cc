// Products of a few float32 rows by quantized weights for the CPU, as an XLA FFI custom call
// (jaxserve.kernels.matmul.cpu); the weights' format is quantized.h's.

#include "common.h"
#include "quantized.h"

namespace {

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
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulQuantRows, MatmulQuantRows,
                              BindQuantized(ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>())  // x [M, K]
                                  .Ret<ffi::Buffer<ffi::F32>>());
