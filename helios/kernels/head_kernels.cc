// ai.flare.LogSoftmaxTopK: the logprob head's LogSoftmax and TopK over the vocabulary in one
// operator (helios.kernels.head rewrites the pair into it when a graph is opened).
//
// Why: onnxruntime runs the two on one thread each, over a 152k-wide vocabulary: at 8 rows
// they took ~2 ms of a ~20 ms decode step, as much as a third of the attention. Here both
// threads share each row in chunks. The first pass also keeps the max of every 128 logits; the
// (c+1)-th largest of those maxima is a floor the c+1 best logits all reach, so the second pass
// (writing Y) sends only lanes at or above it to the candidates, a few hundred a row.
//
// Inputs:  X float [N, V] (logits); optional ids int64 [M <= N, E] (a GatherElements of Y along
//          its last axis, folded in: negative ids count from the end, as ONNX's do).
// Outputs: Y float [N, V] = (x - max) - log(sum(exp(x - max))), onnxruntime's LogSoftmax
//          formula, optional: without it the second pass reads only the blocks that hold a
//          candidate; values float [N, k], indices int64 [N, k]: the k largest of each row of Y,
//          decreasing (onnxruntime's TopK, largest and sorted). The values are Y's own elements,
//          so a later gather from Y agrees with them. The indices are the k largest of x, equal
//          logits by lower index: Y is non-decreasing in x, so they are Y's k largest too, but Y
//          rounds logits a few ulps apart to one value, where onnxruntime's TopK would then take
//          the lower index whichever logit is larger.
//          Optional, for a sampler: candidates int64 [N, c], the c largest of x in the same
//          order (the first k are the indices), and outside float [N], the largest x among the
//          indices not in candidates (-inf when there are none): together they let a sampler
//          rule out every other token without reading the row again (a row with fewer than c
//          orderable logits, NaN aside, pads with id 0). Optional gathered float
//          [M, E]: Y at ids, the same bits Y holds there.
// Attributes: k; candidates (c >= k, default k).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include "simd_math.h"

namespace {

constexpr int64_t kChunk = 8192;  // vocabulary entries per work item
constexpr int64_t kBlock = 128;   // entries per block maximum (the candidates' floor)
constexpr int64_t kBlocksPerChunk = kChunk / kBlock;

struct Candidate {
  float raw;  // x
  int64_t index;
};

// Larger x first, equal x by lower index.
inline bool Before(const Candidate& a, const Candidate& b) { return a.raw > b.raw || (a.raw == b.raw && a.index < b.index); }

struct Head {
  const float* x;
  float* y;
  int64_t V, keep, chunks;  // keep: the best a row keeps (c + 1: the first outside too)
  std::vector<float> chunk_max, chunk_sum;  // [N * chunks]
  std::vector<float> block_max;             // [N * chunks * kBlocksPerChunk], -inf past the row
  std::vector<std::vector<float>> ranked_blocks;  // per row: its block maxima, reordered
  std::vector<float> row_max, row_log_sum, row_floor;  // [N]
  std::vector<Candidate> candidates;        // [N * chunks * 2 * keep]
  std::vector<int64_t> counts;              // [N * chunks]
};

// Phase 1, per (row, chunk): the chunk's max and sum(exp(x - its max)), and its blocks' maxima
// (NaN skipped: _mm512_max_ps returns its second operand when either is NaN). A NaN logit makes
// the chunk's sum NaN, so its row's Y, values and logsumexp are NaN, as onnxruntime's are (Exp
// clamps its input, which would let a NaN through as a finite term).
void ChunkSums(void* data, size_t item) {
  Head& h = *static_cast<Head*>(data);
  const int64_t row = static_cast<int64_t>(item) / h.chunks, chunk = static_cast<int64_t>(item) % h.chunks;
  const int64_t begin = chunk * kChunk, end = std::min(h.V, begin + kChunk);
  const float* x = h.x + row * h.V;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  float* blocks = h.block_max.data() + item * kBlocksPerChunk;
  __mmask16 nan = 0;
  for (int64_t b = 0; b < kBlocksPerChunk; ++b) {
    __m512 block = neg_inf;
    for (int64_t i = begin + b * kBlock; i < std::min(end, begin + (b + 1) * kBlock); i += 16) {
      const __mmask16 lanes = end - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (end - i)) - 1u);
      const __m512 v = _mm512_mask_loadu_ps(neg_inf, lanes, x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      block = _mm512_max_ps(v, block);
    }
    blocks[b] = _mm512_reduce_max_ps(block);
  }
  const float m = *std::max_element(blocks, blocks + kBlocksPerChunk);  // past the row: -inf
  const __m512 neg = _mm512_set1_ps(-m);
  __m512 vsum = _mm512_setzero_ps();
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) vsum = _mm512_add_ps(vsum, Exp(_mm512_add_ps(_mm512_loadu_ps(x + i), neg)));
  if (i < end) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (end - i)) - 1u);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(tail, Exp(_mm512_add_ps(_mm512_maskz_loadu_ps(tail, x + i), neg))));
  }
  h.chunk_max[item] = m;
  h.chunk_sum[item] = nan ? std::numeric_limits<float>::quiet_NaN()
                          : m == -std::numeric_limits<float>::infinity() ? 0.f : _mm512_reduce_add_ps(vsum);
}

