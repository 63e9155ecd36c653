// PagedAttention's view of the paged pool: the K and V rows of a row's keys, wherever they lie,
// their prefetch, and the next split item's pages (included by attention_kernels.cc after
// AttentionProblem, the pool's element types and the chunk constants).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace {

// The K and V rows of one row's keys for one KV head, in the pool's element type E: pool pages
// for history, the step's own new tokens after it (rounded to E for a 16-bit pool). A block of
// keys inside one page is one pointer and a stride.
template <class E>
struct KeyRows {
  using T = typename E::T;
  const AttentionProblem& p;
  int b, kv, history;
  size_t stride;
  const T* k_pages;
  const T* v_pages;
  const T* k_new;
  const T* v_new;

  KeyRows(const AttentionProblem& problem, int row, int head)
      : p(problem), b(row), kv(head), history(static_cast<int>(problem.history_lens[row])),
        stride(static_cast<size_t>(problem.KVH) * problem.D),
        k_pages(static_cast<const T*>(problem.pool) + static_cast<size_t>(2 * problem.layer) * problem.pages * problem.T * stride),
        v_pages(k_pages + static_cast<size_t>(problem.pages) * problem.T * stride) {
    if constexpr (std::is_same_v<T, float>) {
      k_new = problem.k_out;
      v_new = problem.v_out;
    } else {
      k_new = problem.k_new16;
      v_new = problem.v_new16;
    }
  }

  void operator()(int j0, int count, const T** k_rows, const T** v_rows) const {
    if (j0 + count <= history && j0 / p.T == (j0 + count - 1) / p.T) {
      const int64_t page = p.block_tables[static_cast<size_t>(b) * p.M + j0 / p.T];
      const size_t base = (static_cast<size_t>(page) * p.T + j0 % p.T) * stride + kv * p.D;
      for (int jj = 0; jj < count; ++jj) {
        k_rows[jj] = k_pages + base + jj * stride;
        v_rows[jj] = v_pages + base + jj * stride;
      }
      return;
    }
    for (int jj = 0; jj < count; ++jj) {
      const int j = j0 + jj;
      if (j < history) {
        const int64_t page = p.block_tables[static_cast<size_t>(b) * p.M + j / p.T];
        const size_t at = (static_cast<size_t>(page) * p.T + j % p.T) * stride + kv * p.D;
        k_rows[jj] = k_pages + at;
        v_rows[jj] = v_pages + at;
      } else {
        const size_t at = (static_cast<size_t>(b) * p.L + (j - history)) * stride + kv * p.D;
        k_rows[jj] = k_new + at;
        v_rows[jj] = v_new + at;
      }
    }
  }

  // Start loading the K and V rows of keys [j0, end), at most 16 of them, into L1 (a decode's
  // keys stream from memory: the chunks fetch a block or two ahead of the one they work on).
  void Prefetch(int j0, int end) const {
    if (j0 >= end) return;
    const T* rows[2][16];
    const int count = std::min(16, end - j0);
    (*this)(j0, count, rows[0], rows[1]);
    for (int jj = 0; jj < count; ++jj)
      for (int line = 0; line < p.D * static_cast<int>(sizeof(T)); line += 64) {
        PrefetchLine(reinterpret_cast<const char*>(rows[0][jj]) + line);
        PrefetchLine(reinterpret_cast<const char*>(rows[1][jj]) + line);
      }
  }
};

// The pool pages of the chunk a split item's thread attends next, fetched while this item
// converts and computes. An item otherwise reads its chunk from memory and then works with no
// read in flight; spread over its conversion's and its scores' blocks, the next chunk's reads
// overlap that work (a 16k decode's attention 0.48 -> 0.29-0.30 ms a layer on Zen 4). Only
// chunks whose pages fit kSplitTileBytes: larger ones would evict the tiles being read. Used by
// the AVX512-BF16 path (ConvertChunkHeads, Dpbf16Chunk); AMX hosts are unmeasured.
struct NextChunkPages {
  static constexpr int kMaxRuns = 2 * kChunkKeys;  // K and V runs of a chunk's pages (T >= 1)
  const char* runs[kMaxRuns];
  int run_bytes[kMaxRuns];
  int count = 0, at = 0, offset = 0, lines_per_step = 0;

  // Plans the pages of chunk `chunk` of row b (history keys only: the step's own are in cache),
  // spread over `steps` calls of Step.
  template <class E>
  void Plan(const AttentionProblem& p, int b, int chunk, int steps) {
    count = at = offset = 0;
    const int history = static_cast<int>(p.history_lens[b]);
    const int begin = chunk * kChunkKeys, end = std::min(history, begin + kChunkKeys);
    const size_t row_bytes = static_cast<size_t>(p.KVH) * p.D * sizeof(typename E::T);
    if (begin >= end || static_cast<size_t>(end - begin) * row_bytes * 2 > kSplitTileBytes) return;
    const KeyRows<E> rows(p, b, 0);
    int lines = 0;
    for (int j = begin; j < end;) {
      const int n = std::min(end, (j / p.T + 1) * p.T) - j;  // keys of j's page in the chunk
      const typename E::T* k_row[1];
      const typename E::T* v_row[1];
      rows(j, 1, k_row, v_row);
      const int bytes = static_cast<int>(n * row_bytes);
      runs[count] = reinterpret_cast<const char*>(k_row[0]);
      run_bytes[count++] = bytes;
      runs[count] = reinterpret_cast<const char*>(v_row[0]);
      run_bytes[count++] = bytes;
      lines += 2 * ((bytes + 63) / 64);
      j += n;
    }
    lines_per_step = (lines + steps - 1) / std::max(1, steps);
  }

  void Step() {
    for (int n = 0; n < lines_per_step && at < count; ++n) {
      PrefetchLine(runs[at] + offset);
      offset += 64;
      if (offset >= run_bytes[at]) {
        ++at;
        offset = 0;
      }
    }
  }
};

}  // namespace
