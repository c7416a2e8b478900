// Products of a few float32 rows by bfloat16 or float32 weights for the CPU, as an XLA FFI custom call
// (jaxserve.kernels.matmul.cpu).

#include "common.h"

namespace {

// Products of a few float32 rows (M <= kMaxRows: one step's decode tokens) by a weight matrix, float32
// accumulation, for the layer scan's matrices read in place: w is one matrix [K, N] or a stack of them [L, K, N] and
// the call takes the layer's index, so no per-layer slice is copied out of the stack first (a custom call's operand
// is a whole buffer: scan's dynamic slice of its weights copied each layer's matrix, every step).
// - MatmulRows: bfloat16 weights (or uint32 pairs of them, the same memory), or float32 ones. XLA:CPU's own
//   products on bfloat16 weights are pathological below 8 rows (a [1, 576] x [576, 3072] product reads its weights
//   at ~2 GB/s, against ~30 for float32 weights); this one reads each weight once. On float32 stacks it streams the
//   model's layers at twice XLA's rate (its product on the scan's slices: 19.4 against 9.9 ms a token here).
// - MatmulQuantRows: quantized weights (matmul.QArray): int8 or 4-bit values packed two per byte along K
//   (k = 2i in the low nibble of byte i, 2i + 1 in the high one), a float16 / float32 scale per group of ``group``
//   values along K (or an 8-bit code times a float32 per output channel: GroupScales), an optional additive zero,
//   an ``offset`` subtracted from the values. w = (q - offset) * s + z,
//   and per group sum_k x_k w_k = s * sum_k x_k q_k + (z - s * offset) * sum_k x_k: the values are widened to float32
//   in registers and never written out, the scales applied once per group. Either layout: [K', N] (the layers'
//   [in, out] matrices, grouped along rows) or transposed [N, K'] (the [V, D] embedding as the tied output
//   projection, grouped along each row).
// Work is cut into chunks of output columns claimed by the calling thread and helpers on XLA's pool; a [K, N] chunk
// runs down all K rows once per strip of B x 16 columns, the strip's M x B accumulators in registers.

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
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulRows, MatmulRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // w [(L,) K, N] bfloat16, or [(L,) K, N / 2] uint32 pairs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