// Per row: the max, log(sum(exp(x - max))) and the candidates' floor, the keep-th largest block
// maximum (keep blocks hold a logit at least that large, so the keep best all reach it).
void RowStatistics(void* data, size_t item) {
  Head& h = *static_cast<Head*>(data);
  const int64_t row = static_cast<int64_t>(item);
  const float* maxes = h.chunk_max.data() + row * h.chunks;
  const float max = *std::max_element(maxes, maxes + h.chunks);
  double sum = 0.0;
  for (int64_t c = 0; c < h.chunks; ++c) {
    const float part = h.chunk_sum[row * h.chunks + c];
    if (!(part == 0.f)) sum += part * std::exp(maxes[c] - max);  // a NaN part makes the row NaN
  }
  h.row_max[row] = max;
  h.row_log_sum[row] = std::log(static_cast<float>(sum));
  const float* blocks = h.block_max.data() + row * h.chunks * kBlocksPerChunk;
  const int64_t count = (h.V + kBlock - 1) / kBlock;  // the rest of the row's slots are -inf
  float floor = -std::numeric_limits<float>::infinity();
  if (count >= h.keep) {  // on a copy: the second pass reads the blocks' own maxima
    std::vector<float>& ranked = h.ranked_blocks[row];
    ranked.assign(blocks, blocks + count);
    std::nth_element(ranked.begin(), ranked.begin() + h.keep - 1, ranked.end(), std::greater<float>());
    floor = ranked[h.keep - 1];
  }
  h.row_floor[row] = floor;
}

// Y at one index: the same two float subtractions the second pass writes into Y.
inline float LogProb(const Head& h, int64_t row, int64_t index) {
  const float shifted = h.x[row * h.V + index] - h.row_max[row];
  return shifted - h.row_log_sum[row];
}

