// Flare's CPU kernels for x86-64 with AVX512-VNNI, as onnxruntime custom operators (domain
// "ai.flare"): MatMulInt4 (below) and PagedAttention (further down); MoE lives in
// moe_kernels.cc, compiled into the same library and registered here.
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
//          scales float [tiles, blocks, 16]; bias float [N] (optional).
// Output:  Y float [..., N], or [..., N / 2] with activation "swiglu": then the tiles alternate
//          gate and up columns (tile 2i: gate columns 16i.., tile 2i+1: the same up columns) and
//          Y = silu(gate) * up, the MLP's Split/Sigmoid/Mul/Mul done in the store loop.
// Attributes: K, N, block_size, activation (optional: "swiglu").
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

namespace {

void QuantizeItem(void* data, size_t row) {
  const Problem& p = *static_cast<const Problem*>(data);
  QuantizedRows& a = *p.a;
  QuantizeRow(p.a_float + row * p.K, p.K, p.block, a.q.data() + row * p.K, a.scale.data() + row * p.blocks,
              a.zsum.data() + row * p.blocks);
}

// exp for the SwiGLU epilogue: 2^n * e^r with |r| <= ln2/2 and Cephes' degree-6 expf polynomial
// (relative error ~1e-7, like onnxruntime's Sigmoid).
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
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
    if (activation != "" && activation != "swiglu")
      ORT_CXX_API_THROW("MatMulInt4: activation must be absent or \"swiglu\"", ORT_INVALID_ARGUMENT);
    swiglu = activation == "swiglu";
    if (swiglu && N % (2 * kTileN) != 0)
      ORT_CXX_API_THROW("MatMulInt4: swiglu needs N to be a multiple of 32", ORT_INVALID_ARGUMENT);
    if (K <= 0 || N <= 0 || block <= 0 || block % 16 != 0 || K % block != 0)
      ORT_CXX_API_THROW("MatMulInt4: needs K, N > 0 and a block_size that is a multiple of 16 dividing K",
                        ORT_INVALID_ARGUMENT);
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
    std::vector<int64_t> shape = a.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != K) ORT_CXX_API_THROW("MatMulInt4: A's last dimension is not K", ORT_INVALID_ARGUMENT);
    int64_t M = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) M *= shape[i];
    shape.back() = swiglu ? N / 2 : N;
    auto y = ctx.GetOutput(0, shape);
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
    p.wscale = scales.GetTensorData<float>();
    p.y = y.GetTensorMutableData<float>();
    p.a = &rows;
    p.M = static_cast<int>(M);
    p.N = static_cast<int>(N);
    p.K = static_cast<int>(K);
    p.block = static_cast<int>(block);
    p.blocks = blocks;
    p.tiles = static_cast<int>((N + kTileN - 1) / kTileN);
    p.swiglu = swiglu;
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
  size_t GetInputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// ---------------------------------------------------------------------------------------------
// ai.flare.PagedAttention: one decoder layer's attention straight from the paged KV pool.
//
// Inputs:  qkv float [B, L, (H + 2 KVH) * D] (the fused projection, before rotary);
//          positions int64 [B, L]; cos_cache, sin_cache float [P, D/2] (rotate-half rotary);
//          kv_pool float [R, T, KVH, D] with R = num_layers * 2 * pages (row (2 layer + kind) *
//          pages + page holds T tokens); block_tables int64 [B, M]; history_lens, query_lens
//          int64 [B].
// Outputs: out float [B, L, H * D]; k float [B, L, KVH * D] (rotated); v float [B, L, KVH * D].
// Attributes: num_heads, kv_heads, layer, num_layers, scale (float).
// Query i < query_lens[b] of row b attends to the row's history_lens[b] pool tokens and its new
// tokens 0..i (query head h uses KV head h / (H / KVH)); padded queries get zeros. It replaces
// the per-layer page Gather + Transpose + RotaryEmbedding + GroupQueryAttention chain: pages
// are read where they lie, nothing is copied.

struct AttentionProblem {
  const float* qkv;
  const int64_t* positions;
  const float* cos_cache;
  const float* sin_cache;
  const float* pool;
  const int64_t* block_tables;
  const int64_t* history_lens;
  const int64_t* query_lens;
  float* out;
  float* k_out;
  float* v_out;
  float* q_rot;  // [B, L, H, D], filled by RotateToken
  int B, L, M, H, KVH, D, T, P, pages, layer;
  int query_blocks;  // per row: ceil(L / kQueryBlock)
  float scale;
};

