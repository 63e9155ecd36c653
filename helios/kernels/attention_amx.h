// PagedAttention's bfloat16 chunk on AMX tiles (included by attention_kernels.cc).
//
// Why: a 16k-token prefill is ~5.8 T multiply-adds of attention; with fp32 AVX-512 FMAs two
// cores need over a minute for them, while one AMX TDPBF16PS does 16 x 16 x 32 of them.
// Q, K, P and V are rounded to bf16 (round to nearest even); every dot product accumulates in
// fp32, and the softmax (max, exp, sum) runs in fp32.
//
// One chunk of keys, as the fp32 AttendChunk: scores S = Q K^T of every query vector against the
// chunk (tiles of 16 vectors x 16 keys), a softmax over the chunk in fp32 (the chunk's max and
// sum are its state), P = e^(S - max) in bf16, then acc = P V (tiles of 16 vectors x 16 dims,
// summed over 32 keys per step). Each step converts every chunk's K and V once into the tile
// layouts (BlockToTiles: K as [dim pairs, keys] pairs, V as [key pairs, dims] pairs, the "VNNI"
// layout TDPBF16PS takes for its second operand), shared by every query block that reads them;
// Q is scaled before rounding, so the scores need no multiply.
#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// Every tile 16 rows x 64 bytes (AmxChunk says what each holds).
inline void ConfigureTiles() {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// Whether this process may use AMX-BF16: the CPU has tiles and bf16 tile products, Linux granted
// the tile state to the process (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), and a
// forked child can configure, use and release the tiles (some VMs advertise AMX and grant the
// state, yet fault in LDTILECFG: llama.cpp's AMX backend does here; the child takes the fault).
bool AmxUsable() {
  static const bool usable = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
    if ((d & kAmxBf16) == 0 || (d & kAmxTile) == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) return false;
    const pid_t child = fork();
    if (child < 0) return false;
    if (child == 0) {
      ConfigureTiles();
      _tile_zero(0);
      _tile_dpbf16ps(0, 1, 2);
      _tile_release();
      _exit(0);
    }
    int status = 0;
    while (waitpid(child, &status, 0) < 0)
      if (errno != EINTR) return false;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }();
  return usable;
}

constexpr int kStepKeys = 32;  // keys of one P V step (an A row holds 32 bf16)

inline __m512i PackBf16(__m512 lo, __m512 hi) {  // 32 bf16: lo's 16 values, then hi's
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

inline __m256i ToBf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

// 2^t for t <= 0 to ~1e-4 relative (P is rounded to bf16's 2^-9 anyway): 2^n * 2^f, |f| <= 1/2,
// 2^f by a degree-3 minimax polynomial; below -126 the result flushes to zero. The caller folds
// the softmax's shift and log2(e) into one FMA: t = s * log2(e) - max * log2(e).
inline __m512 Exp2Softmax(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_fmadd_ps(f, _mm512_set1_ps(0.05500892f), _mm512_set1_ps(0.24221096f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.69328293f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// out[2m] = in[m], out[2m + 1] = in[16 + m]: two rows of 16 bf16 as 16 pairs.
alignas(64) constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                  8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// Rounds nq query vectors [nq, D] (D a multiple of 32), times the softmax scale, to bf16; rows
// padded with zeros to a multiple of 16.
template <int DV>
void QueriesToBf16(const float* q, int nq, float scale, std::vector<uint16_t>& out) {
  constexpr int D = DV * 16;
  const __m512 s = _mm512_set1_ps(scale);
  out.assign(static_cast<size_t>((nq + 15) / 16 * 16) * D, 0);
  for (int v = 0; v < nq; ++v)
    for (int x = 0; x + 1 < DV; x += 2)
      _mm512_storeu_si512(out.data() + v * D + 16 * x,
                          PackBf16(_mm512_mul_ps(_mm512_loadu_ps(q + v * D + 16 * x), s),
                                   _mm512_mul_ps(_mm512_loadu_ps(q + v * D + 16 * x + 16), s)));
}

// One chunk's K and V in tile layouts (kChunkKeys keys, those past the row's keys zero): K per
// 16-key block and 32-dim slice, row = dim pair, column = key (a transpose of pairs); V per
// 32-key step and 16-dim slice, row = key pair, column = dim (the pair interleaved).
template <int DV>
constexpr size_t ChunkTileElems() {
  return static_cast<size_t>(kChunkKeys) * DV * 16;  // K or V: one bf16 per key and dim
}

// 32 bf16 of a row from `row` (dims in order): a bfloat16 pool's bits as they are, another type's
// values rounded (nearest even).
template <class E>
inline __m512i RowBf16x32(const typename E::T* row) {
  if constexpr (std::is_same_v<E, PoolBf16>) return _mm512_loadu_si512(row);
  return PackBf16(E::Load(row), E::Load(row + 16));
}

// 16 bf16 of two rows side by side (`odd` may be null: zeros), as PackBf16(even, odd) lays them.
template <class E>
inline __m512i TwoRowsBf16x16(const typename E::T* even, const typename E::T* odd) {
  if constexpr (std::is_same_v<E, PoolBf16>) {
    const __m256i hi = odd != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd)) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even))), hi, 1);
  }
  return PackBf16(E::Load(even), odd != nullptr ? E::Load(odd) : _mm512_setzero_ps());
}

