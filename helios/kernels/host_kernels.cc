// Host-side helpers the runner calls between graph runs (through ctypes: helios.kernels.host),
// compiled into the same library as the operators.
//
// flare_scatter_kv: a step's new K/V rows into their pool slots. numpy's fancy-indexed
// assignment of the same rows ran at ~0.2 ms a decode step at one row and 0.3-0.5 ms at eight,
// most of it per-call overhead on cache-cold interpreter state; this is one call.
#include <cstdint>
#include <cstring>

namespace {

// float32 -> bfloat16 rounded to nearest even; a NaN keeps its top bits and stays NaN (a
// low-payload NaN would round into infinity): helios.kernels.kv_dtype.to_bfloat16's formula.
inline uint16_t ToBfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if (value != value) return static_cast<uint16_t>((bits >> 16) | 0x0040);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace

// new_kv [planes, batch, length, width] float32 (planes: layers x {K, V}; width: kv heads x
// head dim) -> pool [planes, pages, page_tokens, width] of float32 (bf16 = 0) or bfloat16
// (bf16 = 1): row i of `count` takes new_kv[:, row[i], token[i]] into pool[:, page[i], offset[i]].
// Returns 0, or -1 without writing anything when an index lies outside its array.
extern "C" int32_t flare_scatter_kv(void* pool, int32_t bf16, int64_t planes, int64_t pages, int64_t page_tokens,
                                    int64_t width, const float* new_kv, int64_t batch, int64_t length,
                                    const int64_t* page, const int64_t* offset, const int64_t* row,
                                    const int64_t* token, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const bool inside = page[i] >= 0 && page[i] < pages && offset[i] >= 0 && offset[i] < page_tokens &&
                        row[i] >= 0 && row[i] < batch && token[i] >= 0 && token[i] < length;
    if (!inside) return -1;
  }
  for (int64_t plane = 0; plane < planes; ++plane) {
    for (int64_t i = 0; i < count; ++i) {
      const float* src = new_kv + ((plane * batch + row[i]) * length + token[i]) * width;
      const int64_t at = ((plane * pages + page[i]) * page_tokens + offset[i]) * width;
      if (bf16) {
        uint16_t* dst = static_cast<uint16_t*>(pool) + at;
        for (int64_t j = 0; j < width; ++j) dst[j] = ToBfloat16(src[j]);
      } else {
        std::memcpy(static_cast<float*>(pool) + at, src, static_cast<size_t>(width) * sizeof(float));
      }
    }
  }
  return 0;
}
