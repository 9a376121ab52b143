// Fused split-K decode attention over packed KV caches (int4 per-token groups, fp8),
// CUDA C++ with mma.sync from registers. Built at first use by kernels/cuda_decode.py
// (nvcc -> a shared library called through ctypes; no torch headers, so it builds in
// seconds). kernels/NOTES.md ("CUDA decode kernels") has the design and the figures.
//
// One CTA per (b * Hkv + h, split); NW warps; each warp takes 16-token tiles of the
// split round-robin, keeps its own online softmax, and the CTA merges its warps in
// shared memory into one partial (out, max, sum, base 2) per query row, which
// `combine_kernel` merges over the splits.
//
// Tokens sit on the mma M axis, the GQA heads (<= 8) on N:
//   S^T[16 tok, 8 heads]  = K[16 tok, D] . Q^T[D, 8]      (A = K from registers)
//   O^T[D, 8 heads]      += V^T[D, 16 tok] . P^T[16 tok, 8] (A = V^T from registers)
// so a 16-token tile costs D/16 + D/16 mma (heads padded to 8, not 16), and the
// score fragment (tokens g, g+8 x heads 2c, 2c+1) becomes the P^T operand by one
// movmatrix.trans per 8x8 half (lane = 4 g + c throughout).
//
// Contracted axes may be permuted freely if both operands agree:
// - QK^T: lane c owns the head-dim chunk [c D/4, (c+1) D/4) of tokens g and g+8 (one
//   16-byte load per token for int4, D=128: exactly one scale group); Q is loaded in
//   the same permuted order once.
// - PV: lane g owns the dims [g D/8, (g+1) D/8) of tokens 2c, 2c+1, 2c+8, 2c+9; the
//   A operand wants pairs along TOKENS, made by one PRMT per two 32-bit words of two
//   tokens BEFORE decoding (the packed bytes of token pairs are interleaved, then the
//   same nibble masks decode (t, t+1) pairs of one dim).
//
// int4 decode without conversions, as the Triton FAST path (kernels/triton_common.py):
// (w & 0x000F000F) | 0x64006400 is the half2 (1024 + x0, 1024 + x1) (high nibbles:
// & 0x00F000F0 | 0x54005400 = 64 + x), one HSUB2 removes the magic exactly, one HFMA2
// gives round16(x s + z). Per element: LOP3 + HSUB2 + HFMA2 per two, a SHR per eight,
// for V a PRMT per eight; fp8: one CVT per two (e4m3x2 / e5m2x2, sm_89+).
// (Tried on the H200 and dropped, NOTES.md: folding the zero point into an extra mma
// and decoding s x with one HFMA2 (fma(1024 + x, s, -1024 s)) saves the HSUB2 but
// rounds s x, whose error is relative to the group range, not to the value:
// 3.3e-3..4.9e-3 relative output error vs 1.7e-3.)

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace {

constexpr uint32_t MAGIC_LO = 0x64006400u;  // fp16 1024 in both halves: mantissa bit 0 weighs 1
constexpr uint32_t MAGIC_HI = 0x54005400u;  // fp16 64: mantissa bit 4 weighs 1
#define NEG_INF (-__int_as_float(0x7f800000))  // -inf (a device intrinsic, not constexpr)

struct Params {
  const void* q;        // [B, Hq, 1, D] contiguous, qtype 0 fp16, 1 bf16, 2 fp32
  const uint8_t* kc;    // K codes [B, Hkv, Tcap, row bytes]
  const uint16_t* ks;   // K scale [B, Hkv, Tcap, NG] fp16 bits (int4), or unused
  const uint16_t* kz;   // K zero
  const uint8_t* vc;
  const uint16_t* vs;
  const uint16_t* vz;
  const float* khs;     // fp8: per-kv-head scale [Hkv] fp32 (K), or null
  const float* vhs;     // fp8: V
  long long k_cs, k_ss, v_cs, v_ss;  // per-(b, h) strides in elements of each buffer
  int qtype, T, Hkv, gqa, steps_per_split, nsplit;
  float qk_scale;       // log2(e) / sqrt(D)
  float* po;            // partials [B*Hq, nsplit, D], [B*Hq, nsplit] x2
  float* pm;
  float* pl;
};

// ---------------------------------------------------------------------------------
// small PTX helpers
// ---------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t hsub2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  uint32_t d;  // cvt.rn.f16x2.f32 d, a, b puts a in the upper half
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
// fp8 -> f16x2 conversions exist from sm_89 on; the loader refuses fp8 below that.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#define KVQ_NO_FP8_CVT 1
#endif
__device__ __forceinline__ uint32_t e4m3x2_lo(uint32_t w) {  // bytes 0, 1 -> half2
#ifdef KVQ_NO_FP8_CVT
  __trap();
  return w;
#else
  uint32_t d;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l; }" : "=r"(d) : "r"(w));
  return d;
#endif
}
__device__ __forceinline__ uint32_t e4m3x2_hi(uint32_t w) {  // bytes 2, 3 -> half2
#ifdef KVQ_NO_FP8_CVT
  __trap();
  return w;
#else
  uint32_t d;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h; }" : "=r"(d) : "r"(w));
  return d;