// Zeroes what a chunk of `keys` keys leaves unwritten in its tiles, up to the 64-key bound the
// AMX chunk reads.
template <int DV>
void ZeroTileTails(int keys, uint16_t* k_tiles, uint16_t* v_tiles) {
  constexpr int D = DV * 16, DT = D / 32;
  const int bound = std::min(kChunkKeys, (keys + 63) / 64 * 64), k_blocks = (keys + 15) / 16;
  std::memset(k_tiles + static_cast<size_t>(k_blocks) * DT * 512, 0, sizeof(uint16_t) * (bound / 16 - k_blocks) * DT * 512);
  const int last_step = (keys - 1) / kStepKeys, pairs = (keys - last_step * kStepKeys + 1) / 2;
  for (int x = 0; x < DV; ++x)
    std::memset(v_tiles + (static_cast<size_t>(last_step) * DV + x) * 512 + pairs * 32, 0, sizeof(uint16_t) * (16 - pairs) * 32);
  std::memset(v_tiles + static_cast<size_t>(last_step + 1) * DV * 512, 0,
              sizeof(uint16_t) * (bound / kStepKeys - last_step - 1) * DV * 512);
}

// Block `blk` (16 keys) of a chunk of `keys` keys starting at `begin` into its K and V tiles.
template <int DV, class E>
inline void BlockToTiles(const KeyRows<E>& key_rows, int begin, int keys, int blk, uint16_t* k_tiles, uint16_t* v_tiles) {
  constexpr int D = DV * 16, DT = D / 32;
  using T = typename E::T;
  const __m512i interleave = _mm512_loadu_si512(kInterleave);
  const T* k_rows[16];
  const T* v_rows[16];
  const int count = std::min(16, keys - 16 * blk);
  key_rows(begin + 16 * blk, count, k_rows, v_rows);
  for (int t = 0; t < DT; ++t) {
    __m512 r[16];
    for (int jj = 0; jj < 16; ++jj)
      r[jj] = jj < count ? _mm512_castsi512_ps(RowBf16x32<E>(k_rows[jj] + 32 * t)) : _mm512_setzero_ps();
    Transpose16(r);
    for (int pair = 0; pair < 16; ++pair)
      _mm512_storeu_si512(k_tiles + (static_cast<size_t>(blk) * DT + t) * 512 + pair * 32, _mm512_castps_si512(r[pair]));
  }
  for (int jj = 0; jj < count; jj += 2) {
    const int key = 16 * blk + jj, step = key / kStepKeys, pair = key % kStepKeys / 2;
    for (int x = 0; x < DV; ++x) {
      const T* odd = jj + 1 < count ? v_rows[jj + 1] + 16 * x : nullptr;
      _mm512_storeu_si512(v_tiles + (static_cast<size_t>(step) * DV + x) * 512 + pair * 32,
                          _mm512_permutexvar_epi16(interleave, TwoRowsBf16x16<E>(v_rows[jj] + 16 * x, odd)));
    }
  }
}

