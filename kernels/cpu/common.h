// Helpers shared by the C++ CPU kernels (cpu/ffi.py builds every .cc of this folder into one library):
// 16-float vectors, bfloat16 widening, horizontal reductions, the work split over XLA's thread pool, and the layer
// of a weight stack. Each translation unit includes it in its own anonymous namespace (nothing here is exported).
#pragma once

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

#if defined(__linux__)
#include <sched.h>
#endif

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

// int8 vectors (sign extension goes int8 -> int16 -> int32 one step at a time: see LoadKV16).
typedef int8_t I8x16 __attribute__((vector_size(16), aligned(1), may_alias));
typedef int16_t I16x16 __attribute__((vector_size(32), aligned(2)));
typedef int32_t I32x16 __attribute__((vector_size(64), aligned(4)));

// int8 K/V elements (Int8Pages pools; quantized.h's LoadInt8 without AVX-512): converted to float32 16 at a time;
// WidenScaled then multiplies each row by its scale. The sign extension goes int8 -> int16 -> int32 one step at a
// time: GCC 12 turns a direct int8 -> int32 (or -> float) conversion of the vector into 16 scalar ones (decode
// attention then took 2.4x bfloat16's time; this way about the same). Defined here, beside the other overloads,
// for every translation unit: a build without AVX-512 calls it from the quantized products too.
inline V16 LoadKV16(const int8_t* p) {
  const I8x16 b = *reinterpret_cast<const I8x16*>(p);
  return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(b, I16x16), I32x16), V16);
}

inline float ToFloat(int8_t x) { return static_cast<float>(x); }

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

// The CPUs this process may run on (its affinity mask; the hardware's count elsewhere), read once. XLA's pool has a
// thread per device, at least, so a process pinned to fewer CPUs than it has devices (a test worker of eight fake
// devices on one core) would hand each call's work to more threads than can run at once.
inline int64_t SchedulableCpus() {
  static const int64_t count = [] {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return static_cast<int64_t>(std::max(1, CPU_COUNT(&set)));
#endif
    return static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return count;
}

// Claims chunks [0, chunks) on the calling thread and up to ``helpers`` of XLA's pool threads, and fewer than
// SchedulableCpus() of them (no thread is created per call); returns when every claimed chunk is done. The shared
// state outlives the call: a helper that starts after it has returned finds no chunk left and touches nothing else.
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
  helpers = std::max<int64_t>(0, std::min({pool.num_threads() - 1, SchedulableCpus() - 1, helpers}));
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([shared, claim]() { claim(*shared); });
  claim(*shared);
  while (shared->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

// The rows products (MatmulRows, MatmulQuantRows, MatmulW8A8Rows) take at most kMaxRows rows.
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

// The streamed rows products' work split (QRowsKNStream, W8A8SumsKNStream).
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

}  // namespace