#endif
}
__device__ __forceinline__ uint32_t e5m2x2_lo(uint32_t w) {
#ifdef KVQ_NO_FP8_CVT
  __trap();
  return w;
#else
  uint32_t d;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e5m2x2 %0, l; }" : "=r"(d) : "r"(w));
  return d;
#endif
}
__device__ __forceinline__ uint32_t e5m2x2_hi(uint32_t w) {
#ifdef KVQ_NO_FP8_CVT
  __trap();
  return w;
#else
  uint32_t d;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e5m2x2 %0, h; }" : "=r"(d) : "r"(w));
  return d;
#endif
}
// 8x8 b16 transpose in the mma fragment layout (row lane/4, cols 2(lane%4), +1)
__device__ __forceinline__ uint32_t movtrans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The nibbles of x at bits 0-3 and 16-19 (HI: 4-7, 20-23) as an exact half2 (x0, x1):
// (x & MASK) | MAGIC in ONE lop3 (C code gives an AND and an OR), then minus the magic.
template <bool HI>
__device__ __forceinline__ uint32_t nibbles(uint32_t x) {
  uint32_t d;
  if constexpr (HI) asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(x), "n"(0x00F000F0u), "n"(MAGIC_HI));
  else asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(x), "n"(0x000F000Fu), "n"(MAGIC_LO));
  return hsub2(d, HI ? MAGIC_HI : MAGIC_LO);
}

template <int N>
__device__ __forceinline__ void load_words(uint32_t (&w)[N], const uint8_t* p, bool ok) {
  // N 32-bit words from p (aligned to min(16, 4N) bytes); zeros when !ok (not read)
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      uint4 x = make_uint4(0, 0, 0, 0);
      if (ok) x = __ldg(reinterpret_cast<const uint4*>(p) + i / 4);
      w[i] = x.x; w[i + 1] = x.y; w[i + 2] = x.z; w[i + 3] = x.w;
    }
  } else if constexpr (N == 2) {
    uint2 x = make_uint2(0, 0);
    if (ok) x = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = x.x; w[1] = x.y;
  } else {
    static_assert(N == 1, "load_words: 1, 2 or a multiple of 4 words");
    w[0] = ok ? __ldg(reinterpret_cast<const uint32_t*>(p)) : 0u;
  }
}
__device__ __forceinline__ uint32_t ldg_u16(const uint16_t* p, bool ok) {
  return ok ? static_cast<uint32_t>(__ldg(reinterpret_cast<const unsigned short*>(p))) : 0u;
}

