// ai.flare.PagedAttention: one decoder layer's attention straight from the paged KV pool.
//
// Inputs:  qkv float [B, L, (H + 2 KVH) * D] (the fused projection, before rotary);
//          positions int64 [B, L]; cos_cache, sin_cache float [P, D/2] (rotate-half rotary);
//          kv_pool float, bfloat16 or float16 [R, T, KVH, D] with R = num_layers * 2 * pages (row
//          (2 layer + kind) * pages + page holds T tokens); block_tables int64 [B, M];
//          history_lens, query_lens int64 [B].
// Outputs: out float [B, L, H * D]; k float [B, L, KVH * D] (rotated); v float [B, L, KVH * D].
// A 16-bit pool: k and v are rounded to its type (nearest even) before anything reads them, so the
// step's own keys are the values the pool will hold (the runner's scatter stores them exactly) and
// a query sees the same keys whether its history was computed in this step or an earlier one.
// Attributes: num_heads, kv_heads, layer, num_layers, scale (float).
// Query i < query_lens[b] of row b attends to the row's history_lens[b] pool tokens and its new
// tokens 0..i (query head h uses KV head h / (H / KVH)); padded queries get zeros. It replaces
// the per-layer page Gather + Transpose + RotaryEmbedding + GroupQueryAttention chain: pages
// are read where they lie, nothing is copied.
//
// Numerics: a query's keys fall into fixed chunks of kChunkKeys by key index; each chunk is an
// online softmax over blocks of 16 keys from a fresh state, and the chunks are folded left to
// right (MergeState). The result depends only on the query and its keys, never on how a step
// batches rows, splits a prompt, or spreads items over threads: a prefix restored from the cache
// continues exactly as if it had been computed in one pass. precision="bfloat16" computes each
// chunk on AMX tiles instead (attention_amx.h), with the same chunks and the same fold.
//
// Work: with many (row, query block) pairs, one item per pair walks every chunk; with few, or
// one query block a row (decode), one item per chunk, so both threads stream their own pages,
// and MergeHeads folds.
// An item covers every KV head: a token's heads lie side by side, so it reads whole rows.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include "simd_math.h"

