// Dequantization of one quantized weight for the CPU, as an XLA FFI custom call (jaxserve.kernels.matmul.cpu).

#include "common.h"
#include "quantized.h"

namespace {

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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDequantize, Dequantize,
                              BindQuantized(ffi::Ffi::Bind())
                                  .Ret<ffi::AnyBuffer>());  // [K, N] or [N, K]: float32 or bfloat16