// ---------------------------------------------------------------------------------
// formats: how a lane's bytes become mma A fragments
// ---------------------------------------------------------------------------------
// A format provides: ROWB (bytes per token row), KW / VW (32-bit words a lane loads
// per token for K / V), ZERO (int: an fp16 scale and zero per token and group of 32),
// kdim(kk, slot, half) (dim within the lane's K chunk of k-step kk, slot 0 = k 2c,
// 2c+1 / 1 = k 2c+8, 2c+9, half 0/1), kfrag, vpair. int4 elements decode as the
// Triton FAST path does: round16(x s + z), one rounding (kernels/triton_common.py).
template <int D>
struct Int4 {
  static constexpr int ROWB = D / 2, KW = D / 32, VW = D / 64, NG = D / 32;  // groups of 32
  static constexpr bool ZERO = true;
  __device__ static int kdim(int kk, int slot, int half) { return 8 * (kk >> 1) + 2 * (kk & 1) + slot + 4 * half; }
  // K: word kk/2 of the token; even k-steps the bytes 0, 2, odd ones (>> 8) bytes 1, 3;
  // slot 0 the low nibbles, slot 1 the high ones; s2, z2 = (s, s), (z, z) of the token
  __device__ static uint32_t kfrag(const uint32_t (&w)[KW], int kk, int slot, uint32_t s2, uint32_t z2) {
    uint32_t x = w[kk >> 1];
    if (kk & 1) x >>= 8;
    return hfma2(slot ? nibbles<true>(x) : nibbles<false>(x), s2, z2);
  }
  // V: m-tile mt takes dims 2mt (row g: low nibble) and 2mt+1 (row g+8: high) of tokens
  // a, b: interleave the two tokens' bytes (a.b0, a.b1, b.b0, b.b1) so each half holds
  // one token; s2, z2 = (s_a, s_b), (z_a, z_b)
  __device__ static void vpair(const uint32_t (&a)[VW], const uint32_t (&b)[VW], int mt, uint32_t s2,
                               uint32_t z2, uint32_t& row_g, uint32_t& row_g8) {
    uint32_t u = __byte_perm(a[mt >> 2], b[mt >> 2], (mt & 2) ? 0x7632 : 0x5410);
    if (mt & 1) u >>= 8;
    row_g = hfma2(nibbles<false>(u), s2, z2);
    row_g8 = hfma2(nibbles<true>(u), s2, z2);
  }
};

template <int D, bool E5>
struct Fp8 {
  static constexpr int ROWB = D, KW = D / 16, VW = D / 32, NG = 1;
  static constexpr bool ZERO = false;
  __device__ static int kdim(int kk, int slot, int half) { return 4 * kk + 2 * slot + half; }
  __device__ static uint32_t cvt_lo(uint32_t w) { return E5 ? e5m2x2_lo(w) : e4m3x2_lo(w); }
  __device__ static uint32_t cvt_hi(uint32_t w) { return E5 ? e5m2x2_hi(w) : e4m3x2_hi(w); }
  __device__ static uint32_t kfrag(const uint32_t (&w)[KW], int kk, int slot, uint32_t, uint32_t) {
    return slot ? cvt_hi(w[kk]) : cvt_lo(w[kk]);
  }
  __device__ static void vpair(const uint32_t (&a)[VW], const uint32_t (&b)[VW], int mt, uint32_t, uint32_t,
                               uint32_t& row_g, uint32_t& row_g8) {
    uint32_t u = __byte_perm(a[mt >> 1], b[mt >> 1], (mt & 1) ? 0x7362 : 0x5140);  // a.bi, b.bi, a.bj, b.bj
    row_g = cvt_lo(u);
    row_g8 = cvt_hi(u);
  }
};

// The bytes a lane holds for one 16-token tile.
template <class F>
struct Raw {
  uint32_t k[2][F::KW];  // tokens g, g+8
  uint32_t v[4][F::VW];  // tokens 2c, 2c+1, 2c+8, 2c+9
  uint32_t ks[2], kz[2], vs[4], vz[4];  // fp16 bits in the low half (int formats)
};

// A lane's pointers into the next tile to load (its first token t0 + g for K, t0 + 2c
// for V), advanced by whole warp strides: the other tokens of a tile are constant
// offsets, so a load costs no 64-bit address arithmetic. Groups of 32 (NG = D/32 per
// token row) are compile-time, so the scale offsets are immediates too.
template <class F>
struct Cursor {
  const uint8_t* k;
  const uint8_t* v;
  const uint16_t* ks;
  const uint16_t* kz;
  const uint16_t* vs;
  const uint16_t* vz;
  int t0;
};

