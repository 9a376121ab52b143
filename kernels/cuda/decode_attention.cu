// Fused split-K decode attention over packed KV caches (int4 per-token groups, fp8),
// CUDA C++ with mma.sync from registers. Built at first use by kernels/cuda_decode.py
// (nvcc -> a shared library called through ctypes; no torch headers, so it builds in
// seconds). kernels/NOTES.md ("CUDA decode kernels") has the design and the figures.
//
// One CTA per (b * Hkv + h, split); NW warps; each warp takes 16-token tiles of the
// split round-robin, keeps its own online softmax, and the CTA merges its warps in
// shared memory into one partial (out, max, sum, base 2) per query row, which
// `combine_kernel` merges over the splits. Head dim 256: the warps work in pairs, each warp
// d = 128's code on its half of every row, the pair adding its partial scores before
// the softmax (split_kernel, common.cuh pair_add).
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

#include "common.cuh"

namespace {

// One source, two libraries (library.py FusedCombine): the default build launches each split
// kernel and then the combine (combine_kernel); built with -DKVQ_FUSED_COMBINE=1 every split
// kernel is its FUSED instance, whose last CTA of a row group merges the partials itself
// (common.cuh combine_rows), one launch a call. Separate builds keep the default library's
// kernels exactly as they were (the same SASS) and its build time.
#ifndef KVQ_FUSED_COMBINE
#define KVQ_FUSED_COMBINE 0
#endif
constexpr bool FUSED_BUILD = KVQ_FUSED_COMBINE != 0;


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
  // KIVI only: the fp16 windows [B, Hkv, Rcap, D] and their per-(b, h) strides; TQK / TQV
  // quantized tokens of K / V (whole groups of 32), the window rows follow
  const uint16_t* kr;
  const uint16_t* vr;
  long long k_rs, v_rs;
  int TQK, TQV;
  // this launch covers tokens [t_first, T) in 16-token tiles, its split sp writes partial
  // split0 + sp of nsplit (int4 / fp8: t_first = split0 = 0; KIVI: the quantized part and
  // the window tail are two launches into one workspace)
  int t_first, split0;
  // KIVI, one launch: splits [0, nsplit_tail) take the window tail [n_main, T) in
  // per_tail tiles each (KiviTail, direct loads), the others the quantized part
  // [0, n_main) in steps_per_split tiles each (KiviQ through the pipeline). The tail's
  // CTAs come first in the grid, so they run beside the first wave, not after the last.
  int n_main, per_tail, nsplit_tail;
  // KIVI with a device count (a graph view): each side's window policy (A, P), its
  // quantized tokens max(0, T - A) / P * P; TQK, TQV and n_main then come from the count
  int KA, KP, VA, VP;
  int qtype, T, Hkv, gqa, steps_per_split, nsplit;
  // log2 of the CTAs per kv row (library.py head_split): a GQA group over 8 q heads runs as 2
  // CTAs of gqa heads each, side by side in the grid (blockIdx.x = kv row * 2 + which half:
  // the second read of the kv row mostly hits L2); a shift, not a division, so that no
  // instance gains registers
  int qsh;
  // the valid token count on the device (null: T). T is then the capacity bound the grid
  // was sized for; the kernel reads min(*vlen, T) at run time, so one captured CUDA graph
  // serves every decode step (CTAs past it write an empty partial).
  const int* vlen;
  // a left-padded batch: null, or a device int32 per batch row, its first key position
  // (keys below it are masked: scores -inf; a row with none left gets 0)
  const int* rstart;
  float qk_scale;       // log2(e) / sqrt(D)
  float* po;            // partials [B*Hq, nsplit, D], [B*Hq, nsplit] x2
  float* pm;
  float* pl;
  // FUSED instances only (after the rest: the other fields keep their offsets): a counter per
  // row group (b * Hkv + h; zero between launches), the output [B*Hq, D] and its type
  // (0 fp16, 1 bf16 bits, 2 fp32)
  int* counters;
  void* out;
  int otype;
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
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// fp8 -> f16x2 conversions exist from sm_89 on; the loader refuses fp8 below that.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#define KVQ_NO_FP8_CVT 1
#endif
// Two fp8 (E5: e5m2, else e4m3) -> f16x2: bytes 0, 1 of w (HI: 2, 3). The format and the
// half are PTX text, so each case is its own asm string.
template <bool E5, bool HI>
__device__ __forceinline__ uint32_t fp8x2(uint32_t w) {
#ifdef KVQ_NO_FP8_CVT
  __trap();
  return w;
#else
  uint32_t d;
  if constexpr (E5 && HI) asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e5m2x2 %0, h; }" : "=r"(d) : "r"(w));
  else if constexpr (E5) asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e5m2x2 %0, l; }" : "=r"(d) : "r"(w));
  else if constexpr (HI) asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h; }" : "=r"(d) : "r"(w));
  else asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l; }" : "=r"(d) : "r"(w));
  return d;
#endif
}
// 8x8 b16 transpose in the mma fragment layout (row lane/4, cols 2(lane%4), +1)

// The nibbles of x at bits 0-3 and 16-19 (HI: 4-7, 20-23) as an exact half2 (x0, x1):
// (x & MASK) | MAGIC in ONE lop3 (C code gives an AND and an OR), then minus the magic.
template <bool HI>
__device__ __forceinline__ uint32_t nibbles(uint32_t x) {
  return hsub2(nibbles_magic<HI>(x), HI ? MAGIC_HI : MAGIC_LO);  // common.cuh
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
  static constexpr int DIM = D;  // the dims a warp takes (head dim 256: a pair's half, Int4<128>)
  static constexpr int ROWB = D / 2, KW = D / 32, VW = D / 64, NG = D / 32;  // groups of 32
  static_assert(D <= 128, "a lane's K chunk (D/4 dims) in one group of 32 (head dim 256: warp pairs of 128)");
  static constexpr bool ZERO = true;
  static constexpr int KIND = 0;  // token rows: Raw / load_tile / copy_tile (KIVI: 1, 2 below)
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
  static constexpr int DIM = D;
  static constexpr int ROWB = D, KW = D / 16, VW = D / 32, NG = 1;
  static constexpr bool ZERO = false;
  static constexpr int KIND = 0;
  __device__ static int kdim(int kk, int slot, int half) { return 4 * kk + 2 * slot + half; }
  __device__ static uint32_t cvt_lo(uint32_t w) { return fp8x2<E5, false>(w); }
  __device__ static uint32_t cvt_hi(uint32_t w) { return fp8x2<E5, true>(w); }
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
  // the K scale / zero of tokens g, g+8 as (s, s), (z, z); zeros for formats without
  __device__ __forceinline__ void k_pairs(uint32_t (&s2)[2], uint32_t (&z2)[2]) const {
    s2[0] = s2[1] = z2[0] = z2[1] = 0;
    if constexpr (F::ZERO) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        s2[j] = __byte_perm(ks[j], 0, 0x1010);
        z2[j] = __byte_perm(kz[j], 0, 0x1010);
      }
    }
  }
  // the V^T fragment of m-tile mt (tokens 2c, 2c+1 | 2c+8, 2c+9), with v_pairs' scales / zeros
  __device__ __forceinline__ void v_frag(int mt, const uint32_t (&s2)[2], const uint32_t (&z2)[2],
                                         uint32_t (&a)[4]) const {
    F::vpair(v[0], v[1], mt, s2[0], z2[0], a[0], a[1]);
    F::vpair(v[2], v[3], mt, s2[1], z2[1], a[2], a[3]);
  }
  // the V scale / zero of token pairs (2c, 2c+1), (2c+8, 2c+9) as (s_t, s_t+1), (z_t, z_t+1)
  __device__ __forceinline__ void v_pairs(uint32_t (&s2)[2], uint32_t (&z2)[2]) const {
    s2[0] = s2[1] = z2[0] = z2[1] = 0;
    if constexpr (F::ZERO) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        s2[j] = __byte_perm(vs[2 * j], vs[2 * j + 1], 0x5410);
        z2[j] = __byte_perm(vz[2 * j], vz[2 * j + 1], 0x5410);
      }
    }
  }
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
// times `scale` (1 at every call: the base-2 scale goes on the fp32 scores), rounded to
// fp16. hqmq_decode.cu has its own load_q with the dims of KIVI's kdim: one load_q in
// common.cuh for both (tried offline, the qtype switch with it) changed the code of
// nearly every kernel of both files (52 of 55 here, 22 of 25 there).
// D: this warp's dims, [D hf, D hf + D) of q's GD (head dim 256: a pair's half).
template <class F, int D, int GD = D, typename QT>
__device__ __forceinline__ void load_q(const QT* q, long long row, bool real, float scale, int c,
                                       uint32_t (&qb)[D / 16][2], int hf = 0) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int slot = 0; slot < 2; ++slot) {
      float x[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = D * hf + c * (D / 4) + F::kdim(kk, slot, half);
        float v = 0.f;
        if (real) {
          if constexpr (std::is_same<QT, float>::value) v = q[row * GD + d];
          else if constexpr (std::is_same<QT, __half>::value) v = __half2float(q[row * GD + d]);
          else v = __uint_as_float((uint32_t)q[row * GD + d] << 16);  // bf16 bits
        }
        x[half] = v * scale;
      }
      qb[kk][slot] = pack_half2(x[0], x[1]);
    }
  }
}

// ---------------------------------------------------------------------------------
// shared-memory pipeline (cp.async): each warp streams its own tiles through SMS
// stages of shared memory, SMS - 1 tiles in flight while it computes one, with no
// register cost (the register path holds every prefetched tile in registers: 28 per
// tile for int4). A tile's bytes are contiguous per buffer (16 token rows of codes,
// 16 x NG scales), so lanes copy 16-byte chunks of codes and one token's scales
// (NG*2 bytes) each; tokens >= T are zero-filled (src-size 0: nothing read), so the
// garbage past T in a store's capacity never reaches the mma.
// ---------------------------------------------------------------------------------
// Where chunk j (16 bytes) of token row t (0..15) of a tile lies in shared memory, in
// chunks: rows permuted / chunks XORed so that the fragment reads (K: lanes read
// tokens g, g+8 at chunk c; V: tokens 2c, 2c+1, 2c+8, 2c+9 at byte g*VW*4) hit
// distinct banks (64-byte rows: tokens 2c of one read land in both 64-byte halves).
template <int CPT>
__device__ __forceinline__ int swz(int t, int j) {
  if constexpr (CPT == 2) return 2 * (t ^ ((t >> 2) & 1)) + j;  // 32-byte rows
  else if constexpr (CPT == 4) return 4 * (t ^ ((t >> 1) & 1)) + j;  // 64-byte rows
  else return CPT * t + (j ^ ((2 * ((t >> 1) & 3) + (t & 1)) & (CPT - 1)));  // 128-byte rows
}

template <class F>
struct SmemTile {  // byte layout of one stage
  static constexpr int CPT = F::ROWB / 16;               // 16-byte chunks per token row
  static constexpr int CODES = 16 * F::ROWB;             // one tensor's codes
  static constexpr int SCL = F::ZERO ? 16 * F::NG * 2 : 0;  // one tensor's scales (or zeros)
  static constexpr int BYTES = 2 * CODES + 4 * SCL;       // K codes, V codes, ks, kz, vs, vz
  static constexpr int PER_LANE = 16 * CPT / 32;          // code chunks per lane per tensor
  static_assert(CPT >= 2 && PER_LANE >= 1, "rows of >= 32 bytes");
};

// A lane's global pointers for its copies of the next tile (chunk `lane` of each
// buffer; scales: lanes 0-15 copy ks / vs of token lane, lanes 16-31 kz / vz).
struct CpCursor {
  const uint8_t* k;
  const uint8_t* v;
  const uint16_t* sa;  // ks or kz
  const uint16_t* sb;  // vs or vz
  int t0;
};

// SPL = 2 (head dim 256): the stage holds this warp's half of each row; the global rows
// are SPL times longer (RowStream::init points the cursor at the half).
template <class F, int NW, int SPL = 1>
__device__ __forceinline__ void copy_tile(uint32_t stage, CpCursor& cur, int tend, bool on, int lane) {
  using S = SmemTile<F>;
  constexpr int CPT = S::CPT;
  constexpr int RSTEP = SPL == 1 ? 512 : (32 / CPT) * F::ROWB * SPL;  // global bytes between a lane's chunks
#pragma unroll
  for (int r = 0; r < S::PER_LANE; ++r) {
    const int i = lane + 32 * r, t = i / CPT, j = i % CPT;
    const bool ok = on && cur.t0 + t < tend;
    const uint32_t off = 16 * swz<CPT>(t, j);
    cp_async<16>(stage + off, cur.k + RSTEP * r, ok);
    cp_async<16>(stage + S::CODES + off, cur.v + RSTEP * r, ok);
  }
  if constexpr (F::ZERO) {
    constexpr int N = F::NG * 2;  // one token's scales
    const int t = lane & 15;
    const bool ok = on && cur.t0 + t < tend;
    const uint32_t off = 2 * S::CODES + (lane >> 4) * S::SCL + t * N;
    cp_async<N>(stage + off, cur.sa, ok);
    cp_async<N>(stage + off + 2 * S::SCL, cur.sb, ok);
  }
  constexpr int STEP = NW * 16;
  cur.t0 += STEP;
  cur.k += STEP * F::ROWB * SPL;
  cur.v += STEP * F::ROWB * SPL;
  if constexpr (F::ZERO) {
    cur.sa += STEP * F::NG * SPL;
    cur.sb += STEP * F::NG * SPL;
  }
}

