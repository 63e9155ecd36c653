// Host-side helpers the runner calls between graph runs (through ctypes: helios.kernels.host),
// compiled into the same library as the operators.
//
// flare_scatter_kv: a step's new K/V rows into their pool slots. numpy's fancy-indexed
// assignment of the same rows ran at ~0.2 ms a decode step at one row and 0.3-0.5 ms at eight,
// most of it per-call overhead on cache-cold interpreter state; this is one call.
// flare_exp_f32 and flare_draw_top_k: the sampler's weights and its usual draw (below).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <vector>

#include "simd_math.h"

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
// (bf16 = 1): slot i of `count` (slots [4, count]: page, offset, row, token) takes
// new_kv[:, row[i], token[i]] into pool[:, page[i], offset[i]]. Returns 0, or -1 without
// writing anything when an index lies outside its array.
extern "C" int32_t flare_scatter_kv(void* pool, int32_t bf16, int64_t planes, int64_t pages, int64_t page_tokens,
                                    int64_t width, const float* new_kv, int64_t batch, int64_t length,
                                    const int64_t* slots, int64_t count) {
  const int64_t *page = slots, *offset = slots + count, *row = slots + 2 * count, *token = slots + 3 * count;
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

// flare_exp_f32: y = e^x with simd_math.h's Exp, and 0 below -87.3 (where float32 leaves the
// normal range; -inf included). Every sampling path takes its weights from here, so a row's draw
// is the same whichever path computes it (numpy's own exp rounds differently in the last bit).
namespace {

constexpr float kExpFloor = -87.3f;

inline __m512 ExpOrZero(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloor), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(live, Exp(x));
}

}  // namespace

extern "C" void flare_exp_f32(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, ExpOrZero(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(y + i, tail, ExpOrZero(_mm512_maskz_loadu_ps(tail, x + i)));
  }
}

// flare_draw_top_k: helios.engine.top_ids_draw's draw for rows whose top-k survivors provably
// lie among their K candidate ids (the usual case), in the same float32/float64 operations:
// ~20 us a row where its ~40 numpy calls took ~0.5 ms a step cache-cold. A row that needs the
// vocabulary pass (its k-th penalized candidate does not clear `outside`) is left undrawn for
// the numpy path.
namespace {

// The k-th largest of `values` (k >= 1), as numpy's sort(values)[n - k].
float KthLargest(std::vector<float> values, int64_t k) {
  std::nth_element(values.begin(), values.begin() + (k - 1), values.end(), std::greater<float>());
  return values[k - 1];
}

struct RowDraw {
  const float* logits;  // the row's [V]
  const int64_t* top_ids;  // its [K] candidates, any order
  const float* seen;  // [K]: 1 where the repetition penalty applies (a prompt or output id)
  const float* counts;  // [K]: times generated (presence and frequency penalties)
  int64_t k_ids, top_k;
  float temperature, log_min_p, repetition, presence, frequency;
  double top_p, uniform;
  const float* outside;  // the largest raw logit outside the candidates, or null
};

// Returns the drawn id, or -1 when the row needs the vocabulary pass.
int64_t Draw(const RowDraw& r) {
  const int64_t n = r.k_ids;
  std::vector<int64_t> slot(n);  // candidate positions by increasing id
  std::iota(slot.begin(), slot.end(), 0);
  std::sort(slot.begin(), slot.end(), [&](int64_t a, int64_t b) { return r.top_ids[a] < r.top_ids[b]; });
  std::vector<int64_t> ids(n);
  std::vector<float> raw(n), value(n);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t s = slot[j];
    ids[j] = r.top_ids[s];
    raw[j] = value[j] = r.logits[ids[j]];
    if (r.seen[s]) value[j] = value[j] > 0 ? value[j] / r.repetition : value[j] * r.repetition;
    if (r.counts[s] > 0) value[j] = value[j] - (Rounded(r.frequency * r.counts[s]) + r.presence);
  }
  const float kth = KthLargest(value, r.top_k);
  const float bound = r.outside ? *r.outside : *std::min_element(raw.begin(), raw.end());
  if (!(kth > bound)) return -1;
  std::vector<float> scaled(n), shifted(n), weight(n);
  for (int64_t j = 0; j < n; ++j) scaled[j] = value[j] / r.temperature;
  const float best = *std::max_element(scaled.begin(), scaled.end());
  const float kth_scaled = KthLargest(scaled, r.top_k);
  std::vector<uint8_t> keep(n);
  for (int64_t j = 0; j < n; ++j) {
    keep[j] = scaled[j] >= best - 35.0f && scaled[j] >= kth_scaled;  // top_ids_draw.CANDIDATE_CUTOFF
    shifted[j] = scaled[j] - best;
  }
  flare_exp_f32(shifted.data(), weight.data(), n);
  if (r.top_p < 1.0) {  // nucleus: best first (decreasing value, then increasing id)
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return scaled[a] > scaled[b] || (scaled[a] == scaled[b] && ids[a] < ids[b]);
    });
    // The same running sum in the same order as numpy's cumsum over the sorted masses.
    std::vector<double> before(n);
    double running = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      before[i] = running;
      running += keep[order[i]] ? static_cast<double>(weight[order[i]]) : 0.0;
    }
    const double cut = r.top_p * running;
    for (int64_t i = 0; i < n; ++i) keep[order[i]] = keep[order[i]] && before[i] < cut;
  }
  const float floor = best + r.log_min_p;  // -inf without min-p
  for (int64_t j = 0; j < n; ++j) keep[j] = keep[j] && scaled[j] >= floor;
  // Inverse CDF over the kept tokens in id order.
  std::vector<double> cdf(n);
  double running = 0.0;
  int64_t last_kept = 0;
  for (int64_t j = 0; j < n; ++j) {
    running += keep[j] ? static_cast<double>(weight[j]) : 0.0;
    cdf[j] = running;
    if (keep[j]) last_kept = j;
  }
  const double target = r.uniform * running;
  int64_t pick = 0;
  while (pick < n && cdf[pick] <= target) ++pick;
  return ids[std::min(pick, last_kept)];
}

}  // namespace

