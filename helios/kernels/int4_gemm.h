// The int4 x int8 GEMM core of ai.flare.MatMulInt4 (cpu_kernels.cc documents the layout and why),
// shared by MatMulInt4 and the routed experts' MoEInt4 (moe_kernels.cc): quantized activation
// rows, the VPDPBUSD passes over tiles of 16 columns. Internal to each file that includes it.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd_math.h"

namespace {

constexpr int kTileN = 16;     // output columns per tile: one zmm of lanes
constexpr int kPassRows = 8;   // activation rows sharing one unpacked weight vector
constexpr int kRowChunk = 64;  // rows whose int8 copy stays in L2 while the tiles stream past
constexpr int kMaxTilesPerItem = 8;  // fewer when a matrix has few tiles, so both threads get work

struct QuantizedRows {
  std::vector<int8_t> q;        // [M, K]
  std::vector<float> scale;     // [M, blocks]
  std::vector<int32_t> zsum;    // [M, blocks]: 8 * sum(q) of the block (the weights' zero point)
};

void QuantizeRow(const float* a, int K, int block, int8_t* q, float* scale, int32_t* zsum) {
  const int blocks = K / block;
  for (int b = 0; b < blocks; ++b) {
    const float* x = a + b * block;
    __m512 amax = _mm512_setzero_ps();
    for (int k = 0; k < block; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    const float m = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (int k = 0; k < block; k += 16) {
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), inv));
      sum = _mm512_add_epi32(sum, qi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * block + k), _mm512_cvtsepi32_epi8(qi));
    }
    scale[b] = m / 127.f;
    zsum[b] = 8 * _mm512_reduce_add_epi32(sum);
  }
}

// acc += u8 x s8 dot products of 4 (VPDPBUSD). Inline assembly because GCC 12 copies the
// accumulator around every _mm512_dpbusd_epi32 (two extra moves each, in the hottest loop).
inline void Dot4(__m512i& acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %[s8], %[u8], %[acc]" : [acc] "+v"(acc) : [u8] "v"(u8), [s8] "v"(s8));
}

// Each tile stream asks for its line 1 KB ahead. The hardware prefetchers alone left a pass's
// concurrent tile streams waiting on memory: with it, on a 2-core Xeon (AVX512-VNNI, no AMX) a
// decode step's matmuls took 10.5 ms instead of 13.1 at one row, 14.9 instead of 18.5 at eight
// (scripts/int4_stream.py, in turns; 2 KB and 4 KB ahead measured the same).
inline void Prefetch(const uint8_t* line) {
  _mm_prefetch(reinterpret_cast<const char*>(line + 1024), _MM_HINT_T0);
}

inline __m512i Broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// MatMulInt4's fused SkipSimplifiedLayerNormalization (cpu_kernels.cc); gamma null: none.
struct NormInputs {
  const float* skip = nullptr;  // [M, K]
  const float* gamma = nullptr;  // [K]
  float epsilon = 0.f;
  float* sum = nullptr;  // [M, K]: A + skip, or null when the graph does not read it
  float* normed = nullptr;  // [M, K]: the rows the matmul quantizes
};

struct Problem {
  const float* a_float;  // [M, K]
  const float* bias;
  const uint8_t* w;
  const float* wscale;  // [tiles, blocks, 16], or null where the scales are half floats:
  const uint16_t* wscale_half = nullptr;  // the same as IEEE half (MatMulInt4's 4-bit tiles only)
  float* y;
  QuantizedRows* a;
  int M, N, K, block, blocks, tiles, tiles_per_item, items_per_chunk;
  bool swiglu;  // N = 2 x the output width; tiles alternate gate, up
  int bits = 4;  // 8: the 8-bit tiles of Pass8 (MoEInt4 with bits = 8)
  NormInputs norm;  // MatMulInt4's fused norm, applied as rows are quantized
};

// Weight scales [at, at + 16) as floats, from the type the matrix stores them in. A template
// argument, not a branch: a branch in the pass's epilogue cost a 64-row pass ~60% (register
// spills beside its 32 live accumulators), where the float16 load is one vcvtph2ps.
template <bool Half>
inline __m512 WeightScales(const Problem& p, size_t at) {
  if constexpr (Half) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.wscale_half + at)));
  } else {
    return _mm512_loadu_ps(p.wscale + at);
  }
}