// The softmax of one chunk's scores S ([tiles * 16, width] fp32, rows past nq ignored) for query
// vectors [0, nq) of queries i0... of row b: P = e^(S - max) in bf16 (zero past each vector's
// visible keys, and for the padding rows), and each vector's chunk state (max, sum). Shared by
// the AMX and the AVX512-BF16 chunks, so both fold the same way.
inline void ChunkSoftmax(const AttentionProblem& p, int b, int i0, int nq, int begin, int keys, int width, int tiles,
                         const float* s_rows, uint16_t* p_rows, QueryState* states) {
  const int group = p.H / p.KVH;
  const int history = static_cast<int>(p.history_lens[b]);
  for (int v = 0; v < tiles * 16; ++v) {  // softmax over the chunk, per query vector
    uint16_t* prow = p_rows + static_cast<size_t>(v) * width;
    const int visible = v < nq ? std::min(keys, std::max(0, history + i0 + v / group + 1 - begin)) : 0;
    if (v < nq) states[v] = QueryState{-INFINITY, 0.f};
    if (visible == 0) {
      std::fill(prow, prow + width, 0);
      continue;
    }
    // Whole 16-key vectors without masks, two max chains (a max waits on the one before), then
    // the partial vector; P past the visible keys is zero.
    const float* srow = s_rows + static_cast<size_t>(v) * width;
    const int whole = visible & ~15;
    const __mmask16 tail = static_cast<__mmask16>((1u << (visible - whole)) - 1u);
    __m512 top0 = _mm512_set1_ps(-INFINITY), top1 = top0;
    int j = 0;
    for (; j + 32 <= whole; j += 32) {
      top0 = _mm512_max_ps(top0, _mm512_loadu_ps(srow + j));
      top1 = _mm512_max_ps(top1, _mm512_loadu_ps(srow + j + 16));
    }
    if (j < whole) top0 = _mm512_max_ps(top0, _mm512_loadu_ps(srow + j));
    if (tail != 0) top1 = _mm512_mask_max_ps(top1, tail, top1, _mm512_maskz_loadu_ps(tail, srow + whole));
    const float max = _mm512_reduce_max_ps(_mm512_max_ps(top0, top1));
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), shift = _mm512_set1_ps(max * 1.44269504088896341f);
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j + 32 <= whole; j += 32) {  // two vectors: one conversion, one 64-byte store
      const __m512 e0 = Exp2Softmax(_mm512_fmsub_ps(_mm512_loadu_ps(srow + j), log2e, shift));
      const __m512 e1 = Exp2Softmax(_mm512_fmsub_ps(_mm512_loadu_ps(srow + j + 16), log2e, shift));
      sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
      _mm512_storeu_si512(prow + j, PackBf16(e0, e1));
    }
    if (j < whole) {
      const __m512 e = Exp2Softmax(_mm512_fmsub_ps(_mm512_loadu_ps(srow + j), log2e, shift));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), ToBf16(e));
      j += 16;
    }
    if (tail != 0) {
      const __m512 e = _mm512_maskz_mov_ps(tail, Exp2Softmax(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(tail, srow + j), log2e, shift)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), ToBf16(e));
      j += 16;
    }
    for (; j < width; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), _mm256_setzero_si256());
    states[v] = QueryState{max, _mm512_reduce_add_ps(sum)};
  }
}

struct AmxChunkBuffers {
  std::vector<uint16_t> p;  // P [16, keys] in bf16
  std::vector<float> s, o;  // scores [16, keys]; P V [16, D]
};

