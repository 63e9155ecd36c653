// PagedAttention's bfloat16 chunk on AVX512-BF16 (VDPBF16PS), for CPUs with a bf16 dot product
// but no AMX tiles (AMD Zen 4); included by attention_kernels.cc after attention_amx.h, whose
// operands it takes: Q rounded to bf16 and pre-scaled (QueriesToBf16), the chunk's K and V in
// BlockToTiles' layouts, P from ChunkSoftmax. Each 32-bit lane of VDPBF16PS adds the two products
// of a bf16 pair in fp32, so:
// - scores: a query's dim pair, broadcast, against a K tile row (16 keys' values of that pair);
// - P V: a query's key pair of P, broadcast, against a V tile row (16 dims' values of that pair).
// The softmax is the AMX chunk's (fp32, P rounded to bf16), and a query vector's sums run in one
// fixed order whatever else the step holds, so prefill and decode of a query give the same bits.
#pragma once

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Whether the CPU has AVX512-BF16 (CPUID leaf 7, subleaf 1, EAX bit 5).
bool Avx512Bf16Usable() {
  static const bool usable = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    return (a & (1u << 5)) != 0;
  }();
  return usable;
}

inline __m512bh Bf16Pairs(const uint16_t* x) { return (__m512bh)_mm512_loadu_si512(x); }
inline __m512bh Bf16Pair(uint32_t pair) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)); }

// Scores of NR query vectors (rows v0.. of q32 [rows, D/2 pairs]) against one 16-key block.
template <int DV, int NR>
inline void ScoreBlock(const uint32_t* q32, int v0, const uint16_t* k_block, float* s, int width) {
  constexpr int D = DV * 16, DT = D / 32, PAIRS = D / 2;
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int t = 0; t < DT; ++t)
    for (int pair = 0; pair < 16; ++pair) {
      const __m512bh k = Bf16Pairs(k_block + t * 512 + pair * 32);
      for (int r = 0; r < NR; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], Bf16Pair(q32[static_cast<size_t>(v0 + r) * PAIRS + 16 * t + pair]), k);
    }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(s + static_cast<size_t>(v0 + r) * width, acc[r]);
}

// acc rows v0.. (at most `rows` of them stored) = P V over the chunk's `steps` 32-key steps.
template <int DV, int NR>
inline void WeighValues(const uint32_t* p32, int v0, int rows, int width, int steps, const uint16_t* v_tiles,
                        float* out) {
  constexpr int D = DV * 16;
  __m512 acc[NR][DV];
  for (int r = 0; r < NR; ++r)
    for (int x = 0; x < DV; ++x) acc[r][x] = _mm512_setzero_ps();
  for (int step = 0; step < steps; ++step)
    for (int pair = 0; pair < 16; ++pair) {
      __m512bh v[DV];
      for (int x = 0; x < DV; ++x) v[x] = Bf16Pairs(v_tiles + (static_cast<size_t>(step) * DV + x) * 512 + pair * 32);
      for (int r = 0; r < NR; ++r) {
        const __m512bh pr = Bf16Pair(p32[static_cast<size_t>(v0 + r) * (width / 2) + step * 16 + pair]);
        for (int x = 0; x < DV; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], pr, v[x]);
      }
    }
  for (int r = 0; r < std::min(NR, rows); ++r)
    for (int x = 0; x < DV; ++x) _mm512_storeu_ps(out + static_cast<size_t>(v0 + r) * D + 16 * x, acc[r][x]);
}

struct Dpbf16ChunkBuffers {
  std::vector<float> s;  // scores [rows, width]
  std::vector<uint16_t> p;  // P [rows, width] in bf16
};

// One chunk for the bf16 query vectors qb ([rows of 16, D], scaled, zero-padded) of row b, queries
// [i0, last), over the chunk's tiles: acc [nq, D] and states as AmxChunk writes them.
template <int DV>
void Dpbf16Chunk(const AttentionProblem& p, int b, int i0, int last, const uint16_t* qb, int begin, int end,
                 const uint16_t* k_tiles, const uint16_t* v_tiles, float* acc, QueryState* states,
                 NextChunkPages* next) {
  constexpr int D = DV * 16, DT = D / 32;
  constexpr int NR = DV <= 2 ? 8 : DV <= 4 ? 4 : DV <= 8 ? 2 : 1;  // P V accumulators NR x DV in registers
  const int group = p.H / p.KVH, nq = (last - i0) * group;
  if (end <= begin) {  // no key of the chunk is visible to these queries
    std::fill(states, states + nq, QueryState{-INFINITY, 0.f});
    return;
  }
  const int keys = end - begin, width = (keys + 31) / 32 * 32, tiles = (nq + 15) / 16;
  thread_local Dpbf16ChunkBuffers buf;
  buf.s.resize(static_cast<size_t>(tiles) * 16 * width);
  buf.p.resize(static_cast<size_t>(tiles) * 16 * width);
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qb);
  for (int blk = 0; blk < width / 16; ++blk) {
    if (next != nullptr) next->Step();
    const uint16_t* k_block = k_tiles + static_cast<size_t>(blk) * DT * 512;
    float* s = buf.s.data() + 16 * blk;
    for (int v0 = 0; v0 < tiles * 16; v0 += 16) {
      if (nq - v0 <= 8) {
        ScoreBlock<DV, 8>(q32, v0, k_block, s, width);
      } else {
        ScoreBlock<DV, 16>(q32, v0, k_block, s, width);
      }
    }
  }
  ChunkSoftmax(p, b, i0, nq, begin, keys, width, tiles, buf.s.data(), buf.p.data(), states);
  const uint32_t* p32 = reinterpret_cast<const uint32_t*>(buf.p.data());
  for (int v0 = 0; v0 < nq; v0 += NR) WeighValues<DV, NR>(p32, v0, nq - v0, width, width / 32, v_tiles, acc);
}

}  // namespace
