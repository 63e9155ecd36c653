// Flare's CPU kernels for x86-64 with AVX512-VNNI, as onnxruntime custom operators (domain
// "ai.flare"): MatMulInt4 here; PagedAttention (attention_kernels.cc), MoE (moe_kernels.cc) and
// LogSoftmaxTopK (head_kernels.cc) are compiled into the same library and registered here.
//
// MatMulInt4: an int4 x int8 matmul.
//
// Why: onnxruntime's MatMulNBits (accuracy level 4) unpacks every weight block once per
// activation row, so 8 rows cost ~7x one row. Here the weights are stored tile-major for 16
// output columns: one 64-byte load unpacks to two vectors of [16 columns x 4 k] u8 nibbles,
// and each vector feeds a VPDPBUSD for every activation row in the pass, so a batch of 8 rows
// pays the unpacking once.
//
// Inputs:  A float [..., K]; W uint8 [tiles * blocks * block_size * 8] (ignition.export.int4_layout);
//          scales float or float16 [tiles, blocks, 16] (float16: 4.25 bits a weight at block 64
//          instead of 4.5, so a decode step reads ~5% fewer bytes); bias float [N] (optional);
//          skip float [..., K] and gamma float [K] (both or neither: the fused norm below).
// Output:  Y float [..., N], or [..., N / 2] with activation "swiglu": then the tiles alternate
//          gate and up columns (tile 2i: gate columns 16i.., tile 2i+1: the same up columns) and
//          Y = silu(gate) * up, the MLP's Split/Sigmoid/Mul/Mul done in the store loop.
//          With the fused norm, sum float [..., K] (optional): A + skip.
// Attributes: K, N, block_size, activation (optional: "swiglu"), epsilon (optional: the fused
//          norm). With epsilon the matmul's input is onnxruntime's SkipSimplifiedLayerNormalization
//          of (A, skip, gamma), in its float operations and order, so the result has the same bits
//          as the two nodes (helios.kernels.norm_fusion makes the rewrite at load; one node
//          dispatch fewer per norm: 47 of the default core's 48 a step).
// Weights are symmetric 4-bit (value = (q - 8) * scale). Activations are quantized to int8 per
// weight block (max-abs scale), as MatMulNBits' accuracy level 4 does.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include "int4_gemm.h"
#include "simd_math.h"

namespace {

// onnxruntime's SkipSimplifiedLayerNormalization of one row (contrib_ops/cpu/skip_layer_norm.cc,
// float): sum = a + skip, a sequential float sum of squares, y = sum / sqrt(mean + eps) * gamma.
void SkipRmsNorm(const float* a, const float* skip, const float* gamma, float epsilon, int K, float* sum, float* y) {
  float square_sum = 0.f;
  for (int h = 0; h < K; ++h) {
    const float value = a[h] + skip[h];
    if (sum) sum[h] = value;
    y[h] = value;
    square_sum = square_sum + Rounded(value * value);
  }
  const float rms = std::sqrt(square_sum / static_cast<float>(K) + epsilon);
  for (int h = 0; h < K; ++h) y[h] = y[h] / rms * gamma[h];
}

// A row's int8 copy, after its norm when the matmul carries one.
void QuantizeItem(void* data, size_t row) {
  const Problem& p = *static_cast<const Problem*>(data);
  QuantizedRows& a = *p.a;
  const float* x = p.a_float + row * p.K;
  if (p.norm.gamma) {
    float* normed = p.norm.normed + row * p.K;
    SkipRmsNorm(x, p.norm.skip + row * p.K, p.norm.gamma, p.norm.epsilon, p.K,
                p.norm.sum ? p.norm.sum + row * p.K : nullptr, normed);
    x = normed;
  }
  QuantizeRow(x, p.K, p.block, a.q.data() + row * p.K, a.scale.data() + row * p.blocks, a.zsum.data() + row * p.blocks);
}

// One work item: a group of tiles against one chunk of rows (chunk-major, so the threads
// share a chunk's int8 rows in cache while each streams its own tiles).
void RunItem(void* data, size_t item) {
  const Problem& p = *static_cast<const Problem*>(data);
  const int chunk = static_cast<int>(item) / p.items_per_chunk;
  const int group = static_cast<int>(item) % p.items_per_chunk;
  const int r0 = chunk * kRowChunk, r1 = std::min(p.M, r0 + kRowChunk);
  const int t0 = group * p.tiles_per_item, t1 = std::min(p.tiles, t0 + p.tiles_per_item);
  if (!p.swiglu) {
    for (int r = r0; r < r1; r += kPassRows)
      RunRows(p, t0, t1 - t0, r, std::min(kPassRows, r1 - r), p.y + static_cast<size_t>(r) * p.N + t0 * kTileN, p.N);
    return;
  }
  // SwiGLU: tiles come in (gate, up) pairs of the same 16 output columns; y = silu(gate) * up.
  alignas(64) float scratch[kPassRows * kMaxTilesPerItem * kTileN];
  const int width = (t1 - t0) * kTileN, out_cols = p.N / 2;
  for (int r = r0; r < r1; r += kPassRows) {
    const int rows = std::min(kPassRows, r1 - r);
    RunRows(p, t0, t1 - t0, r, rows, scratch, width);
    for (int m = 0; m < rows; ++m) {
      for (int pair = 0; pair < (t1 - t0) / 2; ++pair) {
        const __m512 gate = _mm512_load_ps(scratch + m * width + 2 * pair * kTileN);
        const __m512 up = _mm512_load_ps(scratch + m * width + (2 * pair + 1) * kTileN);
        const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), Exp(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
        _mm512_storeu_ps(p.y + static_cast<size_t>(r + m) * out_cols + (t0 / 2 + pair) * kTileN, _mm512_mul_ps(silu, up));
      }
    }
  }
}

struct MatMulInt4Kernel {
  int64_t K, N, block;
  bool swiglu;
  bool norm;  // the fused SkipSimplifiedLayerNormalization (attribute epsilon)
  float epsilon = 0.f;