// A pass's first kilobyte of each tile and all of its tiles' scales, asked for at once. Prefetch
// (1 KB ahead) starts a stream's lines only as the loop reaches them, so a pass began on NT cold
// streams, one miss after another, and each tile's scales are a stream too short (7 lines of
// halves at K 896, block 64) for the hardware prefetchers to learn. A decode step's matmuls
// (scripts/int4_stream.py's graph, float16 scales, runs of both builds interleaved on Zen 4,
// medians of two runs): eight rows 12.05 -> 10.85 and 12.61 -> 11.23 ms; one row and 64 rows
// within 1%.
template <int NT>
inline void PrefetchPass(const Problem& p, const uint8_t* w, size_t tile_bytes, size_t scales_at) {
  const size_t bytes = static_cast<size_t>(NT) * p.blocks * kTileN * (p.wscale_half ? 2 : 4);
  const char* scales = p.wscale_half ? reinterpret_cast<const char*>(p.wscale_half + scales_at)
                                     : reinterpret_cast<const char*>(p.wscale + scales_at);
  for (size_t off = 0; off < bytes; off += 64) PrefetchLine(scales + off);
  for (int t = 0; t < NT; ++t)
    for (int line = 0; line < 1024; line += 64) PrefetchLine(reinterpret_cast<const char*>(w + t * tile_bytes + line));
}

