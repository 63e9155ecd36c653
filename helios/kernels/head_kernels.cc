// ai.flare.LogSoftmaxTopK: the logprob head's LogSoftmax and TopK over the vocabulary in one
// operator (helios.kernels.head rewrites the pair into it when a graph is opened).
//
// Why: onnxruntime runs the two on one thread each, over a 152k-wide vocabulary: at 8 rows
// they took ~2 ms of a ~20 ms decode step, as much as a third of the attention. Here both
// threads share each row in chunks, and TopK is a threshold filter over the logprobs as they are
// written (a lane enters the candidates only when it beats the chunk's k-th best so far).
//
// Input:   X float [N, V] (logits).
// Outputs: Y float [N, V] = (x - max) - log(sum(exp(x - max))), onnxruntime's LogSoftmax
//          formula; values float [N, k], indices int64 [N, k]: the k largest of each row of Y,
//          decreasing, equal values by lower index first (onnxruntime's TopK, largest and
//          sorted). The values are Y's own elements, so a later gather from Y agrees with them.
// Attribute: k.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include "simd_math.h"

namespace {

constexpr int64_t kChunk = 8192;  // vocabulary entries per work item

struct Candidate {
  float value;
  int64_t index;
};

// Orders candidates as onnxruntime's TopK does: larger first, equal values by lower index.
bool Before(const Candidate& a, const Candidate& b) { return a.value > b.value || (a.value == b.value && a.index < b.index); }

struct Head {
  const float* x;
  float* y;
  int64_t V, k, chunks;
  std::vector<float> chunk_max, chunk_sum;  // [N * chunks]
  std::vector<float> row_max, row_log_sum;  // [N]
  std::vector<Candidate> candidates;                      // [N * chunks * k]
  std::vector<int64_t> counts;                             // [N * chunks]
};

// Phase 1, per (row, chunk): the chunk's max and sum(exp(x - its max)).
void ChunkSums(void* data, size_t item) {
  Head& h = *static_cast<Head*>(data);
  const int64_t row = static_cast<int64_t>(item) / h.chunks, chunk = static_cast<int64_t>(item) % h.chunks;
  const int64_t begin = chunk * kChunk, end = std::min(h.V, begin + kChunk);
  const float* x = h.x + row * h.V;
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(x + i));
  float m = _mm512_reduce_max_ps(vmax);
  for (int64_t j = i; j < end; ++j) m = std::max(m, x[j]);
  const __m512 neg = _mm512_set1_ps(-m);
  __m512 vsum = _mm512_setzero_ps();
  for (i = begin; i + 16 <= end; i += 16) vsum = _mm512_add_ps(vsum, Exp(_mm512_add_ps(_mm512_loadu_ps(x + i), neg)));
  if (i < end) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (end - i)) - 1u);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(tail, Exp(_mm512_add_ps(_mm512_maskz_loadu_ps(tail, x + i), neg))));
  }
  h.chunk_max[item] = m;
  h.chunk_sum[item] = m == -std::numeric_limits<float>::infinity() ? 0.f : _mm512_reduce_add_ps(vsum);
}

// Inserts (value, index) into a chunk's sorted candidates (indices arrive ascending, so an equal
// value goes after those already there), keeping at most k.
void Insert(Candidate* list, int64_t& count, int64_t k, float value, int64_t index) {
  int64_t at = count;
  while (at > 0 && list[at - 1].value < value) --at;
  if (at >= k) return;
  const int64_t last = std::min(count, k - 1);
  for (int64_t j = last; j > at; --j) list[j] = list[j - 1];
  list[at] = {value, index};
  count = std::min(count + 1, k);
}

// Phase 2, per (row, chunk): Y = (x - max) - log(sum), and the chunk's k best of Y.
void ChunkOutputs(void* data, size_t item) {
  Head& h = *static_cast<Head*>(data);
  const int64_t row = static_cast<int64_t>(item) / h.chunks, chunk = static_cast<int64_t>(item) % h.chunks;
  const int64_t begin = chunk * kChunk, end = std::min(h.V, begin + kChunk);
  const float* x = h.x + row * h.V;
  float* y = h.y + row * h.V;
  const float max = h.row_max[row], log_sum = h.row_log_sum[row];
  Candidate* list = h.candidates.data() + item * h.k;
  int64_t count = 0;
  const __m512 vmax = _mm512_set1_ps(max), vlog = _mm512_set1_ps(log_sum);
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 lanes = end - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (end - i)) - 1u);
    const __m512 v = _mm512_sub_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x + i), vmax), vlog);
    _mm512_mask_storeu_ps(y + i, lanes, v);
    // Lanes that could enter: all while the list is short, then those above its k-th value.
    __mmask16 enter = lanes;
    if (count == h.k) enter &= _mm512_cmp_ps_mask(v, _mm512_set1_ps(list[h.k - 1].value), _CMP_GT_OQ);
    while (enter) {
      const int lane = __builtin_ctz(enter);
      enter &= enter - 1;
      const float value = y[i + lane];
      if (count == h.k && !(value > list[h.k - 1].value)) continue;  // the bar rose within this vector
      if (value != value) continue;                                    // NaN never ranks
      Insert(list, count, h.k, value, i + lane);
    }
  }
  h.counts[item] = count;
}