// N words of token row t from byte `o` of the row (o aligned to min(16, 4N)).
template <int CPT, int N>
__device__ __forceinline__ void lds_row(uint32_t (&w)[N], const uint8_t* base, int t, int o) {
  if constexpr (N * 4 >= 16) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 x = *reinterpret_cast<const uint4*>(base + 16 * swz<CPT>(t, o / 16 + i));
      w[4 * i] = x.x; w[4 * i + 1] = x.y; w[4 * i + 2] = x.z; w[4 * i + 3] = x.w;
    }
  } else if constexpr (N == 2) {
    const uint2 x = *reinterpret_cast<const uint2*>(base + 16 * swz<CPT>(t, o / 16) + o % 16);
    w[0] = x.x; w[1] = x.y;
  } else {
    static_assert(N == 1, "lds_row: 1, 2 or a multiple of 4 words");
    w[0] = *reinterpret_cast<const uint32_t*>(base + 16 * swz<CPT>(t, o / 16) + o % 16);
  }
}

// The lane's Raw of a tile from its stage (the same words load_tile reads from global).
template <class F, int D>
__device__ __forceinline__ void read_stage(Raw<F>& r, const uint8_t* st, int g, int c) {
  using S = SmemTile<F>;
  constexpr int CPT = S::CPT;
#pragma unroll
  for (int i = 0; i < 2; ++i) lds_row<CPT>(r.k[i], st, g + 8 * i, c * F::KW * 4);
#pragma unroll
  for (int i = 0; i < 4; ++i) lds_row<CPT>(r.v[i], st + S::CODES, 2 * c + (i & 1) + 8 * (i >> 1), g * F::VW * 4);
  if constexpr (F::ZERO) {
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(st + 2 * S::CODES);
    constexpr int L = 16 * F::NG;  // fp16 per scale tensor
    const int kg = c * (D / 4) / 32, vg = g * (D / 8) / 32;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      r.ks[i] = sc[(g + 8 * i) * F::NG + kg];
      r.kz[i] = sc[L + (g + 8 * i) * F::NG + kg];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = 2 * c + (i & 1) + 8 * (i >> 1);
      r.vs[i] = sc[2 * L + t * F::NG + vg];
      r.vz[i] = sc[3 * L + t * F::NG + vg];
    }
  }
}

// The token-row formats' stream through the shared-memory pipeline (copy_tile /
// read_stage above); KIVI brings its own (KiviStream below). One pipeline loop in
// split_kernel drives either.
// GD: the head dim of the rows (D: this warp's dims; GD = 2 D: the warp takes half hf).
template <class F, int D, int NW, int GD = D>
struct RowStream {
  using RawT = Raw<F>;
  static constexpr int BYTES = SmemTile<F>::BYTES, TILES = 1;  // one 16-token tile per stage
  static constexpr int SPL = GD / D;
  CpCursor cur;
  __device__ __forceinline__ void init(const Params& p, int bh, int t0, int lane, int hf = 0) {
    constexpr int NG = F::NG;
    cur.t0 = t0;
    if constexpr (SPL == 1) {
      cur.k = p.kc + bh * p.k_cs + (long long)t0 * F::ROWB + 16 * lane;
      cur.v = p.vc + bh * p.v_cs + (long long)t0 * F::ROWB + 16 * lane;
    } else {  // chunk `lane` of the half tile: token lane / CPT, bytes ROWB hf + 16 (lane % CPT)
      constexpr int CPT = SmemTile<F>::CPT;
      const long long o = (long long)(t0 + lane / CPT) * (F::ROWB * SPL) + F::ROWB * hf + 16 * (lane % CPT);
      cur.k = p.kc + bh * p.k_cs + o;
      cur.v = p.vc + bh * p.v_cs + o;
    }
    if constexpr (F::ZERO) {
      const long long ko = bh * p.k_ss + (long long)(t0 + (lane & 15)) * (NG * SPL) + NG * hf;
      const long long vo = bh * p.v_ss + (long long)(t0 + (lane & 15)) * (NG * SPL) + NG * hf;
      cur.sa = (lane < 16 ? p.ks : p.kz) + ko;
      cur.sb = (lane < 16 ? p.vs : p.vz) + vo;
    }
  }
  __device__ __forceinline__ void copy(uint32_t stage, int tend, bool on, int lane) {
    copy_tile<F, NW, SPL>(stage, cur, tend, on, lane);
  }
  __device__ __forceinline__ static void read(RawT& r, const uint8_t* st, int g, int c, int) {
    read_stage<F, D>(r, st, g, c);
  }
};

// ---------------------------------------------------------------------------------
// KIVI (head dim 64 or 128 a warp, 256 as warp pairs; groups of G = 32; kernels/layout.py KIVIFlat): keys per CHANNEL
// over 32-token groups, codes packed along TOKENS ([group][dim][32 BITS / 8 bytes], token
// i of a group at bits [i BITS, (i+1) BITS)), fp16 scale / zero per (group, dim); values
// per token in groups of 32 dims (2 or 4 bits, rows like int4); then fp16 windows of K
// and V (different lengths allowed). Tokens [0, min(TQK, TQV)) -- both sides quantized,
// whole 16-token tiles -- are KiviQ through the cp.async pipeline; the rest (the window
// tail, usually < R + G tokens) is KiviTail, a second launch of the same kernel template
// with direct loads and a scalar decode, into the same workspace.
//
// K operand: the QK^T A fragment wants (one token, two dims) per register; a K code
// word holds 16 tokens of ONE dim (2 bits) or 8 (4 bits), so one PRMT takes the byte of
// the lane's tokens from the words of two dims (byte 0 <- dim d, byte 2 <- dim d+1) and
// the masks / magics of the int4 decode give (d, d+1) of one token (the V-side
// interleave of int4, transposed). The score ROWS are permuted so that both tokens of a
// lane share that byte: row g -> token row_tok(g), row g+8 -> row_tok(g) + 1 (2 bits:
// 4 (g>>1) + 2 (g&1), bit 4 (g&1) of byte g>>1; 4 bits: 2g, the nibbles of byte g).
// P^T's k index is the score row, so V is read at tokens row_tok(2c), row_tok(2c+1),
// row_tok(2c+8), row_tok(2c+9) = 4c, 4c+2, 4c+1, 4c+3. Contracted dims: lane c owns dims
// [32c, 32c+32), k-step kk the dims 4kk..4kk+3 (one 16-byte shared load of codes, 8
// bytes of scales and of zeros, as (s_d, s_d+1) pairs: no PRMT for scales).
// Per element: PRMT per 4, LOP3 + HSUB2 + HFMA2 per 2 (K and V): ~1.75 instructions.
// ---------------------------------------------------------------------------------
template <int P>  // 2-bit fields at bits P, P+16 (P <= 8) -> exact half2
__device__ __forceinline__ uint32_t crumbs(uint32_t x) {
  constexpr uint32_t M = 0x00030003u << P, MAG = (0x6400u - 0x400u * P) * 0x10001u;  // 2^(10-P)
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(x), "n"(M), "n"(MAG));
  return hsub2(d, MAG);
}
__device__ __forceinline__ uint32_t crumbs_r(uint32_t x, uint32_t m, uint32_t mag) {  // lane-dependent P
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(x), "r"(m), "r"(mag));
  return hsub2(d, mag);
}

// D: a warp's dims, 64 or 128 (head dim 256: warp pairs of 128). A lane c owns the D/4 dims
// [c D/4, (c+1) D/4) of K, a lane g the D/8 dims [g D/8, (g+1) D/8) of V, as at 128; what
// scales with D is the lane's number of k-steps / m-tiles (D/16) and the bytes it reads per
// token (VB: 2, 4 or 8).
template <int BITS_, int D_ = 128>
struct KiviQ {
  static constexpr int BITS = BITS_, KIND = 1, D = D_, DIM = D_, G = 32, NG = D / G;
  static constexpr bool ZERO = true;
  static_assert(BITS == 2 || BITS == 4, "KIVI: 2 or 4 bits");
  static_assert(D == 64 || D == 128, "KIVI: a warp's 64 or 128 dims");
  static constexpr int GB = G * BITS / 8;   // K bytes per (group, dim)
  static constexpr int KPL = BITS / 2;      // K words per dim per 16-token tile ("planes")
  static constexpr int DL = D / 4;          // K dims of a lane c (one block of a plane)
  static constexpr int KBLK = 4 * DL + 16;  // one plane's DL dims + 16 B: lanes c hit other banks (144 at 128)
  static constexpr int SBLK = 2 * DL + 16;  // DL dims of fp16 scales + 16 B (80 at 128)
  static constexpr int RB = D * BITS / 8, CPT = RB / 16;  // V row bytes, 16-byte chunks per row
  static constexpr int VB = RB / 8, VW = (VB + 3) / 4;    // V bytes / 32-bit words of a lane's D/8 dims
  static constexpr int VSH = D == 64 ? 2 : 1;  // lane g's V dims lie in scale group g >> VSH
  // VB bytes of a lane's V dims at p (aligned to VB) into v (zero-extended when VB = 2)
  __device__ __forceinline__ static void ld_v(uint32_t (&v)[VW], const uint8_t* p) {
    if constexpr (VB == 8) {
      const uint2 x = *reinterpret_cast<const uint2*>(p);
      v[0] = x.x;
      v[1] = x.y;
    } else if constexpr (VB == 4) {
      v[0] = *reinterpret_cast<const uint32_t*>(p);
    } else {
      v[0] = *reinterpret_cast<const uint16_t*>(p);
    }
  }
  __device__ static int kdim(int kk, int slot, int half) { return 4 * kk + 2 * slot + half; }
  __device__ static int row_tok(int r) {
    const int b = r & 7;
    return (BITS == 2 ? 4 * (b >> 1) + 2 * (b & 1) : 2 * b) + (r >> 3);
  }
  // V rows in a stage: row t at vrow(t) (the 4 rows 4c + x a read takes land in 4 bank
  // groups), 16-byte chunk j at vchunk (64-byte rows: halves c < 2 / c >= 2 swapped)
  __device__ static int vrow(int t) { return (t & ~3) | ((t & 3) ^ ((t >> 2) & 3)); }
  __device__ static int vchunk(int t, int j) { return BITS == 4 && RB >= 64 ? j ^ (2 * ((t >> 3) & 1)) : j; }
  struct Raw {
    const uint8_t* kb;  // the lane's K codes in the stage (its plane, dims 32c..)
    const uint8_t* sb;  // its K scales (zeros at + 4 SBLK)
    uint32_t sel;       // PRMT: byte of the lane's tokens of dim d -> byte 0, of dim d+1 -> byte 2
    uint32_t ma, mga, mb, mgb;  // 2 bits: masks / magics of rows g, g+8
    uint32_t v[4][VW];
    uint32_t vs2[2], vz2[2];
  };
  // four tokens' fp16 V scales / zeros (low halves of s, z) as half2 pairs: tokens 0,1 and 2,3
  __device__ __forceinline__ static void pair_scales(Raw& r, const uint32_t (&s)[4], const uint32_t (&z)[4]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      r.vs2[j] = __byte_perm(s[2 * j], s[2 * j + 1], 0x5410);
      r.vz2[j] = __byte_perm(z[2 * j], z[2 * j + 1], 0x5410);
    }
  }
  // The rest of a stage read (KiviStream, KiviTileStream; r.kb, r.sb set): the lane's K
  // byte selector (and 2-bit masks / magics of rows g, g+8), its V words of the 16-row V
  // block vb (rows at vrow / vchunk) and their V scales / zeros (vs, vz: NG per row) as pairs.
  __device__ __forceinline__ static void read_rest(Raw& r, const uint8_t* vb, const uint16_t* vs, const uint16_t* vz,
                                                   int g, int c) {
    const int byte = BITS == 4 ? g & 3 : g >> 1;
    r.sel = byte | ((4 + byte) << 8);
    if constexpr (BITS == 2) {
      const int P = 4 * (g & 1);
      r.ma = 0x00030003u << P;
      r.mb = 0x00030003u << (P + 2);
      r.mga = (0x6400u - 0x400u * P) * 0x10001u;
      r.mgb = (0x6400u - 0x400u * (P + 2)) * 0x10001u;
    }
    uint32_t s[4], z[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = row_tok(2 * c + (i & 1) + 8 * (i >> 1));
      const int o = g * VB;  // byte of the lane's D/8 dims in the row
      const uint8_t* row = vb + RB * vrow(t) + 16 * vchunk(t, o / 16) + o % 16;
      ld_v(r.v[i], row);
      s[i] = vs[t * NG + (g >> VSH)];
      z[i] = vz[t * NG + (g >> VSH)];
    }
    pair_scales(r, s, z);
  }
  // k-step kk of both tiles of a group (the fused variants): one load of the dims'
  // scales and zeros for both; kb1 = tile 1's codes (r's the tile-0 ones)
  __device__ static void kstep2(const Raw& r, const uint8_t* kb1, int kk, uint32_t (&a)[4], uint32_t (&b)[4]) {
    const uint4 w = *reinterpret_cast<const uint4*>(r.kb + 16 * kk);
    const uint4 w1 = *reinterpret_cast<const uint4*>(kb1 + 16 * kk);
    const uint2 s = *reinterpret_cast<const uint2*>(r.sb + 8 * kk);
    const uint2 z = *reinterpret_cast<const uint2*>(r.sb + 4 * SBLK + 8 * kk);
    kdec(r, w, s, z, a);
    kdec(r, w1, s, z, b);
  }
  __device__ static void kdec(const Raw& r, const uint4 w, const uint2 s, const uint2 z, uint32_t (&a)[4]) {
    const uint32_t x01 = __byte_perm(w.x, w.y, r.sel), x23 = __byte_perm(w.z, w.w, r.sel);
    if constexpr (BITS == 4) {
      a[0] = hfma2(nibbles<false>(x01), s.x, z.x);
      a[1] = hfma2(nibbles<true>(x01), s.x, z.x);
      a[2] = hfma2(nibbles<false>(x23), s.y, z.y);
      a[3] = hfma2(nibbles<true>(x23), s.y, z.y);
    } else {
      a[0] = hfma2(crumbs_r(x01, r.ma, r.mga), s.x, z.x);
      a[1] = hfma2(crumbs_r(x01, r.mb, r.mgb), s.x, z.x);
      a[2] = hfma2(crumbs_r(x23, r.ma, r.mga), s.y, z.y);
      a[3] = hfma2(crumbs_r(x23, r.mb, r.mgb), s.y, z.y);
    }
  }
  // The lane-byte map of a group (KIVI-2, variant 12; kernels/NOTES.md "KIVI-2 variants
  // prepared offline"): lane (g, c) takes the 4 tokens of byte g & 3 of plane g >> 2 --
  // tokens 4g .. 4g+3 of the group -- for BOTH tiles: tile h row g = crumb 2h (bits 4h),
  // row g+8 = crumb 2h+1. So every lane decodes the same bit positions (immediate masks,
  // no lane registers) and one LDS.128 + 2 PRMT per k-step serve both tiles.
  // Score row r of tile h is token lb_tok(h, r) of the group; V rows sit at lb_vrow(t)
  // (the 4 rows 8c + k of a read land in 4 bank groups).
  __device__ static int lb_tok(int h, int r) { return 4 * (r & 7) + 2 * h + (r >> 3); }
  __device__ static int lb_vrow(int t) { return t ^ ((t >> 3) & 3); }
  // V words, scales and zeros of tile h in the lane-byte map (vb: the group's 32 V rows,
  // vs / vz: its V scales / zeros, NG per token)
  __device__ static void read_v_lb(Raw& r, const uint8_t* vb, const uint16_t* vs, const uint16_t* vz, int g, int c,
                                   int h) {
    static_assert(BITS == 2, "the lane-byte map is KIVI-2's");
    uint32_t s[4], z[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = lb_tok(h, 2 * c + (i & 1) + 8 * (i >> 1));
      ld_v(r.v[i], vb + RB * lb_vrow(t) + VB * g);
      s[i] = vs[t * NG + (g >> VSH)];
      z[i] = vz[t * NG + (g >> VSH)];
    }
    pair_scales(r, s, z);
  }
  __device__ static void kstep(const Raw& r, int kk, uint32_t (&a)[4]) {
    const uint4 w = *reinterpret_cast<const uint4*>(r.kb + 16 * kk);        // dims 4kk..4kk+3
    const uint2 s = *reinterpret_cast<const uint2*>(r.sb + 8 * kk);         // (s0, s1), (s2, s3)
    const uint2 z = *reinterpret_cast<const uint2*>(r.sb + 4 * SBLK + 8 * kk);
    kdec(r, w, s, z, a);
  }
  // V^T: m-tile mt = dims 2mt (row g) and 2mt+1 (row g+8) of the lane's 16 dims, of
  // tokens (v[0], v[1]) -> a0, a1 and (v[2], v[3]) -> a2, a3
  __device__ static void vpair2(uint32_t x, uint32_t y, int mt, uint32_t s2, uint32_t z2, uint32_t& rg,
                                uint32_t& rg8) {
    const int j = mt >> 1;  // the byte of dims 2mt, 2mt+1 (bits 4mt .. 4mt+3)
    const uint32_t u = __byte_perm(x, y, j | ((4 + j) << 8));
    if (mt & 1) {
      rg = hfma2(crumbs<4>(u), s2, z2);
      rg8 = hfma2(crumbs<6>(u), s2, z2);
    } else {
      rg = hfma2(crumbs<0>(u), s2, z2);
      rg8 = hfma2(crumbs<2>(u), s2, z2);
    }
  }
  __device__ static void vstep(const Raw& r, int mt, uint32_t (&a)[4]) {
    if constexpr (BITS == 4) {
      Int4<D>::vpair(r.v[0], r.v[1], mt, r.vs2[0], r.vz2[0], a[0], a[1]);
      Int4<D>::vpair(r.v[2], r.v[3], mt, r.vs2[1], r.vz2[1], a[2], a[3]);
    } else {
      vpair2(r.v[0][0], r.v[1][0], mt, r.vs2[0], r.vz2[0], a[0], a[1]);
      vpair2(r.v[2][0], r.v[3][0], mt, r.vs2[1], r.vz2[1], a[2], a[3]);
    }
  }
};