template <class F, int NW>
__device__ __forceinline__ void load_tile(Raw<F>& r, Cursor<F>& cur, int tend, bool on, int g, int c) {
  constexpr int NG = F::NG;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const bool ok = on && cur.t0 + g + 8 * i < tend;
    load_words(r.k[i], cur.k + 8 * i * F::ROWB, ok);
    if constexpr (F::ZERO) {
      r.ks[i] = ldg_u16(cur.ks + 8 * i * NG, ok);
      r.kz[i] = ldg_u16(cur.kz + 8 * i * NG, ok);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int dt = (i & 1) + 8 * (i >> 1);
    const bool ok = on && cur.t0 + 2 * c + dt < tend;
    load_words(r.v[i], cur.v + dt * F::ROWB, ok);
    if constexpr (F::ZERO) {
      r.vs[i] = ldg_u16(cur.vs + dt * NG, ok);
      r.vz[i] = ldg_u16(cur.vz + dt * NG, ok);
    }
  }
  constexpr int STEP = NW * 16;  // tokens between a warp's tiles
  cur.t0 += STEP;
  cur.k += STEP * F::ROWB;
  cur.v += STEP * F::ROWB;
  if constexpr (F::ZERO) {
    cur.ks += STEP * NG; cur.kz += STEP * NG; cur.vs += STEP * NG; cur.vz += STEP * NG;
  }
}

// Q^T as B fragments of QK^T (k = this lane's permuted chunk of head dims, n = head g),
// scaled to base-2 scores and rounded to fp16.
template <class F, int D, typename QT>
__device__ __forceinline__ void load_q(const QT* q, long long row, bool real, float scale, int c,
                                       uint32_t (&qb)[D / 16][2]) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int slot = 0; slot < 2; ++slot) {
      float x[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = c * (D / 4) + F::kdim(kk, slot, half);
        float v = 0.f;
        if (real) {
          if constexpr (std::is_same<QT, float>::value) v = q[row * D + d];
          else if constexpr (std::is_same<QT, __half>::value) v = __half2float(q[row * D + d]);
          else v = __uint_as_float((uint32_t)q[row * D + d] << 16);  // bf16 bits
        }
        x[half] = v * scale;
      }
      qb[kk][slot] = pack_half2(x[0], x[1]);
    }
  }
}

