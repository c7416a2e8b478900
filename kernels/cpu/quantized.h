// The quantized-weight format that the quantized rows products and the dequantization read
// (QArray, kernels/matmul/qarray.py): values widened 16 at a time, group scales (float16, float32, or uint8 codes
// times per-channel multipliers), one layer of a stack, and the FFI binding both targets share.
#pragma once

#include "common.h"

namespace {

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

// Transposed rows are read 16 bytes at a time: a group is a whole number of such chunks or, 8 bytes (int4's
// vocabulary groups of 16), half of one, two groups a chunk with their scales side by side in a vector.
constexpr bool TransposedGroupsFit(int64_t group_bytes, int64_t row_bytes) {
  return group_bytes % kWide == 0 || (group_bytes == kWide / 2 && row_bytes % kWide == 0);
}

// a in lanes 0-7, b in lanes 8-15.
AJ_INLINE V16 PairOfGroups(float a, float b) {
  return __builtin_shuffle(V16{} + a, V16{} + b, I32x16{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23});
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
}  // namespace

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