// KIVI's stream through the pipeline: a stage holds one whole 32-token group (two
// tiles, read one after the other), so every copy is coalesced and the group's K scales
// and zeros are copied once. (Before GPU run 17 a stage held one 16-token tile, the
// warps of a CTA took the two halves of a group, and each copied its half of the K codes
// -- every other 4 or 8 bytes of the group's rows, 8-16 sectors per 128 useful bytes --
// and the group's 512 B of K scales and zeros again.)
// Stage layout: K codes as [plane][4 blocks of 32 dims, KBLK][dim], a plane = one 32-bit
// word per dim (2 bits: 16 tokens, planes 0/1 = tiles 0/1; 4 bits: 8 tokens, planes
// 2h, 2h+1 = tile h), plane stride PLS chosen so that the copies' 32 lanes (consecutive
// words of the global rows: (dim, plane) pairs) hit 32 banks; K scales / zeros as before
// (SBLK per 32 dims); V rows of tile h as a 16-row block at VC + h 16 RB (KiviQ::vrow /
// vchunk); the group's 32 tokens' V scales then zeros (NG fp16 per token).
// VL = 1 (KIVI-2 lane-byte map, variant 12): the group's 32 V rows as one block,
// token t at row KiviQ::lb_vrow(t).
// SZ = 1 (variant 12): K zeros and scales interleaved per k-step as (z01, s01, z23,
// s23) (z01 = the zeros of dims 4kk, 4kk+1 of the lane's chunk, ...), KSB bytes per 32
// dims, so one LDS.128 (kszq) gives a k-step's scales and zeros (laid out for the folded
// zero point's extra mma, variants 10 / 11, removed; variant 12 reads them as pairs).
// Copied as 4-byte cp.async (4 per lane).
// GD: the head dim of the cache (D_: this warp's dims; GD = 2 D_: the warp takes half hf of
// every group's K dims, V rows and scales; the stage is d = D_'s).
template <int BITS, int NW, int VL_ = 0, int SZ_ = 0, int D_ = 128, int GD = D_>
struct KiviStream {
  using F = KiviQ<BITS, D_>;
  using RawT = typename F::Raw;
  static constexpr int VL = VL_, SZ = SZ_, SPL = GD / D_;
  static constexpr int D = F::D, NG = F::NG, GB = F::GB, RB = F::RB, KBLK = F::KBLK, SBLK = F::SBLK, DL = F::DL;
  static constexpr int PLANES = 2 * F::KPL, PLS = 4 * KBLK + (BITS == 4 ? 32 : 0);
  static constexpr int KSB = 4 * DL + 16;  // SZ: DL dims of (z, s) pairs + 16 B: the 4 lanes c of a read hit other banks
  static constexpr int KSO = PLANES * PLS, KZO = KSO + 4 * SBLK, VC = SZ ? KSO + 4 * KSB : KZO + 4 * SBLK;
  static constexpr int VSO = VC + 32 * RB, VZO = VSO + 32 * NG * 2, BYTES = VZO + 32 * NG * 2;
  static constexpr int TILES = 2;             // 16-token tiles per stage
  static constexpr int RUNS = D * GB / 128;   // 128-byte runs of the group's K codes
  static constexpr int VCH = RB / 16;         // V 16-byte chunks per lane
  static_assert(KSO % 16 == 0 && VC % 16 == 0 && VSO % 16 == 0 && BYTES % 16 == 0, "16-byte aligned blocks");
  const uint8_t* k;     // K codes: word `lane` of the group's first run
  const uint16_t* ksz;  // lanes 0-15: 8 K scales (dims 8 lane..), 16-31: 8 K zeros
  const uint8_t* v;     // V codes: chunk `lane` of the group's rows
  const uint16_t* vsz;  // lanes 0-15: V scales of tokens 2 lane, 2 lane + 1; 16-31: their zeros
  int t0;
  uint32_t kdst;        // the lane's K word in a stage, run 0
  __device__ __forceinline__ void init(const Params& p, int bh, int t0_, int lane, int hf = 0) {
    t0 = t0_;  // a multiple of 32: the warp's units are whole groups
    const long long grp = t0 >> 5;
    if constexpr (SPL == 1) {
      k = p.kc + bh * p.k_cs + grp * (D * GB) + 4 * lane;
      ksz = (lane < 16 ? p.ks : p.kz) + bh * p.k_ss + grp * D + (SZ ? 2 : 8) * (lane & 15);
      v = p.vc + bh * p.v_cs + (long long)t0 * RB + 16 * lane;
      vsz = (lane < 16 ? p.vs : p.vz) + bh * p.v_ss + (long long)(t0 + 2 * (lane & 15)) * NG;
    } else {  // the half: K dims [D hf, D hf + D) of the group, V row bytes [RB hf, RB hf + RB)
      constexpr int CPR = RB / 16;  // a half row's 16-byte chunks
      k = p.kc + bh * p.k_cs + grp * (GD * GB) + hf * (D * GB) + 4 * lane;
      ksz = (lane < 16 ? p.ks : p.kz) + bh * p.k_ss + grp * GD + hf * D + (SZ ? 2 : 8) * (lane & 15);
      v = p.vc + bh * p.v_cs + (long long)(t0 + lane / CPR) * (RB * SPL) + RB * hf + 16 * (lane % CPR);
      vsz = (lane < 16 ? p.vs : p.vz) + bh * p.v_ss + (long long)(t0 + 2 * (lane & 15)) * (NG * SPL) + NG * hf;
    }
    // word `lane` of a run: 2 bits dim 16 r + lane / 2, plane lane % 2; 4 bits dim 8 r + lane / 4, plane lane % 4
    constexpr int WPD = GB / 4;  // words per dim
    kdst = (lane % WPD) * PLS + 4 * (lane / WPD);
  }
  __device__ __forceinline__ void copy(uint32_t stage, int tend, bool on, int lane) {
    constexpr int DPR = 128 / GB;  // dims per run
#pragma unroll
    for (int r = 0; r < RUNS; ++r) {
      const int d0 = DPR * r;  // the run's first dim: block d0 / DL, column d0 % DL
      cp_async<4>(stage + kdst + (d0 / DL) * KBLK + 4 * (d0 % DL), k + 128 * r, on);
    }
    if constexpr (SZ && D == 128) {
      // copy j: word (lane & 15) + 16 j of the scales (lanes 0-15) / zeros (16-31) = the
      // dims 2w, 2w+1 of block j: k-step (lane & 15) / 2, pair lane & 1; scales at words 1, 3
      const int o = 16 * ((lane & 15) >> 1) + 4 * (2 * (lane & 1) + (lane < 16 ? 1 : 0));
#pragma unroll
      for (int j = 0; j < 4; ++j) cp_async<4>(stage + KSO + j * KSB + o, ksz + 32 * j, on);
    } else if constexpr (SZ) {
      // as at 128, over D / 2 words per tensor: word w = (lane & 15) + 16 j lies in block
      // w / (DL / 2) at k-step (w % (DL / 2)) / 2
#pragma unroll
      for (int j = 0; j < D / 32; ++j) {
        const int w = (lane & 15) + 16 * j, b = w / (DL / 2), wb = w % (DL / 2);
        cp_async<4>(stage + KSO + b * KSB + 16 * (wb >> 1) + 4 * (2 * (wb & 1) + (lane < 16 ? 1 : 0)), ksz + 32 * j,
                    on);
      }
    } else if constexpr (D == 128) {
      cp_async<16>(stage + (lane < 16 ? KSO : KZO) + SBLK * ((lane & 15) >> 2) + 16 * (lane & 3), ksz, on);
    } else {
      // 16-byte pieces p = (lane & 15) + 16 j (dims 8p ..) of D / 8 per tensor: block 8p / DL
#pragma unroll
      for (int j = 0; j < (D / 8 + 15) / 16; ++j) {
        const int pc = (lane & 15) + 16 * j;
        if (pc < D / 8)
          cp_async<16>(stage + (lane < 16 ? KSO : KZO) + SBLK * (8 * pc / DL) + 2 * (8 * pc % DL), ksz + 128 * j, on);
      }
    }
    constexpr int VSTEP = SPL == 1 ? 512 : (32 / (RB / 16)) * RB * SPL;  // global bytes between a lane's chunks
#pragma unroll
    for (int r = 0; r < VCH; ++r) {  // 32 rows x 2 VCH chunks
      const int i = lane + 32 * r, t = i / (RB / 16), j = i % (RB / 16), h = t >> 4, tt = t & 15;
      const bool ok = on && t0 + t < tend;
      const int dst = VL ? RB * F::lb_vrow(t) + 16 * j : h * 16 * RB + RB * F::vrow(tt) + 16 * F::vchunk(tt, j);
      cp_async<16>(stage + VC + dst, v + VSTEP * r, ok);
    }
    {
      constexpr int VSB = 4 * NG;  // bytes of the two tokens' V scales a lane copies
      const bool ok = on && t0 + 2 * (lane & 15) < tend;
      if constexpr (SPL == 2) {  // the two tokens' halves lie a row apart
        cp_async<2 * NG>(stage + (lane < 16 ? VSO : VZO) + VSB * (lane & 15), vsz, ok);
        cp_async<2 * NG>(stage + (lane < 16 ? VSO : VZO) + VSB * (lane & 15) + 2 * NG, vsz + NG * SPL, ok);
      } else {
        cp_async<VSB>(stage + (lane < 16 ? VSO : VZO) + VSB * (lane & 15), vsz, ok);
      }
    }
    constexpr int STEP = NW * 32;  // tokens between a warp's groups
    t0 += STEP;
    k += NW * (GD * GB);
    ksz += NW * GD;
    v += STEP * RB * SPL;
    vsz += STEP * NG * SPL;
  }
  // SZ: k-step kk's (z01, s01, z23, s23) of lane c's dims
  __device__ __forceinline__ static uint4 kszq(const uint8_t* st, int c, int kk) {
    static_assert(SZ, "the interleaved scale layout");
    return *reinterpret_cast<const uint4*>(st + KSO + c * KSB + 16 * kk);
  }
  // the lane's K codes of tile h in a stage
  __device__ __forceinline__ static const uint8_t* kb_of(const uint8_t* st, int g, int c, int h) {
    return st + (F::KPL * h + (BITS == 4 ? g >> 2 : 0)) * PLS + c * KBLK;
  }
  // tile h (0, 1) of the stage's group
  __device__ __forceinline__ static void read(RawT& r, const uint8_t* st, int g, int c, int h) {
    r.kb = kb_of(st, g, c, h);
    r.sb = st + KSO + c * SBLK;
    F::read_rest(r, st + VC + h * 16 * RB, reinterpret_cast<const uint16_t*>(st + VSO) + 16 * NG * h,
                 reinterpret_cast<const uint16_t*>(st + VZO) + 16 * NG * h, g, c);
  }
};

