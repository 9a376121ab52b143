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

// floor(x / 9) for x < 2^40: the high half of x * ceil(2^64 / 9) (error 2 x / 2^64 < 1/9 of
// the gap to the next multiple)
__host__ __device__ __forceinline__ uint64_t div9(uint64_t x) {
#ifdef __CUDA_ARCH__
  return __umul64hi(x, 0x1C71C71C71C71C72ull);
#else
  return (uint64_t)(((unsigned __int128)x * 0x1C71C71C71C71C72ull) >> 64);
#endif
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
    const int b = L::W * j, wi = b / 32, s = b % 32;  // (compile-time after unrolling)
    uint64_t v = (uint64_t)x[wi] | (wi + 1 < L::NX ? (uint64_t)x[wi + 1] << 32 : 0ull);
    v >>= s;
    if (s + L::W > 64 && wi + 2 < L::NX) v |= (uint64_t)x[wi + 2] << (64 - s);
    v &= (1ull << L::W) - 1ull;
    uint64_t y = 0;  // the group's G codes as 12-bit fields
#pragma unroll
    for (int k = 0; k < L::G; ++k) {
      // 2304 = 256 * 9: v / 2304 = (v >> 8) / 9, v % 2304 = ((v >> 8) % 9) * 256 + (v & 255)
      const uint64_t h = v >> 8, q = div9(h);
      y |= (((h - 9 * q) << 8) | (v & 255u)) << (12 * k);
      v = q;
    }
    const int ob = 12 * L::G * j, oi = ob / 32, os = ob % 32;
    o[oi] |= (uint32_t)(y << os);
    if (os + 12 * L::G > 32) o[oi + 1] |= (uint32_t)(y >> (32 - os));
    if (os + 12 * L::G > 64) o[oi + 2] |= (uint32_t)(y >> (64 - os));
  }
}

}  // namespace mixed