struct LogSoftmaxTopKKernel {
  int64_t k;

  LogSoftmaxTopKKernel(const OrtApi&, const OrtKernelInfo* info) {
    k = Ort::ConstKernelInfo(info).GetAttribute<int64_t>("k");
    if (k < 1) ORT_CXX_API_THROW("LogSoftmaxTopK: k must be >= 1", ORT_INVALID_ARGUMENT);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto input = ctx.GetInput(0);
    const std::vector<int64_t> shape = input.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() != 2) ORT_CXX_API_THROW("LogSoftmaxTopK: X must be [N, V]", ORT_INVALID_ARGUMENT);
    const int64_t N = shape[0], V = shape[1];
    if (V < k) ORT_CXX_API_THROW("LogSoftmaxTopK: k is larger than the vocabulary", ORT_INVALID_ARGUMENT);
    auto output = ctx.GetOutput(0, shape);
    auto values = ctx.GetOutput(1, {N, k});
    auto indices = ctx.GetOutput(2, {N, k});
    if (N == 0) return;
    thread_local Head h;
    h.x = input.GetTensorData<float>();
    h.y = output.GetTensorMutableData<float>();
    h.V = V;
    h.k = k;
    h.chunks = (V + kChunk - 1) / kChunk;
    const size_t items = static_cast<size_t>(N * h.chunks);
    h.chunk_max.resize(items);
    h.chunk_sum.resize(items);
    h.row_max.resize(N);
    h.row_log_sum.resize(N);
    h.candidates.resize(items * k);
    h.counts.resize(items);
    ctx.ParallelFor(ChunkSums, items, 0, &h);
    for (int64_t row = 0; row < N; ++row) {  // the row's max and log(sum(exp(x - max)))
      const float* maxes = h.chunk_max.data() + row * h.chunks;
      const float max = *std::max_element(maxes, maxes + h.chunks);
      double sum = 0.0;
      for (int64_t c = 0; c < h.chunks; ++c)
        if (h.chunk_sum[row * h.chunks + c] > 0.f) sum += h.chunk_sum[row * h.chunks + c] * std::exp(maxes[c] - max);
      h.row_max[row] = max;
      h.row_log_sum[row] = std::log(static_cast<float>(sum));
    }
    ctx.ParallelFor(ChunkOutputs, items, 0, &h);
    float* top_values = values.GetTensorMutableData<float>();
    int64_t* top_indices = indices.GetTensorMutableData<int64_t>();
    std::vector<Candidate> merged;
    for (int64_t row = 0; row < N; ++row) {
      merged.clear();
      for (int64_t c = 0; c < h.chunks; ++c) {
        const Candidate* list = h.candidates.data() + (row * h.chunks + c) * k;
        merged.insert(merged.end(), list, list + h.counts[row * h.chunks + c]);
      }
      std::partial_sort(merged.begin(), merged.begin() + std::min<int64_t>(k, merged.size()), merged.end(), Before);
      for (int64_t j = 0; j < k; ++j) {
        // Fewer than k ranked (NaN rows): onnxruntime would return something; say NaN, id 0.
        const bool have = j < static_cast<int64_t>(merged.size());
        top_values[row * k + j] = have ? merged[j].value : std::numeric_limits<float>::quiet_NaN();
        top_indices[row * k + j] = have ? merged[j].index : 0;
      }
    }
  }
};

struct LogSoftmaxTopKOp : Ort::CustomOpBase<LogSoftmaxTopKOp, LogSoftmaxTopKKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new LogSoftmaxTopKKernel(api, info); }
  const char* GetName() const { return "LogSoftmaxTopK"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

const LogSoftmaxTopKOp log_softmax_top_k_op;

}  // namespace

namespace flare {
void AddHeadOps(Ort::CustomOpDomain& domain) { domain.Add(&log_softmax_top_k_op); }
}  // namespace flare