// The stream of KIVI variants 5, 6 (run 16's, kept beside the group stream to compare
// in one GPU run): a stage holds one 16-token tile; the warps of a CTA take the two
// halves of a group, so each copies every other 4 bytes (2 bits: 8) of the group's K
// rows and the group's K scales / zeros again.
template <int BITS, int NW>
struct KiviTileStream {
  using F = KiviQ<BITS>;
  using RawT = typename F::Raw;
  static constexpr int KSO = F::KPL * 4 * F::KBLK, KZO = KSO + 4 * F::SBLK, VC = KZO + 4 * F::SBLK;
  static constexpr int VSO = VC + 16 * F::RB, VZO = VSO + 16 * F::NG * 2, BYTES = VZO + 16 * F::NG * 2;
  static constexpr int TILES = 1;
  const uint8_t* k;     // K codes of the lane's dim `lane` in the tile's group, at the tile's half
  const uint16_t* ksz;  // lanes 0-15: 8 K scales (dims 8 lane..), 16-31: 8 K zeros
  const uint8_t* v;     // V codes: chunk `lane` of the tile
  const uint16_t* vsz;  // lanes 0-15: V scales of token lane, 16-31: V zeros
  int t0;
  __device__ __forceinline__ void init(const Params& p, int bh, int t0_, int lane) {
    t0 = t0_;  // a multiple of 16; the warp's tiles keep its parity in the group (NW * 16 = 2 groups)
    const long long grp = t0 >> 5;
    k = p.kc + bh * p.k_cs + grp * (F::D * F::GB) + ((t0 >> 4) & 1) * (F::GB / 2) + lane * F::GB;
    ksz = (lane < 16 ? p.ks : p.kz) + bh * p.k_ss + grp * F::D + 8 * (lane & 15);
    v = p.vc + bh * p.v_cs + (long long)t0 * F::RB + 16 * lane;
    vsz = (lane < 16 ? p.vs : p.vz) + bh * p.v_ss + (long long)(t0 + (lane & 15)) * F::NG;
  }
  __device__ __forceinline__ void init(const Params& p, int bh, int t0_, int lane, int) { init(p, bh, t0_, lane); }
  __device__ __forceinline__ void copy(uint32_t stage, int tend, bool on, int lane) {
    // K codes: dim lane + 32 i, word w of the half group -> plane w, block i (4-byte copies)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int w = 0; w < F::KPL; ++w)
        cp_async<4>(stage + w * 4 * F::KBLK + i * F::KBLK + 4 * lane, k + 32 * i * F::GB + 4 * w, on);
    }
    cp_async<16>(stage + (lane < 16 ? KSO : KZO) + F::SBLK * ((lane & 15) >> 2) + 16 * (lane & 3), ksz, on);
#pragma unroll
    for (int r = 0; r < F::VW; ++r) {  // 16 rows x CPT chunks = 32 VW chunks
      const int i = lane + 32 * r, t = i / F::CPT, j = i % F::CPT;
      const bool ok = on && t0 + t < tend;
      cp_async<16>(stage + VC + F::RB * F::vrow(t) + 16 * F::vchunk(t, j), v + 512 * r, ok);
    }
    cp_async<F::NG * 2>(stage + (lane < 16 ? VSO : VZO) + F::NG * 2 * (lane & 15), vsz,
                        on && t0 + (lane & 15) < tend);
    constexpr int STEP = NW * 16;
    static_assert(STEP % 32 == 0, "a warp's tiles keep their half of the group");
    t0 += STEP;
    k += (STEP / 32) * F::D * F::GB;
    ksz += (STEP / 32) * F::D;
    v += STEP * F::RB;
    vsz += STEP * F::NG;
  }
  __device__ __forceinline__ static void read(RawT& r, const uint8_t* st, int g, int c, int) {
    const int plane = BITS == 4 ? g >> 2 : 0;
    r.kb = st + plane * 4 * F::KBLK + c * F::KBLK;
    r.sb = st + KSO + c * F::SBLK;
    F::read_rest(r, st + VC, reinterpret_cast<const uint16_t*>(st + VSO), reinterpret_cast<const uint16_t*>(st + VZO),
                 g, c);
  }
};


// The KIVI tail: tokens [min(TQK, TQV), T) of each row, K and V each from its quantized
// groups or its fp16 window (a 16-token tile lies in one of them: TQK, TQV are whole
// groups). Direct global loads, scalar decode of quantized elements (round16(x s + z),
// as the main path), zeros past T. Score rows are tokens as they are. A branch of the
// KIVI kernel (its first splits), so it holds little across the tile: K and V are read
// where the mma wants them (kstep / vstep), from per-row base pointers (before run 17
// the tile's V was decoded up front into 32 registers: 136 per thread, which in the
// shared kernel would have cost the quantized path a CTA per SM).
// GD: the cache's head dim (D_: this warp's dims, [d0, d0 + D_) of GD; GD = 2 D_: a pair's half)
template <int BITS_, int D_ = 128, int GD = D_>
struct KiviTail {
  static constexpr int GNG = GD / 32, GRB = GD * BITS_ / 8;
  static constexpr int BITS = BITS_, KIND = 2, D = D_, G = 32, NG = D / G, GB = G * BITS / 8, RB = D * BITS / 8;
  static constexpr bool ZERO = true;
  __device__ static int kdim(int kk, int slot, int half) { return 4 * kk + 2 * slot + half; }
  __device__ static int row_tok(int r) { return r; }
  struct Raw {
    const uint8_t* kc;    // K codes / scale / zero / window of the row (b, h)
    const uint16_t* ks;
    const uint16_t* kz;
    const uint16_t* kr;
    const uint8_t* vc;    // V likewise
    const uint16_t* vs;
    const uint16_t* vz;
    const uint16_t* vr;
    int t0, TQK, TQV, T, c, g;
  };
  __device__ static uint32_t kq2(const Raw& r, int t, int d) {  // quantized K (t, d), (t, d+1)
    const int gi = t >> 5, w = t & 31;
    __half h[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const long long o = (long long)gi * GD + d + e;
      const uint32_t code = (r.kc[o * GB + ((w * BITS) >> 3)] >> ((w * BITS) & 7)) & ((1u << BITS) - 1);
      h[e] = __hfma(__ushort2half_rn((unsigned short)code), __ushort_as_half(r.ks[o]), __ushort_as_half(r.kz[o]));
    }
    return (uint32_t)__half_as_ushort(h[0]) | ((uint32_t)__half_as_ushort(h[1]) << 16);
  }
  __device__ static void kstep(const Raw& r, int kk, uint32_t (&a)[4]) {
    const int d = r.c * (D / 4) + 4 * kk;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int t = r.t0 + r.g + 8 * i;
      uint32_t lo = 0, hi = 0;
      if (t < r.TQK) {
        lo = kq2(r, t, d);
        hi = kq2(r, t, d + 2);
      } else if (t < r.T) {
        const uint2 x = *reinterpret_cast<const uint2*>(r.kr + (long long)(t - r.TQK) * GD + d);
        lo = x.x;
        hi = x.y;
      }
      a[i] = lo;      // a0 / a1: rows g / g+8, dims d, d+1
      a[2 + i] = hi;  // a2 / a3: dims d+2, d+3
    }
    // keep the next k-step's loads after this one's: hoisted all together (8 k-steps x
    // 12 scalar loads) they take more registers than the quantized path of the kernel
    asm volatile("" ::: "memory");
  }
  // hf: this warp's half of GD = 2 D (the pointers start at its first dim d0 = D hf)
  // tqk, tqv, T: the call's counts (the host's, or those of the device count)
  __device__ static void load(Raw& r, const Params& p, int bh, int t0, int g, int c, int hf, int tqk, int tqv, int T) {
    const int d0 = D * hf;
    r.kc = p.kc + bh * p.k_cs + d0 * GB;
    r.ks = p.ks + bh * p.k_ss + d0;
    r.kz = p.kz + bh * p.k_ss + d0;
    r.kr = p.kr + bh * p.k_rs + d0;
    r.vc = p.vc + bh * p.v_cs + d0 * BITS / 8;
    r.vs = p.vs + bh * p.v_ss + d0 / G;
    r.vz = p.vz + bh * p.v_ss + d0 / G;
    r.vr = p.vr + bh * p.v_rs + d0;
    r.t0 = t0; r.TQK = tqk; r.TQV = tqv; r.T = T; r.c = c; r.g = g;
  }
  // dims (D/8) g + 2mt, +1 of V token t as a half2 (zeros past T)
  __device__ static uint32_t vword(const Raw& r, int t, int mt) {
    const int j = (D / 8) * r.g + 2 * mt;
    if (t < r.TQV) {
      const long long so = (long long)t * GNG + (j >> 5);
      const __half s = __ushort_as_half(r.vs[so]), z = __ushort_as_half(r.vz[so]);
      const int bit = j * BITS;  // both dims' codes lie in one byte
      const uint32_t b = r.vc[(long long)t * GRB + (bit >> 3)] >> (bit & 7);
      const __half h0 = __hfma(__ushort2half_rn((unsigned short)(b & ((1u << BITS) - 1))), s, z);
      const __half h1 = __hfma(__ushort2half_rn((unsigned short)((b >> BITS) & ((1u << BITS) - 1))), s, z);
      return (uint32_t)__half_as_ushort(h0) | ((uint32_t)__half_as_ushort(h1) << 16);
    }
    if (t < r.T) return *reinterpret_cast<const uint32_t*>(r.vr + (long long)(t - r.TQV) * GD + j);
    return 0u;
  }
  __device__ static void vstep(const Raw& r, int mt, uint32_t (&a)[4]) {
    const int t = r.t0 + 2 * r.c;  // tokens t, t+1 (k 2c, 2c+1) and t+8, t+9
    const uint32_t w0 = vword(r, t, mt), w1 = vword(r, t + 1, mt), w2 = vword(r, t + 8, mt), w3 = vword(r, t + 9, mt);
    a[0] = __byte_perm(w0, w1, 0x5410);  // dim 2mt of tokens 2c, 2c+1
    a[1] = __byte_perm(w0, w1, 0x7632);  // dim 2mt+1
    a[2] = __byte_perm(w2, w3, 0x5410);
    a[3] = __byte_perm(w2, w3, 0x7632);
    asm volatile("" ::: "memory");  // (as kstep)
  }
};