  MatMulInt4Kernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    K = ki.GetAttribute<int64_t>("K");
    N = ki.GetAttribute<int64_t>("N");
    block = ki.GetAttribute<int64_t>("block_size");
    std::string activation;
    try {
      activation = ki.GetAttribute<std::string>("activation");
    } catch (const Ort::Exception&) {
      activation.clear();  // absent: none
    }
    try {
      epsilon = ki.GetAttribute<float>("epsilon");
      norm = true;
    } catch (const Ort::Exception&) {
      norm = false;  // absent: A is the matmul's input as is
    }
    if (activation != "" && activation != "swiglu")
      ORT_CXX_API_THROW("MatMulInt4: activation must be absent or \"swiglu\"", ORT_INVALID_ARGUMENT);
    swiglu = activation == "swiglu";
    if (swiglu && N % (2 * kTileN) != 0)
      ORT_CXX_API_THROW("MatMulInt4: swiglu needs N to be a multiple of 32", ORT_INVALID_ARGUMENT);
    if (K <= 0 || N <= 0 || block <= 0 || block % 16 != 0 || K % block != 0)
      ORT_CXX_API_THROW("MatMulInt4: needs K, N > 0 and a block_size that is a multiple of 16 dividing K",
                        ORT_INVALID_ARGUMENT);
  }

  // The fused norm's skip [..., K] (A's shape), gamma [K] and the optional sum output.
  NormInputs NormOperands(Ort::KernelContext& ctx, const std::vector<int64_t>& a_shape) const {
    if (ctx.GetInputCount() < 6) ORT_CXX_API_THROW("MatMulInt4: epsilon needs skip and gamma inputs", ORT_INVALID_ARGUMENT);
    auto skip = ctx.GetInput(4);
    auto gamma = ctx.GetInput(5);
    if (!skip || !gamma || skip.GetTensorTypeAndShapeInfo().GetShape() != a_shape ||
        gamma.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(K))
      ORT_CXX_API_THROW("MatMulInt4: the norm needs skip shaped like A and gamma of K values", ORT_INVALID_ARGUMENT);
    NormInputs fused;
    fused.skip = skip.GetTensorData<float>();
    fused.gamma = gamma.GetTensorData<float>();
    fused.epsilon = epsilon;
    if (ctx.GetOutputCount() > 1) {
      auto sum = ctx.GetOutput(1, a_shape);
      if (sum) fused.sum = sum.GetTensorMutableData<float>();
    }
    return fused;
  }