constexpr int kMaxHeadDim = 256;
constexpr int kQueryBlock = 16;  // queries of one row per work item

// Rotate-half rotary of one head: x1 = x[:D/2], x2 = x[D/2:].
void Rotate(const float* x, const float* cos, const float* sin, int half, float* y) {
  for (int j = 0; j < half; ++j) {
    y[j] = x[j] * cos[j] - x[j + half] * sin[j];
    y[j + half] = x[j + half] * cos[j] + x[j] * sin[j];
  }
}

void RotateToken(void* data, size_t token) {
  const AttentionProblem& p = *static_cast<const AttentionProblem*>(data);
  const int width = (p.H + 2 * p.KVH) * p.D, half = p.D / 2;
  const float* x = p.qkv + token * width;
  int64_t pos = p.positions[token];
  pos = std::min<int64_t>(std::max<int64_t>(pos, 0), p.P - 1);  // padding positions are never read
  const float* cos = p.cos_cache + pos * half;
  const float* sin = p.sin_cache + pos * half;
  float* q = p.q_rot + token * p.H * p.D;
  for (int h = 0; h < p.H; ++h) Rotate(x + h * p.D, cos, sin, half, q + h * p.D);
  float* k = p.k_out + token * p.KVH * p.D;
  for (int h = 0; h < p.KVH; ++h) Rotate(x + (p.H + h) * p.D, cos, sin, half, k + h * p.D);
  std::memcpy(p.v_out + token * p.KVH * p.D, x + (p.H + p.KVH) * p.D, sizeof(float) * p.KVH * p.D);
}

// Flash-attention style: the keys stream past in blocks of 16 (transposed in registers, so a query
// vector's 16 scores are D FMAs), each query vector keeps a running max, sum and output
// accumulator (online softmax), and NR query vectors share every key and value load.
struct KeyBlock {
  alignas(64) float kt[kMaxHeadDim][16];  // [d][key]
  const float* values[16];
  int count;  // keys in the block (the rest of kt is zero)
};

// In-register transpose of 16 rows of 16 floats: r[c] becomes column c.
inline void Transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 2; ++i)
    for (int c = 0; c < 4; ++c) {
      t[8 * i + c] = _mm512_shuffle_f32x4(r[8 * i + c], r[8 * i + 4 + c], 0x88);
      t[8 * i + 4 + c] = _mm512_shuffle_f32x4(r[8 * i + c], r[8 * i + 4 + c], 0xDD);
    }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
    r[c + 8] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);
  }
}

struct QueryState {
  float max, sum;
};