// Rows [row, row + MR) against NT consecutive tiles of 16 columns, over all of K. With few
// rows x tiles, the low and high nibbles feed separate int32 chains so that VPDPBUSD's latency
// is hidden; with many, one chain each keeps everything in the 32 vector registers.
// Writes tile t's columns of row m to dst + m * ld + 16 t (masked to the matrix's last column).
// A pass's MR x NT tiles of outputs (plus the bias) into dst, the last tile masked to N.
template <int MR, int NT>
void Store(const Problem& p, int tile, const __m512 (&out)[MR][NT], float* dst, size_t ld) {
  for (int t = 0; t < NT; ++t) {
    const int n0 = (tile + t) * kTileN;
    const int cols = std::min(kTileN, p.N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
    const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(dst + m * ld + t * kTileN, mask, _mm512_add_ps(out[m][t], bias));
  }
}

template <int MR, int NT, bool HalfScales>
void Pass(const Problem& p, int tile, int row, float* dst, size_t ld) {
  constexpr int kChains = MR * NT >= 4 ? 1 : 2;
  const size_t tile_bytes = static_cast<size_t>(p.blocks) * p.block * 8;
  const uint8_t* w = p.w + tile * tile_bytes;
  const size_t ws = static_cast<size_t>(tile) * p.blocks * kTileN;
  PrefetchPass<NT>(p, w, tile_bytes, ws);
  const int8_t* aq = p.a->q.data() + static_cast<size_t>(row) * p.K;
  const float* as = p.a->scale.data() + static_cast<size_t>(row) * p.blocks;
  const int32_t* az = p.a->zsum.data() + static_cast<size_t>(row) * p.blocks;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 out[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) out[m][t] = _mm512_setzero_ps();
  for (int b = 0; b < p.blocks; ++b) {
    __m512i acc[kChains][MR][NT];
    for (int c = 0; c < kChains; ++c)
      for (int m = 0; m < MR; ++m)
        for (int t = 0; t < NT; ++t) acc[c][m][t] = _mm512_setzero_si512();
    const int8_t* ak = aq + b * p.block;
    for (int k = 0; k < p.block; k += 8) {
      __m512i lo[NT], hi[NT];
      for (int t = 0; t < NT; ++t) {
        Prefetch(w + t * tile_bytes);
        const __m512i v = _mm512_loadu_si512(w + t * tile_bytes);
        lo[t] = _mm512_and_si512(v, low4);
        hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      w += 64;
      for (int m = 0; m < MR; ++m) {
        const __m512i a0 = Broadcast4(ak + m * p.K + k), a1 = Broadcast4(ak + m * p.K + k + 4);
        for (int t = 0; t < NT; ++t) {
          Dot4(acc[0][m][t], lo[t], a0);
          Dot4(acc[kChains - 1][m][t], hi[t], a1);
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i zero_point = _mm512_set1_epi32(az[m * p.blocks + b]);
      const __m512 a_scale = _mm512_set1_ps(as[m * p.blocks + b]);
      for (int t = 0; t < NT; ++t) {
        const __m512 scale = _mm512_mul_ps(WeightScales<HalfScales>(p, ws + (t * p.blocks + b) * kTileN), a_scale);
        __m512i dot = acc[0][m][t];
        if constexpr (kChains == 2) dot = _mm512_add_epi32(dot, acc[1][m][t]);
        out[m][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot, zero_point)), scale, out[m][t]);
      }
    }
  }
  Store<MR, NT>(p, tile, out, dst, ld);
}

// The 8-bit tiles (MoEInt4 with bits = 8, int8 cores): one 64-byte vector holds [16 columns x 4 k]
// as q + 128, so it multiplies the activations without unpacking; the zero point is 128 * sum(a)
// = 16 * zsum. Two accumulator chains (even and odd vectors) hide vpdpbusd's latency.
template <int MR, int NT>
void Pass8(const Problem& p, int tile, int row, float* dst, size_t ld) {
  const size_t tile_bytes = static_cast<size_t>(p.blocks) * p.block * 16;
  const uint8_t* w = p.w + tile * tile_bytes;
  const size_t ws = static_cast<size_t>(tile) * p.blocks * kTileN;
  const int8_t* aq = p.a->q.data() + static_cast<size_t>(row) * p.K;
  const float* as = p.a->scale.data() + static_cast<size_t>(row) * p.blocks;
  const int32_t* az = p.a->zsum.data() + static_cast<size_t>(row) * p.blocks;
  __m512 out[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) out[m][t] = _mm512_setzero_ps();
  for (int b = 0; b < p.blocks; ++b) {
    __m512i acc[2][MR][NT];
    for (int c = 0; c < 2; ++c)
      for (int m = 0; m < MR; ++m)
        for (int t = 0; t < NT; ++t) acc[c][m][t] = _mm512_setzero_si512();
    const int8_t* ak = aq + b * p.block;
    for (int k = 0; k < p.block; k += 8) {
      for (int h = 0; h < 2; ++h) {
        __m512i v[NT];
        for (int t = 0; t < NT; ++t) {
          Prefetch(w + t * tile_bytes);
          v[t] = _mm512_loadu_si512(w + t * tile_bytes);
        }
        w += 64;
        for (int m = 0; m < MR; ++m) {
          const __m512i a = Broadcast4(ak + m * p.K + k + 4 * h);
          for (int t = 0; t < NT; ++t) Dot4(acc[h][m][t], v[t], a);
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i zero_point = _mm512_set1_epi32(16 * az[m * p.blocks + b]);
      const __m512 a_scale = _mm512_set1_ps(as[m * p.blocks + b]);
      for (int t = 0; t < NT; ++t) {
        const __m512 scale = _mm512_mul_ps(WeightScales<false>(p, ws + (t * p.blocks + b) * kTileN), a_scale);
        const __m512i dot = _mm512_add_epi32(acc[0][m][t], acc[1][m][t]);
        out[m][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot, zero_point)), scale, out[m][t]);
      }
    }
  }
  Store<MR, NT>(p, tile, out, dst, ld);
}

template <int MR, int NT, int Bits>
void PassOf(const Problem& p, int tile, int row, float* dst, size_t ld) {
  if constexpr (Bits == 8) {
    Pass8<MR, NT>(p, tile, row, dst, ld);
  } else if (p.wscale_half) {
    Pass<MR, NT, true>(p, tile, row, dst, ld);
  } else {
    Pass<MR, NT, false>(p, tile, row, dst, ld);
  }
}

// One row: four tiles per pass for independent chains; more rows: two tiles per pass, which
// halves the activation broadcasts per dot product (8 rows: 22.5 -> 17.8 ms a step's matmuls
// against one tile per pass, the same Xeon).
template <int Bits = 4>
void RunRows(const Problem& p, int tile, int tiles, int row, int rows, float* dst, size_t ld) {
  int t = 0;
  switch (rows) {
    case 1: for (; t + 4 <= tiles; t += 4) PassOf<1, 4, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
    case 2: for (; t + 2 <= tiles; t += 2) PassOf<2, 2, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
    case 3: for (; t + 2 <= tiles; t += 2) PassOf<3, 2, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
    case 4: for (; t + 2 <= tiles; t += 2) PassOf<4, 2, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
    case 5: for (; t + 2 <= tiles; t += 2) PassOf<5, 2, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
    case 6: for (; t + 2 <= tiles; t += 2) PassOf<6, 2, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
    case 7: for (; t + 2 <= tiles; t += 2) PassOf<7, 2, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
    default: for (; t + 2 <= tiles; t += 2) PassOf<8, 2, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
  }
  for (; t < tiles; ++t) {
    switch (rows) {
      case 1: PassOf<1, 1, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
      case 2: PassOf<2, 1, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
      case 3: PassOf<3, 1, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
      case 4: PassOf<4, 1, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
      case 5: PassOf<5, 1, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
      case 6: PassOf<6, 1, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
      case 7: PassOf<7, 1, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
      default: PassOf<8, 1, Bits>(p, tile + t, row, dst + t * kTileN, ld); break;
    }
  }
}

}  // namespace