// ---------------------------------------------------------------------------------
// the split kernel
// ---------------------------------------------------------------------------------
template <class F, int D, int NW, int STAGES, int MINB>
__global__ void __launch_bounds__(NW * 32, MINB) split_kernel(const Params p) {
  constexpr int KS = D / 16;  // k-steps of QK^T = m-tiles of PV
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int bh = blockIdx.x, sp = blockIdx.y;
  const int h = bh % p.Hkv;
  constexpr int NG = F::NG;
  const int vgrp = g * (D / 8) / 32;  // the group of this lane's V dims (int4)

  float qk = p.qk_scale;
  if (!F::ZERO && p.khs) qk *= p.khs[h];  // fp8: q . (s k8) = (s q) . k8
  uint32_t qb[KS][2];
  {
    const bool real = g < p.gqa;
    const long long row = (long long)bh * p.gqa + g;
    if (p.qtype == 0) load_q<F, D>(reinterpret_cast<const __half*>(p.q), row, real, qk, c, qb);
    else if (p.qtype == 1) load_q<F, D>(reinterpret_cast<const uint16_t*>(p.q), row, real, qk, c, qb);
    else load_q<F, D>(reinterpret_cast<const float*>(p.q), row, real, qk, c, qb);
  }

  float acc[KS][4];  // O^T: rows dims g D/8 + 2mt (+1 for c2, c3), cols heads 2c, 2c+1
#pragma unroll
  for (int i = 0; i < KS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

  const int nsteps = (p.T + 15) / 16;
  const int first = sp * p.steps_per_split;
  const int last = min(first + p.steps_per_split, nsteps);
  const int tend = p.T;

  Cursor<F> cur;  // at this warp's first tile
  {
    const int t0 = (first + warp) * 16;
    cur.t0 = t0;
    cur.k = p.kc + bh * p.k_cs + (long long)(t0 + g) * F::ROWB + c * (F::KW * 4);
    cur.v = p.vc + bh * p.v_cs + (long long)(t0 + 2 * c) * F::ROWB + g * (F::VW * 4);
    if constexpr (F::ZERO) {
      const long long ko = bh * p.k_ss + (long long)(t0 + g) * NG + c * (D / 4) / 32;
      const long long vo = bh * p.v_ss + (long long)(t0 + 2 * c) * NG;
      cur.ks = p.ks + ko; cur.kz = p.kz + ko;
      cur.vs = p.vs + vo + vgrp; cur.vz = p.vz + vo + vgrp;
    }
  }
  Raw<F> buf[STAGES];
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) load_tile<F, NW>(buf[i], cur, tend, first + warp + i * NW < last, g, c);
  for (int base = first + warp; base < last; base += STAGES * NW) {
#pragma unroll
    for (int i = 0; i < STAGES; ++i) {
      const int st = base + i * NW;
      // prefetch STAGES-1 tiles ahead (the cursor is there)
      load_tile<F, NW>(buf[(i + STAGES - 1) % STAGES], cur, tend, st + (STAGES - 1) * NW < last, g, c);
      if (st >= last) break;  // warp-uniform
      const Raw<F>& r = buf[i];
      const int t0 = st * 16;

      // ---- scores S^T (tokens g, g+8; heads 2c, 2c+1), base 2
      float s[4] = {0.f, 0.f, 0.f, 0.f};
      uint32_t ks2[2] = {0, 0}, kz2[2] = {0, 0};  // (s, s), (z, z) of tokens g, g+8
      if constexpr (F::ZERO) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          ks2[j] = __byte_perm(r.ks[j], 0, 0x1010);
          kz2[j] = __byte_perm(r.kz[j], 0, 0x1010);
        }
      }
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        mma16816(s, F::kfrag(r.k[0], kk, 0, ks2[0], kz2[0]), F::kfrag(r.k[1], kk, 0, ks2[1], kz2[1]),
                 F::kfrag(r.k[0], kk, 1, ks2[0], kz2[0]), F::kfrag(r.k[1], kk, 1, ks2[1], kz2[1]), qb[kk][0],
                 qb[kk][1]);
      }
      if (t0 + g >= tend) s[0] = s[1] = NEG_INF;
      if (t0 + g + 8 >= tend) s[2] = s[3] = NEG_INF;

      // ---- online softmax per head (2c + e); the max over the 16 tokens is over g
      float mx[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], o));
      }
      const bool grow = mx[0] > m[0] || mx[1] > m[1];
      if (__any_sync(0xffffffffu, grow)) {  // rescale only when some max grew (rare after the start)
        float alpha[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float mn = fmaxf(m[e], mx[e]);
          alpha[e] = (mn == NEG_INF) ? 1.f : exp2f(m[e] - mn);
          m[e] = mn;
          l[e] *= alpha[e];
        }
#pragma unroll
        for (int i = 0; i < KS; ++i) {
          acc[i][0] *= alpha[0]; acc[i][1] *= alpha[1]; acc[i][2] *= alpha[0]; acc[i][3] *= alpha[1];
        }
      }
      const float ms0 = m[0] == NEG_INF ? 0.f : m[0], ms1 = m[1] == NEG_INF ? 0.f : m[1];
      const float p0 = exp2f(s[0] - ms0), p1 = exp2f(s[1] - ms1), p2 = exp2f(s[2] - ms0), p3 = exp2f(s[3] - ms1);
      l[0] += p0 + p2;
      l[1] += p1 + p3;
      const uint32_t pb0 = movtrans(pack_half2(p0, p1));  // P^T: k = tokens 2c, 2c+1; n = head g
      const uint32_t pb1 = movtrans(pack_half2(p2, p3));  //      k = tokens 2c+8, 2c+9

      // ---- O^T += V^T P^T
      uint32_t vs2[2] = {0, 0}, vz2[2] = {0, 0};
      if constexpr (F::ZERO) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          vs2[j] = __byte_perm(r.vs[2 * j], r.vs[2 * j + 1], 0x5410);  // (s_t, s_t+1)
          vz2[j] = __byte_perm(r.vz[2 * j], r.vz[2 * j + 1], 0x5410);  // (z_t, z_t+1)
        }
      }