template <int DV, int NR>
void AttendBlock(const AttentionProblem& p, const KeyBlock& blk, int j0, int history, int i0, int group,
                 const float* q, int v0, int nv, float* acc, QueryState* state) {
  constexpr int D = DV * 16;
  __m512 s[NR];
  for (int r = 0; r < NR; ++r) s[r] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m512 kd = _mm512_load_ps(blk.kt[d]);
    for (int r = 0; r < NR; ++r) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[(v0 + r) * D + d]), kd, s[r]);
  }
  alignas(64) float prob[NR][16];
  float corr[NR];
  const __mmask16 present = static_cast<__mmask16>((1u << blk.count) - 1u);
  for (int r = 0; r < NR; ++r) {
    corr[r] = 1.f;
    _mm512_store_ps(prob[r], _mm512_setzero_ps());
    if (r >= nv) continue;
    const int i = i0 + (v0 + r) / group;  // query index of this query vector
    const int visible = history + i + 1 - j0;  // keys of the block it may see: the first `visible`
    if (visible <= 0) continue;
    const __mmask16 mask = visible >= 16 ? present : static_cast<__mmask16>(present & ((1u << visible) - 1u));
    const __m512 scores = _mm512_mul_ps(s[r], _mm512_set1_ps(p.scale));
    const float block_max = _mm512_mask_reduce_max_ps(mask, scores);
    QueryState& st = state[v0 + r];
    const float new_max = std::max(st.max, block_max);
    corr[r] = st.sum == 0.f ? 0.f : std::exp(st.max - new_max);
    const __m512 e = _mm512_maskz_mov_ps(mask, Exp(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
    st.sum = st.sum * corr[r] + _mm512_reduce_add_ps(e);
    st.max = new_max;
    _mm512_store_ps(prob[r], e);
  }
  __m512 out[NR][DV];
  for (int r = 0; r < NR; ++r)
    for (int x = 0; x < DV; ++x)
      out[r][x] = _mm512_mul_ps(_mm512_loadu_ps(acc + (v0 + r) * D + 16 * x), _mm512_set1_ps(corr[r]));
  for (int j = 0; j < blk.count; ++j) {
    __m512 v[DV];
    for (int x = 0; x < DV; ++x) v[x] = _mm512_loadu_ps(blk.values[j] + 16 * x);
    for (int r = 0; r < NR; ++r) {
      const __m512 pj = _mm512_set1_ps(prob[r][j]);
      for (int x = 0; x < DV; ++x) out[r][x] = _mm512_fmadd_ps(pj, v[x], out[r][x]);
    }
  }
  for (int r = 0; r < nv; ++r)
    for (int x = 0; x < DV; ++x) _mm512_storeu_ps(acc + (v0 + r) * D + 16 * x, out[r][x]);
}

template <int DV>
void AttendQueries(const AttentionProblem& p, int b, int kv, int i0, int last) {
  constexpr int D = DV * 16;
  constexpr int NR = DV <= 2 ? 8 : DV <= 4 ? 4 : DV <= 8 ? 2 : 1;  // accumulators NR x DV stay in registers
  const int group = p.H / p.KVH;
  const int history = static_cast<int>(p.history_lens[b]);
  const size_t stride = static_cast<size_t>(p.KVH) * D;
  const float* k_pages = p.pool + static_cast<size_t>(2 * p.layer) * p.pages * p.T * stride;
  const float* v_pages = k_pages + static_cast<size_t>(p.pages) * p.T * stride;
  const int nq = (last - i0) * group;  // query vectors (i, g) -> (i - i0) * group + g
  thread_local std::vector<float> q_buf, acc_buf;
  thread_local std::vector<QueryState> states;
  q_buf.resize(static_cast<size_t>(nq) * D);
  acc_buf.assign(static_cast<size_t>(nq) * D, 0.f);
  states.assign(nq, QueryState{-INFINITY, 0.f});
  for (int i = i0; i < last; ++i)  // the group's query heads of query i are contiguous
    std::memcpy(q_buf.data() + static_cast<size_t>(i - i0) * group * D,
                p.q_rot + ((static_cast<size_t>(b) * p.L + i) * p.H + static_cast<size_t>(kv) * group) * D,
                sizeof(float) * group * D);
  auto row = [&](int j, const float* pages_base, const float* fresh) -> const float* {
    if (j < history) {
      const int64_t page = p.block_tables[static_cast<size_t>(b) * p.M + j / p.T];
      return pages_base + (static_cast<size_t>(page) * p.T + j % p.T) * stride + kv * D;
    }
    return fresh + (static_cast<size_t>(b) * p.L + (j - history)) * stride + kv * D;
  };
  KeyBlock blk;
  const int keys = history + last;  // the last query sees every key up to itself
  for (int j0 = 0; j0 < keys; j0 += 16) {
    blk.count = std::min(16, keys - j0);
    const float* key_rows[16];
    for (int jj = 0; jj < blk.count; ++jj) {
      key_rows[jj] = row(j0 + jj, k_pages, p.k_out);
      blk.values[jj] = row(j0 + jj, v_pages, p.v_out);
    }
    for (int x = 0; x < DV; ++x) {  // 16 keys x 16 dims at a time, missing keys as zeros
      __m512 r[16];
      for (int jj = 0; jj < 16; ++jj) r[jj] = jj < blk.count ? _mm512_loadu_ps(key_rows[jj] + 16 * x) : _mm512_setzero_ps();
      Transpose16(r);
      for (int c = 0; c < 16; ++c) _mm512_store_ps(blk.kt[16 * x + c], r[c]);
    }
    for (int v0 = 0; v0 < nq; v0 += NR)
      AttendBlock<DV, NR>(p, blk, j0, history, i0, group, q_buf.data(), v0, std::min(NR, nq - v0), acc_buf.data(),
                          states.data());
  }
  for (int i = i0; i < last; ++i) {
    float* out = p.out + ((static_cast<size_t>(b) * p.L + i) * p.H + static_cast<size_t>(kv) * group) * D;
    for (int g = 0; g < group; ++g) {
      const int v = (i - i0) * group + g;
      const __m512 inv = _mm512_set1_ps(1.f / states[v].sum);
      for (int x = 0; x < DV; ++x)
        _mm512_storeu_ps(out + g * D + 16 * x, _mm512_mul_ps(_mm512_loadu_ps(acc_buf.data() + v * D + 16 * x), inv));
    }
  }
}

// One item: row b, KV head kv, a block of queries; every query head of the KV head's group.
void AttendItem(void* data, size_t item) {
  const AttentionProblem& p = *static_cast<const AttentionProblem*>(data);
  const int qb = static_cast<int>(item % p.query_blocks);
  const int kv = static_cast<int>(item / p.query_blocks % p.KVH);
  const int b = static_cast<int>(item / p.query_blocks / p.KVH);
  const int group = p.H / p.KVH;
  const int i0 = qb * kQueryBlock, i1 = std::min(p.L, i0 + kQueryBlock);
  const int last = std::max(i0, std::min(i1, static_cast<int>(p.query_lens[b])));  // [i0, last): real queries
  for (int i = last; i < i1; ++i)  // padded queries: zeros
    std::memset(p.out + ((static_cast<size_t>(b) * p.L + i) * p.H + static_cast<size_t>(kv) * group) * p.D, 0,
                sizeof(float) * group * p.D);
  if (last == i0) return;
  switch (p.D / 16) {
#define FLARE_HEAD(n) \
  case n:             \
    return AttendQueries<n>(p, b, kv, i0, last);
    FLARE_HEAD(1) FLARE_HEAD(2) FLARE_HEAD(3) FLARE_HEAD(4) FLARE_HEAD(5) FLARE_HEAD(6) FLARE_HEAD(7) FLARE_HEAD(8)
    FLARE_HEAD(9) FLARE_HEAD(10) FLARE_HEAD(11) FLARE_HEAD(12) FLARE_HEAD(13) FLARE_HEAD(14) FLARE_HEAD(15) FLARE_HEAD(16)
#undef FLARE_HEAD
    default: return;  // unreachable: Compute checks the head dimension
  }
}

struct PagedAttentionKernel {
  int64_t H, KVH, layer, num_layers;
  float scale;

  PagedAttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    H = ki.GetAttribute<int64_t>("num_heads");
    KVH = ki.GetAttribute<int64_t>("kv_heads");
    layer = ki.GetAttribute<int64_t>("layer");
    num_layers = ki.GetAttribute<int64_t>("num_layers");
    scale = ki.GetAttribute<float>("scale");
    if (H <= 0 || KVH <= 0 || H % KVH != 0 || num_layers <= 0 || layer < 0 || layer >= num_layers)
      ORT_CXX_API_THROW("PagedAttention: needs num_heads a multiple of kv_heads and 0 <= layer < num_layers",
                        ORT_INVALID_ARGUMENT);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto qkv = ctx.GetInput(0), positions = ctx.GetInput(1), cos = ctx.GetInput(2), sin = ctx.GetInput(3);
    auto pool = ctx.GetInput(4), tables = ctx.GetInput(5), history = ctx.GetInput(6), query = ctx.GetInput(7);
    const auto qkv_shape = qkv.GetTensorTypeAndShapeInfo().GetShape();
    const auto cos_shape = cos.GetTensorTypeAndShapeInfo().GetShape();
    const auto pool_shape = pool.GetTensorTypeAndShapeInfo().GetShape();
    const auto table_shape = tables.GetTensorTypeAndShapeInfo().GetShape();
    auto fail = [](const char* what) { ORT_CXX_API_THROW(std::string("PagedAttention: ") + what, ORT_INVALID_ARGUMENT); };
    if (qkv_shape.size() != 3 || cos_shape.size() != 2 || pool_shape.size() != 4 || table_shape.size() != 2)
      fail("qkv, caches, pool or block_tables have the wrong rank");
    const int64_t B = qkv_shape[0], L = qkv_shape[1], D = cos_shape[1] * 2, T = pool_shape[1];
    if (D % 16 != 0 || D > kMaxHeadDim) fail("head_dim must be a multiple of 16, at most 256");
    if (qkv_shape[2] != (H + 2 * KVH) * D) fail("qkv width is not (num_heads + 2 kv_heads) * head_dim");
    if (pool_shape[2] != KVH || pool_shape[3] != D || pool_shape[0] % (2 * num_layers) != 0)
      fail("kv_pool is not [num_layers * 2 * pages, tokens, kv_heads, head_dim]");
    if (table_shape[0] != B || positions.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(B * L) ||
        history.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(B) ||
        query.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(B) ||
        sin.GetTensorTypeAndShapeInfo().GetShape() != cos_shape)
      fail("positions, block_tables, history_lens, query_lens or sin_cache do not match the batch");
    AttentionProblem p;
    p.B = static_cast<int>(B);
    p.L = static_cast<int>(L);
    p.M = static_cast<int>(table_shape[1]);
    p.H = static_cast<int>(H);
    p.KVH = static_cast<int>(KVH);
    p.D = static_cast<int>(D);
    p.T = static_cast<int>(T);
    p.P = static_cast<int>(cos_shape[0]);
    p.pages = static_cast<int>(pool_shape[0] / (2 * num_layers));
    p.layer = static_cast<int>(layer);
    p.scale = scale;
    p.qkv = qkv.GetTensorData<float>();
    p.positions = positions.GetTensorData<int64_t>();
    p.cos_cache = cos.GetTensorData<float>();
    p.sin_cache = sin.GetTensorData<float>();
    p.pool = pool.GetTensorData<float>();
    p.block_tables = tables.GetTensorData<int64_t>();
    p.history_lens = history.GetTensorData<int64_t>();
    p.query_lens = query.GetTensorData<int64_t>();
    // Every history token must lie in a listed page of a pool row: a bad table would read
    // outside the pool.
    for (int b = 0; b < p.B; ++b) {
      const int64_t h = p.history_lens[b], q = p.query_lens[b];
      if (h < 0 || q < 0 || q > L || h > static_cast<int64_t>(p.M) * T) fail("history_lens or query_lens out of range");
      for (int64_t page = 0; page < (h + T - 1) / T; ++page) {
        const int64_t row = p.block_tables[b * p.M + page];
        if (row < 0 || row >= p.pages) fail("block_tables names a page outside the pool");
      }
    }
    p.out = ctx.GetOutput(0, {B, L, H * D}).GetTensorMutableData<float>();
    p.k_out = ctx.GetOutput(1, {B, L, KVH * D}).GetTensorMutableData<float>();
    p.v_out = ctx.GetOutput(2, {B, L, KVH * D}).GetTensorMutableData<float>();
    if (B == 0 || L == 0) return;
    thread_local std::vector<float> q_rot;
    q_rot.resize(static_cast<size_t>(B * L * H * D));
    p.q_rot = q_rot.data();
    if (B * L < 16) {
      for (int64_t t = 0; t < B * L; ++t) RotateToken(&p, t);
    } else {
      ctx.ParallelFor(RotateToken, static_cast<size_t>(B * L), 0, &p);
    }
    p.query_blocks = static_cast<int>((L + kQueryBlock - 1) / kQueryBlock);
    ctx.ParallelFor(AttendItem, static_cast<size_t>(B) * KVH * p.query_blocks, 0, &p);
  }
};

struct PagedAttentionOp : Ort::CustomOpBase<PagedAttentionOp, PagedAttentionKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new PagedAttentionKernel(api, info); }
  const char* GetName() const { return "PagedAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 || i >= 5 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

std::mutex domains_mutex;
std::vector<std::unique_ptr<Ort::CustomOpDomain>> domains;  // must outlive every session
const MatMulInt4Op matmul_int4_op;
const PagedAttentionOp paged_attention_op;

}  // namespace

namespace flare {
void AddMoEOps(Ort::CustomOpDomain& domain);  // moe_kernels.cc
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
    domain->Add(&paged_attention_op);
    flare::AddMoEOps(*domain);
    Ort::UnownedSessionOptions(options).Add(*domain);
    std::lock_guard<std::mutex> lock(domains_mutex);
    domains.push_back(std::move(domain));
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
