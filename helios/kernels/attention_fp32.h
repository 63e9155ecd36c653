// PagedAttention's fp32 chunk, on any CPU with AVX-512 (included by attention_kernels.cc after
// the definitions it takes: QueryState, KeyRows, Transpose16, Exp, kPrefetchBlocks).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// Flash-attention style: the keys stream past in blocks of 16 (transposed in registers, so a query
// vector's 16 scores are D FMAs), each query vector keeps a running max, sum and output
// accumulator (online softmax), and NR query vectors share every key and value load.
template <class E>
struct KeyBlock {
  alignas(64) float kt[kMaxHeadDim][16];  // [d][key]
  const typename E::T* values[16];
  int count;  // keys in the block (the rest of kt is zero)
};

// Not inlined: inside AttendChunk the compiler spills the NR x DV accumulators to the stack.
template <int DV, int NR, class E>
__attribute__((noinline)) void AttendBlock(const AttentionProblem& p, const KeyBlock<E>& blk, int j0, int history, int i0, int group,
                 const float* q, int v0, int nv, float* acc, QueryState* state) {
  constexpr int D = DV * 16;
  // Vectors past nv (the last pass of a group not a multiple of NR) repeat the last real one:
  // q and acc end at nq vectors, and reading past them can cross into an unmapped page.
  const float* qr[NR];
  for (int r = 0; r < NR; ++r) qr[r] = q + (v0 + std::min(r, nv - 1)) * D;
  __m512 s[NR], s_odd[NR];  // even and odd dimensions: two chains per score halve its latency
  for (int r = 0; r < NR; ++r) s[r] = s_odd[r] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 2) {
    const __m512 kd = _mm512_load_ps(blk.kt[d]), ke = _mm512_load_ps(blk.kt[d + 1]);
    for (int r = 0; r < NR; ++r) {
      s[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), kd, s[r]);
      s_odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d + 1]), ke, s_odd[r]);
    }
  }
  for (int r = 0; r < NR; ++r) s[r] = _mm512_add_ps(s[r], s_odd[r]);
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
      out[r][x] = r < nv ? _mm512_mul_ps(_mm512_loadu_ps(acc + (v0 + r) * D + 16 * x), _mm512_set1_ps(corr[r]))
                         : _mm512_setzero_ps();
  for (int j = 0; j < blk.count; ++j) {
    __m512 v[DV];
    for (int x = 0; x < DV; ++x) v[x] = E::Load(blk.values[j] + 16 * x);
    for (int r = 0; r < NR; ++r) {
      const __m512 pj = _mm512_set1_ps(prob[r][j]);
      for (int x = 0; x < DV; ++x) out[r][x] = _mm512_fmadd_ps(pj, v[x], out[r][x]);
    }
  }
  for (int r = 0; r < nv; ++r)
    for (int x = 0; x < DV; ++x) _mm512_storeu_ps(acc + (v0 + r) * D + 16 * x, out[r][x]);
}

// One chunk of keys for query vectors [i0, last) x group of row b (q: their rotated queries,
// [nq, D]), from a fresh state: acc [nq, D] gets sum(e^(s - max) v), states the running max and
// sum. Keys [begin, end): the chunk, clipped to what the last query sees.
template <int DV, class E>
void AttendChunk(const AttentionProblem& p, int b, int i0, int last, const float* q, int begin, int end,
                 const KeyRows<E>& key_rows, float* acc, QueryState* states) {
  using T = typename E::T;
  constexpr int D = DV * 16;
  constexpr int NR = DV <= 2 ? 8 : DV <= 4 ? 4 : DV <= 8 ? 2 : 1;  // accumulators NR x DV stay in registers
  const int group = p.H / p.KVH;
  const int nq = (last - i0) * group;  // query vectors (i, g) -> (i - i0) * group + g
  std::fill(acc, acc + static_cast<size_t>(nq) * D, 0.f);
  std::fill(states, states + nq, QueryState{-INFINITY, 0.f});
  // A one-row decode waits on memory unless the rows a few blocks ahead are already on the way.
  for (int ahead = 0; ahead < kPrefetchBlocks; ++ahead) key_rows.Prefetch(begin + 16 * ahead, end);
  KeyBlock<E> blk;
  for (int j0 = begin; j0 < end; j0 += 16) {
    key_rows.Prefetch(j0 + 16 * kPrefetchBlocks, end);
    blk.count = std::min(16, end - j0);
    const T* k_rows[16];
    key_rows(j0, blk.count, k_rows, blk.values);
    for (int x = 0; x < DV; ++x) {  // 16 keys x 16 dims at a time, missing keys as zeros
      __m512 r[16];
      for (int jj = 0; jj < 16; ++jj) r[jj] = jj < blk.count ? E::Load(k_rows[jj] + 16 * x) : _mm512_setzero_ps();
      Transpose16(r);
      for (int c = 0; c < 16; ++c) _mm512_store_ps(blk.kt[16 * x + c], r[c]);
    }
    for (int v0 = 0; v0 < nq; v0 += NR)
      AttendBlock<DV, NR, E>(p, blk, j0, key_rows.history, i0, group, q, v0, std::min(NR, nq - v0), acc, states);
  }
}

}  // namespace
