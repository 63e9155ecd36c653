// ai.flare.MoE: one layer's routed experts, computing only the experts its rows are routed to
// (built into the same library as cpu_kernels.cc, which registers it).
//
// Inputs:  h float [N, W]; idx int64 [N, k]; weights float [N, k]; up float [E, I, W];
//          down float [E, W, I]; gate float [E, I, W] (optional: absent for a plain expert).
// Output:  out float [N, W]: out[n] = sum_j weights[n, j] * down_e(glu(h_n)), e = idx[n, j], with
//          glu(x) = act(gate_e x) * up_e x, or act(up_e x) without gate.
// Attributes: activation ("silu", "gelu_tanh" or "relu2"); unit, limit L, alpha (optional, the
//          gated unit of glu(x) with gate: "glu" act(g) * u, the default; "clamp_after"
//          min(act(g), L) * clamp(u, -L, L); "clamp_before" act(min(g, L)) * clamp(u, -L, L);
//          "alpha" (clamp(u, -L, L) + 1) * g' * sigmoid(alpha g'), g' = min(g, L)).
//
// Why: a mixture-of-experts layer computed densely reads every expert's weights per step; decode
// needs only the k routed ones (k / E of the bytes: 4 of 64 experts, say). The (row, choice)
// pairs are grouped by expert, so each routed expert's weights are read once per call however
// many rows chose it, and an expert no row chose is never read. A row naming one expert twice
// gets it twice (what a scatter-add of the routing weights gives). The per-row sum runs in the
// row's choice order, so the result does not depend on the thread count.
// flare_moe_expert_reads() / flare_moe_calls() count routed experts read and calls (tests check
// that reads follow the routing).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include "int4_gemm.h"

namespace {

std::atomic<uint64_t> moe_calls{0}, moe_expert_reads{0};

constexpr int kMoEColumns = 32;  // output columns of one expert per work item

enum class Activation { kSilu, kGeluTanh, kRelu2 };

inline float Activate(Activation a, float x) {
  switch (a) {
    case Activation::kSilu:
      return x / (1.0f + std::exp(-x));
    case Activation::kGeluTanh:
      return 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    case Activation::kRelu2:
      return x > 0.0f ? x * x : 0.0f;
  }
  return x;
}

enum class UnitKind { kGlu, kClampAfter, kClampBefore, kAlpha };

// The gated unit of one (gate, up) pair (ignition.models.moe_ops.gated).
struct Unit {
  Activation act;
  UnitKind kind = UnitKind::kGlu;
  float limit = 0.0f, alpha = 0.0f;