// Phase 2, per (row, chunk): Y = (x - max) - log(sum) where Y is wanted, and the chunk's `keep`
// best logits at or above the row's floor, in order (without Y, only blocks whose maximum
// reaches the floor are read). Entrants go unsorted into a buffer of 2 * keep; a full buffer is
// cut to its best `keep` (nth_element), whose last becomes a higher bar.
void ChunkOutputs(void* data, size_t item) {
  Head& h = *static_cast<Head*>(data);
  const int64_t row = static_cast<int64_t>(item) / h.chunks, chunk = static_cast<int64_t>(item) % h.chunks;
  const int64_t begin = chunk * kChunk, end = std::min(h.V, begin + kChunk);
  const float* x = h.x + row * h.V;
  float* y = h.y == nullptr ? nullptr : h.y + row * h.V;
  const float* blocks = h.block_max.data() + item * kBlocksPerChunk;
  const float row_floor = h.row_floor[row];
  const int64_t keep = h.keep;
  Candidate* list = h.candidates.data() + item * 2 * keep;
  int64_t count = 0;
  const __m512 vmax = _mm512_set1_ps(h.row_max[row]), vlog = _mm512_set1_ps(h.row_log_sum[row]);
  const __m512 floor = _mm512_set1_ps(row_floor);
  bool cut = false;  // the buffer has been cut: `bar` holds its last kept logit
  __m512 bar = floor;
  for (int64_t i = begin; i < end; i += 16) {
    if (y == nullptr && (i - begin) % kBlock == 0 && !(blocks[(i - begin) / kBlock] >= row_floor)) {
      i += kBlock - 16;  // no logit of this block reaches the floor
      continue;
    }
    const __mmask16 lanes = end - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (end - i)) - 1u);
    const __m512 raw = _mm512_maskz_loadu_ps(lanes, x + i);
    if (y != nullptr) _mm512_mask_storeu_ps(y + i, lanes, _mm512_sub_ps(_mm512_sub_ps(raw, vmax), vlog));
    // Ordered compares: NaN never enters. A lane equal to the bar ranks after it (higher index).
    __mmask16 enter = _mm512_mask_cmp_ps_mask(lanes, raw, floor, _CMP_GE_OQ);
    if (cut) enter = _mm512_mask_cmp_ps_mask(enter, raw, bar, _CMP_GT_OQ);
    while (enter) {
      const int lane = __builtin_ctz(enter);
      enter &= enter - 1;
      list[count++] = {x[i + lane], i + lane};
      if (count == 2 * keep) {
        std::nth_element(list, list + keep - 1, list + count, Before);
        count = keep;
        bar = _mm512_set1_ps(list[keep - 1].raw);
        cut = true;
      }
    }
  }
  const int64_t kept = std::min(count, keep);
  std::partial_sort(list, list + kept, list + count, Before);
  h.counts[item] = kept;
}

struct LogSoftmaxTopKKernel {
  int64_t k, candidates_per_row;