// One chunk for the bf16 query vectors qb ([rows of 16, D], scaled) of row b, queries [i0, last),
// over the chunk's tiles (BlockToTiles): acc [nq, D] and states as AttendChunk writes them.
// Needs D a multiple of 32 and the tiles configured (ConfigureTiles).
template <int DV>
void AmxChunk(const AttentionProblem& p, int b, int i0, int last, const uint16_t* qb, int begin, int end,
              const uint16_t* k_tiles, const uint16_t* v_tiles, float* acc, QueryState* states) {
  constexpr int D = DV * 16, DT = D / 32;  // dims of a K tile row: 32
  const int group = p.H / p.KVH, nq = (last - i0) * group;
  const int history = static_cast<int>(p.history_lens[b]);
  if (end <= begin) {  // no key of the chunk is visible to these queries
    std::fill(states, states + nq, QueryState{-INFINITY, 0.f});
    return;
  }
  // Scores come in groups of four 16-key blocks (four independent tiles keep the tile unit busy):
  // the S and P rows are padded to 64 keys (the tiles past the chunk's keys are zeros).
  const int keys = end - begin, blocks = (keys + 63) / 64 * 4, width = blocks * 16, steps = width / kStepKeys;
  // Three passes over all query tiles, so no vector load waits on a tile store just made (and
  // no tile load on vector stores): S for every tile, the softmax of every row, then P V.
  const int tiles = (nq + 15) / 16;
  thread_local AmxChunkBuffers buf;
  buf.s.resize(static_cast<size_t>(tiles) * 16 * width);
  buf.p.resize(static_cast<size_t>(tiles) * 16 * width);
  buf.o.resize(static_cast<size_t>(16) * D);
  int single = 0;  // the first query tile S has not covered yet
  if constexpr (DT == 2) {
    // Pairs of query tiles: both tiles' Q in 4-7 for the whole chunk, so each K tile load serves
    // two products (a tile load costs more than a product here).
    for (; single + 16 < nq; single += 32) {
      const uint16_t* qa = qb + static_cast<size_t>(single) * D;
      _tile_loadd(4, qa, D * 2);
      _tile_loadd(5, qa + 32, D * 2);
      _tile_loadd(6, qa + 16 * D, D * 2);
      _tile_loadd(7, qa + 16 * D + 32, D * 2);
      float* sa = buf.s.data() + static_cast<size_t>(single) * width;
      float* sb = sa + static_cast<size_t>(16) * width;
      for (int blk = 0; blk < blocks; ++blk) {
        const uint16_t* k = k_tiles + static_cast<size_t>(blk) * DT * 512;
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(2, k, 64);
        _tile_loadd(3, k + 512, 64);
        _tile_dpbf16ps(0, 4, 2);
        _tile_dpbf16ps(1, 6, 2);
        _tile_dpbf16ps(0, 5, 3);
        _tile_dpbf16ps(1, 7, 3);
        _tile_stored(0, sa + 16 * blk, width * 4);
        _tile_stored(1, sb + 16 * blk, width * 4);
      }
    }
  }
  for (int v0 = single; v0 < nq; v0 += 16) {
    // S = Q K^T: tiles 0-3 four key blocks; with 64 dims, 4 and 5 hold Q's two 32-dim slices for
    // the whole chunk and 6 and 7 the blocks' K slices (tile loads cost more than products here);
    // wider heads reload Q's slice into 4 per block group.
    const uint16_t* q_tile = qb + static_cast<size_t>(v0) * D;
    if constexpr (DT == 2) {
      _tile_loadd(4, q_tile, D * 2);
      _tile_loadd(5, q_tile + 32, D * 2);
    }
    for (int blk = 0; blk < blocks; blk += 4) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* k = k_tiles + static_cast<size_t>(blk) * DT * 512;
      if constexpr (DT == 2) {
        _tile_loadd(6, k, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, k + 512, 64);
        _tile_dpbf16ps(0, 5, 7);
        _tile_loadd(6, k + 1024, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, k + 1536, 64);
        _tile_dpbf16ps(1, 5, 7);
        _tile_loadd(6, k + 2048, 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, k + 2560, 64);
        _tile_dpbf16ps(2, 5, 7);
        _tile_loadd(6, k + 3072, 64);
        _tile_dpbf16ps(3, 4, 6);
        _tile_loadd(7, k + 3584, 64);
        _tile_dpbf16ps(3, 5, 7);
      } else {
        for (int t = 0; t < DT; ++t) {
          _tile_loadd(4, q_tile + 32 * t, D * 2);
          _tile_loadd(6, k + t * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, k + (DT + t) * 512, 64);
          _tile_dpbf16ps(1, 4, 7);
          _tile_loadd(6, k + (2 * DT + t) * 512, 64);
          _tile_dpbf16ps(2, 4, 6);
          _tile_loadd(7, k + (3 * DT + t) * 512, 64);
          _tile_dpbf16ps(3, 4, 7);
        }
      }
      float* srow = buf.s.data() + static_cast<size_t>(v0) * width + 16 * blk;
      _tile_stored(0, srow, width * 4);
      _tile_stored(1, srow + 16, width * 4);
      _tile_stored(2, srow + 32, width * 4);
      _tile_stored(3, srow + 48, width * 4);
    }
  }
  ChunkSoftmax(p, b, i0, nq, begin, keys, width, tiles, buf.s.data(), buf.p.data(), states);
  // acc = P V over the chunk's 32-key steps. Pairs of query tiles take 2 x 2 accumulators (two
  // P tiles and two V tiles per step: each V tile serves both query tiles, a load per product);
  // a last unpaired tile takes four 16-dim accumulators. Whole tiles are stored straight into acc.
  auto out_of = [&](int v0) { return v0 + 16 <= nq ? acc + static_cast<size_t>(v0) * D : nullptr; };
  int v0 = 0;
  for (; v0 + 16 < nq; v0 += 32) {
    const uint16_t* pa = buf.p.data() + static_cast<size_t>(v0) * width;
    const uint16_t* pb = pa + static_cast<size_t>(16) * width;
    float* oa = acc + static_cast<size_t>(v0) * D;
    float* ob = out_of(v0 + 16);
    float* ob_tiles = ob != nullptr ? ob : buf.o.data();
    for (int x0 = 0; x0 < DV; x0 += 2) {
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int step = 0; step < steps; ++step) {
        const uint16_t* vt = v_tiles + (static_cast<size_t>(step) * DV + x0) * 512;
        _tile_loadd(0, pa + step * kStepKeys, width * 2);
        _tile_loadd(2, vt, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_loadd(3, vt + 512, 64);
        _tile_dpbf16ps(5, 0, 3);
        _tile_loadd(1, pb + step * kStepKeys, width * 2);
        _tile_dpbf16ps(6, 1, 2);
        _tile_dpbf16ps(7, 1, 3);
      }
      _tile_stored(4, oa + 16 * x0, D * 4);
      _tile_stored(5, oa + 16 * x0 + 16, D * 4);
      _tile_stored(6, ob_tiles + 16 * x0, D * 4);
      _tile_stored(7, ob_tiles + 16 * x0 + 16, D * 4);
    }
    if (ob == nullptr)
      std::memcpy(acc + static_cast<size_t>(v0 + 16) * D, buf.o.data(), sizeof(float) * (nq - v0 - 16) * D);
  }
  if (v0 < nq) {
    const uint16_t* prows = buf.p.data() + static_cast<size_t>(v0) * width;
    float* whole = out_of(v0);
    float* o = whole != nullptr ? whole : buf.o.data();
    for (int x0 = 0; x0 < DV; x0 += 4) {
      const int n = std::min(4, DV - x0);
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int step = 0; step < steps; ++step) {
        _tile_loadd(1, prows + step * kStepKeys, width * 2);
        const uint16_t* vt = v_tiles + (static_cast<size_t>(step) * DV + x0) * 512;
        _tile_loadd(2, vt, 64);
        _tile_dpbf16ps(4, 1, 2);
        if (n > 1) {
          _tile_loadd(3, vt + 512, 64);
          _tile_dpbf16ps(5, 1, 3);
        }
        if (n > 2) {
          _tile_loadd(2, vt + 1024, 64);
          _tile_dpbf16ps(6, 1, 2);
        }
        if (n > 3) {
          _tile_loadd(3, vt + 1536, 64);
          _tile_dpbf16ps(7, 1, 3);
        }
      }
      _tile_stored(4, o + 16 * x0, D * 4);
      if (n > 1) _tile_stored(5, o + 16 * x0 + 16, D * 4);
      if (n > 2) _tile_stored(6, o + 16 * x0 + 32, D * 4);
      if (n > 3) _tile_stored(7, o + 16 * x0 + 48, D * 4);
    }
    if (whole == nullptr)
      std::memcpy(acc + static_cast<size_t>(v0) * D, buf.o.data(), sizeof(float) * (nq - v0) * D);
  }
}