#pragma unroll
      for (int mt = 0; mt < KS; ++mt) {
        uint32_t a0, a1, a2, a3;
        F::vpair(r.v[0], r.v[1], mt, vs2[0], vz2[0], a0, a1);
        F::vpair(r.v[2], r.v[3], mt, vs2[1], vz2[1], a2, a3);
        mma16816(acc[mt], a0, a1, a2, a3, pb0, pb1);
      }
    }
  }

  // ---- the warp's sums over its tokens (l is per lane so far)
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) l[e] += __shfl_xor_sync(0xffffffffu, l[e], o);
  }

  // ---- merge the warps of the CTA in shared memory, write the partial
  __shared__ float red[NW][8][D];
  __shared__ float sm_m[NW][8], sm_l[NW][8];
  if (g == 0) {
    sm_m[warp][2 * c] = m[0]; sm_m[warp][2 * c + 1] = m[1];
    sm_l[warp][2 * c] = l[0]; sm_l[warp][2 * c + 1] = l[1];
  }
  __syncthreads();
  float outs = 1.f;
  if (!F::ZERO && p.vhs) outs = p.vhs[h];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int hd = 2 * c + e;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w][hd]);
    const float f = (m[e] == NEG_INF) ? 0.f : exp2f(m[e] - M) * outs;
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      const int d = g * (D / 8) + 2 * mt;
      red[warp][hd][d] = f * acc[mt][e];
      red[warp][hd][d + 1] = f * acc[mt][2 + e];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < p.gqa * D; idx += NW * 32) {
    const int hd = idx / D, d = idx % D;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) o += red[w][hd][d];
    const long long prow = ((long long)bh * p.gqa + hd) * p.nsplit + sp;
    p.po[prow * D + d] = o;
    if (d == 0) {
      float M = NEG_INF, L = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w][hd]);
#pragma unroll
      for (int w = 0; w < NW; ++w) L += (sm_m[w][hd] == NEG_INF) ? 0.f : sm_l[w][hd] * exp2f(sm_m[w][hd] - M);
      p.pm[prow] = M;
      p.pl[prow] = L;
    }
  }
}

// Merge the nsplit partials of each query row: one CTA per row, one thread per dim.
// The max over the splits is a block reduction and the weighted sum is unrolled by 8,
// so the loads of 8 splits are in flight together (GPU run 3: the first version, one
// dependent round trip per split, is the suspect for B=1's 53 us where the bytes take
// ~10 us: 132 splits per row there).
template <typename OutT>
__global__ void __launch_bounds__(128) combine_kernel(const float* __restrict__ po, const float* __restrict__ pm,
                                                      const float* __restrict__ pl, OutT* __restrict__ out,
                                                      int nsplit, int D) {
  __shared__ float wmax[4];
  const long long row = blockIdx.x;
  const int d = threadIdx.x;
  const float* pmr = pm + row * nsplit;
  const float* plr = pl + row * nsplit;
  const float* por = po + row * nsplit * D + d;
  float M = NEG_INF;
  for (int s = d; s < nsplit; s += blockDim.x) M = fmaxf(M, pmr[s]);
#pragma unroll
  for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  if ((d & 31) == 0) wmax[d >> 5] = M;
  __syncthreads();
  M = wmax[0];
  for (int i = 1; i < (int)(blockDim.x >> 5); ++i) M = fmaxf(M, wmax[i]);
  float num = 0.f, den = 0.f;
#pragma unroll 8
  for (int s = 0; s < nsplit; ++s) {
    const float ms = pmr[s];
    const float w = (ms == NEG_INF) ? 0.f : exp2f(ms - M);
    den += w * plr[s];
    num += w * por[(long long)s * D];
  }
  const float o = num / den;
  if constexpr (sizeof(OutT) == 4) out[row * D + d] = o;
  else if constexpr (std::is_same<OutT, __half>::value) out[row * D + d] = __float2half_rn(o);
  else {  // bf16 bits, round to nearest even
    const uint32_t u = __float_as_uint(o);
    out[row * D + d] = (OutT)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}

// Launch variants (timed in NOTES.md): register prefetch depth (stages: tiles loaded
// ahead + 1) and a minimum of resident CTAs per SM (a register cap, may spill).
constexpr int VARIANTS[][2] = {{2, 1}, {2, 4}, {3, 1}, {3, 3}};
constexpr int NVARIANTS = 4;

template <class F, int D>
const void* kernel_ptr(int variant) {
  switch (variant) {
    case 1: return (const void*)split_kernel<F, D, 4, VARIANTS[1][0], VARIANTS[1][1]>;
    case 2: return (const void*)split_kernel<F, D, 4, VARIANTS[2][0], VARIANTS[2][1]>;
    case 3: return (const void*)split_kernel<F, D, 4, VARIANTS[3][0], VARIANTS[3][1]>;
    default: return (const void*)split_kernel<F, D, 4, VARIANTS[0][0], VARIANTS[0][1]>;
  }
}

template <class F, int D>
int launch(const Params& p, int rows, void* out, int otype, int variant, cudaStream_t stream) {
  constexpr int NW = 4;
  const dim3 grid(rows, p.nsplit);
  switch (variant) {
    case 1: split_kernel<F, D, NW, VARIANTS[1][0], VARIANTS[1][1]><<<grid, NW * 32, 0, stream>>>(p); break;
    case 2: split_kernel<F, D, NW, VARIANTS[2][0], VARIANTS[2][1]><<<grid, NW * 32, 0, stream>>>(p); break;
    case 3: split_kernel<F, D, NW, VARIANTS[3][0], VARIANTS[3][1]><<<grid, NW * 32, 0, stream>>>(p); break;
    default: split_kernel<F, D, NW, VARIANTS[0][0], VARIANTS[0][1]><<<grid, NW * 32, 0, stream>>>(p); break;
  }
  const int rows_q = rows * p.gqa;
  if (otype == 0) combine_kernel<__half><<<rows_q, D, 0, stream>>>(p.po, p.pm, p.pl, (__half*)out, p.nsplit, D);
  else if (otype == 1) combine_kernel<uint16_t><<<rows_q, D, 0, stream>>>(p.po, p.pm, p.pl, (uint16_t*)out, p.nsplit, D);
  else combine_kernel<float><<<rows_q, D, 0, stream>>>(p.po, p.pm, p.pl, (float*)out, p.nsplit, D);
  return (int)cudaGetLastError();
}

template <class F, int D>
int regs_of(int variant) {
  cudaFuncAttributes a;
  const cudaError_t e = cudaFuncGetAttributes(&a, kernel_ptr<F, D>(variant));
  return e == cudaSuccess ? a.numRegs : -(int)e;
}

}  // namespace

