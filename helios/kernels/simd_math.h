// Math shared by flare's kernels (AVX-512).
#pragma once

#include <immintrin.h>

namespace {

// prefetcht0 of the line holding `p`. Not _mm_prefetch: GCC 12 deletes a loop whose body is only
// __builtin_prefetch calls (it has no side effects for the optimizer), so such a loop (PagedAttention's
// KeyRows::Prefetch, MatMulInt4's pass start) compiled to nothing; an asm volatile stays.
inline void PrefetchLine(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }

// An opaque copy: keeps the compiler from fusing a product into the add that follows (FMA
// contraction rounds once where the numpy or onnxruntime formula being matched rounds twice).
inline float Rounded(float value) {
  asm("" : "+v"(value));
  return value;
}

// exp for the SwiGLU epilogue and the attention softmax: 2^n * e^r with |r| <= ln2/2 and Cephes' degree-6 expf polynomial
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

}  // namespace