// Every KV head's K and V tiles of one (row, chunk) of a bf16 step, head by head within each
// 16-key block: a block's keys are one page's rows, read whole (heads lie side by side in a row)
// where a pass per head read half of every row twice over (~9% of a 16k decode's attention on
// Zen 4). Heads [kv0, kv1): head kv's K tiles go to tiles + (kv - kv0) * head_stride, its V
// tiles right after them. `next` (a split item's): a step of its prefetches per block.
template <int DV, class E>
void ConvertChunkHeads(const AttentionProblem& p, int b, int chunk, int kv0, int kv1, uint16_t* tiles,
                       size_t head_stride, NextChunkPages* next = nullptr) {
  const int begin = chunk * kChunkKeys;
  const int keys = std::min(kChunkKeys, static_cast<int>(p.history_lens[b] + p.query_lens[b]) - begin);
  if (keys <= 0) return;  // past the row's keys: no query reads it
  constexpr size_t kElems = ChunkTileElems<DV>();
  for (int kv = kv0; kv < kv1; ++kv) {
    uint16_t* k_tiles = tiles + (kv - kv0) * head_stride;
    ZeroTileTails<DV>(keys, k_tiles, k_tiles + kElems);
    KeyRows<E>(p, b, kv).Prefetch(begin, begin + keys);
  }
  for (int blk = 0; blk * 16 < keys; ++blk)
    for (int kv = kv0; kv < kv1; ++kv) {
      if (next != nullptr && kv == kv0) next->Step();
      const KeyRows<E> rows(p, b, kv);
      rows.Prefetch(begin + 16 * (blk + 1), begin + keys);
      uint16_t* k_tiles = tiles + (kv - kv0) * head_stride;
      BlockToTiles<DV, E>(rows, begin, keys, blk, k_tiles, k_tiles + kElems);
    }
}

// One item per (row, chunk) of a bf16 step that is not split, or per (row, KV head, chunk) when
// its heads go apart: the chunk's tiles, shared by every query block of the row (chunk_tiles:
// [B, KVH, row_chunks] chunks).
template <int DV, class E>
void ConvertItemOf(const AttentionProblem& p, size_t item) {
  if constexpr (DV % 2 == 0) {
    const size_t chunk_elems = 2 * ChunkTileElems<DV>();
    const int chunk = static_cast<int>(item % p.row_chunks);
    const int heads = p.heads_apart ? 1 : p.KVH;  // the item's KV heads
    const int kv0 = p.heads_apart ? static_cast<int>(item / p.row_chunks % p.KVH) : 0;
    const int b = static_cast<int>(item / p.row_chunks / (p.heads_apart ? p.KVH : 1));
    uint16_t* first = p.chunk_tiles + ((static_cast<size_t>(b) * p.KVH + kv0) * p.row_chunks + chunk) * chunk_elems;
    ConvertChunkHeads<DV, E>(p, b, chunk, kv0, kv0 + heads, first, p.row_chunks * chunk_elems);
  }
}

}  // namespace