// The pipeline's stream of a format: token rows (int4, fp8) or KIVI's, whose stage holds a
// whole group (GS >= 1, since run 17; GS 5 with the interleaved K scales / zeros and, for
// KIVI-2, the lane-byte map) or one tile (GS = 0, run 16's).
// D: a warp's dims, GD the cache's (2 D: warp pairs, each its half of the rows).
template <class F, int D, int NW, int GS, int GD = D, int KIND = F::KIND>
struct StreamOf {
  using type = RowStream<F, D, NW, GD>;
};
template <class F, int D, int NW, int GS, int GD>
struct StreamOf<F, D, NW, GS, GD, 1> {
  static_assert(GS != 0 || GD == 128, "the tile stream (variants 5, 6) is head dim 128's only");
  using type = typename std::conditional<GS != 0, KiviStream<F::BITS, NW, GS == 5 && F::BITS == 2, GS == 5, F::D, GD>,
                                         KiviTileStream<F::BITS, NW>>::type;
};

// ---------------------------------------------------------------------------------
// the split kernel
// ---------------------------------------------------------------------------------
// One 16-token tile of a warp: scores, online softmax, O^T += V^T P^T.
// R: Raw<F> for the token-row formats (KIND 0); F::Raw for KIVI, whose K fragments are
// read per k-step (F::kstep) and V fragments per m-tile (F::vstep). Score row r of the
// mma is token t0 + r for KIND 0, t0 + F::row_tok(r) for KIVI.
// SPL = 2 (head dim 256): D is this warp's half; its partial scores are added to its
// partner's (common.cuh pair_add: xb, hf, bar) before the softmax.
// t0, tend: token positions shifted down by the row's first key lo (0 without row_start):
// token t scores iff 0 <= t - lo < tend, one unsigned compare (the group steps alike).
template <class F, int D, class R, int SPL = 1>
__device__ __forceinline__ void tile_step(const R& r, int t0, int tend, float qk, const uint32_t (&qb)[D / 16][2],
                                          float (&acc)[D / 16][4], float (&m)[2], float (&l)[2], int g,
                                          uint8_t* xb = nullptr, int hf = 0, int bar = 0) {
  constexpr int KS = D / 16;
  // ---- scores S^T (tokens g, g+8; heads 2c, 2c+1); q is exact fp16, the base-2
  // scale is applied to the fp32 scores (as the Triton kernels do)
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  int tg = g, tg8 = g + 8;  // the tokens of score rows g, g+8
  if constexpr (F::KIND == 0) {
    uint32_t ks2[2], kz2[2];  // (s, s), (z, z) of tokens g, g+8
    r.k_pairs(ks2, kz2);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      mma16816(s, F::kfrag(r.k[0], kk, 0, ks2[0], kz2[0]), F::kfrag(r.k[1], kk, 0, ks2[1], kz2[1]),
               F::kfrag(r.k[0], kk, 1, ks2[0], kz2[0]), F::kfrag(r.k[1], kk, 1, ks2[1], kz2[1]), qb[kk][0],
               qb[kk][1]);
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      uint32_t a[4];
      F::kstep(r, kk, a);
      mma16816(s, a[0], a[1], a[2], a[3], qb[kk][0], qb[kk][1]);
    }
    tg = F::row_tok(g);
    tg8 = F::row_tok(g + 8);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] *= qk;
  if constexpr (SPL == 2) pair_add(s, xb, hf, threadIdx.x & 31, bar);
  if ((unsigned)(t0 + tg) >= (unsigned)tend) s[0] = s[1] = NEG_INF;  // (keys [0, tend) of the shifted range)
  if ((unsigned)(t0 + tg8) >= (unsigned)tend) s[2] = s[3] = NEG_INF;

  // ---- online softmax per head (2c + e): common.cuh
  float p0, p1, p2, p3;
  online_softmax<KS>(s, m, l, acc, p0, p1, p2, p3);
  const uint32_t pb0 = movtrans(pack_half2(p0, p1));  // P^T: k = tokens 2c, 2c+1; n = head g
  const uint32_t pb1 = movtrans(pack_half2(p2, p3));  //      k = tokens 2c+8, 2c+9

  // ---- O^T += V^T P^T
  if constexpr (F::KIND == 0) {
    uint32_t vs2[2], vz2[2];
    r.v_pairs(vs2, vz2);
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      uint32_t a[4];
      r.v_frag(mt, vs2, vz2, a);
      mma16816(acc[mt], a[0], a[1], a[2], a[3], pb0, pb1);
    }
  } else {
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      uint32_t a[4];
      F::vstep(r, mt, a);
      mma16816(acc[mt], a[0], a[1], a[2], a[3], pb0, pb1);
    }
  }
}

// tile_step for a GQA group of 16 in one CTA (HH = 2 head halves of 8, JOINT_VARIANT): each K
// and V fragment is decoded once and goes through two mma, one per half (each with its own
// q, scores, softmax and O^T), where two CTAs of half the heads each decode every byte of
// the row (int4: 225 of a tile's 419 instructions are the decode; sass_census). Token-row
// formats (KIND 0), a whole row a warp (SPL 1). The score scaling and masks repeat tile_step's
// (per half); tile_step is otherwise left as it was, and every instance of the default build
// stays byte-identical (sass_census --against: 95 of 95).
template <class F, int D, class R>
__device__ __forceinline__ void tile_step_joint(const R& r, int t0, int tend, float qk,
                                                const uint32_t (&qb)[2][D / 16][2], float (&acc)[2][D / 16][4],
                                                float (&m)[2][2], float (&l)[2][2], int g) {
  static_assert(F::KIND == 0, "the joint step reads token rows");
  constexpr int KS = D / 16;
  float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  uint32_t ks2[2], kz2[2];
  r.k_pairs(ks2, kz2);
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const uint32_t a0 = F::kfrag(r.k[0], kk, 0, ks2[0], kz2[0]), a1 = F::kfrag(r.k[1], kk, 0, ks2[1], kz2[1]);
    const uint32_t a2 = F::kfrag(r.k[0], kk, 1, ks2[0], kz2[0]), a3 = F::kfrag(r.k[1], kk, 1, ks2[1], kz2[1]);
    mma16816(s[0], a0, a1, a2, a3, qb[0][kk][0], qb[0][kk][1]);
    mma16816(s[1], a0, a1, a2, a3, qb[1][kk][0], qb[1][kk][1]);
  }
  uint32_t pb0[2], pb1[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
    for (int i = 0; i < 4; ++i) s[hh][i] *= qk;
    if ((unsigned)(t0 + g) >= (unsigned)tend) s[hh][0] = s[hh][1] = NEG_INF;
    if ((unsigned)(t0 + g + 8) >= (unsigned)tend) s[hh][2] = s[hh][3] = NEG_INF;
    float p0, p1, p2, p3;
    online_softmax<KS>(s[hh], m[hh], l[hh], acc[hh], p0, p1, p2, p3);
    pb0[hh] = movtrans(pack_half2(p0, p1));
    pb1[hh] = movtrans(pack_half2(p2, p3));
  }
  uint32_t vs2[2], vz2[2];
  r.v_pairs(vs2, vz2);
#pragma unroll
  for (int mt = 0; mt < KS; ++mt) {
    uint32_t a[4];
    r.v_frag(mt, vs2, vz2, a);
    mma16816(acc[0][mt], a[0], a[1], a[2], a[3], pb0[0], pb1[0]);
    mma16816(acc[1][mt], a[0], a[1], a[2], a[3], pb0[1], pb1[1]);
  }
}

// The online softmax over the 32 tokens of two tiles (s0: tile 0, s1: tile 1, each as
// online_softmax's s): one max reduction and at most one rescale per group.
// The max reduction and rescale repeat common.cuh's online_softmax on purpose: a shared
// helper for them (tried offline: softmax_rescale, called by both) changed the ptxas code
// of 24 of this file's 55 kernels and of hqmq_decode.cu's 4 Med3x kernels (instruction
// order and register assignment; same register counts), kernels that no GPU run has
// tested or timed in that form. Merge them together with a GPU run that does.
template <int KS>
__device__ __forceinline__ void online_softmax2(const float (&s0)[4], const float (&s1)[4], float (&m)[2],
                                                float (&l)[2], float (&acc)[KS][4], float (&p)[8]) {
  float mx[2] = {fmaxf(fmaxf(s0[0], s0[2]), fmaxf(s1[0], s1[2])), fmaxf(fmaxf(s0[1], s0[3]), fmaxf(s1[1], s1[3]))};
  if (__any_sync(0xffffffffu, mx[0] > m[0] || mx[1] > m[1])) {  // lazily, as online_softmax
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], o));
    }
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
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    p[i] = exp2f(s0[i] - ((i & 1) ? ms1 : ms0));
    p[4 + i] = exp2f(s1[i] - ((i & 1) ? ms1 : ms0));
  }
  l[0] += (p[0] + p[2]) + (p[4] + p[6]);
  l[1] += (p[1] + p[3]) + (p[5] + p[7]);
}
// P x V of tile h of a fused group step: its probabilities p[4h..4h+3] as the mma's B
// fragment, V decoded m-tile by m-tile from r (the format functor F)
template <class F, int KS>
__device__ __forceinline__ void pv_tile(const typename F::Raw& r, const float (&p)[8], int h, float (&acc)[KS][4]) {
  const uint32_t pb0 = movtrans(pack_half2(p[4 * h], p[4 * h + 1]));
  const uint32_t pb1 = movtrans(pack_half2(p[4 * h + 2], p[4 * h + 3]));
#pragma unroll
  for (int mt = 0; mt < KS; ++mt) {
    uint32_t a[4];
    F::vstep(r, mt, a);
    mma16816(acc[mt], a[0], a[1], a[2], a[3], pb0, pb1);
  }
}

// Both tiles of a KIVI group in one step (the fused variants): the two score chains of
// QK^T interleaved (independent mma chains: more work between dependent mma), the
// k-steps' scales / zeros loaded once for both, one softmax pass over 32 tokens, then
// O^T += V^T P^T tile by tile. u0: the group's first token.
template <class S, int D, int SPL = 1>
__device__ __forceinline__ void group_step(const uint8_t* st, int u0, int tend, float qk,
                                           const uint32_t (&qb)[D / 16][2], float (&acc)[D / 16][4], float (&m)[2],
                                           float (&l)[2], int g, int c, uint8_t* xb = nullptr, int hf = 0,
                                           int bar = 0) {
  using F = typename S::F;
  constexpr int KS = D / 16;
  typename F::Raw r;
  S::read(r, st, g, c, 0);
  const uint8_t* kb1 = S::kb_of(st, g, c, 1);
  float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    uint32_t a[4], b[4];
    if constexpr (S::SZ) {  // (z01, s01, z23, s23) in one load
      const uint4 zs = S::kszq(st, c, kk);
      const uint4 w = *reinterpret_cast<const uint4*>(r.kb + 16 * kk);
      const uint4 w1 = *reinterpret_cast<const uint4*>(kb1 + 16 * kk);
      F::kdec(r, w, make_uint2(zs.y, zs.w), make_uint2(zs.x, zs.z), a);
      F::kdec(r, w1, make_uint2(zs.y, zs.w), make_uint2(zs.x, zs.z), b);
      mma16816(s0, a[0], a[1], a[2], a[3], qb[kk][0], qb[kk][1]);
      mma16816(s1, b[0], b[1], b[2], b[3], qb[kk][0], qb[kk][1]);
    } else {
      F::kstep2(r, kb1, kk, a, b);
      mma16816(s0, a[0], a[1], a[2], a[3], qb[kk][0], qb[kk][1]);
      mma16816(s1, b[0], b[1], b[2], b[3], qb[kk][0], qb[kk][1]);
    }
  }
  const int tg = F::row_tok(g), tg8 = F::row_tok(g + 8);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s0[i] *= qk;
    s1[i] *= qk;
  }
  if constexpr (SPL == 2) pair_add2(s0, s1, xb, hf, 4 * g + c, bar);
  if ((unsigned)(u0 + tg) >= (unsigned)tend) s0[0] = s0[1] = NEG_INF;
  if ((unsigned)(u0 + tg8) >= (unsigned)tend) s0[2] = s0[3] = NEG_INF;
  if ((unsigned)(u0 + 16 + tg) >= (unsigned)tend) s1[0] = s1[1] = NEG_INF;
  if ((unsigned)(u0 + 16 + tg8) >= (unsigned)tend) s1[2] = s1[3] = NEG_INF;
  float p[8];
  online_softmax2<KS>(s0, s1, m, l, acc, p);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (h) S::read(r, st, g, c, 1);  // tile 1's V (its K part is not used again)
    pv_tile<F, KS>(r, p, h, acc);
  }
}