// Parameter columns of flare_draw_top_k's `params` [count, kDrawColumns], float64
// (helios.kernels.host.DRAW_COLUMNS); the float32 ones are rounded to nearest here, as numpy's
// astype(float32) rounds them.
enum DrawColumn { kTopK, kTemperature, kTopP, kLogMinP, kRepetition, kPresence, kFrequency, kUniform, kOutside,
                  kDrawColumns };

// Row i draws from logits[rows[i]] over top_ids[rows[i]] (K per row) with params[i] (kOutside
// NaN: none given, the K-th raw candidate bounds the rest); penalties [count, 2, K] are, in
// top_ids' order, whether the repetition penalty applies and how often the id was generated.
// rows_tokens [2, count]: the rows in, then each row's draw out (-1: left to the vocabulary
// pass). Returns 0, or -1 without drawing when an index or top_k is out of range.
extern "C" int32_t flare_draw_top_k(const float* logits, int64_t batch, int64_t vocab, const int64_t* top_ids,
                                    int64_t k_ids, int64_t count, const double* params, const float* penalties,
                                    int64_t* rows_tokens) {
  const int64_t* rows = rows_tokens;
  for (int64_t i = 0; i < count; ++i) {
    const double top_k = params[i * kDrawColumns + kTopK];
    if (rows[i] < 0 || rows[i] >= batch || !(top_k >= 1 && top_k <= static_cast<double>(k_ids))) return -1;
    for (int64_t j = 0; j < k_ids; ++j) {
      const int64_t id = top_ids[rows[i] * k_ids + j];
      if (id < 0 || id >= vocab) return -1;
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    const double* column = params + i * kDrawColumns;
    const float outside = static_cast<float>(column[kOutside]);
    const RowDraw row{logits + rows[i] * vocab,
                      top_ids + rows[i] * k_ids,
                      penalties + (2 * i) * k_ids,
                      penalties + (2 * i + 1) * k_ids,
                      k_ids,
                      static_cast<int64_t>(column[kTopK]),
                      static_cast<float>(column[kTemperature]),
                      static_cast<float>(column[kLogMinP]),
                      static_cast<float>(column[kRepetition]),
                      static_cast<float>(column[kPresence]),
                      static_cast<float>(column[kFrequency]),
                      column[kTopP],
                      column[kUniform],
                      outside == outside ? &outside : nullptr};
    rows_tokens[count + i] = Draw(row);
  }
  return 0;
}