  LogSoftmaxTopKKernel(const OrtApi& api, const OrtKernelInfo* info) {
    k = Ort::ConstKernelInfo(info).GetAttribute<int64_t>("k");
    if (k < 1) ORT_CXX_API_THROW("LogSoftmaxTopK: k must be >= 1", ORT_INVALID_ARGUMENT);
    // candidates is optional: the C API says so by a status, where the C++ one would throw.
    if (OrtStatus* missing = api.KernelInfoGetAttribute_int64(info, "candidates", &candidates_per_row)) {
      api.ReleaseStatus(missing);
      candidates_per_row = k;
    }
    if (candidates_per_row < k) ORT_CXX_API_THROW("LogSoftmaxTopK: candidates must be >= k", ORT_INVALID_ARGUMENT);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto input = ctx.GetInput(0);
    const std::vector<int64_t> shape = input.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() != 2) ORT_CXX_API_THROW("LogSoftmaxTopK: X must be [N, V]", ORT_INVALID_ARGUMENT);
    const int64_t N = shape[0], V = shape[1];
    if (V < candidates_per_row) ORT_CXX_API_THROW("LogSoftmaxTopK: k or candidates is larger than the vocabulary", ORT_INVALID_ARGUMENT);
    auto output = ctx.GetOutput(0, shape);  // null where the node names no Y
    auto values = ctx.GetOutput(1, {N, k});
    auto indices = ctx.GetOutput(2, {N, k});
    // Optional outputs may be absent or named "" (onnxruntime gives no tensor then).
    int64_t* candidates = nullptr;
    float* outside = nullptr;
    if (ctx.GetOutputCount() > 3) {
      auto value = ctx.GetOutput(3, {N, candidates_per_row});
      if (value) candidates = value.GetTensorMutableData<int64_t>();
    }
    if (ctx.GetOutputCount() > 4) {
      auto value = ctx.GetOutput(4, {N});
      if (value) outside = value.GetTensorMutableData<float>();
    }
    const int64_t* gather_ids = nullptr;
    float* gathered = nullptr;
    int64_t gather_rows = 0, gather_width = 0;
    if (ctx.GetInputCount() > 1 && ctx.GetOutputCount() > 5) {
      auto ids = ctx.GetInput(1);
      if (ids) {
        const std::vector<int64_t> ids_shape = ids.GetTensorTypeAndShapeInfo().GetShape();
        if (ids_shape.size() != 2 || ids_shape[0] > N)
          ORT_CXX_API_THROW("LogSoftmaxTopK: ids must be [M <= N, E]", ORT_INVALID_ARGUMENT);
        gather_rows = ids_shape[0];
        gather_width = ids_shape[1];
        gather_ids = ids.GetTensorData<int64_t>();
        for (int64_t i = 0; i < gather_rows * gather_width; ++i)
          if (gather_ids[i] < -V || gather_ids[i] >= V)
            ORT_CXX_API_THROW("LogSoftmaxTopK: an id lies outside the vocabulary", ORT_INVALID_ARGUMENT);
        auto value = ctx.GetOutput(5, {gather_rows, gather_width});
        if (value) {
          gathered = value.GetTensorMutableData<float>();
        } else {
          gather_rows = 0;  // ids without a gathered output: nothing to write
        }
      }
    }
    if (N == 0) return;
    thread_local Head h;
    h.x = input.GetTensorData<float>();
    h.y = output ? output.GetTensorMutableData<float>() : nullptr;
    h.V = V;
    h.keep = candidates_per_row + 1;
    h.chunks = (V + kChunk - 1) / kChunk;
    const size_t items = static_cast<size_t>(N * h.chunks);
    h.chunk_max.resize(items);
    h.chunk_sum.resize(items);
    h.block_max.resize(items * kBlocksPerChunk);
    h.row_max.resize(N);
    h.row_log_sum.resize(N);
    h.row_floor.resize(N);
    h.ranked_blocks.resize(N);
    h.candidates.resize(items * 2 * h.keep);
    h.counts.resize(items);
    ctx.ParallelFor(ChunkSums, items, 0, &h);
    ctx.ParallelFor(RowStatistics, static_cast<size_t>(N), 0, &h);
    ctx.ParallelFor(ChunkOutputs, items, 0, &h);
    float* top_values = values.GetTensorMutableData<float>();
    int64_t* top_indices = indices.GetTensorMutableData<int64_t>();
    std::vector<Candidate> merged;
    for (int64_t row = 0; row < N; ++row) {
      merged.clear();
      for (int64_t chunk = 0; chunk < h.chunks; ++chunk) {
        const Candidate* list = h.candidates.data() + (row * h.chunks + chunk) * 2 * h.keep;
        merged.insert(merged.end(), list, list + h.counts[row * h.chunks + chunk]);
      }
      const int64_t ranked = std::min<int64_t>(h.keep, merged.size());
      std::partial_sort(merged.begin(), merged.begin() + ranked, merged.end(), Before);
      const int64_t c = candidates_per_row;
      if (outside != nullptr) outside[row] = ranked > c ? merged[c].raw : -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; candidates != nullptr && j < c; ++j) candidates[row * c + j] = j < ranked ? merged[j].index : 0;
      for (int64_t j = 0; j < k; ++j) {
        // Fewer than k ranked (NaN rows): onnxruntime would return something; say NaN, id 0.
        const bool have = j < ranked;
        top_values[row * k + j] = have ? LogProb(h, row, merged[j].index) : std::numeric_limits<float>::quiet_NaN();
        top_indices[row * k + j] = have ? merged[j].index : 0;
      }
    }
    for (int64_t i = 0; i < gather_rows * gather_width; ++i) {
      const int64_t id = gather_ids[i] < 0 ? gather_ids[i] + V : gather_ids[i];
      gathered[i] = LogProb(h, i / gather_width, id);
    }
  }
};

struct LogSoftmaxTopKOp : Ort::CustomOpBase<LogSoftmaxTopKOp, LogSoftmaxTopKKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new LogSoftmaxTopKKernel(api, info); }
  const char* GetName() const { return "LogSoftmaxTopK"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 1 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                  : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 6; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 1 || i == 2 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED
                            : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL;
  }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i == 2 || i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

const LogSoftmaxTopKOp log_softmax_top_k_op;

}  // namespace

namespace flare {
void AddHeadOps(Ort::CustomOpDomain& domain) { domain.Add(&log_softmax_top_k_op); }
}  // namespace flare
