// The K/V write for the CPU, as an XLA FFI custom call (jaxserve.kernels.kv_write.cpu).

#include "common.h"

namespace {

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
}  // namespace

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