// The group step of KIVI-2 in the lane-byte map (variant 12; KiviQ::lb_tok): per k-step
// one LDS.128 of the lane's plane and two PRMT give both tiles' K codes (crumbs 0, 1:
// tile 0 rows g, g+8; crumbs 2, 3: tile 1), decoded with immediate masks as
// round16(x s + z), as group_step.
template <class S, int D, int SPL = 1>
__device__ __forceinline__ void group_step_lb(const uint8_t* st, int u0, int tend, float qk,
                                              const uint32_t (&qb)[D / 16][2], float (&acc)[D / 16][4],
                                              float (&m)[2], float (&l)[2], int g, int c, uint8_t* xb = nullptr,
                                              int hf = 0, int bar = 0) {
  using F = typename S::F;
  static_assert(F::BITS == 2, "the lane-byte map is KIVI-2's");
  constexpr int KS = D / 16;
  const uint8_t* kb = st + (g >> 2) * S::PLS + c * F::KBLK;  // the lane's plane: tokens 16 (g >> 2) ..
  const uint32_t sel = (g & 3) | ((4 + (g & 3)) << 8);  // its byte of dim d -> byte 0, of dim d+1 -> byte 2
  float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const uint4 w = *reinterpret_cast<const uint4*>(kb + 16 * kk);  // dims 4kk..4kk+3, 16 tokens each
    const uint4 zs = S::kszq(st, c, kk);                             // (z01, s01, z23, s23)
    const uint32_t x01 = __byte_perm(w.x, w.y, sel), x23 = __byte_perm(w.z, w.w, sel);
    mma16816(s0, hfma2(crumbs<0>(x01), zs.y, zs.x), hfma2(crumbs<2>(x01), zs.y, zs.x),
             hfma2(crumbs<0>(x23), zs.w, zs.z), hfma2(crumbs<2>(x23), zs.w, zs.z), qb[kk][0], qb[kk][1]);
    mma16816(s1, hfma2(crumbs<4>(x01), zs.y, zs.x), hfma2(crumbs<6>(x01), zs.y, zs.x),
             hfma2(crumbs<4>(x23), zs.w, zs.z), hfma2(crumbs<6>(x23), zs.w, zs.z), qb[kk][0], qb[kk][1]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s0[i] *= qk;
    s1[i] *= qk;
  }
  if constexpr (SPL == 2) pair_add2(s0, s1, xb, hf, 4 * g + c, bar);
  const int tg = F::lb_tok(0, g);  // row g of tile h: token tg + 2h; row g+8: + 1
  if ((unsigned)(u0 + tg) >= (unsigned)tend) s0[0] = s0[1] = NEG_INF;
  if ((unsigned)(u0 + tg + 1) >= (unsigned)tend) s0[2] = s0[3] = NEG_INF;
  if ((unsigned)(u0 + tg + 2) >= (unsigned)tend) s1[0] = s1[1] = NEG_INF;
  if ((unsigned)(u0 + tg + 3) >= (unsigned)tend) s1[2] = s1[3] = NEG_INF;
  float p[8];
  online_softmax2<KS>(s0, s1, m, l, acc, p);
  const uint16_t* vs = reinterpret_cast<const uint16_t*>(st + S::VSO);
  const uint16_t* vz = reinterpret_cast<const uint16_t*>(st + S::VZO);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    typename F::Raw r;
    F::read_v_lb(r, st + S::VC, vs, vz, g, c, h);
    pv_tile<F, KS>(r, p, h, acc);
  }
}

// Stages of a stream whose stage holds TILES tiles: the variant's SMS 16-token stages in
// units of TILES tiles (at least 2), about the same bytes per warp.
template <int SMS, int TILES>
__host__ __device__ constexpr int unit_stages() {
  return SMS / TILES < 2 ? 2 : SMS / TILES;
}

// Shared memory of the SMS-stage pipeline (0: the register path), and of the merge.
// D: the cache's head dim; F: a warp's format (F::DIM = D, or D / 2 for warp pairs: then
// NW / 2 pairs stream the tiles, and 4 KB per pair after the stages hold their exchange).
template <class F, int D, int NW, int SMS, int GS>
__host__ __device__ constexpr int pipe_bytes() {
  if constexpr (SMS == 0) {
    return 0;
  } else {
    constexpr int SPL = D / F::DIM;
    using S = typename StreamOf<F, F::DIM, NW / SPL, GS, D>::type;
    return unit_stages<SMS, S::TILES>() * NW * S::BYTES;
  }
}
template <class F, int D, int NW, int SMS, int GS>
constexpr int dyn_smem() {
  if constexpr (SMS == 0 || F::KIND == 2) {
    return 0;
  } else {
    constexpr int SPL = D / F::DIM, NP = NW / SPL;
    constexpr int pipe = pipe_bytes<F, D, NW, SMS, GS>() + (SPL == 2 ? NP * 4096 : 0);
    constexpr int red = NP * 8 * D * 4;
    return pipe > red ? pipe : red;
  }
}

// STAGES: register path (SMS = 0), tiles held = STAGES (STAGES - 1 loaded ahead);
// SMS > 0: the shared-memory pipeline of SMS stages per warp (STAGES unused).
// GS: KIVI's stream (StreamOf). FUSED: the last CTA of a row group merges the group's
// partials into p.out (common.cuh combine_rows), no combine launch after it.
// HH: q-head halves a CTA takes (2: a GQA group of 16 as one CTA per kv row, tile_step_joint;
// blockIdx.x is then the kv row and half hh the q-head group 2 blockIdx.x + hh of p.qsh's two).
template <class F, int D, int NW, int STAGES, int MINB, int SMS, int GS, bool FUSED = false, int HH = 1>
__global__ void __launch_bounds__(NW * 32, MINB) split_kernel(const Params p) {
  // Head dim 256 (SPL = 2): warp pairs (wp) take the tiles, warp hf of a pair the dims
  // [128 hf, 128 hf + 128) of every row with d = 128's format F (DW dims), and the pair adds
  // its partial scores before the softmax (pair_add): 120-odd registers a thread as at 128,
  // where doubling every per-thread array took 165-217. Else wp = warp, NP = NW, DW = D.
  pdl_trigger();  // (common.cuh: the combine may be launched once every split CTA is resident)
  constexpr int SPL = D / F::DIM, DW = F::DIM, NP = NW / SPL;
  constexpr int KS = DW / 16;  // k-steps of QK^T = m-tiles of PV
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wp = warp / SPL, hf = warp % SPL;
  const int g = lane >> 2, c = lane & 3;
  static_assert(HH == 1 || (HH == 2 && F::KIND == 0 && SPL == 1), "joint halves: token rows, whole rows a warp");
  // this CTA's kv row (b Hkv + h); blockIdx.x: its q-head group (HH = 2: its kv row)
  const int bh = HH == 1 ? (int)blockIdx.x >> p.qsh : (int)blockIdx.x;
  const int h = bh % p.Hkv;
  constexpr int NG = F::NG;

  float qk = p.qk_scale;
  if (!F::ZERO && p.khs) qk *= p.khs[h];  // fp8: q . (s k8) = s (q . k8)
  uint32_t qbh[HH][KS][2];
#pragma unroll
  for (int hh = 0; hh < HH; ++hh) {
    const bool real = g < p.gqa;
    const long long row = ((long long)blockIdx.x * HH + hh) * p.gqa + g;
    if (p.qtype == 0) load_q<F, DW, D>(reinterpret_cast<const __half*>(p.q), row, real, 1.f, c, qbh[hh], hf);
    else if (p.qtype == 1) load_q<F, DW, D>(reinterpret_cast<const uint16_t*>(p.q), row, real, 1.f, c, qbh[hh], hf);
    else load_q<F, DW, D>(reinterpret_cast<const float*>(p.q), row, real, 1.f, c, qbh[hh], hf);
  }
  uint32_t(&qb)[KS][2] = qbh[0];

  float acch[HH][KS][4];  // O^T: rows dims g D/8 + 2mt (+1 for c2, c3), cols heads 2c, 2c+1
  float mh[HH][2], lh[HH][2];
  zero_halves(acch, mh, lh);
  float(&acc)[KS][4] = acch[0];
  float(&m)[2] = mh[0];
  float(&l)[2] = lh[0];

  // valid tokens: p.T, or the device count (may be below T, down to none: a CTA whose
  // tiles all lie past it keeps m = -inf, l = 0, acc = 0 and writes exactly that empty
  // partial, which the combine weighs by 0)
  int tend = p.vlen ? min(p.T, __ldg(p.vlen)) : p.T;
  // a left-padded batch: the row's keys below lo are masked (the score masks see tokens
  // shifted by lo); a row with no key left gets 0, not 0/0: its split 0 writes the neutral
  // partial (m 0, l 1, o 0) below.
  const int lo = p.rstart ? max(0, __ldg(p.rstart + bh / p.Hkv)) : 0;
  const bool none = p.rstart && lo >= tend && p.split0 + blockIdx.y == 0;
  int t_first = p.t_first, sp = blockIdx.y, per = p.steps_per_split;
  bool tail_cta = false;
  int tqk = p.TQK, tqv = p.TQV;  // KIVI: each side's quantized tokens
  if constexpr (F::KIND == 1) {  // KIVI: this CTA's part (the tail's splits first)
    int n_main = p.n_main;
    if (p.vlen) {  // a graph view: the window policies split the device count (whole groups)
      tqk = max(tend - p.KA, 0) / p.KP * p.KP;
      tqv = max(tend - p.VA, 0) / p.VP * p.VP;
      n_main = min(tqk, tqv);
    }
    tail_cta = sp < p.nsplit_tail;
    if (tail_cta) {
      t_first = n_main;
      per = p.per_tail;
    } else {
      tend = n_main;
      sp -= p.nsplit_tail;
    }
  }
  const int nsteps = tend > t_first ? (tend - t_first + 15) / 16 : 0;  // tiles of [t_first, tend)
  const int tlo = max(tend - lo, 0);  // (the masks' shifted bound)
  const int last = min(sp * per + per, nsteps);
  // tiles wholly below the row's first key are neither read nor scored (a split of pads runs
  // none); the stream rounds a start down to its unit (KIVI: a group), whose keys are masked
  const int first = max(sp * per, (lo - t_first) / 16);  // (lo <= t_first: sp * per)
  extern __shared__ __align__(16) uint8_t dsm[];
  // SPL = 2: the pair's score exchange, after every warp's stages: two buffers of 2 KB
  constexpr int XB = pipe_bytes<F, D, NW, SMS, GS>();
  uint8_t* const xb = dsm + XB + wp * 4096;

  if (tail_cta) {
    if constexpr (F::KIND == 1) {  // KIVI window tail: direct loads, one tile per warp at a time
      using TF = KiviTail<F::BITS, DW, D>;
      int jt = 0;
      for (int st = first + wp; st < last; st += NP) {
        typename TF::Raw r;
        const int t0 = t_first + st * 16;
        TF::load(r, p, bh, t0, g, c, hf, tqk, tqv, tend);
        tile_step<TF, DW, typename TF::Raw, SPL>(r, t0 - lo, tlo, qk, qb, acc, m, l, g, xb + 2048 * (jt & 1), hf,
                                                 1 + wp);
        ++jt;
      }
    }
  } else if constexpr (SMS == 0) {
    static_assert(F::KIND == 0 && SPL == 1, "the register path reads whole token rows");
    const int vgrp = g * (D / 8) / 32;  // the group of this lane's V dims (int4)
    Cursor<F> cur;  // at this warp's first tile
    {
      const int t0 = t_first + (first + warp) * 16;
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
        if constexpr (HH == 2) tile_step_joint<F, D>(buf[i], t_first + st * 16 - lo, tlo, qk, qbh, acch, mh, lh, g);
        else tile_step<F, D>(buf[i], t_first + st * 16 - lo, tlo, qk, qb, acc, m, l, g);
      }
    }
  } else {
    using S = typename StreamOf<F, DW, NP, GS, D>::type;  // RowStream (int4, fp8), KiviStream or KiviTileStream
    constexpr int TPU = S::TILES, NS = unit_stages<SMS, TPU>();  // tiles per stage (unit), stages
    const int ufirst = first / TPU, ulast = (last + TPU - 1) / TPU;  // KIVI: splits are whole groups
    S cur;
    cur.init(p, bh, t_first + (ufirst + wp) * TPU * 16, lane, hf);
    const uint8_t* wsm = dsm + warp * (NS * S::BYTES);
    const uint32_t wsa = smem_u32(wsm);
    // this warp's units (the same for both warps of a pair: pair_add's barriers match)
    const int nunit = ulast > ufirst + wp ? (ulast - ufirst - wp + NP - 1) / NP : 0;
#pragma unroll
    for (int i = 0; i < NS - 1; ++i) {
      cur.copy(wsa + i * S::BYTES, tend, i < nunit, lane);
      cp_commit();
    }
    int rd = 0, wr = NS - 1;  // stage read next, stage written next
    for (int j = 0; j < nunit; ++j) {
      __syncwarp();  // every lane has read the stage written now (read at j - 1)
      cur.copy(wsa + wr * S::BYTES, tend, j + NS - 1 < nunit, lane);
      cp_commit();
      cp_wait<NS - 1>();  // this lane's copies of unit j are done
      __syncwarp();       // ... and every lane's
      const int u0 = t_first + (ufirst + wp + j * NP) * TPU * 16;
      if constexpr (F::KIND == 1 && GS >= 2) {  // KIVI, a group per step (S::F is KiviQ)
        if constexpr (GS == 5 && S::F::BITS == 2)
          group_step_lb<S, DW, SPL>(wsm + rd * S::BYTES, u0 - lo, tlo, qk, qb, acc, m, l, g, c, xb + 2048 * (j & 1), hf,
                                    1 + wp);
        else
          group_step<S, DW, SPL>(wsm + rd * S::BYTES, u0 - lo, tlo, qk, qb, acc, m, l, g, c, xb + 2048 * (j & 1), hf,
                                 1 + wp);
      } else {
#pragma unroll
        for (int h = 0; h < TPU; ++h) {
          typename S::RawT r;
          S::read(r, wsm + rd * S::BYTES, g, c, h);
          if constexpr (HH == 2)
            tile_step_joint<F, DW, typename S::RawT>(r, u0 + 16 * h - lo, tlo, qk, qbh, acch, mh, lh, g);
          else
            tile_step<F, DW, typename S::RawT, SPL>(r, u0 + 16 * h - lo, tlo, qk, qb, acc, m, l, g,
                                                    xb + 2048 * ((j * TPU + h) & 1), hf, 1 + wp);
        }
      }
      rd = rd == NS - 1 ? 0 : rd + 1;
      wr = wr == NS - 1 ? 0 : wr + 1;
    }
    cp_wait<0>();
  }

  // (HH = 2: the merge and partial below once per half, the CTA's threads in step)
  __shared__ float sm_m[NP][8], sm_l[NP][8];
  __shared__ float red_static[SMS ? 1 : NP][SMS ? 1 : 8][SMS ? 1 : D];
  float(*red)[8][D] = SMS ? reinterpret_cast<float(*)[8][D]>(dsm) : reinterpret_cast<float(*)[8][D]>(&red_static[0][0][0]);
