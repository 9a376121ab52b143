// Mixed-radix HQMQ code rows (pack=mixed, quantizers/packing.py `mixed_layout`) -> the
// 12-bit rows the HQMQ kernel decodes. Host and device code alike, so a CPU test
// (suites/tests/test_cuda_mixed_codes.py) builds it with a plain C++ compiler and holds it
// to quantizers/packing.py's unpacking.
//
// Radix 2304 (S = 96) only: a row of NC codes is NC / G groups of W bits, group j at bit W j
// of the little-endian row, its value sum_k c_k 2304^k (c_0 least significant):
//   head dim 64:  16 codes, G = 2, W = 23 -> 23-byte rows (12-bit rows: 24 bytes)
//   head dim 128: 32 codes, G = 4, W = 45 -> 45-byte rows (48 bytes)
// Every group is whole (NC % G == 0), so no short last group.
#pragma once
#include <stdint.h>

#ifndef __CUDACC__  // a host compiler alone (the CPU test)
#define __host__
#define __device__
#define __forceinline__ inline
#endif

namespace mixed {

template <int D>
struct Layout {
  static_assert(D == 64 || D == 128, "mixed-radix rows: head dim 64 or 128 (S = 96)");
  static constexpr int NC = D / 4;              // codes per row
  static constexpr int G = D == 64 ? 2 : 4;     // codes per group
  static constexpr int W = D == 64 ? 23 : 45;   // bits per group: bits_for(2304^G)
  static constexpr int NG = NC / G;             // groups per row
  static constexpr int MB = (NG * W + 7) / 8;   // mixed row bytes (23, 45)
  static constexpr int NX = (MB + 3) / 4;       // words holding a mixed row (6, 12)
  static constexpr int NO = NC * 12 / 32;       // words of the 12-bit row (6, 12)
};
constexpr unsigned RADIX = 2304;  // 24 S at S = 96

// floor(x / 9) for any 32-bit x: the high half of x * ceil(2^33 / 9), shifted once (exact:
// the magic's excess, 1 / (9 2^33) per unit of x, stays under 1/9 for x < 2^32)
__host__ __device__ __forceinline__ uint32_t div9(uint32_t x) {
#ifdef __CUDA_ARCH__
  return __umulhi(x, 0x38E38E39u) >> 1;
#else
  return (uint32_t)(((uint64_t)x * 0x38E38E39u) >> 33);
#endif
}

// One mixed-radix digit of v = hi 2^32 + lo (hi < 2^13): returns v % 2304 and leaves v / 2304
// in (lo, hi). 2304 = 256 * 9, so v % 2304 = ((v >> 8) % 9) 256 + (v & 255) and v / 2304 =
// (v >> 8) / 9; with u = v >> 8 = uh 2^32 + ul (uh < 32) and 2^32 = 9 * 477218588 + 4:
// u / 9 = 477218588 uh + ul / 9 + (4 uh + ul % 9) / 9, all in 32-bit arithmetic but the one
// widening multiply. (x 57 >> 9 is x / 9 for x <= 132.)
__host__ __device__ __forceinline__ uint32_t digit_wide(uint32_t& lo, uint32_t& hi) {
  const uint32_t ul = (lo >> 8) | (hi << 24), uh = hi >> 8;
  const uint32_t ql = div9(ul), rl = ul - 9u * ql;
  const uint32_t a = 4u * uh + rl, qa = (a * 57u) >> 9, r = a - 9u * qa;
  const uint32_t c = (r << 8) | (lo & 255u);
  const uint64_t q = (uint64_t)uh * 477218588u + ql + qa;
  lo = (uint32_t)q;
  hi = (uint32_t)(q >> 32);
  return c;
}
// The same for v < 2^40 whose v >> 8 fits 32 bits (lo, hi as above; hi < 256): the quotient
// then fits 32 bits, left in lo.
__host__ __device__ __forceinline__ uint32_t digit_narrow(uint32_t& lo, uint32_t hi) {
  const uint32_t u = (lo >> 8) | (hi << 24), q = div9(u);
  const uint32_t c = ((u - 9u * q) << 8) | (lo & 255u);
  lo = q;
  return c;
}

// x: the row's bytes as little-endian words (bits past the row's MB bytes are ignored);
// o: the same codes as 12-bit fields, code i at bits 12 i (pack_bits' layout).
template <int D>
__host__ __device__ __forceinline__ void to_bits(const uint32_t (&x)[Layout<D>::NX], uint32_t (&o)[Layout<D>::NO]) {
  using L = Layout<D>;
#pragma unroll
  for (int i = 0; i < L::NO; ++i) o[i] = 0u;
#pragma unroll
  for (int j = 0; j < L::NG; ++j) {
    // the group's W bits at bit W j: (lo, hi), hi < 2^(W - 32) (compile-time indices after unrolling)
    const int b = L::W * j, wi = b / 32, s = b % 32;
    const uint32_t x0 = x[wi], x1 = wi + 1 < L::NX ? x[wi + 1] : 0u, x2 = wi + 2 < L::NX ? x[wi + 2] : 0u;
    uint32_t lo = s ? (x0 >> s) | (x1 << (32 - s)) : x0;
    uint32_t hi = s ? (x1 >> s) | (x2 << (32 - s)) : x1;
    if constexpr (L::W <= 32) {
      lo &= (uint32_t)((1ull << L::W) - 1ull);
      hi = 0u;
    } else {
      hi &= (1u << (L::W - 32)) - 1u;
    }
    // its G codes, c_0 first, as 12-bit fields of y (G 12 <= 48 bits: y0 the low word, y1 the rest)
    uint32_t c[L::G];
    if constexpr (L::G == 4) {  // v < 2304^4 < 2^45; after one digit < 2^34, after two < 2^23
      c[0] = digit_wide(lo, hi);
      c[1] = digit_narrow(lo, hi);
      c[2] = digit_narrow(lo, 0u);
      c[3] = lo & 0xFFFu;  // (a corrupt row stays inside its 12-bit field, as a 12-bit row's code would)
    } else {
      static_assert(L::G == 2, "groups of 2 or 4 codes");
      c[0] = digit_narrow(lo, 0u);  // v < 2304^2 < 2^23
      c[1] = lo & 0xFFFu;
    }
    uint32_t y0 = 0u, y1 = 0u;
#pragma unroll
    for (int k = 0; k < L::G; ++k) {
      const int sh = 12 * k;
      if (sh < 32) y0 |= c[k] << sh;
      if (sh + 12 > 32) y1 |= sh < 32 ? c[k] >> (32 - sh) : c[k] << (sh - 32);
    }
    const int ob = 12 * L::G * j, oi = ob / 32, os = ob % 32;  // (os + 12 G <= 64: two words)
    o[oi] |= y0 << os;
    if (os + 12 * L::G > 32) o[oi + 1] |= os ? (y0 >> (32 - os)) | (y1 << os) : y1;
  }
}

}  // namespace mixed
