// PagedAttention's view of the paged pool: the K and V rows of a row's keys, wherever they lie,
// and their prefetch (included by attention_kernels.cc after AttentionProblem and the pool's
// element types).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace {

// prefetcht0 of the line holding `p`. Not _mm_prefetch: GCC 12 deletes a loop whose body is only
// __builtin_prefetch calls (it has no side effects for the optimizer), so KeyRows::Prefetch compiled
// to nothing; an asm volatile stays.
inline void PrefetchLine(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }

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

}  // namespace