namespace {

struct QueryState {  // one query vector's online softmax
  float max, sum;
};

enum class PoolType { kF32, kBf16, kF16 };

// The pool's element types: each loads 16 values of a row as fp32 (D is a multiple of 16).
struct PoolF32 {
  using T = float;
  static __m512 Load(const float* x) { return _mm512_loadu_ps(x); }
};
struct PoolBf16 {
  using T = uint16_t;
  static __m512 Load(const uint16_t* x) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  // Round to nearest even, NaN kept quiet: numpy's (ml_dtypes') float32 -> bfloat16.
  static uint16_t Round(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  static float Widen(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
  }
};
struct PoolF16 {
  using T = uint16_t;
  static __m512 Load(const uint16_t* x) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))); }
  // Saturated to +-65504 (an overflowing key would otherwise turn the softmax into NaN), then
  // rounded to nearest even as numpy's float32 -> float16.
  static uint16_t Round(float x) {
    return _cvtss_sh(std::min(std::max(x, -65504.f), 65504.f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static float Widen(uint16_t h) { return _cvtsh_ss(h); }
};

struct AttentionProblem {
  const float* qkv;
  const int64_t* positions;
  const float* cos_cache;
  const float* sin_cache;
  const void* pool;
  PoolType pool_type;
  const int64_t* block_tables;
  const int64_t* history_lens;
  const int64_t* query_lens;
  float* out;
  float* k_out;
  float* v_out;
  uint16_t* k_new16;  // 16-bit pools: the step's k and v in the pool's type [B, L, KVH, D]
  uint16_t* v_new16;
  float* q_rot;  // [B, L, H, D], filled by RotateToken
  int B, L, M, H, KVH, D, T, P, pages, layer;
  int query_blocks;  // per row: ceil(L / kQueryBlock)
  int row_chunks;  // chunks of kChunkKeys keys in the longest row
  bool split;  // one item per (row, query block, chunk), folded by MergeHeads
  int slot_vectors;  // query vectors of one (item, KV head) slot of the partial buffers
  float* part_acc;  // split: [item, KVH, slot_vectors, D] unnormalized sums
  QueryState* part_state;  // split: [item, KVH, slot_vectors]
  float scale;
  bool bf16;  // the chunks run in bf16: on AMX tiles (attention_amx.h) or with AVX512-BF16 (attention_dpbf16.h)
  bool amx;  // bf16 on AMX tiles
  uint16_t* chunk_tiles;  // bf16: [B, KVH, row_chunks] chunks of K tiles then V tiles
  // A step that is not split and has fewer than kMinItems (row, query block) pairs (a short
  // decode of a few rows): conversion and attention items take one KV head each, not every head.
  bool heads_apart;
};

constexpr int kMaxHeadDim = 256;
// Queries of one row per work item: with 7 query heads per KV head, 32 queries fill 14 query
// tiles (pairs of tiles share each K and V tile load of the bf16 chunk).
constexpr int kQueryBlock = 32;
constexpr int kChunkKeys = 256;  // keys per chunk: its K and V rows stay in L2 for every KV head
constexpr int kMinItems = 8;  // fewer (rows x 16-query groups) than this: split the keys
constexpr size_t kMaxSplitFloats = size_t{8} << 20;  // the split's partial sums stay under 32 MB
constexpr int kPrefetchBlocks = 2;  // key blocks fetched ahead of the one attended
// A split item converts this many bytes of K and V tiles at a time (whole rows for as many KV
// heads as fit), so they are still in L2 when its heads attend them.
constexpr size_t kSplitTileBytes = size_t{256} << 10;

// Rotate-half rotary of one head: x1 = x[:D/2], x2 = x[D/2:].
void Rotate(const float* x, const float* cos, const float* sin, int half, float* y) {
  for (int j = 0; j < half; ++j) {
    y[j] = x[j] * cos[j] - x[j + half] * sin[j];
    y[j + half] = x[j + half] * cos[j] + x[j] * sin[j];
  }
}

// A 16-bit pool: the token's k and v rounded to E in place, and their 16-bit bits kept.
template <class E>
void RoundNewKeys(const AttentionProblem& p, size_t token) {
  const size_t n = static_cast<size_t>(p.KVH) * p.D, at = token * n;
  for (size_t i = 0; i < n; ++i) {
    p.k_new16[at + i] = E::Round(p.k_out[at + i]);
    p.k_out[at + i] = E::Widen(p.k_new16[at + i]);
    p.v_new16[at + i] = E::Round(p.v_out[at + i]);
    p.v_out[at + i] = E::Widen(p.v_new16[at + i]);
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
  if (p.pool_type == PoolType::kBf16) RoundNewKeys<PoolBf16>(p, token);
  if (p.pool_type == PoolType::kF16) RoundNewKeys<PoolF16>(p, token);
}

// In-register transpose of 16 rows of 16 floats: r[c] becomes column c. Always inlined: called
// out of line (as GCC chose), the rows went through the stack and every reload waited on its store
// (a 16k-token decode's bf16 attention: 0.70 -> 0.53 ms a layer on Zen 4).
__attribute__((always_inline)) inline void Transpose16(__m512 r[16]) {
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

// Folds a chunk's partial state into a running one. Every path folds with this one function in
// chunk order, so a query's result is the same bits whichever path computed it.
template <int DV>
inline void MergeState(QueryState& run, float* run_acc, const QueryState& part, const float* part_acc) {
  if (part.sum == 0.f) return;  // the chunk holds no key this query sees
  if (run.sum == 0.f) {
    run = part;
    std::memcpy(run_acc, part_acc, sizeof(float) * DV * 16);
    return;
  }
  const float top = std::max(run.max, part.max);
  const float a = std::exp(run.max - top), c = std::exp(part.max - top);
  run.sum = std::fma(part.sum, c, run.sum * a);
  run.max = top;
  for (int x = 0; x < DV; ++x)
    _mm512_storeu_ps(run_acc + 16 * x, _mm512_fmadd_ps(_mm512_loadu_ps(part_acc + 16 * x), _mm512_set1_ps(c),
                                                       _mm512_mul_ps(_mm512_loadu_ps(run_acc + 16 * x), _mm512_set1_ps(a))));
}

template <int DV>
inline void Finish(const QueryState& run, const float* run_acc, float* out) {
  const __m512 inv = _mm512_set1_ps(1.f / run.sum);
  for (int x = 0; x < DV; ++x) _mm512_storeu_ps(out + 16 * x, _mm512_mul_ps(_mm512_loadu_ps(run_acc + 16 * x), inv));
}

}  // namespace

// How the chunks read the pool (KeyRows), then the chunks themselves (fp32 on any AVX-512 CPU;
// bf16 on AMX or AVX512-BF16): after the definitions they share (AttentionProblem, QueryState,
// Transpose16, Exp).
#include "attention_pool.h"
#include "attention_fp32.h"
#include "attention_amx.h"
#include "attention_dpbf16.h"

namespace {

// A chunk's keys: [chunk * kChunkKeys, +kChunkKeys), clipped to the keys the last query sees.
inline int ChunkEnd(const AttentionProblem& p, int b, int last, int chunk) {
  return std::min((chunk + 1) * kChunkKeys, static_cast<int>(p.history_lens[b]) + last);
}

// One item's query vectors of one KV head, in the precision the step runs: fp32 or bf16 tiles.
template <int DV, class E>
struct HeadQueries {
  const AttentionProblem& p;
  int b, kv, i0, last, nq;
  std::vector<float>& q;  // rotated queries [nq, D]
  std::vector<uint16_t>& q_bf16;  // the same in bf16, padded (bf16 steps)
  const uint16_t* heads_tiles;  // a split bf16 step: this chunk's tiles of heads first_head...
  int first_head;
  NextChunkPages* next;  // a split AVX512-BF16 step: the next item's pages, read during this one

  void Load() {
    constexpr int D = DV * 16;
    const int group = p.H / p.KVH;
    q.resize(static_cast<size_t>(nq) * D);
    for (int i = i0; i < last; ++i)  // the group's query heads of query i are contiguous
      std::memcpy(q.data() + static_cast<size_t>(i - i0) * group * D,
                  p.q_rot + ((static_cast<size_t>(b) * p.L + i) * p.H + static_cast<size_t>(kv) * group) * D,
                  sizeof(float) * group * D);
    if constexpr (DV % 2 == 0) {
      if (p.bf16) QueriesToBf16<DV>(q.data(), nq, p.scale, q_bf16);
    }
  }

  void Chunk(int chunk, float* acc, QueryState* states) const {
    const KeyRows<E> rows(p, b, kv);
    const int begin = chunk * kChunkKeys, end = ChunkEnd(p, b, last, chunk);
    if constexpr (DV % 2 == 0) {  // bf16 chunks take 32 dims at a time: Compute sets bf16 only then
      if (p.bf16) {
        // Converted by ConvertItemOf for every query block of the step, or (a split step reads
        // each chunk once) by AttendHeads for the item, a few heads at a time (kSplitTileBytes).
        const uint16_t* k_tiles =
            p.chunk_tiles != nullptr
                ? p.chunk_tiles + ((static_cast<size_t>(b) * p.KVH + kv) * p.row_chunks + chunk) * 2 * ChunkTileElems<DV>()
                : heads_tiles + static_cast<size_t>(kv - first_head) * 2 * ChunkTileElems<DV>();
        const uint16_t* v_tiles = k_tiles + ChunkTileElems<DV>();
        if (p.amx) return AmxChunk<DV>(p, b, i0, last, q_bf16.data(), begin, end, k_tiles, v_tiles, acc, states);
        return Dpbf16Chunk<DV>(p, b, i0, last, q_bf16.data(), begin, end, k_tiles, v_tiles, acc, states, next);
      }
    }
    AttendChunk<DV, E>(p, b, i0, last, q.data(), begin, end, rows, acc, states);
  }
};

// Item coordinates: row b, query block qb, chunk (split) and the block's real queries [i0, last).
struct ItemSpan {
  int b, qb, chunk, i0, last;
  int kv0, kv1;  // the KV heads of the item
};

ItemSpan Span(const AttentionProblem& p, size_t item, int chunks, bool heads_apart = false) {
  ItemSpan s;
  s.kv0 = heads_apart ? static_cast<int>(item % p.KVH) : 0;
  s.kv1 = heads_apart ? s.kv0 + 1 : p.KVH;
  if (heads_apart) item /= p.KVH;
  s.chunk = static_cast<int>(item % chunks);
  s.qb = static_cast<int>(item / chunks % p.query_blocks);
  s.b = static_cast<int>(item / chunks / p.query_blocks);
  s.i0 = s.qb * kQueryBlock;
  const int i1 = std::min(p.L, s.i0 + kQueryBlock);
  s.last = std::max(s.i0, std::min(i1, static_cast<int>(p.query_lens[s.b])));
  return s;
}

template <int DV, class E>
void AttendHeads(const AttentionProblem& p, size_t item) {
  constexpr int D = DV * 16;
  const ItemSpan s = Span(p, item, p.split ? p.row_chunks : 1, p.heads_apart);
  const int group = p.H / p.KVH;
  if (s.chunk == 0 && s.kv0 == 0)
    for (int i = s.last; i < std::min(p.L, s.i0 + kQueryBlock); ++i)  // padded queries: zeros
      std::memset(p.out + (static_cast<size_t>(s.b) * p.L + i) * p.H * D, 0, sizeof(float) * p.H * D);
  if (s.last == s.i0) return;
  const int nq = (s.last - s.i0) * group;
  thread_local std::vector<float> q_buf, chunk_acc, run_acc;
  thread_local std::vector<uint16_t> q_bf16;
  thread_local std::vector<QueryState> chunk_state, run_state;
  if (p.amx) ConfigureTiles();
  constexpr size_t kHeadTiles = 2 * ChunkTileElems<DV>();  // one head's K and V tiles
  const int heads_per_pass = std::max<int>(1, static_cast<int>(kSplitTileBytes / (kHeadTiles * sizeof(uint16_t))));
  thread_local std::vector<uint16_t> converted;
  thread_local NextChunkPages next_pages;
  NextChunkPages* next = nullptr;
  int first_head = s.kv0;
  for (int kv = s.kv0; kv < s.kv1; ++kv) {
    if constexpr (DV % 2 == 0) {
      if (p.bf16 && p.split && (kv - s.kv0) % heads_per_pass == 0) {
        const int last_head = std::min(s.kv1, kv + heads_per_pass);
        converted.resize(static_cast<size_t>(last_head - kv) * kHeadTiles);
        if (!p.amx && kv == s.kv0) {
          if (item + 1 < static_cast<size_t>(p.B) * p.query_blocks * p.row_chunks) {  // the item after this one
            const ItemSpan after = Span(p, item + 1, p.row_chunks);
            next_pages.Plan<E>(p, after.b, after.chunk, (s.kv1 - s.kv0 + 1) * kChunkKeys / 16);
            next = &next_pages;
          }
        }
        ConvertChunkHeads<DV, E>(p, s.b, s.chunk, kv, last_head, converted.data(), kHeadTiles, next);
        first_head = kv;
      }
    }
    HeadQueries<DV, E> queries{p, s.b, kv, s.i0, s.last, nq, q_buf, q_bf16, converted.data(), first_head, next};
    queries.Load();
    if (p.split) {
      const size_t slot = item * p.KVH + kv;
      queries.Chunk(s.chunk, p.part_acc + slot * p.slot_vectors * D, p.part_state + slot * p.slot_vectors);
      continue;
    }
    chunk_acc.resize(static_cast<size_t>(nq) * D);
    run_acc.resize(static_cast<size_t>(nq) * D);
    chunk_state.resize(nq);
    run_state.assign(nq, QueryState{-INFINITY, 0.f});
    const int keys = static_cast<int>(p.history_lens[s.b]) + s.last;
    for (int chunk = 0; chunk * kChunkKeys < keys; ++chunk) {
      queries.Chunk(chunk, chunk_acc.data(), chunk_state.data());
      for (int v = 0; v < nq; ++v)
        MergeState<DV>(run_state[v], run_acc.data() + v * D, chunk_state[v], chunk_acc.data() + v * D);
    }
    for (int v = 0; v < nq; ++v)
      Finish<DV>(run_state[v], run_acc.data() + v * D,
                 p.out + ((static_cast<size_t>(s.b) * p.L + s.i0 + v / group) * p.H + kv * group + v % group) * D);
  }
  if (p.amx) _tile_release();
}

// One item per (row, query block, KV head) of a split step: folds the chunks' partial states.
template <int DV>
void MergeHeads(const AttentionProblem& p, size_t item) {
  constexpr int D = DV * 16;
  const int kv = static_cast<int>(item % p.KVH);
  const ItemSpan s = Span(p, item / p.KVH, 1);
  const int group = p.H / p.KVH;
  const size_t first = (static_cast<size_t>(s.b) * p.query_blocks + s.qb) * p.row_chunks;  // chunk 0's item
  for (int v = 0; v < (s.last - s.i0) * group; ++v) {
    QueryState run{-INFINITY, 0.f};
    alignas(64) float run_acc[kMaxHeadDim];
    for (int c = 0; c < p.row_chunks; ++c) {
      const size_t at = ((first + c) * p.KVH + kv) * p.slot_vectors + v;
      MergeState<DV>(run, run_acc, p.part_state[at], p.part_acc + at * D);
    }
    Finish<DV>(run, run_acc, p.out + ((static_cast<size_t>(s.b) * p.L + s.i0 + v / group) * p.H + kv * group + v % group) * D);
  }
}

// The three kinds of work item of a step, each a template over the head width in 16-float
// vectors, called through ForHeadDim for the step's head dimension (and the pool's type).
template <int DV>
struct Attend {
  static void Run(const AttentionProblem& p, size_t item) {
    switch (p.pool_type) {
      case PoolType::kBf16: return AttendHeads<DV, PoolBf16>(p, item);
      case PoolType::kF16: return AttendHeads<DV, PoolF16>(p, item);
      default: return AttendHeads<DV, PoolF32>(p, item);
    }
  }
};
template <int DV>
struct Convert {
  static void Run(const AttentionProblem& p, size_t item) {
    switch (p.pool_type) {
      case PoolType::kBf16: return ConvertItemOf<DV, PoolBf16>(p, item);
      case PoolType::kF16: return ConvertItemOf<DV, PoolF16>(p, item);
      default: return ConvertItemOf<DV, PoolF32>(p, item);
    }
  }
};
template <int DV>
struct Merge {
  static void Run(const AttentionProblem& p, size_t item) { MergeHeads<DV>(p, item); }
};

template <template <int> class Work>
void ForHeadDim(void* data, size_t item) {
  const AttentionProblem& p = *static_cast<const AttentionProblem*>(data);
  switch (p.D / 16) {
#define FLARE_CASE(n) \
  case n:             \
    return Work<n>::Run(p, item);
    FLARE_CASE(1) FLARE_CASE(2) FLARE_CASE(3) FLARE_CASE(4) FLARE_CASE(5) FLARE_CASE(6) FLARE_CASE(7) FLARE_CASE(8)
    FLARE_CASE(9) FLARE_CASE(10) FLARE_CASE(11) FLARE_CASE(12) FLARE_CASE(13) FLARE_CASE(14) FLARE_CASE(15) FLARE_CASE(16)
#undef FLARE_CASE
    default: return;  // unreachable: Compute checks the head dimension
  }
}

struct PagedAttentionKernel {
  int64_t H, KVH, layer, num_layers;
  float scale;
  bool bf16 = false;  // precision "bfloat16": bf16 chunks where the CPU has a bf16 dot product

  PagedAttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    H = ki.GetAttribute<int64_t>("num_heads");
    KVH = ki.GetAttribute<int64_t>("kv_heads");
    layer = ki.GetAttribute<int64_t>("layer");
    num_layers = ki.GetAttribute<int64_t>("num_layers");
    scale = ki.GetAttribute<float>("scale");
    std::string precision = "float32";
    try {
      precision = ki.GetAttribute<std::string>("precision");
    } catch (const Ort::Exception&) {  // absent: float32
    }
    if (precision != "float32" && precision != "bfloat16")
      ORT_CXX_API_THROW("PagedAttention: precision must be float32 or bfloat16", ORT_INVALID_ARGUMENT);
    bf16 = precision == "bfloat16";
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
    switch (pool.GetTensorTypeAndShapeInfo().GetElementType()) {
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: p.pool_type = PoolType::kF32; break;
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: p.pool_type = PoolType::kBf16; break;
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: p.pool_type = PoolType::kF16; break;
      default: fail("kv_pool must be float, bfloat16 or float16");
    }
    p.pool = pool.GetTensorRawData();
    // bf16 chunks for precision="bfloat16" or a bfloat16 pool, where the CPU has a bf16 dot product
    // (AMX tiles, else AVX512-BF16) and head_dim is a multiple of 32; fp32 otherwise.
    const bool wants_bf16 = (bf16 || p.pool_type == PoolType::kBf16) && D % 32 == 0;
    p.amx = wants_bf16 && AmxUsable();
    p.bf16 = p.amx || (wants_bf16 && Avx512Bf16Usable());
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
    thread_local std::vector<uint16_t> k_new16, v_new16;
    p.k_new16 = p.v_new16 = nullptr;
    if (p.pool_type != PoolType::kF32) {
      k_new16.resize(static_cast<size_t>(B * L * KVH * D));
      v_new16.resize(static_cast<size_t>(B * L * KVH * D));
      p.k_new16 = k_new16.data();
      p.v_new16 = v_new16.data();
    }
    if (B * L < 16) {
      for (int64_t t = 0; t < B * L; ++t) RotateToken(&p, t);
    } else {
      ctx.ParallelFor(RotateToken, static_cast<size_t>(B * L), 0, &p);
    }
    p.query_blocks = static_cast<int>((L + kQueryBlock - 1) / kQueryBlock);
    int64_t keys = 0;
    for (int b = 0; b < p.B; ++b) keys = std::max(keys, p.history_lens[b] + p.query_lens[b]);
    p.row_chunks = static_cast<int>((keys + kChunkKeys - 1) / kChunkKeys);
    // Few query blocks (decode, a short chunk), or one per row (decode of any batch, where no
    // other query block would share a converted chunk): one item per chunk of keys, so every
    // thread streams its own span of the pages and a chunk's tiles stay in L2; a merge pass folds
    // the chunks in order. (Eight rows decoding at 16k: 5.8 -> 2.9 ms a layer on Zen 4, where
    // the whole rows' tiles went through memory.)
    p.slot_vectors = static_cast<int>(std::min<int64_t>(L, kQueryBlock) * (H / KVH));
    const size_t split_items = static_cast<size_t>(B) * p.query_blocks * p.row_chunks;
    const size_t split_floats = split_items * KVH * p.slot_vectors * D;
    p.split = (B * ((L + 15) / 16) < kMinItems || p.query_blocks == 1) && p.row_chunks > 1 &&
              split_floats <= kMaxSplitFloats;
    thread_local std::vector<float> part_acc;
    thread_local std::vector<QueryState> part_state;
    if (p.split) {
      part_acc.resize(split_floats);
      part_state.resize(split_floats / D);
      p.part_acc = part_acc.data();
      p.part_state = part_state.data();
    }
    p.heads_apart = !p.split && static_cast<size_t>(B) * p.query_blocks < kMinItems;
    const size_t items = p.split ? split_items : static_cast<size_t>(B) * p.query_blocks * (p.heads_apart ? KVH : 1);
    thread_local std::vector<uint16_t> chunk_tiles;
    p.chunk_tiles = nullptr;
    if (p.bf16 && !p.split) {  // every chunk's K and V in tile layouts, once per step
      const size_t chunks = static_cast<size_t>(B) * p.row_chunks;
      chunk_tiles.resize(chunks * KVH * 2 * kChunkKeys * D);
      p.chunk_tiles = chunk_tiles.data();
      ctx.ParallelFor(ForHeadDim<Convert>, chunks * (p.heads_apart ? KVH : 1), 0, &p);
    }
    ctx.ParallelFor(ForHeadDim<Attend>, items, 0, &p);
    if (p.split) ctx.ParallelFor(ForHeadDim<Merge>, static_cast<size_t>(B) * p.query_blocks * KVH, 0, &p);
  }
};

struct PagedAttentionOp : Ort::CustomOpBase<PagedAttentionOp, PagedAttentionKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new PagedAttentionKernel(api, info); }
  const char* GetName() const { return "PagedAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == 4) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // kv_pool: float, bfloat16 or float16
    return i == 1 || i >= 5 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

const PagedAttentionOp paged_attention_op;

}  // namespace

namespace flare {
void AddAttentionOps(Ort::CustomOpDomain& domain) { domain.Add(&paged_attention_op); }
}  // namespace flare