#pragma unroll
  for (int hh = 0; hh < HH; ++hh) {
  float(&m)[2] = mh[hh];
  float(&l)[2] = lh[hh];
  float(&acc)[KS][4] = acch[hh];
  if (hh > 0) __syncthreads();  // (the last half's reads of sm_m, sm_l and red are done)
  // ---- the warp's sums over its tokens (l is per lane so far)
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) l[e] += __shfl_xor_sync(0xffffffffu, l[e], o);
  }

  // ---- merge the warps of the CTA in shared memory, write the partial
  // (the pipeline's stages are free once every warp is past the first barrier)
  // hqmq_decode.cu ends its kernel with the same merge, on purpose not shared: as one
  // common.cuh helper (tried offline) it left hqmq_decode.cu's kernels and this file's
  // int4 / fp8 ones byte-identical but changed the instruction order of the 16 KIVI
  // kernels, which no GPU run has tested or timed in that form.
  // (a pair's two warps hold the same m, l: both write them; each its half of the dims)
  if (g == 0) {
    sm_m[wp][2 * c] = m[0]; sm_m[wp][2 * c + 1] = m[1];
    sm_l[wp][2 * c] = l[0]; sm_l[wp][2 * c + 1] = l[1];
  }
  __syncthreads();
  float outs = 1.f;
  if (!F::ZERO && p.vhs) outs = p.vhs[h];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int hd = 2 * c + e;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < NP; ++w) M = fmaxf(M, sm_m[w][hd]);
    const float f = (m[e] == NEG_INF) ? 0.f : exp2f(m[e] - M) * outs;
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      const int d = DW * hf + g * (DW / 8) + 2 * mt;
      red[wp][hd][d] = f * acc[mt][e];
      red[wp][hd][d + 1] = f * acc[mt][2 + e];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < p.gqa * D; idx += NW * 32) {
    const int hd = idx / D, d = idx % D;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < NP; ++w) o += red[w][hd][d];
    const long long prow = (((long long)blockIdx.x * HH + hh) * p.gqa + hd) * p.nsplit + p.split0 + blockIdx.y;
    p.po[prow * D + d] = o;
    if (d == 0) {
      float M = NEG_INF, L = 0.f;
#pragma unroll
      for (int w = 0; w < NP; ++w) M = fmaxf(M, sm_m[w][hd]);
#pragma unroll
      for (int w = 0; w < NP; ++w) L += (sm_m[w][hd] == NEG_INF) ? 0.f : sm_l[w][hd] * exp2f(sm_m[w][hd] - M);
      p.pm[prow] = none ? 0.f : M;
      p.pl[prow] = none ? 1.f : L;
    }
  }
  }
  if constexpr (FUSED) {  // (sm_m is free once every thread is past last_of_group's barrier)
    if (last_of_group(p.counters + blockIdx.x, p.nsplit)) {
      if constexpr (HH == 1)
        combine_rows<D>(p.po, p.pm, p.pl, p.out, p.otype, (long long)blockIdx.x * p.gqa, p.gqa, p.nsplit, &sm_m[0][0]);
      else  // (both halves' rows: 2 blockIdx.x gqa on, 2 gqa of them)
        combine_rows<D>(p.po, p.pm, p.pl, p.out, p.otype, (long long)blockIdx.x * HH * p.gqa, HH * p.gqa, p.nsplit,
                        &sm_m[0][0]);
    }
  }
}


// Launch variants (timed in NOTES.md): {register stages, min CTAs per SM (a register
// cap, may spill), shared-memory stages (0: the register path)}.
constexpr int VARIANTS[][3] = {{2, 1, 0}, {3, 3, 0}, {1, 1, 4}, {1, 4, 3}, {1, 3, 6}, {1, 2, 8}};
constexpr int NVARIANTS = 6;
// JOINT_VARIANT: variant 2's launch with both q-head halves of a GQA group over 8 in one CTA
// (split_kernel's HH = 2), head dim 64 / 128; for head-split calls only (qsh = 1).
constexpr int JOINT_VARIANT = 6, JOINT_OF = 2;
// KIVI's variants 2..6 (run 17): {min CTAs per SM, shared-memory stages in 16-token tiles
// (the group stream holds SMS / 2 groups, at least 2), GS: group stream (1) or run 16's
// tile stream (0)}. The group stream unrolls a stage's two tiles: 137-140 registers
// uncapped (3 CTAs per SM: v4), <= 128 capped (4 CTAs: v2, v3; KIVI-2 spills 16 bytes).
// 7, 8, 9 (GS = 2): the group stream with both tiles of a group in one step (group_step),
// uncapped / capped at 128 registers with 2 group stages, capped with 3.
// 12 (GS = 5; 2026-12-02, the default since GPU call 20a; as 8: capped, 2 group stages, and
// the interleaved K scale / zero layout, KiviStream SZ): KIVI-2 in the lane-byte map
// (group_step_lb) with the decode of 8 (round16(x s + z): numerics unchanged), KIVI-4 = 8
// with the SZ layout. 10 and 11 (GS -1: no kernel) were the zero point folded out of the K
// decode; removed after GPU call 20a (3.6-4.1e-3 relative at T = 131072, NOTES.md).
constexpr int KVARIANTS[][3] = {{4, 4, 1}, {4, 6, 1}, {3, 4, 1}, {1, 4, 0}, {4, 3, 0}, {3, 4, 2}, {4, 4, 2}, {4, 6, 2},
                                {0, 0, -1}, {0, 0, -1}, {4, 4, 5}};
constexpr int KVARIANT0 = 2, NKVARIANTS = 11;

// Head dim 256: 8 warps (4 pairs) of d = 128's per-warp code, so a variant's register cap
// per warp is kept by halving its min CTAs per SM (rounded down, at least 1); the pipeline
// variants only (split_kernel's register path reads whole rows), with at most SMEM256 bytes
// of stages per CTA (fp8 v5's 8 stages x 8 warps x 4 KB would not fit).
constexpr int SMEM256 = 192 * 1024;
template <int D>
constexpr int minb_of(int minb) {
  return D > 128 ? (minb / 2 > 0 ? minb / 2 : 1) : minb;
}
// KIVI at head dim 64: one more CTA per SM than the variant's d = 128 cap (91-96 registers,
// no spills offline; v12: 5 x 4 warps), for the latency a tile of half the work leaves
// exposed. (+2 spilled up to 116 bytes.)
template <int D>
constexpr int kivi_minb_of(int minb) {
  return D == 64 ? minb + 1 : minb_of<D>(minb);
}
template <class F, int D>
constexpr int sms_of(int sms) {
  if constexpr (D > 128) {
    constexpr int most = SMEM256 / (8 * SmemTile<F>::BYTES);
    return sms < most ? sms : most;
  } else {
    return sms;
  }
}

// rows: the grid's rows of a one-half CTA (B Hkv << qsh); HH = 2 launches half as many.
template <class F, int D, int STAGES, int MINB, int SMS, int GS, int HH = 1>
int launch_cfg(const Params& p, int rows, int grid_y, cudaStream_t stream) {
  constexpr int NW = 4 * (D / F::DIM);  // (head dim 256: 4 warp pairs)
  constexpr int smem = dyn_smem<F, D, NW, SMS, GS>();
  auto k = split_kernel<F, D, NW, STAGES, MINB, SMS, GS, FUSED_BUILD, HH>;
  if constexpr (smem > 0) {  // dynamic + static (256 B) may pass the default 48 KiB (fp8, 3 stages: 48 KiB + 256 B)
    static bool set = false;  // once per instance (benign race: the same value)
    if (!set) {
      const cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e != cudaSuccess) return (int)e;
      set = true;
    }
  }
  k<<<dim3(rows / HH, grid_y), NW * 32, smem, stream>>>(p);
  return 0;
}

// What an instance is asked (query_of): its registers per thread, or the CTAs resident per
// SM (registers, threads and shared memory, after the opt-in a launch makes); < 0: -error.
enum Query { REGS = 0, OCCUPANCY = 1 };

template <class F, int D, int STAGES, int MINB, int SMS, int GS, int HH = 1>
int query_cfg(Query what) {
  constexpr int NW = 4 * (D / F::DIM), smem = dyn_smem<F, D, NW, SMS, GS>();
  auto k = split_kernel<F, D, NW, STAGES, MINB, SMS, GS, FUSED_BUILD, HH>;
  cudaError_t e;
  if (what == REGS) {
    cudaFuncAttributes a;
    e = cudaFuncGetAttributes(&a, k);
    return e == cudaSuccess ? a.numRegs : -(int)e;
  }
  // (a GPU whose opt-in is below the instance's stages, e.g. Ada's 99 KB at head dim 256, refuses here)
  if (smem > 0 && (e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)) != cudaSuccess)
    return -(int)e;
  int n = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, NW * 32, smem);
  return e == cudaSuccess ? n : -(int)e;
}

// variant V of a format: VARIANTS (int4, fp8: 0..5) or KVARIANTS (KIVI: 2..12); else invalid
template <class F, int D, int V>
int launch_v(const Params& p, int rows, int grid_y, cudaStream_t stream) {
  if constexpr (F::KIND == 1) {
    if constexpr (V < KVARIANT0 || V >= KVARIANT0 + NKVARIANTS || KVARIANTS[V - KVARIANT0][2] < 0 ||
                  (D != 128 && KVARIANTS[V - KVARIANT0][2] == 0)) {
      return (int)cudaErrorInvalidValue;  // KIVI's quantized part streams through shared memory only
    } else {
      constexpr int MINB = kivi_minb_of<D>(KVARIANTS[V - KVARIANT0][0]), SMS = KVARIANTS[V - KVARIANT0][1];
      return launch_cfg<F, D, 1, MINB, SMS, KVARIANTS[V - KVARIANT0][2]>(p, rows, grid_y, stream);
    }
  } else if constexpr (V == JOINT_VARIANT) {
    if constexpr (D > 128) {
      return (int)cudaErrorInvalidValue;
    } else {
      if (p.qsh != 1) return (int)cudaErrorInvalidValue;  // (two halves to join)
      return launch_cfg<F, D, VARIANTS[JOINT_OF][0], VARIANTS[JOINT_OF][1], VARIANTS[JOINT_OF][2], 0, 2>(
          p, rows, grid_y, stream);
    }
  } else if constexpr (V >= NVARIANTS || (D > 128 && VARIANTS[V][2] == 0)) {
    return (int)cudaErrorInvalidValue;
  } else {
    return launch_cfg<F, D, VARIANTS[V][0], minb_of<D>(VARIANTS[V][1]), sms_of<F, D>(VARIANTS[V][2]), 0>(
        p, rows, grid_y, stream);
  }
}

template <class F, int D, int V>
int query_v(Query what) {
  if constexpr (F::KIND == 1) {
    if constexpr (V < KVARIANT0 || V >= KVARIANT0 + NKVARIANTS || KVARIANTS[V - KVARIANT0][2] < 0 ||
                  (D != 128 && KVARIANTS[V - KVARIANT0][2] == 0)) {
      return -1;
    } else {
      constexpr int MINB = kivi_minb_of<D>(KVARIANTS[V - KVARIANT0][0]), SMS = KVARIANTS[V - KVARIANT0][1];
      return query_cfg<F, D, 1, MINB, SMS, KVARIANTS[V - KVARIANT0][2]>(what);
    }
  } else if constexpr (V == JOINT_VARIANT) {
    if constexpr (D > 128) {
      return -1;
    } else {
      return query_cfg<F, D, VARIANTS[JOINT_OF][0], VARIANTS[JOINT_OF][1], VARIANTS[JOINT_OF][2], 0, 2>(what);
    }
  } else if constexpr (V >= NVARIANTS || (D > 128 && VARIANTS[V][2] == 0)) {
    return -1;
  } else {
    return query_cfg<F, D, VARIANTS[V][0], minb_of<D>(VARIANTS[V][1]), sms_of<F, D>(VARIANTS[V][2]), 0>(what);
  }
}