  // The weights' sizes follow from the attributes; a mismatch would read out of bounds.
  void CheckSizes(const Ort::ConstValue& w, const Ort::ConstValue& scales, const Ort::ConstValue* bias) const {
    const int64_t tiles = (N + kTileN - 1) / kTileN, blocks = K / block;
    if (w.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(tiles * K * 8) ||
        scales.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(tiles * blocks * kTileN) ||
        (bias && bias->GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(N)))
      ORT_CXX_API_THROW("MatMulInt4: weight, scale or bias sizes do not match K, N and block_size", ORT_INVALID_ARGUMENT);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto a = ctx.GetInput(0);
    auto w = ctx.GetInput(1);
    auto scales = ctx.GetInput(2);
    const float* bias = nullptr;
    Ort::ConstValue bias_value{nullptr};
    if (ctx.GetInputCount() > 3) {
      bias_value = ctx.GetInput(3);
      if (bias_value) bias = bias_value.GetTensorData<float>();
    }
    CheckSizes(w, scales, bias ? &bias_value : nullptr);
    const std::vector<int64_t> a_shape = a.GetTensorTypeAndShapeInfo().GetShape();
    std::vector<int64_t> shape = a_shape;
    if (shape.empty() || shape.back() != K) ORT_CXX_API_THROW("MatMulInt4: A's last dimension is not K", ORT_INVALID_ARGUMENT);
    int64_t M = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) M *= shape[i];
    shape.back() = swiglu ? N / 2 : N;
    auto y = ctx.GetOutput(0, shape);
    NormInputs fused;
    if (norm) fused = NormOperands(ctx, a_shape);
    if (M == 0) return;

    thread_local QuantizedRows rows;
    const int blocks = static_cast<int>(K / block);
    rows.q.resize(M * K);
    rows.scale.resize(M * blocks);
    rows.zsum.resize(M * blocks);
    Problem p;
    p.a_float = a.GetTensorData<float>();
    p.bias = bias;
    p.w = w.GetTensorData<uint8_t>();
    switch (scales.GetTensorTypeAndShapeInfo().GetElementType()) {
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: p.wscale = scales.GetTensorData<float>(); break;
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
        p.wscale_half = reinterpret_cast<const uint16_t*>(scales.GetTensorRawData());
        break;
      default: ORT_CXX_API_THROW("MatMulInt4: scales must be float or float16", ORT_INVALID_ARGUMENT);
    }
    p.y = y.GetTensorMutableData<float>();
    p.a = &rows;
    p.M = static_cast<int>(M);
    p.N = static_cast<int>(N);
    p.K = static_cast<int>(K);
    p.block = static_cast<int>(block);
    p.blocks = blocks;
    p.tiles = static_cast<int>((N + kTileN - 1) / kTileN);
    p.swiglu = swiglu;
    if (norm) {
      thread_local std::vector<float> normed;  // the rows the matmul quantizes
      normed.resize(M * K);
      p.norm = fused;
      p.norm.normed = normed.data();
    }
    p.tiles_per_item = std::clamp(p.tiles / 16, 1, kMaxTilesPerItem);
    if (swiglu) p.tiles_per_item = std::max(2, p.tiles_per_item & ~1);  // whole (gate, up) pairs
    p.items_per_chunk = (p.tiles + p.tiles_per_item - 1) / p.tiles_per_item;
    if (M < 16) {
      for (int m = 0; m < p.M; ++m) QuantizeItem(&p, m);
    } else {
      ctx.ParallelFor(QuantizeItem, static_cast<size_t>(M), 0, &p);  // a prefill chunk: ~M * K floats
    }
    const size_t items = static_cast<size_t>(p.items_per_chunk) * ((M + kRowChunk - 1) / kRowChunk);
    ctx.ParallelFor(RunItem, items, 0, &p);
  }
};

struct MatMulInt4Op : Ort::CustomOpBase<MatMulInt4Op, MatMulInt4Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new MatMulInt4Kernel(api, info); }
  const char* GetName() const { return "MatMulInt4"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 6; }  // A, W, scales, bias, skip, gamma
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == 1) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
    return i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;  // float or float16
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }  // Y, and the fused norm's sum
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 1 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
};

std::mutex domains_mutex;
std::vector<std::unique_ptr<Ort::CustomOpDomain>> domains;  // must outlive every session
const MatMulInt4Op matmul_int4_op;

}  // namespace

namespace flare {
void AddMoEOps(Ort::CustomOpDomain& domain);  // moe_kernels.cc
void AddAttentionOps(Ort::CustomOpDomain& domain);  // attention_kernels.cc
void AddHeadOps(Ort::CustomOpDomain& domain);  // head_kernels.cc
}  // namespace flare

extern "C" OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {  // an onnxruntime older than these headers: register nothing (unknown op later)
    std::fprintf(stderr, "flare kernels: onnxruntime %s lacks API version %d\n", api_base->GetVersionString(),
                 ORT_API_VERSION);
    return nullptr;
  }
  Ort::InitApi(api);
  try {
    auto domain = std::make_unique<Ort::CustomOpDomain>("ai.flare");
    domain->Add(&matmul_int4_op);
    flare::AddAttentionOps(*domain);
    flare::AddMoEOps(*domain);
    flare::AddHeadOps(*domain);
    Ort::UnownedSessionOptions(options).Add(*domain);
    std::lock_guard<std::mutex> lock(domains_mutex);
    domains.push_back(std::move(domain));
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