// fmt: 0 int4 (groups of 32), 1 fp8 e4m3, 2 fp8 e5m2; variant: VARIANTS above.
// Returns a cudaError_t (0 = launched), or -1 for a head dim other than 64 / 128.
#define KVQ_DISPATCH(CALL, ARGS)                                       \
  if (D == 128) {                                                  \
    if (fmt == 0) return CALL<Int4<128>, 128> ARGS;                     \
    if (fmt == 1) return CALL<Fp8<128, false>, 128> ARGS;               \
    if (fmt == 2) return CALL<Fp8<128, true>, 128> ARGS;                \
  } else if (D == 64) {                                            \
    if (fmt == 0) return CALL<Int4<64>, 64> ARGS;                       \
    if (fmt == 1) return CALL<Fp8<64, false>, 64> ARGS;                 \
    if (fmt == 2) return CALL<Fp8<64, true>, 64> ARGS;                  \
  }                                                                \
  return -1;

extern "C" int kvq_decode(int fmt, int D, const void* q, int qtype, const void* kc, const void* ks, const void* kz,
                          const void* vc, const void* vs, const void* vz, const float* khs, const float* vhs,
                          long long k_cs, long long k_ss, long long v_cs, long long v_ss, int B, int Hkv, int gqa,
                          int T, int steps_per_split, int nsplit, float qk_scale, float* po, float* pm, float* pl,
                          void* out, int otype, int variant, void* stream) {
  Params p;
  p.q = q; p.qtype = qtype;
  p.kc = (const uint8_t*)kc; p.ks = (const uint16_t*)ks; p.kz = (const uint16_t*)kz;
  p.vc = (const uint8_t*)vc; p.vs = (const uint16_t*)vs; p.vz = (const uint16_t*)vz;
  p.khs = khs; p.vhs = vhs;
  p.k_cs = k_cs; p.k_ss = k_ss; p.v_cs = v_cs; p.v_ss = v_ss;
  p.T = T; p.Hkv = Hkv; p.gqa = gqa;
  p.steps_per_split = steps_per_split; p.nsplit = nsplit; p.qk_scale = qk_scale;
  p.po = po; p.pm = pm; p.pl = pl;
  const int rows = B * Hkv;
  cudaStream_t s = (cudaStream_t)stream;
  KVQ_DISPATCH(launch, (p, rows, out, otype, variant, s))
}

extern "C" int kvq_num_variants() { return NVARIANTS; }

// Registers per thread of an instance (the loader records them; NOTES.md quotes ptxas).
extern "C" int kvq_num_regs(int fmt, int D, int variant) { KVQ_DISPATCH(regs_of, (variant)) }