  float operator()(float g, float u) const {
    if (kind == UnitKind::kGlu) return Activate(act, g) * u;
    u = std::clamp(u, -limit, limit);
    if (kind == UnitKind::kClampAfter) return std::min(Activate(act, g), limit) * u;
    if (kind == UnitKind::kClampBefore) return Activate(act, std::min(g, limit)) * u;
    g = std::min(g, limit);
    return (u + 1.0f) * (g / (1.0f + std::exp(-alpha * g)));
  }
};

// The activation and unit attributes (MoE and MoEInt4 share them).
Unit ReadUnit(const Ort::ConstKernelInfo& ki, const char* op) {
  Unit unit;
  const std::string name = ki.GetAttribute<std::string>("activation");
  if (name == "silu") {
    unit.act = Activation::kSilu;
  } else if (name == "gelu_tanh") {
    unit.act = Activation::kGeluTanh;
  } else if (name == "relu2") {
    unit.act = Activation::kRelu2;
  } else {
    ORT_CXX_API_THROW(std::string(op) + ": activation must be silu, gelu_tanh or relu2", ORT_INVALID_ARGUMENT);
  }
  std::string kind = "glu";
  try {
    kind = ki.GetAttribute<std::string>("unit");
    unit.limit = ki.GetAttribute<float>("limit");
    unit.alpha = ki.GetAttribute<float>("alpha");
  } catch (const Ort::Exception&) {
    if (kind != "glu") ORT_CXX_API_THROW(std::string(op) + ": a unit needs limit and alpha", ORT_INVALID_ARGUMENT);
  }
  if (kind == "glu") {
    unit.kind = UnitKind::kGlu;
  } else if (kind == "clamp_after") {
    unit.kind = UnitKind::kClampAfter;
  } else if (kind == "clamp_before") {
    unit.kind = UnitKind::kClampBefore;
  } else if (kind == "alpha") {
    unit.kind = UnitKind::kAlpha;
  } else {
    ORT_CXX_API_THROW(std::string(op) + ": unit must be glu, clamp_after, clamp_before or alpha", ORT_INVALID_ARGUMENT);
  }
  return unit;
}

inline float Dot(const float* a, const float* b, int n) {
  __m512 acc = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// The (row, choice) pairs grouped by expert (a counting sort, stable in pair order).
struct Routing {
  std::vector<int> first;     // [E + 1]: expert e's pairs are first[e] .. first[e + 1] - 1
  std::vector<int> pair_row;  // grouped pair -> its row
  std::vector<int> where;     // pair n * k + j -> its grouped position
  std::vector<int> active;    // experts with at least one pair

  // False when idx names an expert outside 0..E-1.
  bool Build(const int64_t* choice, int64_t N, int64_t k, int64_t E) {
    const int64_t R = N * k;
    first.assign(E + 1, 0);
    for (int64_t r = 0; r < R; ++r) {
      if (choice[r] < 0 || choice[r] >= E) return false;
      ++first[choice[r] + 1];
    }
    active.clear();
    for (int64_t e = 0; e < E; ++e) {
      if (first[e + 1] > 0) active.push_back(static_cast<int>(e));
      first[e + 1] += first[e];
    }
    std::vector<int> slot(first.begin(), first.end() - 1);
    pair_row.resize(R);
    where.resize(R);
    for (int64_t r = 0; r < R; ++r) {
      const int s = slot[choice[r]]++;
      pair_row[s] = static_cast<int>(r / k);
      where[r] = s;
    }
    moe_expert_reads.fetch_add(active.size(), std::memory_order_relaxed);
    return true;
  }

  // out[n] = sum_j weights[n, j] * expert_out[where[n k + j]], in choice order.
  void Combine(const float* weights, const float* expert_out, int64_t N, int64_t k, int64_t W, float* y) const {
    for (int64_t n = 0; n < N; ++n) {
      float* row = y + n * W;
      std::fill(row, row + W, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const float weight = weights[n * k + j];
        const float* x = expert_out + static_cast<size_t>(where[n * k + j]) * W;
        for (int64_t o = 0; o < W; ++o) row[o] += weight * x[o];
      }
    }
  }
};

struct MoEProblem {
  const float *h, *up, *down, *gate;
  int W, I;
  Unit unit;
  const int* pair_row;       // grouped pair r -> the row it belongs to
  const int* first;          // [E + 1]: expert e's pairs are first[e] .. first[e + 1] - 1
  const int* active;         // experts with at least one pair
  int up_items, down_items;  // work items per active expert
  float* hidden;             // [R, I]: glu outputs per grouped pair
  float* expert_out;         // [R, W]: expert outputs per grouped pair
};

// Columns [c0, c1) of one expert's gate/up projection (plus the activation) for all its pairs.
void UpItem(void* data, size_t item) {
  const MoEProblem& p = *static_cast<const MoEProblem*>(data);
  const int e = p.active[item / p.up_items];
  const int c0 = static_cast<int>(item % p.up_items) * kMoEColumns, c1 = std::min(c0 + kMoEColumns, p.I);
  for (int i = c0; i < c1; ++i) {
    const float* up = p.up + (static_cast<size_t>(e) * p.I + i) * p.W;
    const float* gate = p.gate ? p.gate + (static_cast<size_t>(e) * p.I + i) * p.W : nullptr;
    for (int r = p.first[e]; r < p.first[e + 1]; ++r) {
      const float* x = p.h + static_cast<size_t>(p.pair_row[r]) * p.W;
      const float u = Dot(x, up, p.W);
      p.hidden[static_cast<size_t>(r) * p.I + i] = gate ? p.unit(Dot(x, gate, p.W), u) : Activate(p.unit.act, u);
    }
  }
}

// Columns [c0, c1) of one expert's down projection for all its pairs.
void DownItem(void* data, size_t item) {
  const MoEProblem& p = *static_cast<const MoEProblem*>(data);
  const int e = p.active[item / p.down_items];
  const int c0 = static_cast<int>(item % p.down_items) * kMoEColumns, c1 = std::min(c0 + kMoEColumns, p.W);
  for (int o = c0; o < c1; ++o) {
    const float* down = p.down + (static_cast<size_t>(e) * p.W + o) * p.I;
    for (int r = p.first[e]; r < p.first[e + 1]; ++r)
      p.expert_out[static_cast<size_t>(r) * p.W + o] = Dot(p.hidden + static_cast<size_t>(r) * p.I, down, p.I);
  }
}

struct MoEKernel {
  Unit unit;

  MoEKernel(const OrtApi&, const OrtKernelInfo* info) : unit(ReadUnit(Ort::ConstKernelInfo(info), "MoE")) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto h = ctx.GetInput(0), idx = ctx.GetInput(1), weights = ctx.GetInput(2), up = ctx.GetInput(3),
         down = ctx.GetInput(4);
    Ort::ConstValue gate{nullptr};
    if (ctx.GetInputCount() > 5) gate = ctx.GetInput(5);
    auto fail = [](const char* what) { ORT_CXX_API_THROW(std::string("MoE: ") + what, ORT_INVALID_ARGUMENT); };
    const auto hs = h.GetTensorTypeAndShapeInfo().GetShape(), is = idx.GetTensorTypeAndShapeInfo().GetShape(),
               ws = weights.GetTensorTypeAndShapeInfo().GetShape(), us = up.GetTensorTypeAndShapeInfo().GetShape(),
               ds = down.GetTensorTypeAndShapeInfo().GetShape();
    if (hs.size() != 2 || is.size() != 2 || ws != is || us.size() != 3 || ds.size() != 3)
      fail("needs h [N, W], idx and weights [N, k], up [E, I, W], down [E, W, I]");
    const int64_t N = hs[0], W = hs[1], k = is[1], E = us[0], I = us[1];
    if (is[0] != N || us[2] != W || ds[0] != E || ds[1] != W || ds[2] != I) fail("shapes do not agree");
    if (gate && gate.GetTensorTypeAndShapeInfo().GetShape() != us) fail("gate is not shaped like up");
    auto out = ctx.GetOutput(0, {N, W});
    float* y = out.GetTensorMutableData<float>();
    const int64_t R = N * k;
    moe_calls.fetch_add(1, std::memory_order_relaxed);
    if (N == 0 || W == 0) return;
    if (R == 0 || I == 0) {
      std::fill(y, y + N * W, 0.0f);
      return;
    }
    thread_local Routing routing;
    if (!routing.Build(idx.GetTensorData<int64_t>(), N, k, E)) fail("idx names an expert outside 0..E-1");
    thread_local std::vector<float> hidden, expert_out;
    hidden.resize(R * I);
    expert_out.resize(R * W);
    MoEProblem p;
    p.h = h.GetTensorData<float>();
    p.up = up.GetTensorData<float>();
    p.down = down.GetTensorData<float>();
    p.gate = gate ? gate.GetTensorData<float>() : nullptr;
    p.W = static_cast<int>(W);
    p.I = static_cast<int>(I);
    p.unit = unit;
    p.pair_row = routing.pair_row.data();
    p.first = routing.first.data();
    p.active = routing.active.data();
    p.up_items = static_cast<int>((I + kMoEColumns - 1) / kMoEColumns);
    p.down_items = static_cast<int>((W + kMoEColumns - 1) / kMoEColumns);
    p.hidden = hidden.data();
    p.expert_out = expert_out.data();
    ctx.ParallelFor(UpItem, routing.active.size() * p.up_items, 0, &p);
    ctx.ParallelFor(DownItem, routing.active.size() * p.down_items, 0, &p);
    routing.Combine(weights.GetTensorData<float>(), expert_out.data(), N, k, W, y);
  }
};

struct MoEOp : Ort::CustomOpBase<MoEOp, MoEKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new MoEKernel(api, info); }
  const char* GetName() const { return "MoE"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 6; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 5 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// ---------------------------------------------------------------------------------------------
// ai.flare.MoEInt4: ai.flare.MoE with int4 expert weights in MatMulInt4's tiled layout, experts
// back to back. Per expert: gate_up [tiles(N1) * W * 8] bytes, N1 = 2I with tiles alternating 16
// gate and the same 16 up columns (glu = 1) or N1 = I (glu = 0), scales [tiles(N1), W / block_up,
// 16]; down [tiles(W) * I * 8], scales [tiles(W), I / block_down, 16].
// Inputs:  h, idx, weights (as MoE); gate_up uint8; gate_up_scales float; down uint8; down_scales float.
// Attributes: activation, unit, limit, alpha (as MoE), glu (0 or 1), inter (I), block_up, block_down,
// bits (4, or 8 for int8 cores: then 16 bytes per (tile, k), each vector [16 columns x 4 k] of
// q + 128; absent: 4).
// Each routed expert's rows are quantized to int8 per block (as MatMulInt4 does, accuracy level
// 4) and run through MatMulInt4's passes (Pass8 for 8 bits) against that expert's tiles only.

struct Int4Item {
  int expert, t0, t1, r0, r1;
};

struct Int4Gemm {
  std::vector<Problem> experts;  // by expert id (only the active ones are used)
  std::vector<Int4Item> items;
  float* out;
  int ld;

  // Problems for the active experts (weights at `w` + e * bytes, scales likewise) and work
  // items of up to kMaxTilesPerItem tiles x kRowChunk grouped rows.
  void Plan(const Routing& routing, QuantizedRows* rows, const uint8_t* w, const float* scales, int N, int K,
            int block, int64_t E, float* dst, int bits) {
    const int tiles = (N + kTileN - 1) / kTileN, blocks = K / block;
    const size_t bytes = static_cast<size_t>(tiles) * K * (bits == 8 ? 16 : 8);
    const size_t scale_count = static_cast<size_t>(tiles) * blocks * kTileN;
    experts.assign(E, Problem{});
    items.clear();
    const int per_item = std::clamp(tiles / 4, 1, kMaxTilesPerItem);
    for (int e : routing.active) {
      Problem& p = experts[e];
      p.w = w + e * bytes;
      p.wscale = scales + e * scale_count;
      p.a = rows;
      p.bias = nullptr;
      p.N = N;
      p.K = K;
      p.block = block;
      p.blocks = blocks;
      p.tiles = tiles;
      p.bits = bits;
      for (int r0 = routing.first[e]; r0 < routing.first[e + 1]; r0 += kRowChunk)
        for (int t0 = 0; t0 < tiles; t0 += per_item)
          items.push_back({e, t0, std::min(tiles, t0 + per_item), r0, std::min(routing.first[e + 1], r0 + kRowChunk)});
    }
    out = dst;
    ld = N;
  }
};

void Int4GemmItem(void* data, size_t i) {
  const Int4Gemm& g = *static_cast<const Int4Gemm*>(data);
  const Int4Item& it = g.items[i];
  const Problem& p = g.experts[it.expert];
  for (int r = it.r0; r < it.r1; r += kPassRows) {
    float* dst = g.out + static_cast<size_t>(r) * g.ld + it.t0 * kTileN;
    const int rows = std::min(kPassRows, it.r1 - r);
    if (p.bits == 8) {
      RunRows<8>(p, it.t0, it.t1 - it.t0, r, rows, dst, g.ld);
    } else {
      RunRows<4>(p, it.t0, it.t1 - it.t0, r, rows, dst, g.ld);
    }
  }
}

void QuantizeRows(const float* x, const int* row_of, int rows, int K, int block, QuantizedRows& q) {
  const int blocks = K / block;
  q.q.resize(static_cast<size_t>(rows) * K);
  q.scale.resize(static_cast<size_t>(rows) * blocks);
  q.zsum.resize(static_cast<size_t>(rows) * blocks);
  for (int r = 0; r < rows; ++r)
    QuantizeRow(x + static_cast<size_t>(row_of ? row_of[r] : r) * K, K, block, q.q.data() + static_cast<size_t>(r) * K,
                q.scale.data() + static_cast<size_t>(r) * blocks, q.zsum.data() + static_cast<size_t>(r) * blocks);
}

struct MoEInt4Kernel {
  Unit unit;
  bool glu;
  int64_t I, block_up, block_down, bits = 4;

  MoEInt4Kernel(const OrtApi&, const OrtKernelInfo* info) : unit(ReadUnit(Ort::ConstKernelInfo(info), "MoEInt4")) {
    Ort::ConstKernelInfo ki(info);
    try {
      bits = ki.GetAttribute<int64_t>("bits");  // absent: 4 (the first MoEInt4 cores)
    } catch (const Ort::Exception&) {
    }
    if (bits != 4 && bits != 8) ORT_CXX_API_THROW("MoEInt4: bits must be 4 or 8", ORT_INVALID_ARGUMENT);
    glu = ki.GetAttribute<int64_t>("glu") != 0;
    I = ki.GetAttribute<int64_t>("inter");
    block_up = ki.GetAttribute<int64_t>("block_up");
    block_down = ki.GetAttribute<int64_t>("block_down");
    if (I <= 0 || block_up <= 0 || block_up % 16 || block_down <= 0 || block_down % 16 || I % block_down ||
        (glu && I % kTileN))
      ORT_CXX_API_THROW("MoEInt4: needs blocks that are multiples of 16 dividing K, and I a multiple of 16 with glu",
                        ORT_INVALID_ARGUMENT);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto h = ctx.GetInput(0), idx = ctx.GetInput(1), weights = ctx.GetInput(2);
    auto gu = ctx.GetInput(3), gus = ctx.GetInput(4), dn = ctx.GetInput(5), dns = ctx.GetInput(6);
    auto fail = [](const char* what) { ORT_CXX_API_THROW(std::string("MoEInt4: ") + what, ORT_INVALID_ARGUMENT); };
    const auto hs = h.GetTensorTypeAndShapeInfo().GetShape(), is = idx.GetTensorTypeAndShapeInfo().GetShape();
    if (hs.size() != 2 || is.size() != 2 || weights.GetTensorTypeAndShapeInfo().GetShape() != is || is[0] != hs[0])
      fail("needs h [N, W], idx and weights [N, k]");
    const int64_t N = hs[0], W = hs[1], k = is[1], N1 = glu ? 2 * I : I;
    if (W % block_up) fail("block_up does not divide W");
    const int64_t tiles1 = (N1 + kTileN - 1) / kTileN, tiles2 = (W + kTileN - 1) / kTileN;
    const int64_t per_k = bits == 8 ? 16 : 8;  // bytes per (tile, k): 16 columns of 4 or 8 bits
    const int64_t per1 = tiles1 * W * per_k, per2 = tiles2 * I * per_k;
    const int64_t gu_bytes = static_cast<int64_t>(gu.GetTensorTypeAndShapeInfo().GetElementCount());
    const int64_t E = per1 ? gu_bytes / per1 : 0;
    if (E <= 0 || gu_bytes != E * per1 ||
        static_cast<int64_t>(gus.GetTensorTypeAndShapeInfo().GetElementCount()) != E * tiles1 * (W / block_up) * kTileN ||
        static_cast<int64_t>(dn.GetTensorTypeAndShapeInfo().GetElementCount()) != E * per2 ||
        static_cast<int64_t>(dns.GetTensorTypeAndShapeInfo().GetElementCount()) != E * tiles2 * (I / block_down) * kTileN)
      fail("weight or scale sizes do not match W, inter and the blocks");
    auto out = ctx.GetOutput(0, {N, W});
    float* y = out.GetTensorMutableData<float>();
    moe_calls.fetch_add(1, std::memory_order_relaxed);
    const int64_t R = N * k;
    if (N == 0) return;
    if (R == 0) {
      std::fill(y, y + N * W, 0.0f);
      return;
    }
    thread_local Routing routing;
    if (!routing.Build(idx.GetTensorData<int64_t>(), N, k, E)) fail("idx names an expert outside 0..E-1");
    thread_local QuantizedRows rows, hidden_rows;
    thread_local std::vector<float> first_out, hidden, expert_out;
    thread_local Int4Gemm gemm;
    QuantizeRows(h.GetTensorData<float>(), routing.pair_row.data(), static_cast<int>(R), static_cast<int>(W),
                 static_cast<int>(block_up), rows);
    first_out.resize(R * N1);
    gemm.Plan(routing, &rows, gu.GetTensorData<uint8_t>(), gus.GetTensorData<float>(), static_cast<int>(N1),
              static_cast<int>(W), static_cast<int>(block_up), E, first_out.data(), static_cast<int>(bits));
    ctx.ParallelFor(Int4GemmItem, gemm.items.size(), 0, &gemm);
    hidden.resize(R * I);
    for (int64_t r = 0; r < R; ++r) {
      const float* g = first_out.data() + r * N1;
      float* o = hidden.data() + r * I;
      for (int64_t c = 0; c < I; ++c) {
        if (glu) {  // tiles alternate 16 gate and the same 16 up columns
          const int64_t at = (c / kTileN) * 2 * kTileN + c % kTileN;
          o[c] = unit(g[at], g[at + kTileN]);
        } else {
          o[c] = Activate(unit.act, g[c]);
        }
      }
    }
    QuantizeRows(hidden.data(), nullptr, static_cast<int>(R), static_cast<int>(I), static_cast<int>(block_down),
                 hidden_rows);
    expert_out.resize(R * W);
    gemm.Plan(routing, &hidden_rows, dn.GetTensorData<uint8_t>(), dns.GetTensorData<float>(), static_cast<int>(W),
              static_cast<int>(I), static_cast<int>(block_down), E, expert_out.data(), static_cast<int>(bits));
    ctx.ParallelFor(Int4GemmItem, gemm.items.size(), 0, &gemm);
    routing.Combine(weights.GetTensorData<float>(), expert_out.data(), N, k, W, y);
  }
};

struct MoEInt4Op : Ort::CustomOpBase<MoEInt4Op, MoEInt4Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new MoEInt4Kernel(api, info); }
  const char* GetName() const { return "MoEInt4"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 7; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64
           : (i == 3 || i == 5) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

const MoEOp moe_op;
const MoEInt4Op moe_int4_op;

}  // namespace

namespace flare {
void AddMoEOps(Ort::CustomOpDomain& domain) {
  domain.Add(&moe_op);
  domain.Add(&moe_int4_op);
}
}  // namespace flare

extern "C" uint64_t flare_moe_calls() { return moe_calls.load(); }
extern "C" uint64_t flare_moe_expert_reads() { return moe_expert_reads.load(); }