template <class F, int D>
int launch_split(const Params& p, int rows, int grid_y, int variant, cudaStream_t stream) {
  switch (variant) {
    case 0: return launch_v<F, D, 0>(p, rows, grid_y, stream);
    case 1: return launch_v<F, D, 1>(p, rows, grid_y, stream);
    case 2: return launch_v<F, D, 2>(p, rows, grid_y, stream);
    case 3: return launch_v<F, D, 3>(p, rows, grid_y, stream);
    case 4: return launch_v<F, D, 4>(p, rows, grid_y, stream);
    case 5: return launch_v<F, D, 5>(p, rows, grid_y, stream);
    case 6: return launch_v<F, D, 6>(p, rows, grid_y, stream);
    case 7: return launch_v<F, D, 7>(p, rows, grid_y, stream);
    case 8: return launch_v<F, D, 8>(p, rows, grid_y, stream);
    case 9: return launch_v<F, D, 9>(p, rows, grid_y, stream);
    case 10: return launch_v<F, D, 10>(p, rows, grid_y, stream);
    case 11: return launch_v<F, D, 11>(p, rows, grid_y, stream);
    case 12: return launch_v<F, D, 12>(p, rows, grid_y, stream);
    default: return (int)cudaErrorInvalidValue;
  }
}

// A call's launches: the split kernel, then the combine (a FUSED_BUILD: the split kernel alone).
template <class F, int D>
int launch(const Params& p, int rows, void* out, int otype, int variant, cudaStream_t stream) {
  const int e = launch_split<F, D>(p, rows, p.nsplit, variant, stream);
  if (e) return e;
  if constexpr (FUSED_BUILD) return (int)cudaGetLastError();
  else return launch_combine<D>(p.po, p.pm, p.pl, out, otype, rows * p.gqa, p.nsplit, stream);
}

template <class F, int D>
int query_of(int variant, Query what) {
  switch (variant) {
    case 0: return query_v<F, D, 0>(what);
    case 1: return query_v<F, D, 1>(what);
    case 2: return query_v<F, D, 2>(what);
    case 3: return query_v<F, D, 3>(what);
    case 4: return query_v<F, D, 4>(what);
    case 5: return query_v<F, D, 5>(what);
    case 6: return query_v<F, D, 6>(what);
    case 7: return query_v<F, D, 7>(what);
    case 8: return query_v<F, D, 8>(what);
    case 9: return query_v<F, D, 9>(what);
    case 10: return query_v<F, D, 10>(what);
    case 11: return query_v<F, D, 11>(what);
    case 12: return query_v<F, D, 12>(what);
    default: return -1;
  }
}

// The launch arguments that stay the same from call to call, built once per cache layout
// by the loader (kernels/cuda_decode.py `_Args` mirrors this struct field by field;
// kvq_args_size lets it check the size): a call then passes one pointer and the per-call
// q / valid count / workspace / stream, not ~35 converted arguments (host time at B=1).
struct HostArgs {
  const void* kc; const void* ks; const void* kz; const void* kr;  // K codes, scale, zero, KIVI window
  const void* vc; const void* vs; const void* vz; const void* vr;
  const float* khs; const float* vhs;  // fp8 per-kv-head scales (fp32), else null
  long long k_cs, k_ss, k_rs, v_cs, v_ss, v_rs;  // per-(b, h) strides in elements
  int kind;     // 0: int4 / fp8 token rows, 1: KIVI
  int fmt;      // kind 0: 0 int4 (groups of 32), 1 fp8 e4m3, 2 e5m2; kind 1: bits (2 or 4)
  int D, qtype, otype, variant;
  int B, Hkv, gqa, T;  // kind 0: T = the capacity bound when a valid count is passed; gqa: heads a CTA
  int per, nsplit;     // kind 0: tiles per split, splits; kind 1: nsplit = main + tail
  // KIVI: TQK / TQV quantized tokens, tokens [0, n_main) in nsplit_main splits of per_main
  // tiles through the pipeline, [n_main, T) in nsplit_tail splits of per_tail by the tail path
  int TQK, TQV, n_main, per_main, nsplit_main, per_tail, nsplit_tail;
  // KIVI graph views: the window policies (KP = 0: none; the call takes no device count),
  // T the capacity, the splits cut for it
  int KA, KP, VA, VP;
  int qsh;         // log2 of the CTAs per kv row (Params.qsh): 0 or 1
  float qk_scale;  // log2(e) / sqrt(D)
};

// fmt: 0 int4 (groups of 32), 1 fp8 e4m3, 2 fp8 e5m2; variant: VARIANTS above.
// Returns a cudaError_t (0 = launched), or -1 for a head dim other than 64 / 128 / 256.
#define KVQ_DISPATCH(CALL, ARGS)                                       \
  if (D == 128) {                                                  \
    if (fmt == 0) return CALL<Int4<128>, 128> ARGS;                     \
    if (fmt == 1) return CALL<Fp8<128, false>, 128> ARGS;               \
    if (fmt == 2) return CALL<Fp8<128, true>, 128> ARGS;                \
  } else if (D == 64) {                                            \
    if (fmt == 0) return CALL<Int4<64>, 64> ARGS;                       \
    if (fmt == 1) return CALL<Fp8<64, false>, 64> ARGS;                 \
    if (fmt == 2) return CALL<Fp8<64, true>, 64> ARGS;                  \
  } else if (D == 256) { /* warp pairs, each d = 128's format */   \
    if (fmt == 0) return CALL<Int4<128>, 256> ARGS;                     \
    if (fmt == 1) return CALL<Fp8<128, false>, 256> ARGS;               \
    if (fmt == 2) return CALL<Fp8<128, true>, 256> ARGS;                \
  }                                                                \
  return -1;

static int run_rows(const HostArgs& a, const Params& p, int rows, void* out, cudaStream_t s) {
  const int fmt = a.fmt, D = a.D;
  KVQ_DISPATCH(launch, (p, rows, out, a.otype, a.variant, s))
}

// The KIVI instance of (head dim, bits), handed to `act` (KiviRun, KiviQuery); -1 for any other.
template <class Act>
int kivi_dispatch(int D, int bits, const Act& act) {
  if (bits != 2 && bits != 4) return -1;
  if (D == 128) return bits == 2 ? act.template go<KiviQ<2>, 128>() : act.template go<KiviQ<4>, 128>();
  if (D == 64) return bits == 2 ? act.template go<KiviQ<2, 64>, 64>() : act.template go<KiviQ<4, 64>, 64>();
  if (D == 256) return bits == 2 ? act.template go<KiviQ<2>, 256>() : act.template go<KiviQ<4>, 256>();  // warp pairs
  return -1;
}
struct KiviRun {
  const Params& p;
  int rows;
  void* out;
  int otype, variant;
  cudaStream_t s;
  template <class F, int D>
  int go() const { return launch<F, D>(p, rows, out, otype, variant, s); }
};
struct KiviQuery {
  int variant;
  Query what;
  template <class F, int D>
  int go() const { return query_of<F, D>(variant, what); }
};

// KIVI, head dim 64 / 128 / 256, groups of 32, 2 or 4 bits, ONE launch: tokens [n_main, T) (the
// windows) in nsplit_tail splits of per_tail tiles by the tail path, then tokens
// [0, n_main) (both K and V quantized; n_main = min(TQK, TQV), whole groups) in
// nsplit_main splits of per_main tiles through the pipeline (variant 2..5); one combine.
// (Before GPU run 17 the tail was a second launch after the quantized part's.)
// kr / vr: the fp16 windows (window row i = token TQK + i / TQV + i).
static int run_kivi(const HostArgs& a, Params p, int rows, void* out, cudaStream_t s) {
  const int bits = a.fmt;
  if (bits != 2 && bits != 4) return -1;
  p.TQK = a.TQK; p.TQV = a.TQV;
  p.t_first = 0; p.T = a.T; p.split0 = 0;
  p.n_main = a.n_main; p.steps_per_split = a.per_main; p.per_tail = a.per_tail; p.nsplit_tail = a.nsplit_tail;
  p.KA = a.KA; p.KP = a.KP; p.VA = a.VA; p.VP = a.VP;
  return kivi_dispatch(a.D, bits, KiviRun{p, rows, out, a.otype, a.variant, s});
}

}  // namespace

extern "C" int kvq_args_size() { return (int)sizeof(HostArgs); }

// One decode call: q [B, Hq, 1, D] contiguous; vlen: null, or a device int32 holding the
// valid token count (<= a.T; the kernel clamps to a.T; KIVI: with the plan of a graph
// view, a.KP > 0); rstart: null, or B device int32, each batch row's first key (a
// left-padded batch: Params.rstart); po / pm / pl the
// partials [B*Hq, nsplit, D] / [B*Hq, nsplit] x2 (fp32), out [B*Hq, D] in a.otype.
// Launches only (no allocation, no synchronisation): capturable in a CUDA graph.
// (args is a HostArgs*: a type of the anonymous namespace in the signature would give the
// function internal linkage, and the library would not export it)
static int run_call(const void* args, const void* q, const int* vlen, const int* rstart, float* po, float* pm,
                    float* pl, void* out, int* counters, void* stream) {
  const HostArgs* a = static_cast<const HostArgs*>(args);
  Params p = {};
  p.q = q; p.qtype = a->qtype;
  p.kc = (const uint8_t*)a->kc; p.ks = (const uint16_t*)a->ks; p.kz = (const uint16_t*)a->kz;
  p.vc = (const uint8_t*)a->vc; p.vs = (const uint16_t*)a->vs; p.vz = (const uint16_t*)a->vz;
  p.kr = (const uint16_t*)a->kr; p.vr = (const uint16_t*)a->vr;
  p.khs = a->khs; p.vhs = a->vhs;
  p.k_cs = a->k_cs; p.k_ss = a->k_ss; p.v_cs = a->v_cs; p.v_ss = a->v_ss; p.k_rs = a->k_rs; p.v_rs = a->v_rs;
  p.T = a->T; p.Hkv = a->Hkv; p.gqa = a->gqa; p.qsh = a->qsh;
  p.steps_per_split = a->per; p.nsplit = a->nsplit; p.qk_scale = a->qk_scale;
  p.po = po; p.pm = pm; p.pl = pl;
  p.counters = counters; p.out = out; p.otype = a->otype;
  if (a->qsh < 0 || a->qsh > 1) return (int)cudaErrorInvalidValue;
  const int rows = (a->B * a->Hkv) << a->qsh;  // the grid's rows: 1 or 2 CTAs per kv row
  cudaStream_t s = (cudaStream_t)stream;
  p.vlen = vlen;
  p.rstart = rstart;
  if (a->kind == 1) {
    if (vlen && a->KP <= 0) return -2;  // KIVI: a device count needs the window policies (a graph view's plan)
    return run_kivi(*a, p, rows, out, s);
  }
  return run_rows(*a, p, rows, out, s);
}

extern "C" int kvq_run(const void* args, const void* q, const int* vlen, const int* rstart, float* po, float* pm,
                       float* pl, void* out, void* stream) {
  if (FUSED_BUILD) return (int)cudaErrorInvalidValue;  // (this build's calls are kvq_run_fused's)
  return run_call(args, q, vlen, rstart, po, pm, pl, out, nullptr, stream);
}

// The call of a FUSED_BUILD (library.py FusedCombine), one launch: as kvq_run, and counters:
// B * Hkv int32 at zero (each launch leaves them at zero), this call's alone while it runs
// (a call at the same time takes other counters, as it takes other partials).
extern "C" int kvq_run_fused(const void* args, const void* q, const int* vlen, const int* rstart, float* po,
                             float* pm, float* pl, void* out, int* counters, void* stream) {
  if (!FUSED_BUILD || !counters) return (int)cudaErrorInvalidValue;
  return run_call(args, q, vlen, rstart, po, pm, pl, out, counters, stream);
}

extern "C" int kvq_fused_build() { return FUSED_BUILD; }

// Programmatic dependent launch of the combine on (1) or off (0): common.cuh pdl_on (library.py PDL).
extern "C" void kvq_set_pdl(int on) { pdl_on = on; }

// Registers of the KIVI instances: tail = 0 the quantized part (variant), 1 the tail path.
extern "C" int kvq_num_regs_kivi(int bits, int tail, int variant, int D) {
  if (tail) variant = 2;  // (the tail path is a branch of the same kernel since run 17)
  return kivi_dispatch(D, bits, KiviQuery{variant, REGS});
}

extern "C" int kvq_num_variants() { return NVARIANTS; }

// Registers per thread of an instance (the loader records them; NOTES.md quotes ptxas).
extern "C" int kvq_num_regs(int fmt, int D, int variant) { KVQ_DISPATCH(query_of, (variant, REGS)) }

// CTAs of an instance resident per SM (< 0: -error, -1: no such head dim / format / variant).
extern "C" int kvq_occupancy(int fmt, int D, int variant) { KVQ_DISPATCH(query_of, (variant, OCCUPANCY)) }
extern "C" int kvq_occupancy_kivi(int bits, int variant, int D) {
  return kivi_dispatch(D, bits, KiviQuery{variant, OCCUPANCY});
}
