// Fused split-K decode attention over HQMQ caches (S secondaries with 12-bit codes,
// r=4 uniform radius levels, head_dim 64, 128 or 256: Dims; Med3x outliers: see below), CUDA C++ with mma.sync
// from registers. Built at first use by kernels/cuda_hqmq.py (nvcc -> a shared library
// called through ctypes). kernels/NOTES.md ("CUDA HQMQ decode") has the design and the
// figures.
//
// Same skeleton as kernels/cuda/decode_attention.cu (int4/fp8), written separately; the
// helpers both use (mma, movmatrix, cp.async, the nibble LOP3, the online softmax, the
// combine kernel and its launch) are in common.cuh.
//
// One CTA of NW warps per (b * Hkv + h, split). The CTA first copies the kv head's two
// codebooks (K and V, [24 S, 4] fp16 = 192 S bytes each, 18 KB at S=96) into shared
// memory; every chunk of 4 dims is then ONE 8-byte LDS gather table[code] (two half2),
// times its radius code rq (0..15, exact in fp16 by the magic-number trick: one LOP3 +
// one HSUB2 per two chunks): one rounding of cw * rq. The token's r_max / 15 is applied
// in fp32 outside the mma: K to the scores (s_t = r_max_t / 15 sum_c rq <q_c, cw_c>),
// V to P (p_t r_max_t / 15, then rounded to fp16 as P is anyway). GPU run 1 (NOTES.md)
// rounded rhat = rq * round16(r_max / 15) into the decode as Triton does: ~3e-3 relative
// output error at the tolerance's edge, and 16 more HMUL2 per tile.
// Each warp streams its 16-token tiles through SMS cp.async stages (K and V codes 48 B
// per token, radius 16 B per token, and a 16-byte-aligned 48-byte window of r_max).
//
// Tokens on the mma M axis, GQA heads (<= 8) on N (as the int4 kernel):
//   S^T[16 tok, 8] = K[16 tok, 128] Q^T     (A = K: lane (g, c) owns chunks 8c..8c+7 of
//                                            tokens g, g+8; chunk 8c+kk feeds k-step kk:
//                                            dims 0,1 -> k 2c,2c+1; dims 2,3 -> k 2c+8,2c+9;
//                                            Q loaded in the same permuted order)
//   O^T[128, 8] += V^T[128, 16 tok] P^T      (A = V^T: lane g owns chunks 4g..4g+3 of
//                                            tokens 2c, 2c+1, 2c+8, 2c+9; the two tokens'
//                                            gathered codewords are interleaved by PRMT
//                                            into (t, t+1) pairs of one dim)
// so per chunk: 2 address ops (SHF/LOP3), 1 LDS.64, 2 HMUL2 (+2 PRMT for V), and the
// radius code (~1 per chunk); an HMMA per 2 chunks.
//
// Med3x caches (the OUT instances, see tile_step) add their fp16 outlier chunks by extra
// mma; variants 9 and 10 (PF) stage each tile's outliers one tile ahead (out_meta).
// Mixed-radix code rows (pack=mixed, S = 96, head dim 64 / 128 / 256: the MIX instances of
// v3, v10) land in the stage as copied and are rewritten there as 12-bit rows before the
// tile is read (mixed_tile_to_bits), so the decode above is the same. At 256 each half of a
// row (8 groups of 45 bits: 45 bytes) is a head dim 128 row, so each warp of a pair copies
// and rewrites its half as d 128 does.

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include <type_traits>

#include "common.cuh"
#include "mixed_codes.cuh"

namespace {


// The head dim D (64, 128, 256) fixes a token's bytes and how many chunks a lane decodes:
// lane c takes KC = D/16 chunks of K (one per k-step), lane g VC = D/32 of V (two m-tiles
// each), as at 128. What needs care is alignment: at 64 a token's codes are 24 bytes and a
// lane's K codes 6 bytes at byte 6c, its V codes 3 bytes at 3g (shifted out of two words).
template <int D>
struct Dims {
  static_assert(D == 64 || D == 128 || D == 256, "HQMQ: head dim 64, 128 or 256");
  static constexpr int NC = D / 4;        // chunks per token
  static constexpr int CB = NC * 12 / 8;  // code bytes per token (24, 48, 96)
  static constexpr int RB = NC * 4 / 8;   // radius bytes per token (8, 16, 32)
  static constexpr int KS = D / 16;       // k-steps of QK^T = m-tiles of PV = K chunks of a lane
  static constexpr int VC = D / 32;       // V chunks of a lane
  static constexpr int FB = NC / 8;       // Med3x flag bytes per token (2, 4, 8)
  // codes are copied in pieces of PIECE bytes that never straddle two tokens (24-byte rows: 8)
  static constexpr int PIECE = CB % 16 ? 8 : 16, PPT = CB / PIECE, NPC = 16 * PPT;  // per token / per tile
  using FlagT = typename std::conditional<FB == 2, uint16_t,
                                          typename std::conditional<FB == 4, uint32_t, uint2>::type>::type;
  // D = 256 splits the head over the two warps of a pair (SPL): each decodes, scores and
  // accumulates its DW = 128 dims with d = 128's code, the pair adds its two partial scores
  // through shared memory before the softmax. Doubling every per-thread array instead took
  // 194-203 registers (offline), one CTA of 8 warps per SM.
  static constexpr int SPL = D > 128 ? 2 : 1, DW = D / SPL;
};

// One source, two libraries (library.py FusedCombine), as decode_attention.cu: built with
// -DKVQ_FUSED_COMBINE=1 every split kernel is its FUSED instance (its last CTA of a row group
// merges the partials: common.cuh combine_rows), one launch a call; the default build is
// the split kernel and the combine launch, its kernels exactly as before.
#ifndef KVQ_FUSED_COMBINE
#define KVQ_FUSED_COMBINE 0
#endif
constexpr bool FUSED_BUILD = KVQ_FUSED_COMBINE != 0;

struct Params {
  const void* q;  // [B, Hq, 1, D], qtype 0 fp16, 1 bf16, 2 fp32
  const uint8_t* kc;  // codes [B, Hkv, Tcap, 48]
  const uint8_t* kr;  // radius codes [B, Hkv, Tcap, 16]
  const uint16_t* km;  // r_max [B, Hkv, Tcap] fp16 bits
  const uint8_t* vc;
  const uint8_t* vr;
  const uint16_t* vm;
  const uint16_t* ktab;  // [Hkv, 24 S, 4] fp16 codebook of K
  const uint16_t* vtab;
  long long k_cs, k_rs, k_ms, v_cs, v_rs, v_ms;  // per-(b, h) strides in elements
  // Med3x (the OUT instances): flag words [B, Hkv, Tcap] (bit c = chunk c is an outlier),
  // the fp16 outlier chunks per (b, h) in (token, chunk) order as 8-byte items, and the
  // start of each 64-token block's outliers within that list; strides in those units
  const uint32_t* kf;
  const uint32_t* vf;
  const uint2* ko;
  const uint2* vo;
  const int* ki;
  const int* vi;
  long long k_fs, k_os, k_is, v_fs, v_os, v_is;
  const int* vlen;  // device-side valid length (nullptr: T); T is then the capacity bound
  const int* rstart;  // a left-padded batch: null, or per batch row its first key (keys below masked)
  int qtype, T, Hkv, gqa, steps_per_split, nsplit, tab_bytes;  // tab_bytes = 24 S cw (one table)
  int qsh;  // log2 of the CTAs per kv row (decode_attention.cu Params.qsh); gqa = heads a CTA
  float qk_scale;
  float* po;
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
// helpers (the shared ones: common.cuh)
// ---------------------------------------------------------------------------------
__device__ __forceinline__ __half2 h2(uint32_t u) {
  __half2 h;
  memcpy(&h, &u, 4);
  return h;
}
__device__ __forceinline__ uint32_t u32(__half2 h) {
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}
// nibbles at bits 0-3 and 16-19 (HI: 4-7, 20-23) of x as an exact half2: one LOP3 + HSUB2
template <bool HI>
__device__ __forceinline__ __half2 nibbles(uint32_t x) {
  return __hsub2(h2(nibbles_magic<HI>(x)), h2(HI ? MAGIC_HI : MAGIC_LO));  // common.cuh
}
// fp16 r_max bits -> r_max / 15 in fp32 (rounded to fp16 by the caller, as the Triton kernel does)
__device__ __forceinline__ float rm15(uint32_t bits) {
  return __half2float(__ushort_as_half((unsigned short)bits)) * (1.f / 15.f);  // within an fp32 ulp of the quotient
}

// ---------------------------------------------------------------------------------
// one warp stage: the bytes of a 16-token tile
// ---------------------------------------------------------------------------------
template <int D>
struct Stage {  // of one warp: its DW dims' bytes (the whole row's flags)
  static constexpr int CB = Dims<Dims<D>::DW>::CB, RB = Dims<Dims<D>::DW>::RB, FB = Dims<D>::FB;
  static constexpr int KC = 0, VC = 16 * CB, KR = 2 * 16 * CB, VR = KR + 16 * RB, KM = VR + 16 * RB, VM = KM + 48;
  static constexpr int BYTES = VM + 48;  // 2144 at D = 128
  // Med3x: the tile's 16 flag rows per role (token t of role r at FL + FLR r + FB t; at D = 64
  // FL + FLR r + 2 (t + fsh): see copy_tile) and the 64-token block's outlier start per role
  static constexpr int FLR = D == 64 ? 40 : 16 * FB;  // bytes per role (64: 9 words + padding)
  static constexpr int FL = BYTES, OX = FL + 2 * FLR;  // K at +0, V at +FLR (flags) / +4 (start)
  static constexpr int BYTES_OUT = OX + 16;  // 2288 at D = 128
};
// MIX at head dim 256 (RAW16): a tile's raw half rows land in 64-byte slots (16-byte pieces
// from the boundary below each: see copy_tile), K's from the stage's start over its code
// regions, V's in MIX_RAW bytes past the stage's end. With Med3x that 1 KB more per stage
// would leave one v10 CTA of 8 warps per SM (118 KB with the fp16 codebook), so Med3x's
// instance there is one CTA of 16 warps (WIDE_MIX: 200 KB, the tables once per SM).
template <int D, bool MIX>
constexpr bool RAW16 = MIX && D == 256;
template <bool OUT, int D, bool MIX>
constexpr bool WIDE_MIX = OUT && RAW16<D, MIX>;
template <int D, bool MIX>
constexpr int MIX_RAW = RAW16<D, MIX> ? 16 * 64 : 0;
template <bool OUT, int D = 128, bool MIX = false>
constexpr int STAGE_BYTES = (OUT ? Stage<D>::BYTES_OUT : Stage<D>::BYTES) + MIX_RAW<D, MIX>;

// A lane's global source pointers for its copies of the next tile (advanced by warp strides).
template <int D>
struct CpCursor {
  const uint8_t* c0;  // codes piece `lane` (K for lanes 0..31), piece lane + 32 (lanes 0..15) ...
  const uint8_t* vc0;
  const uint8_t* r;   // radius row lane & 15: K (lanes 0..15) or V (16..31)
  const uint8_t* m;   // r_max window granule (lanes 0..2 K, 3..5 V)
  const uint8_t* mlast;  // last valid r_max byte of this lane's tensor (the window is read only up to it)
  const typename Dims<D>::FlagT* frow;  // Med3x: flag rows of this lane's role (lanes 0..15 K, 16..31 V)
  const int* irow;       // Med3x: its 64-token block starts
  int t0;
  int i;  // tiles copied so far (Med3x: position in the 64-token block)
  int fsh;  // D = 64: 1 when the role's flag rows start 2 bytes past a 4-byte boundary (odd capacity)
  int o1;   // D = 256: bytes from code chunk `lane` of the warp's half tile to chunk lane + 32
  int kmis, vmis;  // MIX: bytes from the 16-byte boundary below the (b, h)'s K / V code rows to them
};

// Tokens from one tile of a warp to its next: NW tiles on (a warp takes every NW-th tile),
// or with Med3x (OUT) the warp takes whole 64-token blocks (4 tiles), every NW-th block,
// so it can carry the running outlier offset within a block.
template <int NW, bool OUT>
__device__ __forceinline__ int tile_advance(int i) {
  if constexpr (OUT) return (i & 3) == 3 ? (NW - 1) * 64 + 16 : 16;
  else return NW * 16;
}

// PF (the Med3x variants that fetch the outliers one tile ahead): the stage of tile n carries
// the flag words and block start of tile n + 1 instead of its own (on1: tile n + 1 is one of
// the warp's), so they are in shared memory while tile n runs; tile 0's come from global memory.
// cp.async of N <= 16 bytes of which only the first `src` are read (the rest zero-filled):
// Med3x flag rows of 2 bytes at D = 64, copied two tokens per 4-byte copy
__device__ __forceinline__ void cp_async4_part(uint32_t dst, const void* src, int n) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(n) : "memory");
}

// Bytes of a token's code row in global memory: 12-bit codes (Dims::CB) or mixed-radix (MIX;
// head dim 256: two head dim 128 rows, packing.py's groups of 4 codes falling on byte 45)
template <int D, bool MIX>
__host__ __device__ constexpr int code_row_bytes() {
  if constexpr (MIX && D == 256) return 2 * mixed::Layout<128>::MB;
  else if constexpr (MIX) return mixed::Layout<D>::MB;
  else return Dims<D>::CB;
}

// cp.async of 16 bytes of which only the first n (0..16) are read, the rest zero-filled
__device__ __forceinline__ void cp_async16_part(uint32_t dst, const void* src, int n) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n) : "memory");
}

// NW: the warps (D = 256: warp pairs) streaming tiles; CB, RB of the global rows (the
// cursor's strides), the stage holds the warp's DW dims.
// MIX: mixed-radix code rows (mixed_codes.cuh; MB bytes a token): a tile's 16 rows are
// 16 MB bytes, a multiple of 16, from `mis` bytes past a 16-byte boundary (the (b, h) row's
// start: any capacity), copied as MB + 1 pieces of 16 bytes from that boundary into the
// stage's code regions (the tile at byte mis), the bytes past the valid tokens zero-filled
// (code 0); the tile loop rewrites them as 12-bit rows in place. Head dim 256: the warp's
// 45-byte halves lie 90 bytes apart, so each goes to its own 64-byte slot (RAW16: K's over the
// code regions, V's past the stage: MIX_RAW) as 4 pieces of 16 bytes from the boundary below
// it ((10 t + mis) % 16 bytes below, mis the tile's first half row's; the pieces' bytes past
// the half row are not read: cp.async's source size), 2 copies a lane per role that bypass L1.
template <int NW, bool OUT, bool PF = false, int D = 128, bool MIX = false>
__device__ __forceinline__ void copy_tile(uint32_t st, CpCursor<D>& cur, int T, bool on, int lane, bool on1 = false) {
  using Stage = ::Stage<D>;
  using DD = Dims<D>;
  [[maybe_unused]] constexpr int CB = DD::CB;
  constexpr int RB = DD::RB;
  const int STEP = tile_advance<NW, OUT>(cur.i);
  if constexpr (RAW16<D, MIX>) {
    constexpr int HB = mixed::Layout<128>::MB, RAWV = STAGE_BYTES<OUT, D, MIX> - MIX_RAW<D, MIX>;
    static_assert(16 * 64 <= Stage::KR, "K's raw slots stay clear of the radius rows");
    // (not unrolled, as below)
#pragma unroll 1
    for (int j = 0; j < 2; ++j) {
      const int i = lane + 32 * j, t = i >> 2, pc = i & 3;  // piece pc of token t's half row
      const bool ok = on && cur.t0 + t < T;
      // the half row's bytes past a 16-byte boundary (90 bytes a row: 10 t more each token)
      const int ak = (10 * t + cur.kmis) & 15, av = (10 * t + cur.vmis) & 15;
      const int row = code_row_bytes<D, MIX>() * t + 16 * pc;  // from the tile's first half row
      cp_async16_part(st + 64 * t + 16 * pc, cur.c0 + row - ak, ok ? max(0, min(16, ak + HB - 16 * pc)) : 0);
      cp_async16_part(st + RAWV + 64 * t + 16 * pc, cur.vc0 + row - av, ok ? max(0, min(16, av + HB - 16 * pc)) : 0);
    }
  } else if constexpr (MIX) {
    constexpr int MB = mixed::Layout<D>::MB, NPM = MB + 1;
    const int valid = (T - cur.t0) * MB;  // the valid tokens' bytes from the tile's start
#pragma unroll
    for (int j = 0; j < (NPM + 31) / 32; ++j) {
      const int i = lane + 32 * j;  // piece i: bytes 16 i .. 16 i + 15 from the boundary
      if (i < NPM) {
        const int nk = on ? max(0, min(16, cur.kmis + valid - 16 * i)) : 0;
        const int nv = on ? max(0, min(16, cur.vmis + valid - 16 * i)) : 0;
        cp_async16_part(st + Stage::KC + 16 * i, cur.c0 + 512 * j, nk);
        cp_async16_part(st + Stage::VC + 16 * i, cur.vc0 + 512 * j, nv);
      }
    }
  } else if constexpr (D >= 128) {  // 48 code bytes a token in the stage (256: the warp's half of the row)
    {
      const int i = lane;  // code chunk i: token i / 3
      const bool ok = on && cur.t0 + i / 3 < T;
      cp_async<16>(st + Stage::KC + 16 * i, cur.c0, ok);
      cp_async<16>(st + Stage::VC + 16 * i, cur.vc0, ok);
    }
    if (lane < 16) {
      const int i = lane + 32;
      const bool ok = on && cur.t0 + i / 3 < T;
      cp_async<16>(st + Stage::KC + 16 * i, cur.c0 + (D == 128 ? 512 : cur.o1), ok);
      cp_async<16>(st + Stage::VC + 16 * i, cur.vc0 + (D == 128 ? 512 : cur.o1), ok);
    }
  } else {
    constexpr int P = DD::PIECE;
#pragma unroll
    for (int j = 0; j < (DD::NPC + 31) / 32; ++j) {
      const int i = lane + 32 * j;  // piece i: token i / PPT
      if (DD::NPC % 32 == 0 || i < DD::NPC) {
        const bool ok = on && cur.t0 + i / DD::PPT < T;
        cp_async<P>(st + Stage::KC + P * i, cur.c0 + 32 * P * j, ok);
        cp_async<P>(st + Stage::VC + P * i, cur.vc0 + 32 * P * j, ok);
      }
    }
  }
  if constexpr (D >= 128) {  // (256: the warp's 16 bytes of the token's 32)
    const bool ok = on && cur.t0 + (lane & 15) < T;
    cp_async<16>(st + (lane < 16 ? Stage::KR : Stage::VR) + 16 * (lane & 15), cur.r, ok);
  } else {
    const bool ok = on && cur.t0 + (lane & 15) < T;
#pragma unroll
    for (int x = 0; x < (RB + 15) / 16; ++x) {  // one token's radius row: 8 bytes
      constexpr int N = RB < 16 ? RB : 16;
      cp_async<N>(st + (lane < 16 ? Stage::KR : Stage::VR) + RB * (lane & 15) + 16 * x, cur.r + 16 * x, ok);
    }
  }
  if (lane < 6) {
    // granule (lane % 3) of the 16-byte-aligned window over this tile's r_max: copied only
    // if it holds a valid token's byte (so it lies inside the allocation)
    const bool ok = on && cur.m <= cur.mlast;
    cp_async<16>(st + (lane < 3 ? Stage::KM : Stage::VM) + 16 * (lane % 3), cur.m, ok);
  }
  if constexpr (OUT && PF) {  // the next tile's flags and (at a block's first tile) outlier starts
    const int t1 = cur.t0 + STEP;
    if constexpr (DD::FB == 2) {
      // 2-byte rows, 4-byte copies: lanes 0..8 (K) / 16..24 (V) copy word l of the window
      // from token t1 - fsh (4-byte aligned: an odd capacity puts every other (b, h) row 2
      // bytes off), the valid tokens' bytes only (zeros past T); token t1 + i then lies at
      // byte 2 (i + fsh) of the role's region. (Token t1 - 1 is inside the allocation: only a
      // row that starts off the boundary, so not the first, has fsh = 1.)
      const int a = t1 - cur.fsh + 2 * (lane & 15);
      if ((lane & 15) < 9)
        cp_async4_part(st + Stage::FL + Stage::FLR * (lane >> 4) + 4 * (lane & 15), cur.frow + a,
                       on1 ? 2 * max(0, min(2, T - a)) : 0);
    } else {
      const int t = t1 + (lane & 15);
      cp_async<DD::FB>(st + Stage::FL + DD::FB * lane, cur.frow + t, on1 && t < T);
    }
    if (((cur.i + 1) & 3) == 0 && (lane & 15) == 0)
      cp_async<4>(st + Stage::OX + (lane >> 2), cur.irow + (t1 >> 6), on1);
  } else if constexpr (OUT) {
    static_assert(D == 128, "the direct Med3x path (variants 0, 2) is head dim 128's only");
    const int t = cur.t0 + (lane & 15);  // lanes 0..15: K flags of token lane, 16..31: V's
    cp_async<4>(st + Stage::FL + 4 * lane, cur.frow + t, on && t < T);
    if ((cur.i & 3) == 0 && (lane & 15) == 0)  // the block's outlier start, at its first tile
      cp_async<4>(st + Stage::OX + (lane >> 2), cur.irow + (cur.t0 >> 6), on);
  }
  cur.i += 1;
  cur.t0 += STEP;
  cur.c0 += STEP * code_row_bytes<D, MIX>();
  cur.vc0 += STEP * code_row_bytes<D, MIX>();
  cur.r += STEP * RB;
  cur.m += STEP * 2;
}

// ---------------------------------------------------------------------------------
// the tile: K decode + scores, online softmax, V decode + PV
// ---------------------------------------------------------------------------------
// (decode_attention.cu's load_q with KiviQ's kdim; kept apart, as it says why)
// DW: the dims of this warp, dims [DW hf, DW hf + DW) of q's D (D = 256: a pair's half)
template <int DW, int D, typename QT>
__device__ __forceinline__ void load_q(const QT* q, long long row, bool real, int c, uint32_t (&qb)[DW / 16][2],
                                       int hf = 0) {
  constexpr int KS = DW / 16;
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
    for (int slot = 0; slot < 2; ++slot) {
      float x[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = DW * hf + 4 * (KS * c + kk) + 2 * slot + half;
        float v = 0.f;
        if (real) {
          if constexpr (std::is_same<QT, float>::value) v = q[row * D + d];
          else if constexpr (std::is_same<QT, __half>::value) v = __half2float(q[row * D + d]);
          else v = __uint_as_float((uint32_t)q[row * D + d] << 16);  // bf16 bits
        }
        x[half] = v;
      }
      qb[kk][slot] = pack_half2(x[0], x[1]);
    }
  }
}

// CW: bytes per codeword in the shared table: 8 (fp16 components) or 4 (codebook=int8:
// components k + 128, k = round(127 u); see gather)
template <int CW>
constexpr int CW_SHIFT = CW == 8 ? 3 : 2;  // log2 CW
template <int CW>
constexpr uint32_t CW_MASK = 0xFFFu << CW_SHIFT<CW>;

// code kk (0..7) of the 96-bit little-endian stream w0 w1 w2, times CW (a byte offset into the table)
template <int KK, int CW = 8>
__device__ __forceinline__ uint32_t code8(uint32_t w0, uint32_t w1, uint32_t w2) {
  // shifted right by (bit % 32) - log2 CW, so the code lands at bits 3..14 (CW 4: 2..13):
  // one SHF + one LOP3
  constexpr int bit = 12 * KK, wi = bit / 32, sh = bit % 32, L = CW_SHIFT<CW>;
  const uint32_t lo = wi == 0 ? w0 : (wi == 1 ? w1 : w2);
  const uint32_t hi = wi == 0 ? w1 : w2;
  uint32_t x;
  if constexpr (sh < L) x = lo << (L - sh);
  else if constexpr (sh + 12 > 32) x = __funnelshift_r(lo, hi, sh - L);
  else x = lo >> (sh - L);
  return x & CW_MASK<CW>;
}
// code KK of the little-endian stream w[0..N), times CW (code8 over N words: D = 64's shifted pair)
template <int KK, int N, int CW = 8>
__device__ __forceinline__ uint32_t code8n(const uint32_t (&w)[N]) {
  constexpr int bit = 12 * KK, wi = bit / 32, sh = bit % 32, L = CW_SHIFT<CW>;
  const uint32_t lo = w[wi];
  const uint32_t hi = wi + 1 < N ? w[wi + 1 < N ? wi + 1 : wi] : 0u;
  uint32_t x;
  if constexpr (sh < L) x = lo << (L - sh);
  else if constexpr (sh + 12 > 32) x = __funnelshift_r(lo, hi, sh - L);
  else x = lo >> (sh - L);
  return x & CW_MASK<CW>;
}

// The codeword at byte offset off as two half2 (components 0, 1 and 2, 3). CW 4 (codebook=int8):
// one 4-byte load (a random 4-byte gather costs about half the shared-memory wavefronts of an
// 8-byte one: reports/latency/cb8_experiment_h100_2026-12-06/, 134 -> 93 per d 64 tile); each
// byte k + 128 goes into the mantissa of fp16 1024 + byte (one PRMT per pair), minus 1152:
// k exactly. The 1/127 is applied outside (CW_SCALE: the K scores' scale, the V partials).
template <int CW>
__device__ __forceinline__ uint2 gather(const uint8_t* tab, uint32_t off) {
  if constexpr (CW == 8) {
    return *reinterpret_cast<const uint2*>(tab + off);
  } else {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(tab + off);
    const __half2 bias = __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));  // 1152
    return make_uint2(u32(__hsub2(h2(__byte_perm(w, 0x64646464u, 0x4140)), bias)),
                      u32(__hsub2(h2(__byte_perm(w, 0x64646464u, 0x4342)), bias)));
  }
}
template <int CW>
constexpr float CW_SCALE = CW == 8 ? 1.f : 1.f / 127.f;  // gathered codeword x CW_SCALE = the format's codeword
template <int CW>
constexpr float CW_UNSCALE = CW == 8 ? 1.f : 127.f;  // (exactly; 1 / CW_SCALE need not round to 127)

// One K chunk's q.K step, shared by k_generic (D = 64) and tile_step's D = 128 path (one copy
// of the gather + scale + mma): the codewords at table byte offsets o0 (token g) and o8 (g + 8)
// times their radius nibble (nibble 1 if hi) of x, into the scores s against q's k-step qk.
template <int CW>
__device__ __forceinline__ void k_chunk(float (&s)[4], const uint8_t* ktab, uint32_t o0, uint32_t o8, uint32_t x,
                                        bool hi, uint32_t qk0, uint32_t qk1) {
  const __half2 rh = hi ? nibbles<true>(x) : nibbles<false>(x);  // (rq of token g, of g+8), exact
  const uint2 cg = gather<CW>(ktab, o0);
  const uint2 cg8 = gather<CW>(ktab, o8);
  const __half2 rg = __low2half2(rh), rg8 = __high2half2(rh);
  mma16816(s, u32(__hmul2(h2(cg.x), rg)), u32(__hmul2(h2(cg8.x), rg8)), u32(__hmul2(h2(cg.y), rg)),
           u32(__hmul2(h2(cg8.y), rg8)), qk0, qk1);
}

// One V chunk's P@V step, shared by v_generic (D = 64) and tile_step's D = 128 path (one copy
// of the gather + scale + 2 mma): the codewords at table byte offsets o0..o3 (tokens 2c, 2c+1,
// 2c+8, 2c+9) times their radius nibble (HI = nibble 1 if hi) of x01 / x89, into m-tiles a0
// (the codewords' .x halves) and a1 (.y); hi is a constant of the unrolled callers' loops
template <int CW>
__device__ __forceinline__ void pv_chunk(float (&a0)[4], float (&a1)[4], const uint8_t* vtab, uint32_t o0,
                                         uint32_t o1, uint32_t o2, uint32_t o3, uint32_t x01, uint32_t x89,
                                         bool hi, uint32_t pb0, uint32_t pb1) {
  const __half2 r01 = hi ? nibbles<true>(x01) : nibbles<false>(x01);  // (rq_2c, rq_2c+1), exact
  const __half2 r89 = hi ? nibbles<true>(x89) : nibbles<false>(x89);
  const uint2 c0 = gather<CW>(vtab, o0), c1 = gather<CW>(vtab, o1);
  const uint2 c8 = gather<CW>(vtab, o2), c9 = gather<CW>(vtab, o3);
  mma16816(a0, u32(__hmul2(h2(__byte_perm(c0.x, c1.x, 0x5410)), r01)),
           u32(__hmul2(h2(__byte_perm(c0.x, c1.x, 0x7632)), r01)),
           u32(__hmul2(h2(__byte_perm(c8.x, c9.x, 0x5410)), r89)),
           u32(__hmul2(h2(__byte_perm(c8.x, c9.x, 0x7632)), r89)), pb0, pb1);
  mma16816(a1, u32(__hmul2(h2(__byte_perm(c0.y, c1.y, 0x5410)), r01)),
           u32(__hmul2(h2(__byte_perm(c0.y, c1.y, 0x7632)), r01)),
           u32(__hmul2(h2(__byte_perm(c8.y, c9.y, 0x5410)), r89)),
           u32(__hmul2(h2(__byte_perm(c8.y, c9.y, 0x7632)), r89)), pb0, pb1);
}

// The joint step's chunks (tile_step_joint: a GQA group of 16 as one CTA): k_chunk's and
// pv_chunk's gathers and scaling as A fragments, each fed to two mma by the caller. (Not
// shared with k_chunk / pv_chunk: routing those through these changed the SASS of 15 of the
// 103 existing instances, offline; kept apart, every existing instance is byte-identical.)
template <int CW>
__device__ __forceinline__ void k_frags(uint32_t (&a)[4], const uint8_t* ktab, uint32_t o0, uint32_t o8, uint32_t x,
                                        bool hi) {
  const __half2 rh = hi ? nibbles<true>(x) : nibbles<false>(x);
  const uint2 cg = gather<CW>(ktab, o0), cg8 = gather<CW>(ktab, o8);
  const __half2 rg = __low2half2(rh), rg8 = __high2half2(rh);
  a[0] = u32(__hmul2(h2(cg.x), rg));
  a[1] = u32(__hmul2(h2(cg8.x), rg8));
  a[2] = u32(__hmul2(h2(cg.y), rg));
  a[3] = u32(__hmul2(h2(cg8.y), rg8));
}
template <int CW>
__device__ __forceinline__ void pv_frags(uint32_t (&f)[2][4], const uint8_t* vtab, uint32_t o0, uint32_t o1, uint32_t o2,
                                         uint32_t o3, uint32_t x01, uint32_t x89, bool hi) {
  const __half2 r01 = hi ? nibbles<true>(x01) : nibbles<false>(x01);
  const __half2 r89 = hi ? nibbles<true>(x89) : nibbles<false>(x89);
  const uint2 c0 = gather<CW>(vtab, o0), c1 = gather<CW>(vtab, o1);
  const uint2 c8 = gather<CW>(vtab, o2), c9 = gather<CW>(vtab, o3);
  const uint32_t lo[4] = {c0.x, c1.x, c8.x, c9.x}, hi4[4] = {c0.y, c1.y, c8.y, c9.y};
#pragma unroll
  for (int y = 0; y < 2; ++y) {
    const uint32_t* w = y ? hi4 : lo;
    f[y][0] = u32(__hmul2(h2(__byte_perm(w[0], w[1], 0x5410)), r01));
    f[y][1] = u32(__hmul2(h2(__byte_perm(w[0], w[1], 0x7632)), r01));
    f[y][2] = u32(__hmul2(h2(__byte_perm(w[2], w[3], 0x5410)), r89));
    f[y][3] = u32(__hmul2(h2(__byte_perm(w[2], w[3], 0x7632)), r89));
  }
}

// Med3x outliers are ADDED by two more mma per tile: the format stores radius code 0 for an
// outlier chunk (quantizers/hqmq.py encode: rq of where(outlier, 0, r); kernels/step_encode.py
// writes the same bytes), so the quantized path contributes 0 there, and
//   scores += qk * O_K q  (A = the tile's K outliers, zeros elsewhere; unscaled by r_max),
//   O^T    += O_V^T P^T   (P without V's r_max / 15).
// A chunk's outlier is item pre(t) + popc(flags_t below the chunk) of its (b, h) list, with
// pre(t) = the block start + the popcounts of the block's earlier tokens: `run` carries the
// count over the warp's consecutive tiles of a block (lanes 0..15 for K, 16..31 for V), a
// 16-lane scan gives the tile's tokens. Loads come from global memory (L2: the lists are
// small), issued before the quantized path that hides their latency.
struct OutRows {
  const uint2* k;  // this (b, h)'s K outlier list
  const uint2* v;
};

// ---- PF: the outliers one tile ahead (variants 9, 10; NOTES.md "Med3x outliers one tile ahead")
// While tile j runs, the warp already reads tile j+1's flag words (in tile j's stage, see
// copy_tile), scans them, writes the tile's bookkeeping into its half of the warp's double
// buffer and cp.asyncs tile j+1's whole outlier run there: its nK K items and then its nV V
// items are consecutive in their lists, so lane l copies slots l, l + 32, ... (8 bytes each,
// coalesced). Tile j+1 then reads its mma fragments from that buffer (LDS) right before the
// outlier mma, once its copy group has landed (issued a whole tile earlier): the L2 latency
// sits behind a tile, and no fragment or bookkeeping registers live across the quantized parts
// (the direct path held 64 fragment registers). Only the k-steps (K) / chunk columns (V) with
// an outlier in some lane of the tile get an mma. A tile of more than OCAP items is not copied:
// it reads its fragments from global memory (as the direct path, without the prefetch).
constexpr int OCAP = 128;  // items per buffer; call 17b's data: ~40 per tile (K only), the tests' ~80
constexpr int OPL = OCAP / 32;  // item copies per lane
// A token's Med3x flags as one integer (bit c = chunk c): 64 bits at D = 256
template <int D>
using FlagW = typename std::conditional<D == 256, unsigned long long, uint32_t>::type;
__device__ __forceinline__ int popc(uint32_t x) { return __popc(x); }
__device__ __forceinline__ int popc(unsigned long long x) { return __popcll(x); }
template <int D>
__device__ __forceinline__ FlagW<D> flags_at(const uint8_t* p) {  // a flag row in shared memory
  if constexpr (D == 64) return *reinterpret_cast<const uint16_t*>(p);
  else if constexpr (D == 128) return *reinterpret_cast<const uint32_t*>(p);
  else return *reinterpret_cast<const unsigned long long*>(p);
}

template <int D = 128>
struct PfBuf {  // one tile's half of a warp's double buffer (the same at every head dim)
  static constexpr int IT = 0;              // OCAP items (uint2)
  static constexpr int WS = OCAP * 8;       // [32] {flag word, first slot} of token lane & 15, role lane >> 4
  static constexpr int U = WS + 32 * 8;     // {k0, v0, mask, n}: list index of slot 0 (K, V), see out_meta
  static constexpr int BYTES = U + 16;      // 1296
};
// entry of token `tok` (role K: 0..15, V: 16..31) in the buffer half pb: (the warp's flag
// word, the slot of its first chunk)
template <int D>
__device__ __forceinline__ void ws_get(const uint8_t* pb, int tok, FlagW<D>& fw, int& first) {
  const int2 ws = *reinterpret_cast<const int2*>(pb + PfBuf<D>::WS + 8 * tok);
  fw = (uint32_t)ws.x;
  first = ws.y;
}

// Tile bookkeeping from its flag words fl (lane: token lane & 15 of role lane >> 4; 0 past T)
// and the list positions runk / runv of its first K / V outlier (warp-uniform; advanced past
// it), into buffer half pb (shared address pa); then the copies of its items (not committed).
// Slots: K items at 0 .. nK-1, V items at nK .. nK+nV-1; u.mask bits 0..KS-1: k-steps kk with a
// K outlier in some lane (chunk KS c + kk), bits KS..KS+VC-1: V chunk columns jj (chunk VC g + jj);
// at D = 128 bits 0..7 and 8..11. D = 256 (a warp pair, hf: this warp's half): the slots and
// counts are the whole rows', the entries and masks this warp's word of them (as d = 128's).
template <int D = 128>
__device__ __forceinline__ void out_meta(FlagW<D> fl, int& runk, int& runv, const OutRows& orow, int lane,
                                         uint8_t* pb, uint32_t pa, int hf = 0) {
  using PfBuf = ::PfBuf<D>;
  const int x = popc(fl);
  int inc = x;
#pragma unroll
  for (int d = 1; d < 16; d <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, inc, d, 16);
    if ((lane & 15) >= d) inc += y;
  }
  const int nk = __shfl_sync(0xffffffffu, inc, 15), nv = __shfl_sync(0xffffffffu, inc, 31);
  constexpr int DW = Dims<D>::DW, KS = DW / 16;
  constexpr uint32_t KM = (1u << KS) - 1u, VM = (1u << (DW / 32)) - 1u;
  uint32_t kk, mv;  // k-steps with a K outlier (bit KS c + kk of some lane c folded onto kk), V columns
  if constexpr (D == 256) {  // the warp's 32 chunks: 8 per lane c (K), 4 per lane g (V), as at 128
    const uint32_t lo = (uint32_t)fl, hi = (uint32_t)(fl >> 32), mine = hf ? hi : lo;
    *reinterpret_cast<int2*>(pb + PfBuf::WS + 8 * lane) =
        make_int2((int)mine, inc - x + (lane >= 16 ? nk : 0) + (hf ? __popc(lo) : 0));
    const uint32_t mk = __reduce_or_sync(0xffffffffu, lane < 16 ? mine : 0u);
    mv = __reduce_or_sync(0xffffffffu, lane < 16 ? 0u : mine);
    kk = mk | (mk >> 8) | (mk >> 16) | (mk >> 24);
    mv |= mv >> 16;
    mv |= mv >> 8;
    mv |= mv >> 4;
  } else {
    *reinterpret_cast<int2*>(pb + PfBuf::WS + 8 * lane) = make_int2((int)fl, inc - x + (lane >= 16 ? nk : 0));
    const uint32_t mk = __reduce_or_sync(0xffffffffu, lane < 16 ? fl : 0u);
    mv = __reduce_or_sync(0xffffffffu, lane < 16 ? 0u : fl);
    if constexpr (D == 128) {
      kk = mk | (mk >> 8) | (mk >> 16) | (mk >> 24);
      mv |= mv >> 16;
      mv |= mv >> 8;
      mv |= mv >> 4;
    } else {  // 16 chunks: 4 per lane c (K), 2 per lane g (V)
      kk = mk | (mk >> 4) | (mk >> 8) | (mk >> 12);
      mv |= mv >> 8;
      mv |= mv >> 4;
      mv |= mv >> 2;
    }
  }
  const int n = nk + nv;
  if (lane == 0)
    *reinterpret_cast<int4*>(pb + PfBuf::U) = make_int4(runk, runv - nk, (int)((kk & KM) | ((mv & VM) << KS)), n);
  if (n <= OCAP) {
    const uint2* kp = orow.k + runk;  // slot sl of K (sl < nk) / of V (nk <= sl < n): kp + sl / vp + sl
    const uint2* vp = orow.v + (runv - nk);
#pragma unroll
    for (int i = 0; i < OPL; ++i) {
      const int sl = lane + 32 * i;
      if (32 * i < n) cp_async<8>(pa + PfBuf::IT + 8 * sl, (sl < nk ? kp : vp) + sl, sl < n);  // (uniform test)
    }
  }
  runk += nk;
  runv += nv;
}

// item of buffer slot sl (role K or V): from the buffer, or (G: the tile overflowed it) from
// global memory at list index u.x + sl (K) / u.y + sl (V)
template <bool G, bool K>
__device__ __forceinline__ uint2 out_item(const uint8_t* pb, const int4& u, const OutRows& orow, int sl) {
  if constexpr (G) return __ldg((K ? orow.k + u.x : orow.v + u.y) + sl);
  else return *reinterpret_cast<const uint2*>(pb + PfBuf<>::IT + 8 * sl);
}

// RUN (variant 11, PF = 2): a lane's next slot kept as a running count, one predicated add per
// item it takes, instead of a popcount of the bits below each k-step (AND, POPC, ADD per item
// slot and k-step: Nsight Compute put Med3x at +59% instructions over HQMQ on an H100,
// reports/latency/h100_2026-12-07b/ncu_hqmq_med3_d128.txt). The same items in the same mma
// slots, so the same bits.
// scores (s[4] of tokens g, g+8) += qk * (the tile's K outliers) q; lane c's chunks KS c ..
template <bool G, int D = 128, bool RUN = false>
__device__ __forceinline__ void out_scores(float (&s)[4], const uint8_t* pb, const int4& u, const OutRows& orow,
                                           float qk, const uint32_t (&qb)[D / 16][2], int g, int c) {
  constexpr int KS = D / 16;
  constexpr uint32_t KMASK = (1u << KS) - 1u;
  uint32_t bits[2];
  int sl[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    FlagW<D> fw;
    int first;
    ws_get<D>(pb, g + 8 * i, fw, first);
    sl[i] = first + popc(fw & ((FlagW<D>(1) << (KS * c)) - FlagW<D>(1)));
    bits[i] = (uint32_t)(fw >> (KS * c)) & KMASK;
  }
  float so[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    if (((uint32_t)u.z >> kk) & 1u) {  // warp-uniform
      uint2 a[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        a[i] = make_uint2(0u, 0u);
        if ((bits[i] >> kk) & 1u) {
          if constexpr (RUN) {
            a[i] = out_item<G, true>(pb, u, orow, sl[i]++);
          } else {
            a[i] = out_item<G, true>(pb, u, orow, sl[i] + __popc(bits[i] & ((1u << kk) - 1u)));
          }
        }
      }
      mma16816(so, a[0].x, a[1].x, a[0].y, a[1].y, qb[kk][0], qb[kk][1]);
    }
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) s[e] += qk * so[e];
}

// O^T += (the tile's V outliers)^T P^T (qb0, qb1: P^T without r_max / 15); the lane's tokens
// 2c, 2c+1, 2c+8, 2c+9, chunks VC g .. VC g + VC - 1 (4g .. 4g+3 at D = 128)
template <bool G, int D = 128, bool RUN = false>  // (RUN: as out_scores)
__device__ __forceinline__ void out_values(float (&acc)[D / 16][4], const uint8_t* pb, const int4& u,
                                           const OutRows& orow, int g, int c, uint32_t qb0, uint32_t qb1) {
  constexpr int KS = D / 16, VC = D / 32;
  constexpr uint32_t VMASK = (1u << VC) - 1u;
  uint32_t bits[4];
  int sl[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int t = 2 * c + (j & 1) + 8 * (j >> 1);
    FlagW<D> fw;
    int first;
    ws_get<D>(pb, 16 + t, fw, first);
    sl[j] = first + popc(fw & ((FlagW<D>(1) << (VC * g)) - FlagW<D>(1)));
    bits[j] = (uint32_t)(fw >> (VC * g)) & VMASK;
  }
#pragma unroll
  for (int jj = 0; jj < VC; ++jj) {
    if (((uint32_t)u.z >> (KS + jj)) & 1u) {  // warp-uniform
      uint2 vo[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        vo[j] = make_uint2(0u, 0u);
        if ((bits[j] >> jj) & 1u) {
          if constexpr (RUN) {
            vo[j] = out_item<G, false>(pb, u, orow, sl[j]++);
          } else {
            vo[j] = out_item<G, false>(pb, u, orow, sl[j] + __popc(bits[j] & ((1u << jj) - 1u)));
          }
        }
      }
      mma16816(acc[2 * jj], __byte_perm(vo[0].x, vo[1].x, 0x5410), __byte_perm(vo[0].x, vo[1].x, 0x7632),
               __byte_perm(vo[2].x, vo[3].x, 0x5410), __byte_perm(vo[2].x, vo[3].x, 0x7632), qb0, qb1);
      mma16816(acc[2 * jj + 1], __byte_perm(vo[0].y, vo[1].y, 0x5410), __byte_perm(vo[0].y, vo[1].y, 0x7632),
               __byte_perm(vo[2].y, vo[3].y, 0x5410), __byte_perm(vo[2].y, vo[3].y, 0x7632), qb0, qb1);
    }
  }
}

// ---- the quantized path at D = 64 (tile_step keeps D = 128's verbatim, which D = 256's
// warp pairs run too: its timing was measured in that form). Same arithmetic; a lane's codes
// lie at unaligned bytes of the 24-byte rows.
// K: tokens g, g+8; lane c's 4 chunks 4c .. 4c + 3 (one per k-step): the scores s (unscaled)
// and the tokens' r_max / 15 (rk).
template <int D, int CW>
__device__ __forceinline__ void k_generic(const uint8_t* st, const uint8_t* ktab, int moff_k,
                                          const uint32_t (&qb)[D / 16][2], float (&s)[4], float (&rk)[2], int g,
                                          int c) {
  static_assert(D == 64, "D = 64's layout");
  using Stage = ::Stage<D>;
  constexpr int KS = D / 16, CB = Dims<D>::CB, RB = Dims<D>::RB;
  uint32_t off[2][KS], rw[2], rmb[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int t = g + 8 * i;
    // 48 bits at byte 6c: from the word pair at 4 (3c / 2), shifted by 16 (c & 1)
    const uint8_t* row = st + Stage::KC + t * CB + 4 * ((3 * c) >> 1);
    const uint32_t w0 = *reinterpret_cast<const uint32_t*>(row), w1 = *reinterpret_cast<const uint32_t*>(row + 4);
    const int sh = 16 * (c & 1);
    const uint32_t w[2] = {__funnelshift_r(w0, w1, sh), w1 >> sh};
    rw[i] = *reinterpret_cast<const uint16_t*>(st + Stage::KR + t * RB + 2 * c);
    rmb[i] = *reinterpret_cast<const uint16_t*>(st + Stage::KM + moff_k + 2 * t);
    off[i][0] = code8n<0, 2, CW>(w);
    off[i][1] = code8n<1, 2, CW>(w);
    off[i][2] = code8n<2, 2, CW>(w);
    off[i][3] = code8n<3, 2, CW>(w);
  }
  rk[0] = rm15(rmb[0]);
  rk[1] = rm15(rmb[1]);
  const uint32_t rlo = __byte_perm(rw[0], rw[1], 0x5410);  // chunks 0-3 of g, g+8
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    k_chunk<CW>(s, ktab, off[0][kk], off[1][kk], (kk & 2) ? rlo >> 8 : rlo, kk & 1, qb[kk][0], qb[kk][1]);
  }
}

// V: tokens 2c, 2c+1, 2c+8, 2c+9; lane g's 2 chunks 2g, 2g + 1: O^T += V^T P^T (pb0, pb1)
template <int D, int CW>
__device__ __forceinline__ void v_generic(const uint8_t* st, const uint8_t* vtab, float (&acc)[D / 16][4],
                                          uint32_t pb0, uint32_t pb1, int g, int c) {
  static_assert(D == 64, "D = 64's layout");
  using Stage = ::Stage<D>;
  constexpr int VC = D / 32, CB = Dims<D>::CB, RB = Dims<D>::RB;
  uint32_t off[4][VC];
  uint32_t rb[4];  // the lane's radius byte (2 nibbles) of each token
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int t = 2 * c + (j & 1) + 8 * (j >> 1);
    // 24 bits at byte 3g: from the word pair at 4 (3g / 4), shifted by 8 (3g % 4)
    const uint8_t* row = st + Stage::VC + t * CB + 4 * ((3 * g) >> 2);
    const uint32_t w0 = *reinterpret_cast<const uint32_t*>(row), w1 = *reinterpret_cast<const uint32_t*>(row + 4);
    const uint32_t lo = __funnelshift_r(w0, w1, 8 * ((3 * g) & 3));
    off[j][0] = (lo << CW_SHIFT<CW>) & CW_MASK<CW>;
    off[j][1] = (lo >> (12 - CW_SHIFT<CW>)) & CW_MASK<CW>;
    rb[j] = st[Stage::VR + t * RB + g];
  }
  const uint32_t x01 = __byte_perm(rb[0], rb[1], 0x5410), x89 = __byte_perm(rb[2], rb[3], 0x5410);
  // chunk jj = m-tiles 2 jj, 2 jj + 1; its radius nibble is nibble jj of the byte
#pragma unroll
  for (int jj = 0; jj < VC; ++jj) {
    pv_chunk<CW>(acc[2 * jj], acc[2 * jj + 1], vtab, off[0][jj], off[1][jj], off[2][jj], off[3][jj], x01, x89,
                 jj != 0, pb0, pb1);
  }
}

// MIX: the landed stage's mixed-radix code rows (copy_tile) rewritten in place as the 12-bit
// rows tile_step reads. Lane l takes row t = l & 15 of role l >> 4: its MB bytes at mis + MB t
// from the region's start, its 12-bit row to CB t (16- / 8-byte stores without bank
// conflicts). Every lane reads its row before any lane writes (the rows overlap). The caller
// syncs the warp before the stage is read. Head dim 256 (RAW16): the warp's half rows (head
// dim 128 rows) lie in 64-byte slots, token t's (10 t + mis) % 16 bytes in (K's from the
// stage's start, V's at raw_v), and go to the 12-bit rows' places.
template <int D>
__device__ __forceinline__ void mixed_tile_to_bits(uint8_t* st, int lane, int mis, int raw_v = 0) {
  constexpr int DW = Dims<D>::DW;  // (256: the warp's half)
  using L = mixed::Layout<DW>;
  constexpr int CB = Stage<D>::CB;
  uint8_t* base = st + (lane < 16 ? Stage<D>::KC : Stage<D>::VC);
  const int t = lane & 15;
  const uint8_t* src = raw_v ? st + (lane < 16 ? 0 : raw_v) + 64 * t : base;
  const int b0 = raw_v ? (10 * t + mis) & 15 : mis + L::MB * t;
  const int sh = 8 * (b0 & 3);
  // (the words read past a row stay in the stage: the K region's run into V's, V's into the
  // radius rows; their bits are masked off)
  const uint32_t* w = reinterpret_cast<const uint32_t*>(src + (b0 & ~3));
  uint32_t r[L::NX + 1], x[L::NX], o[L::NO];
#pragma unroll
  for (int i = 0; i <= L::NX; ++i) r[i] = w[i];
#pragma unroll
  for (int i = 0; i < L::NX; ++i) x[i] = __funnelshift_r(r[i], r[i + 1], sh);
  mixed::to_bits<DW>(x, o);
  __syncwarp();
  if constexpr (CB % 16 == 0) {
#pragma unroll
    for (int i = 0; i < L::NO / 4; ++i)
      reinterpret_cast<uint4*>(base + CB * t)[i] = make_uint4(o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < L::NO / 2; ++i) reinterpret_cast<uint2*>(base + CB * t)[i] = make_uint2(o[2 * i], o[2 * i + 1]);
  }
}

// PF: the tile's outliers from its half pb of the warp's buffer (filled one tile ahead; its
// item copies are the last group but two: the loop commits the stage of tile j + SMS - 1 and
// tile j + 1's items after them)
// SPL = 2 (head dim 256): D is the warp's 128 dims; its partial scores are added to its
// partner's (pair_add: xb, hf, bar) before the softmax.
// t0, T: token positions shifted down by the row's first key lo (0 without row_start): token
// t scores iff 0 <= t - lo < T, one unsigned compare.
// The K code rows of tokens g, g+8 at head dim 128 (the lane's chunks 8c .. 8c+7) from a stage:
// each chunk's table byte offset (off[token][chunk]), r_max / 15 of both tokens in fp32 (rk:
// applied to the fp32 scores) and their chunk radii (rlo: chunks 0-3 of g, g+8; rhi: 4-7).
// tile_step and tile_step_joint read them alike.
template <int CW>
__device__ __forceinline__ void k_row_offsets(const uint8_t* st, int moff_k, int g, int c, uint32_t (&off)[2][8],
                                              float (&rk)[2], uint32_t& rlo, uint32_t& rhi) {
  using Stage = ::Stage<128>;
  constexpr int CB = Dims<128>::CB, RB = Dims<128>::RB;
  uint32_t w[2][3], rw[2], rmb[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int t = g + 8 * i;
    const uint8_t* row = st + Stage::KC + t * CB + 12 * c;
    w[i][0] = *reinterpret_cast<const uint32_t*>(row);
    w[i][1] = *reinterpret_cast<const uint32_t*>(row + 4);
    w[i][2] = *reinterpret_cast<const uint32_t*>(row + 8);
    rw[i] = *reinterpret_cast<const uint32_t*>(st + Stage::KR + t * RB + 4 * c);
    rmb[i] = *reinterpret_cast<const uint16_t*>(st + Stage::KM + moff_k + 2 * t);
  }
  rk[0] = rm15(rmb[0]);
  rk[1] = rm15(rmb[1]);
  rlo = __byte_perm(rw[0], rw[1], 0x5410);
  rhi = __byte_perm(rw[0], rw[1], 0x7632);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    off[i][0] = code8<0, CW>(w[i][0], w[i][1], w[i][2]);
    off[i][1] = code8<1, CW>(w[i][0], w[i][1], w[i][2]);
    off[i][2] = code8<2, CW>(w[i][0], w[i][1], w[i][2]);
    off[i][3] = code8<3, CW>(w[i][0], w[i][1], w[i][2]);
    off[i][4] = code8<4, CW>(w[i][0], w[i][1], w[i][2]);
    off[i][5] = code8<5, CW>(w[i][0], w[i][1], w[i][2]);
    off[i][6] = code8<6, CW>(w[i][0], w[i][1], w[i][2]);
    off[i][7] = code8<7, CW>(w[i][0], w[i][1], w[i][2]);
  }
}

// The radius bytes of k-step kk's chunk for tokens g, g+8 (from k_row_offsets' rlo / rhi).
__device__ __forceinline__ uint32_t k_radii(uint32_t rlo, uint32_t rhi, int kk) {
  const uint32_t x = kk < 4 ? rlo : rhi;
  return (kk & 2) ? x >> 8 : x;
}

// The V code rows of tokens 2c, 2c+1, 2c+8, 2c+9 at head dim 128 (the lane's chunks 4g .. 4g+3):
// each chunk's table byte offset (off[token][chunk]) and the tokens' chunk radii as byte pairs
// (u01: tokens 2c, 2c+1; u89: 2c+8, 2c+9; each t.b0 t.b1 t1.b0 t1.b1).
template <int CW>
__device__ __forceinline__ void v_row_offsets(const uint8_t* st, int g, int c, uint32_t (&off)[4][4], uint32_t& u01,
                                              uint32_t& u89) {
  using Stage = ::Stage<128>;
  constexpr int CB = Dims<128>::CB, RB = Dims<128>::RB;
  const int sh = 16 * (g & 1);
  const int wo = 4 * ((3 * g) >> 1);  // byte of the word holding bit 48 g of the row
  uint32_t rb[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int t = 2 * c + (j & 1) + 8 * (j >> 1);
    const uint8_t* row = st + Stage::VC + t * CB + wo;
    const uint32_t w0 = *reinterpret_cast<const uint32_t*>(row), w1 = *reinterpret_cast<const uint32_t*>(row + 4);
    const uint32_t lo = __funnelshift_r(w0, w1, sh), hi = w1 >> sh;  // bits 48g .. 48g+47 of the row
    constexpr int L = CW_SHIFT<CW>;
    off[j][0] = (lo << L) & CW_MASK<CW>;  // code * CW: a byte offset into the table
    off[j][1] = (lo >> (12 - L)) & CW_MASK<CW>;
    off[j][2] = __funnelshift_r(lo, hi, 24 - L) & CW_MASK<CW>;
    off[j][3] = (hi >> (4 - L)) & CW_MASK<CW>;
    rb[j] = *reinterpret_cast<const uint16_t*>(st + Stage::VR + t * RB + 2 * g);
  }
  u01 = __byte_perm(rb[0], rb[1], 0x5410);
  u89 = __byte_perm(rb[2], rb[3], 0x5410);
}

template <bool OUT, int PF = 0, int D = 128, int SPL = 1, int CW = 8>  // (PF: 0, 1, 2 = 1 with RUN)
__device__ __forceinline__ void tile_step(const uint8_t* st, const uint8_t* ktab, const uint8_t* vtab, int moff_k,
                                          int moff_v, int t0, int T, float qk, const uint32_t (&qb)[D / 16][2],
                                          float (&acc)[D / 16][4], float (&m)[2], float (&l)[2], int g, int c,
                                          int& run, bool block_start, const OutRows& orow,
                                          const uint8_t* pb = nullptr, uint8_t* xb = nullptr, int hf = 0,
                                          int bar = 0) {
  using Stage = ::Stage<D>;
  constexpr int KS = D / 16;
  static_assert(D == 128 || !OUT || PF, "the direct Med3x path (variants 0, 2) is head dim 128's only");
  const int lane = 4 * g + c;
  int4 u = make_int4(0, 0, 0, 0);  // PF: {k0, v0, mask, n} of the tile (warp-uniform)
  if constexpr (OUT && PF) u = *reinterpret_cast<const int4*>(pb + PfBuf<D>::U);
  // ---- Med3x: flags, offsets, the K outliers' loads
  uint32_t myw = 0, outb = 0;
  int pre_l = 0;
  uint2 ko[2][8];
  if constexpr (OUT && !PF) {
    myw = *reinterpret_cast<const uint32_t*>(st + Stage::FL + 4 * lane);  // K token lane / V token lane - 16
    const int x = __popc(myw);
    int inc = x;
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, inc, o, 16);
      if ((lane & 15) >= o) inc += y;
    }
    if (block_start) run = *reinterpret_cast<const int*>(st + Stage::OX + 4 * (lane >> 4));
    pre_l = run + inc - x;  // outliers of this role before token (lane & 15) of the tile
    run += __shfl_sync(0xffffffffu, inc, 15, 16);
    outb = __ballot_sync(0xffffffffu, myw != 0);  // bits 0..15: K tokens with outliers, 16..31: V
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) ko[i][kk] = make_uint2(0u, 0u);
    if (outb & 0xFFFFu) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int t = g + 8 * i;
        const uint32_t fw = __shfl_sync(0xffffffffu, myw, t);
        int idx = __shfl_sync(0xffffffffu, pre_l, t) + __popc(fw & ((1u << (8 * c)) - 1u));
        const uint32_t bits = fw >> (8 * c);
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
          if ((bits >> kk) & 1u) ko[i][kk] = __ldg(orow.k + idx);
          idx += (bits >> kk) & 1u;
        }
      }
    }
  }
  // ---- K: tokens g, g+8; chunks 8c .. 8c+7 (KS c .. KS c + KS - 1: k_generic)
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  float rk[2];
  if constexpr (D != 128) {
    k_generic<D, CW>(st, ktab, moff_k, qb, s, rk, g, c);
  } else {
    uint32_t off[2][8], rlo, rhi;
    k_row_offsets<CW>(st, moff_k, g, c, off, rk, rlo, rhi);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      const uint32_t x = k_radii(rlo, rhi, kk);
      k_chunk<CW>(s, ktab, off[0][kk], off[1][kk], x, kk & 1, qb[kk][0], qb[kk][1]);
    }
  }
  {
    const float qc = qk * CW_SCALE<CW>;  // (the outliers' scores below take qk itself)
    s[0] *= qc * rk[0]; s[1] *= qc * rk[0]; s[2] *= qc * rk[1]; s[3] *= qc * rk[1];
  }
  uint2 vo[4][4];
  if constexpr (OUT && PF) {
    if (u.z) {  // the tile's item copies have landed (each lane's), and every lane's are visible
      cp_wait<2>();
      __syncwarp();
    }
    if (u.z & ((1 << KS) - 1)) {  // the K outliers' scores, unscaled by r_max
      if (u.w > OCAP) out_scores<true, D, PF == 2>(s, pb, u, orow, qk, qb, g, c);
      else out_scores<false, D, PF == 2>(s, pb, u, orow, qk, qb, g, c);
    }
  } else if constexpr (OUT) {
    if (outb & 0xFFFFu) {  // the K outliers' scores, unscaled by r_max
      float so[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < KS; ++kk)
        mma16816(so, ko[0][kk].x, ko[1][kk].x, ko[0][kk].y, ko[1][kk].y, qb[kk][0], qb[kk][1]);
#pragma unroll
      for (int e = 0; e < 4; ++e) s[e] += qk * so[e];
    }
    // the V outliers' loads (tokens 2c, 2c+1, 2c+8, 2c+9; chunks 4g .. 4g+3), consumed after P
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) vo[j][jj] = make_uint2(0u, 0u);
    if (outb >> 16) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int t = 2 * c + (j & 1) + 8 * (j >> 1);
        const uint32_t fw = __shfl_sync(0xffffffffu, myw, 16 + t);
        int idx = __shfl_sync(0xffffffffu, pre_l, 16 + t) + __popc(fw & ((1u << (4 * g)) - 1u));
        const uint32_t bits = fw >> (4 * g);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          if ((bits >> jj) & 1u) vo[j][jj] = __ldg(orow.v + idx);
          idx += (bits >> jj) & 1u;
        }
      }
    }
  }
  if constexpr (SPL == 2) pair_add(s, xb, hf, lane, bar);
  if ((unsigned)(t0 + g) >= (unsigned)T) s[0] = s[1] = NEG_INF;  // (t0, T: shifted by the row's first key)
  if ((unsigned)(t0 + g + 8) >= (unsigned)T) s[2] = s[3] = NEG_INF;

  // ---- online softmax per head (2c + e): common.cuh
  float p0, p1, p2, p3;
  online_softmax<KS>(s, m, l, acc, p0, p1, p2, p3);
  // V's r_max / 15 folded into P (v_t = (r_max_t / 15) rq cw): P^T carries p_t r_max_t / 15;
  // zero past T (and below the row's first key), so no garbage r_max of the capacity reaches the sums
  const float rv0 =
      (unsigned)(t0 + g) < (unsigned)T ? rm15(*reinterpret_cast<const uint16_t*>(st + Stage::VM + moff_v + 2 * g)) : 0.f;
  const float rv1 = (unsigned)(t0 + g + 8) < (unsigned)T
                        ? rm15(*reinterpret_cast<const uint16_t*>(st + Stage::VM + moff_v + 2 * (g + 8)))
                        : 0.f;
  const uint32_t pb0 = movtrans(pack_half2(p0 * rv0, p1 * rv0));  // P^T: k = tokens 2c, 2c+1; n = head g
  const uint32_t pb1 = movtrans(pack_half2(p2 * rv1, p3 * rv1));  //      k = tokens 2c+8, 2c+9

  // ---- V: tokens 2c, 2c+1 (pair 0), 2c+8, 2c+9 (pair 1); chunks 4g .. 4g+3 (VC g ..: v_generic)
  if constexpr (D != 128) {
    v_generic<D, CW>(st, vtab, acc, pb0, pb1, g, c);
  } else {
  uint32_t off[4][4], u01, u89;  // [token 2c, 2c+1, 2c+8, 2c+9][chunk jj] table byte offsets; radii
  v_row_offsets<CW>(st, g, c, off, u01, u89);
  // chunk jj of the lane = m-tiles 2 jj (dims 4jj, 4jj+1 = rows g, g+8) and 2 jj + 1 (dims 4jj+2, +3):
  // dim 16 g + 2 mt + row, as the merge below expects
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const uint32_t x01 = (jj & 2) ? (u01 >> 8) : u01, x89 = (jj & 2) ? (u89 >> 8) : u89;
    pv_chunk<CW>(acc[2 * jj], acc[2 * jj + 1], vtab, off[0][jj], off[1][jj], off[2][jj], off[3][jj], x01, x89,
                 (jj & 1) != 0, pb0, pb1);
  }
  }
  if constexpr (OUT && PF) {
    if (u.z >> KS) {  // the V outliers, weighted by P without r_max / 15 (CW 4: acc's scale, 127)
      constexpr float o = CW_UNSCALE<CW>;
      const uint32_t qb0 = movtrans(pack_half2(p0 * o, p1 * o)), qb1 = movtrans(pack_half2(p2 * o, p3 * o));
      if (u.w > OCAP) out_values<true, D, PF == 2>(acc, pb, u, orow, g, c, qb0, qb1);
      else out_values<false, D, PF == 2>(acc, pb, u, orow, g, c, qb0, qb1);
    }
  } else if constexpr (OUT) {
    if (outb >> 16) {  // the V outliers, weighted by P without r_max / 15 (CW 4: acc's scale, 127)
      constexpr float o = CW_UNSCALE<CW>;
      const uint32_t qb0 = movtrans(pack_half2(p0 * o, p1 * o)), qb1 = movtrans(pack_half2(p2 * o, p3 * o));
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        mma16816(acc[2 * jj], __byte_perm(vo[0][jj].x, vo[1][jj].x, 0x5410), __byte_perm(vo[0][jj].x, vo[1][jj].x, 0x7632),
                 __byte_perm(vo[2][jj].x, vo[3][jj].x, 0x5410), __byte_perm(vo[2][jj].x, vo[3][jj].x, 0x7632), qb0,
                 qb1);
        mma16816(acc[2 * jj + 1], __byte_perm(vo[0][jj].y, vo[1][jj].y, 0x5410),
                 __byte_perm(vo[0][jj].y, vo[1][jj].y, 0x7632), __byte_perm(vo[2][jj].y, vo[3][jj].y, 0x5410),
                 __byte_perm(vo[2][jj].y, vo[3][jj].y, 0x7632), qb0, qb1);
      }
    }
  }
}

// tile_step for a GQA group of 16 in one CTA (HH = 2 q-head halves of 8, JOINT_VARIANT): plain
// HQMQ at head dim 128, tile_step's arithmetic for each half in its order, but every codeword
// gathered and scaled once for both halves' mma (HQMQ is bound by its gathers: two CTAs of
// half the heads each gather every codeword of the row). The row reads and code offsets are
// tile_step's (k_row_offsets / v_row_offsets); its masks and P fold repeat tile_step's D = 128
// path on purpose, and the gathers stand apart from k_chunk / pv_chunk (routing those through
// shared helpers had moved 15 of the 103 existing instances' SASS).
// OUT (Med3x, PF = 1: v10's outliers one tile ahead): each half adds the tile's outlier scores
// and values as tile_step does (out_scores / out_values once per half: the items are few, and
// each half's sums keep v10's order).
template <int CW, bool OUT = false, int PF = 0>
__device__ __forceinline__ void tile_step_joint(const uint8_t* st, const uint8_t* ktab, const uint8_t* vtab,
                                                int moff_k, int moff_v, int t0, int T, float qk,
                                                const uint32_t (&qb)[2][8][2], float (&acc)[2][8][4],
                                                float (&m)[2][2], float (&l)[2][2], int g, int c,
                                                const OutRows& orow = OutRows{}, const uint8_t* pb = nullptr) {
  static_assert(!OUT || PF == 1, "the joint Med3x step is v10's (outliers one tile ahead)");
  using Stage = ::Stage<128>;
  constexpr int KS = 8;
  int4 u = make_int4(0, 0, 0, 0);  // OUT: {k0, v0, mask, n} of the tile (warp-uniform)
  if constexpr (OUT) u = *reinterpret_cast<const int4*>(pb + PfBuf<128>::U);
  float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  float rk[2];
  {
    uint32_t off[2][8], rlo, rhi;
    k_row_offsets<CW>(st, moff_k, g, c, off, rk, rlo, rhi);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      const uint32_t x = k_radii(rlo, rhi, kk);
      uint32_t a[4];
      k_frags<CW>(a, ktab, off[0][kk], off[1][kk], x, kk & 1);
      mma16816(s[0], a[0], a[1], a[2], a[3], qb[0][kk][0], qb[0][kk][1]);
      mma16816(s[1], a[0], a[1], a[2], a[3], qb[1][kk][0], qb[1][kk][1]);
    }
  }
  const float qc = qk * CW_SCALE<CW>;
  const float rv0 =
      (unsigned)(t0 + g) < (unsigned)T ? rm15(*reinterpret_cast<const uint16_t*>(st + Stage::VM + moff_v + 2 * g)) : 0.f;
  const float rv1 = (unsigned)(t0 + g + 8) < (unsigned)T
                        ? rm15(*reinterpret_cast<const uint16_t*>(st + Stage::VM + moff_v + 2 * (g + 8)))
                        : 0.f;
  uint32_t pb0[2], pb1[2];
  [[maybe_unused]] uint32_t qo0[2], qo1[2];  // OUT: P^T without r_max / 15, for the V outliers
  if constexpr (OUT) {
    if (u.z) {  // the tile's item copies have landed (each lane's), and every lane's are visible
      cp_wait<2>();
      __syncwarp();
    }
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    s[hh][0] *= qc * rk[0]; s[hh][1] *= qc * rk[0]; s[hh][2] *= qc * rk[1]; s[hh][3] *= qc * rk[1];
    if constexpr (OUT) {
      if (u.z & ((1 << KS) - 1)) {  // the K outliers' scores, unscaled by r_max
        if (u.w > OCAP) out_scores<true, 128>(s[hh], pb, u, orow, qk, qb[hh], g, c);
        else out_scores<false, 128>(s[hh], pb, u, orow, qk, qb[hh], g, c);
      }
    }
    if ((unsigned)(t0 + g) >= (unsigned)T) s[hh][0] = s[hh][1] = NEG_INF;
    if ((unsigned)(t0 + g + 8) >= (unsigned)T) s[hh][2] = s[hh][3] = NEG_INF;
    float p0, p1, p2, p3;
    online_softmax<KS>(s[hh], m[hh], l[hh], acc[hh], p0, p1, p2, p3);
    pb0[hh] = movtrans(pack_half2(p0 * rv0, p1 * rv0));
    pb1[hh] = movtrans(pack_half2(p2 * rv1, p3 * rv1));
    if constexpr (OUT) {  // (CW 4: acc's scale, 127)
      constexpr float o = CW_UNSCALE<CW>;
      qo0[hh] = movtrans(pack_half2(p0 * o, p1 * o));
      qo1[hh] = movtrans(pack_half2(p2 * o, p3 * o));
    }
  }
  uint32_t off[4][4], u01, u89;  // [token 2c, 2c+1, 2c+8, 2c+9][chunk jj] table byte offsets; radii
  v_row_offsets<CW>(st, g, c, off, u01, u89);
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const uint32_t x01 = (jj & 2) ? (u01 >> 8) : u01, x89 = (jj & 2) ? (u89 >> 8) : u89;
    uint32_t f[2][4];
    pv_frags<CW>(f, vtab, off[0][jj], off[1][jj], off[2][jj], off[3][jj], x01, x89, (jj & 1) != 0);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      mma16816(acc[hh][2 * jj], f[0][0], f[0][1], f[0][2], f[0][3], pb0[hh], pb1[hh]);
      mma16816(acc[hh][2 * jj + 1], f[1][0], f[1][1], f[1][2], f[1][3], pb0[hh], pb1[hh]);
    }
  }
  if constexpr (OUT) {
    if (u.z >> KS) {  // the V outliers, weighted by P without r_max / 15
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        if (u.w > OCAP) out_values<true, 128>(acc[hh], pb, u, orow, g, c, qo0[hh], qo1[hh]);
        else out_values<false, 128>(acc[hh], pb, u, orow, g, c, qo0[hh], qo1[hh]);
      }
    }
  }
}

template <int NW, int SMS, int TABB, bool OUT, bool PF = false, int D = 128, bool MIX = false>
constexpr int dyn_smem() {
  constexpr int SPL = Dims<D>::SPL, NP = NW / SPL;  // (D = 256: the pairs' score exchange, 2 KB each)
  constexpr int body = 2 * TABB + SMS * NW * STAGE_BYTES<OUT, D, MIX> + (OUT && PF ? NW * 2 * PfBuf<D>::BYTES : 0) +
                       (SPL == 2 ? NP * 2048 : 0);
  constexpr int red = NP * 8 * D * 4;
  return body > red ? body : red;
}

// TABB: bytes reserved per codebook (>= 192 S): the V table sits at a compile-time offset,
// so both gathers are [reg + immediate] LDS.64.
// OUT: Med3x (flags and outlier lists in Params; a split starts on a 64-token block).
// PF (with OUT): the outliers one tile ahead, through a per-warp double buffer after the stages.
// FUSED: the last CTA of a row group merges the group's partials into p.out (common.cuh
// combine_rows), no combine launch after it.
// MIX: mixed-radix code rows (S = 96, head dim 64 / 128 / 256: mixed_tile_to_bits).
// HH: q-head halves a CTA takes (2: JOINT_VARIANT, a GQA group of 16 as one CTA per kv row,
// tile_step_joint; blockIdx.x is then the kv row, half hh the q-head group 2 blockIdx.x + hh).
template <int NW, int SMS, int TABB, int MINB, bool OUT, int PF = 0, int D = 128, bool FUSED = false,
          int CW = 8, bool MIX = false, int HH = 1>
__global__ void __launch_bounds__(NW * 32, MINB) hqmq_split_kernel(const Params p) {
  pdl_trigger();  // (common.cuh: the combine may be launched once every split CTA is resident)
  using Stage = ::Stage<D>;
  using PfBuf = ::PfBuf<D>;
  using FlagT = typename Dims<D>::FlagT;
  // SPL = 2 (D = 256): warp pairs (wp) stream the tiles, warp hf of a pair takes dims
  // [128 hf, 128 hf + 128) (DW) of every row; else wp = warp, NP = NW, DW = D.
  constexpr int SPL = Dims<D>::SPL, NP = NW / SPL, DW = Dims<D>::DW;
  constexpr int SB = STAGE_BYTES<OUT, D, MIX>, KS = DW / 16, CB = Dims<D>::CB, RB = Dims<D>::RB;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wp = warp / SPL, hf = warp % SPL;
  const int g = lane >> 2, c = lane & 3;
  static_assert(HH == 1 || (HH == 2 && (!OUT || PF == 1) && D == 128),
                "joint halves: HQMQ or Med3x v10's path at head dim 128");
  // kv row (b Hkv + h; blockIdx.x: q-head group, HH = 2: the kv row), split
  const int bh = HH == 1 ? (int)blockIdx.x >> p.qsh : (int)blockIdx.x, sp = blockIdx.y;
  const int h = bh % p.Hkv;
  // (the other head dims name their dynamic shared memory apart: with one symbol for all, the
  // 64 / 256 instances changed how nvcc unrolled d = 128 v8's table copy)
  extern __shared__ __align__(16) uint8_t dsm[];
  extern __shared__ __align__(16) uint8_t dsm_d[];
  uint8_t* const dsm_of = D == 128 ? dsm : dsm_d;
  uint8_t* ktab = dsm_of;
  uint8_t* vtab = dsm_of + TABB;
  uint8_t* stages = dsm_of + 2 * TABB;

  // The valid length: p.T, or read from device memory at run time (CUDA-graph replays of a
  // growing cache) and clamped to the capacity p.T the splits were sized for. CTAs whose
  // tiles all lie past it run no tile and write an empty partial (m = -inf, l = 0, o = 0),
  // which the combine weights by 0.
  const int T = p.vlen ? max(0, min(__ldg(p.vlen), p.T)) : p.T;
  // a left-padded batch: the row's keys below lo are masked (tile_step sees tokens shifted by
  // lo, and Tlo keys past it)
  const int lo = p.rstart ? max(0, __ldg(p.rstart + bh / p.Hkv)) : 0;
  const int Tlo = max(T - lo, 0);
  const int nsteps = (T + 15) / 16;
  const int last = min(sp * p.steps_per_split + p.steps_per_split, nsteps);
  // tiles wholly below the row's first key are neither read nor scored (a split of pads runs
  // none); Med3x starts on the block holding lo (its outlier offsets run per 64-token block)
  const int first = max(sp * p.steps_per_split, OUT ? (lo >> 6) << 2 : lo >> 4);

  // ---- start this warp's pipeline first (the DRAM stream), then the tables
  CpCursor<D> cur;
  int moff_k, moff_v;
  {
    const int t0 = (first + (OUT ? 4 * wp : wp)) * 16;
    cur.t0 = t0;
    cur.i = 0;
    if constexpr (OUT) {
      cur.frow = lane < 16 ? reinterpret_cast<const FlagT*>(p.kf) + bh * p.k_fs
                           : reinterpret_cast<const FlagT*>(p.vf) + bh * p.v_fs;
      if constexpr (D == 64) cur.fsh = (int)((reinterpret_cast<uintptr_t>(cur.frow) >> 1) & 1);
      cur.irow = lane < 16 ? p.ki + bh * p.k_is : p.vi + bh * p.v_is;
    }
    if constexpr (SPL == 2 && MIX) {  // the warp's half row of token t0 (45 bytes at 45 hf of 90)
      constexpr int RBY = code_row_bytes<D, MIX>();
      cur.c0 = p.kc + bh * p.k_cs + (long long)t0 * RBY + (RBY / 2) * hf;
      cur.vc0 = p.vc + bh * p.v_cs + (long long)t0 * RBY + (RBY / 2) * hf;
      // (the same every tile: 16 tokens of 90 bytes are a multiple of 16)
      cur.kmis = (int)(reinterpret_cast<uintptr_t>(cur.c0) & 15);
      cur.vmis = (int)(reinterpret_cast<uintptr_t>(cur.vc0) & 15);
      cur.r = (lane < 16 ? p.kr + bh * p.k_rs : p.vr + bh * p.v_rs) + (long long)t0 * RB + RB * (lane & 15) +
              (RB / 2) * hf;
    } else if constexpr (SPL == 2) {  // chunk i (16 B) of the warp's half tile: token i / 3, bytes 48 hf + 16 (i % 3)
      const int o0 = (lane / 3) * CB + 16 * (lane % 3), i1 = lane + 32;
      cur.o1 = (i1 / 3) * CB + 16 * (i1 % 3) - o0;
      cur.c0 = p.kc + bh * p.k_cs + (long long)t0 * CB + (CB / 2) * hf + o0;
      cur.vc0 = p.vc + bh * p.v_cs + (long long)t0 * CB + (CB / 2) * hf + o0;
      cur.r = (lane < 16 ? p.kr + bh * p.k_rs : p.vr + bh * p.v_rs) + (long long)t0 * RB + RB * (lane & 15) +
              (RB / 2) * hf;
    } else {
      constexpr int piece = MIX ? 16 : Dims<D>::PIECE;  // (MIX: 16-byte pieces from a boundary)
      const uint8_t* kb = p.kc + bh * p.k_cs + (long long)t0 * code_row_bytes<D, MIX>();
      const uint8_t* vb = p.vc + bh * p.v_cs + (long long)t0 * code_row_bytes<D, MIX>();
      cur.kmis = MIX ? (int)(reinterpret_cast<uintptr_t>(kb) & 15) : 0;  // (t0 MB: a multiple of 16)
      cur.vmis = MIX ? (int)(reinterpret_cast<uintptr_t>(vb) & 15) : 0;
      cur.c0 = kb - cur.kmis + piece * lane;
      cur.vc0 = vb - cur.vmis + piece * lane;
      cur.r = (lane < 16 ? p.kr + bh * p.k_rs : p.vr + bh * p.v_rs) + (long long)t0 * RB + RB * (lane & 15);
    }
    const uint8_t* mk = reinterpret_cast<const uint8_t*>(p.km + bh * p.k_ms + t0);
    const uint8_t* mv = reinterpret_cast<const uint8_t*>(p.vm + bh * p.v_ms + t0);
    moff_k = (int)(reinterpret_cast<uintptr_t>(mk) & 15);
    moff_v = (int)(reinterpret_cast<uintptr_t>(mv) & 15);
    const uint8_t* mine = lane < 3 ? mk : mv;
    cur.m = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(mine) & ~uintptr_t(15)) + 16 * (lane % 3);
    cur.mlast = reinterpret_cast<const uint8_t*>(lane < 3 ? p.km + bh * p.k_ms + (T - 1) : p.vm + bh * p.v_ms + (T - 1));
  }
  // PF: tile 0's flag words and block starts straight from global memory (the stages carry
  // the next tile's), issued now so they land behind the table copy
  FlagW<D> fl0 = 0;
  int runk = 0, runv = 0;  // PF: list position of the next tile's first K / V outlier
  if constexpr (OUT && PF) {
    const int t = cur.t0 + (lane & 15);
    if constexpr (D == 256) {
      if (t < T) {
        const uint2 f = __ldg(cur.frow + t);
        fl0 = (unsigned long long)f.x | ((unsigned long long)f.y << 32);
      }
    } else {
      if (t < T) fl0 = __ldg(cur.frow + t);
    }
    if (cur.t0 < T) {
      runk = __ldg(p.ki + bh * p.k_is + (cur.t0 >> 6));
      runv = __ldg(p.vi + bh * p.v_is + (cur.t0 >> 6));
    }
  }
  // The kv head's two codebooks: cp.async, every thread's 16-byte pieces in flight at once
  // (one group, committed before the stage prologue, so the loop's first wait covers it).
  // GPU run 16 copied them through registers (__ldg + store, a few loads in flight per
  // thread): ~36 KB of L2 latency at the start of every CTA.
  {
    const uint8_t* kt = reinterpret_cast<const uint8_t*>(p.ktab) + (long long)h * p.tab_bytes;
    const uint8_t* vt = reinterpret_cast<const uint8_t*>(p.vtab) + (long long)h * p.tab_bytes;
    const uint32_t ka = smem_u32(ktab), va = smem_u32(vtab);
    const int n = p.tab_bytes / 16;
    for (int i = threadIdx.x; i < n; i += NW * 32) {
      cp_async<16>(ka + 16 * i, kt + 16 * i, true);
      cp_async<16>(va + 16 * i, vt + 16 * i, true);
    }
    cp_commit();
  }
  const uint8_t* wsm = stages + warp * (SMS * SB);
  const uint32_t wsa = smem_u32(wsm);
  int ntile;  // (the same for both warps of a pair: pair_add's barriers match)
  if constexpr (OUT) {  // whole blocks: the final block's tiles past T are masked (and cost a tile)
    const int nb = (last - first + 3) / 4;
    ntile = nb > wp ? 4 * ((nb - wp + NP - 1) / NP) : 0;
  } else {
    ntile = last > first + wp ? (last - first - wp + NP - 1) / NP : 0;
  }
#pragma unroll
  for (int i = 0; i < SMS - 1; ++i) {
    copy_tile<NP, OUT, PF != 0, D, MIX>(wsa + i * SB, cur, T, i < ntile, lane, i + 1 < ntile);
    cp_commit();
  }
  int run = 0;  // Med3x: outliers of this lane's role before the current tile, in its block
  OutRows orow;
  if constexpr (OUT) {
    orow.k = p.ko + bh * p.k_os;
    orow.v = p.vo + bh * p.v_os;
  }

  uint32_t qbh[HH][KS][2];
#pragma unroll
  for (int hh = 0; hh < HH; ++hh) {
    const bool real = g < p.gqa;
    const long long row = ((long long)blockIdx.x * HH + hh) * p.gqa + g;
    if (p.qtype == 0) load_q<DW, D>(reinterpret_cast<const __half*>(p.q), row, real, c, qbh[hh], hf);
    else if (p.qtype == 1) load_q<DW, D>(reinterpret_cast<const uint16_t*>(p.q), row, real, c, qbh[hh], hf);
    else load_q<DW, D>(reinterpret_cast<const float*>(p.q), row, real, c, qbh[hh], hf);
  }
  uint32_t(&qb)[KS][2] = qbh[0];
  float acch[HH][KS][4];
  float mh[HH][2], lh[HH][2];
  zero_halves(acch, mh, lh);
  float(&acc)[KS][4] = acch[0];
  float(&m)[2] = mh[0];
  float(&l)[2] = lh[0];
  // PF: tile 0's bookkeeping and item copies into buffer half 0 (fl0 is 0 for a warp without
  // tiles: nothing to copy); its own group, after the prologue's stages
  uint8_t* pfb = stages + NW * SMS * SB + warp * 2 * PfBuf::BYTES;
  const uint32_t pfa = smem_u32(pfb);
  // SPL = 2: the pair's score exchange (pair_add), two tiles' buffers of 1 KB
  uint8_t* xb = stages + NW * SMS * SB + (OUT && PF ? NW * 2 * PfBuf::BYTES : 0) + wp * 2048;
  if constexpr (OUT && PF) {
    out_meta<D>(fl0, runk, runv, orow, lane, pfb, pfa, hf);
    cp_commit();
    cp_wait<SMS>();  // the tables (the oldest group) have landed
  } else {
    cp_wait<SMS - 1>();  // this thread's table pieces (the oldest group) have landed
  }
  __syncthreads();     // and every thread's: the tables are in

  int rd = 0, wr = SMS - 1;
  for (int j = 0; j < ntile; ++j) {
    __syncwarp();
    copy_tile<NP, OUT, PF != 0, D, MIX>(wsa + wr * SB, cur, T, j + SMS - 1 < ntile, lane, j + SMS < ntile);
    cp_commit();
    if constexpr (OUT && PF) {
      // stage j: groups since it = tile j-1's items?, then per tile (stage, items) and the stage
      // just committed; SMS for j = 0 (the prologue's stages, tile 0's items), 2 SMS - 2 later
      cp_wait<SMS>();
      __syncwarp();
      // tile j+1's bookkeeping and item copies into the other half: its flags are in stage j
      const uint8_t* st = wsm + rd * SB;
      if (((j + 1) & 3) == 0) {  // it starts a block
        runk = *reinterpret_cast<const int*>(st + Stage::OX);
        runv = *reinterpret_cast<const int*>(st + Stage::OX + 4);
      }
      const int nb = ((j + 1) & 1) * PfBuf::BYTES;
      const uint8_t* fr = D == 64 ? st + Stage::FL + Stage::FLR * (lane >> 4) + 2 * ((lane & 15) + cur.fsh)
                                  : st + Stage::FL + Dims<D>::FB * lane;
      out_meta<D>(flags_at<D>(fr), runk, runv, orow, lane, pfb + nb, pfa + nb, hf);
      cp_commit();
    } else {
      cp_wait<SMS - 1>();
      __syncwarp();
    }
    const int tile = OUT ? first + 4 * (wp + NP * (j >> 2)) + (j & 3) : first + wp + j * NP;
    if constexpr (MIX) {
      mixed_tile_to_bits<D>(stages + warp * (SMS * SB) + rd * SB, lane, lane < 16 ? cur.kmis : cur.vmis,
                            RAW16<D, MIX> ? SB - MIX_RAW<D, MIX> : 0);
      __syncwarp();
    }
    if constexpr (HH == 2)
      tile_step_joint<CW, OUT, PF>(wsm + rd * SB, ktab, vtab, moff_k, moff_v, tile * 16 - lo, Tlo, p.qk_scale, qbh,
                                   acch, mh, lh, g, c, orow, pfb + (j & 1) * PfBuf::BYTES);
    else
      tile_step<OUT, PF, DW, SPL, CW>(wsm + rd * SB, ktab, vtab, moff_k, moff_v, tile * 16 - lo, Tlo, p.qk_scale, qb,
                                      acc, m, l, g, c, run, (j & 3) == 0, orow, pfb + (j & 1) * PfBuf::BYTES,
                                      xb + (j & 1) * 1024, hf, 1 + wp);
    rd = rd == SMS - 1 ? 0 : rd + 1;
    wr = wr == SMS - 1 ? 0 : wr + 1;
  }
  cp_wait<0>();

  // (HH = 2: the merge and partial below once per half; each starts at a barrier)
  __shared__ float sm_m[NP][8], sm_l[NP][8];
#pragma unroll
  for (int hh = 0; hh < HH; ++hh) {
  float(&m)[2] = mh[hh];
  float(&l)[2] = lh[hh];
  float(&acc)[KS][4] = acch[hh];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) l[e] += __shfl_xor_sync(0xffffffffu, l[e], o);
  }
  // (the merge and partial write as decode_attention.cu's, kept apart: it says why)
  // (a pair's two warps hold the same m, l: both write them; each its half of the dims)
  __syncthreads();  // every warp is done with the tables and stages (HH = 2: and the last half's reads)
  float(*red)[8][D] = reinterpret_cast<float(*)[8][D]>(dsm_of);
  if (g == 0) {
    sm_m[wp][2 * c] = m[0]; sm_m[wp][2 * c + 1] = m[1];
    sm_l[wp][2 * c] = l[0]; sm_l[wp][2 * c + 1] = l[1];
  }
  __syncthreads();
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int hd = 2 * c + e;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < NP; ++w) M = fmaxf(M, sm_m[w][hd]);
    // (CW 4: acc holds the V codewords' integers k, 127 u: CW_SCALE makes them the format's)
    const float f = (m[e] == NEG_INF) ? 0.f : exp2f(m[e] - M) * CW_SCALE<CW>;
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
    const long long prow = (((long long)blockIdx.x * HH + hh) * p.gqa + hd) * p.nsplit + sp;
    p.po[prow * D + d] = o;
    if (d == 0) {
      float M = NEG_INF, L = 0.f;
#pragma unroll
      for (int w = 0; w < NP; ++w) M = fmaxf(M, sm_m[w][hd]);
#pragma unroll
      for (int w = 0; w < NP; ++w) L += (sm_m[w][hd] == NEG_INF) ? 0.f : sm_l[w][hd] * exp2f(sm_m[w][hd] - M);
      // No valid token at all (valid length 0, or a row start at or past it): every split is
      // empty and the combine would return 0/0; split 0 then says (m = 0, l = 1, o = 0), so
      // the output is zeros, the flash-attention convention for a fully masked row.
      const bool none = Tlo == 0 && sp == 0;
      p.pm[prow] = none ? 0.f : M;
      p.pl[prow] = none ? 1.f : L;
    }
  }
  }
  if constexpr (FUSED) {  // (sm_m is free once every thread is past last_of_group's barrier)
    if (last_of_group(p.counters + blockIdx.x, p.nsplit)) {
      if constexpr (HH == 1)
        combine_rows<D>(p.po, p.pm, p.pl, p.out, p.otype, (long long)blockIdx.x * p.gqa, p.gqa, p.nsplit, &sm_m[0][0]);
      else  // (both halves' rows)
        combine_rows<D>(p.po, p.pm, p.pl, p.out, p.otype, (long long)blockIdx.x * HH * p.gqa, HH * p.gqa, p.nsplit,
                        &sm_m[0][0]);
    }
  }
}


// Launch variants: {warps per CTA, cp.async stages per warp, min CTAs per SM (a register cap)}.
// GPU run 1 (NOTES.md) had min 1 everywhere: 168-176 registers = 2 CTAs of 4 warps per SM;
// the caps (3 x 4 warps: 167 registers, 2 x 8 warps: 128) compile without spills (offline).
// Since the tables are copied by cp.async (run 17) every instance needs ~120 registers, no
// spills (the __ldg copy loop had set the peak: 167-177), so shared memory (36 KB of tables
// + NW x SMS x 2144 B per CTA) decides the CTAs per SM. 5..8 (run 17) take 16 warps per SM
// for the latency of the bank-conflicted gathers: 2 CTAs of 8 warps with 4 stages (v3 has
// 2), 4 CTAs of 4 warps with 2, one CTA of 16 warps with 4 or 5 (one copy of the tables
// per SM). 20 warps (102 registers) spilled 60 bytes offline: not taken.
// 9, 10 (2026-12-02, for Med3x): v2's and v3's shapes with the outliers one tile ahead (PF);
// their instance without outliers is v2's / v3's kernel itself. 11 (2026-12-07): v10 with
// running item slots (out_scores' RUN; PREFETCH 2); on the H100 as fast as v10 at d 128,
// 2.6% faster at 64, 1.2% slower at 256 (NOTES.md): no default. (An earlier 11
// and 12, head dim 64's bypass copies, went on 2026-12-06: NOTES.md.)
// 12 (JOINT_VARIANT, 2026-12-08): v3's 8 warps and 2 stages with both q-head halves of a GQA
// group of 10..16 in one CTA per kv row (HH = 2: tile_step_joint), at head dim 128 only,
// uncapped (the second half's q, O^T, m, l: one CTA per SM); its Med3x instance is v10's path
// (the outliers one tile ahead, PREFETCH 1); mixed-radix rows too (MIX: the tile rewritten first).
constexpr int VARIANTS[][3] = {{4, 4, 3}, {8, 4, 1}, {4, 3, 3}, {8, 2, 2}, {4, 6, 1}, {8, 4, 2},
                               {4, 2, 4}, {16, 4, 1}, {16, 5, 1}, {4, 3, 3}, {8, 2, 2}, {8, 2, 2}, {8, 2, 1}};
constexpr int NVARIANTS = 13, JOINT_VARIANT = 12;  // (hqmq_decode.py: NUM_VARIANTS 12, JOINT_VARIANT apart)
constexpr int PREFETCH[NVARIANTS] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 1};  // (the kernel's PF, Med3x instances)
// bytes of one codebook (24 S codewords of cw bytes: 8 fp16 x 4, or 4 int8 x 4)
constexpr int tab_bytes(int S, int cw) { return 24 * cw * S; }
// Two table sizes per cw: S <= 96 and S <= 170 (fill=true at 12 bits), each a multiple of the
// 16-byte copies for any S
static_assert(tab_bytes(1, 4) % 16 == 0, "table alignment (16-byte copies)");
// codebook=int8 (CW 4): 4-byte codewords, half the table; instances of the defaults alone
// (v3, Med3x v10; the other variants lost to them on both GPUs: NOTES.md)
constexpr bool cw4_variant(int v) { return v == 3 || v == 10 || v == JOINT_VARIANT; }
// Mixed-radix code rows (pack=mixed at S = 96, head dim 64 / 128 / 256): instances of the default
// variants alone (v3; Med3x v10; JOINT_VARIANT at 128), with either table (MIX: the stage's rows rewritten as
// 12-bit ones before the tile; Med3x's outliers are read as on 12-bit rows)
constexpr int MIX_VARIANT = 3, MIX_VARIANT_MED3 = 10;

// Variants with a Med3x (OUT) instance: the outlier fragments take ~44 more registers (164
// for v0 / v2 under their 168 cap, no spills offline); the 128-register variants (v3, v6)
// spilled 108 bytes, so they have none and are refused for Med3x caches.
// 9 and 10 (PF) hold no fragments across the quantized parts: see NOTES.md ("Med3x outliers one
// tile ahead") for their registers.
constexpr bool OUT_OK[NVARIANTS] = {true, false, true, false, false, false, false, false, false, true, true, true, true};

// Head dims 64 and 256 (2026-12, not yet timed on a GPU): Med3x through the prefetching
// variants only (the direct path's outlier fragments are d = 128's alone; at 64 its chunk
// bookkeeping differs).
template <int D>
constexpr bool out_ok(int v) {
  return D == 128 ? OUT_OK[v] : PREFETCH[v] != 0;
}
// Head dim 64, 8-warp variants without Med3x: one more CTA per SM than at 128 (80 registers,
// no spills offline; v3: 3 x 8 warps where the shared memory allows, S <= 96), for the
// latency a tile of half the work leaves exposed. (Med3x v10 spilled 64 bytes so capped.)
// Med3x mixed rows at 256 (WIDE_MIX): 16 warps in one CTA per SM, the warps per SM of v10's 2 x 8.
template <int V, int D, bool OUT, bool MIX = false>
constexpr int minb_of() {
  return WIDE_MIX<OUT, D, MIX> ? 1 : D == 64 && !OUT && VARIANTS[V][0] == 8 ? VARIANTS[V][2] + 1 : VARIANTS[V][2];
}
template <int V, int D, bool OUT, bool MIX = false>
constexpr int warps_of() {
  return WIDE_MIX<OUT, D, MIX> ? 16 : VARIANTS[V][0];
}

template <int V, int TABB, bool OUT, int D, bool MIX = false>
constexpr int smem_of() {
  return dyn_smem<warps_of<V, D, OUT, MIX>(), VARIANTS[V][1], (TABB + 15) / 16 * 16, OUT, OUT && PREFETCH[V] != 0, D,
                  MIX>();
}
template <int V, int TABB, bool OUT, int D, int CW, bool MIX = false>
constexpr auto kernel_of() {
  return hqmq_split_kernel<warps_of<V, D, OUT, MIX>(), VARIANTS[V][1], (TABB + 15) / 16 * 16,
                           minb_of<V, D, OUT, MIX>(), OUT,
                           OUT ? PREFETCH[V] : 0, D, FUSED_BUILD, CW, MIX, V == JOINT_VARIANT ? 2 : 1>;
}

// The dynamic shared-memory opt-in, once per instance (also before an occupancy query).
template <int V, int TABB, bool OUT, int D, int CW, bool MIX = false>
int prepare() {
  static cudaError_t e = cudaFuncSetAttribute(kernel_of<V, TABB, OUT, D, CW, MIX>(),
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, smem_of<V, TABB, OUT, D, MIX>());
  return (int)e;
}

enum What { LAUNCH = 0, OCCUPANCY = 1, REGS = 2 };
constexpr int NO_INSTANCE = -1001;  // no Med3x instance of this variant

// LAUNCH: 0 or a cudaError_t; OCCUPANCY: CTAs resident per SM (registers, shared memory,
// threads), < 0 = -error; REGS: registers per thread, < 0 = -error.
template <int V, int TABB, bool OUT, int D, int CW, bool MIX = false>
int act(What what, const Params* p, int rows, cudaStream_t stream) {
  if constexpr ((OUT && !out_ok<D>(V)) || (CW == 4 && !cw4_variant(V)) ||
                (MIX && V != JOINT_VARIANT && V != (OUT ? MIX_VARIANT_MED3 : MIX_VARIANT)) ||
                (V == JOINT_VARIANT && D != 128)) {
    return NO_INSTANCE;
  } else {
    constexpr auto k = kernel_of<V, TABB, OUT, D, CW, MIX>();
    constexpr int NT = warps_of<V, D, OUT, MIX>() * 32, SM = smem_of<V, TABB, OUT, D, MIX>();
    if (what == REGS) {
      cudaFuncAttributes a;
      const cudaError_t e = cudaFuncGetAttributes(&a, k);
      return e == cudaSuccess ? a.numRegs : -(int)e;
    }
    if (const int e = prepare<V, TABB, OUT, D, CW, MIX>()) return what == LAUNCH ? e : -e;
    if (what == OCCUPANCY) {
      int n = 0;
      const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, NT, SM);
      return e == cudaSuccess ? n : -(int)e;
    }
    if constexpr (V == JOINT_VARIANT) {
      if (p->qsh != 1) return (int)cudaErrorInvalidValue;  // (two halves to join)
      k<<<dim3(rows / 2, p->nsplit), NT, SM, stream>>>(*p);
    } else {
      k<<<dim3(rows, p->nsplit), NT, SM, stream>>>(*p);
    }
    return 0;
  }
}

template <int TABB, bool OUT, int D, int CW>
int act_t(int variant, What what, const Params* p, int rows, cudaStream_t s) {
  switch (variant) {
    case 1: return act<1, TABB, OUT, D, CW>(what, p, rows, s);
    case 2: return act<2, TABB, OUT, D, CW>(what, p, rows, s);
    case 3: return act<3, TABB, OUT, D, CW>(what, p, rows, s);
    case 4: return act<4, TABB, OUT, D, CW>(what, p, rows, s);
    case 5: return act<5, TABB, OUT, D, CW>(what, p, rows, s);
    case 6: return act<6, TABB, OUT, D, CW>(what, p, rows, s);
    case 7: return act<7, TABB, OUT, D, CW>(what, p, rows, s);
    case 8: return act<8, TABB, OUT, D, CW>(what, p, rows, s);
    case 9: return act<9, TABB, OUT, D, CW>(what, p, rows, s);
    case 10: return act<10, TABB, OUT, D, CW>(what, p, rows, s);
    case 11: return act<11, TABB, OUT, D, CW>(what, p, rows, s);
    case 12: return act<12, TABB, OUT, D, CW>(what, p, rows, s);
    default: return act<0, TABB, OUT, D, CW>(what, p, rows, s);
  }
}

template <int D, int CW>
int dispatch_cw(int variant, int S, bool out, What what, const Params* p, int rows, cudaStream_t s, bool mix) {
  constexpr int SMALL = tab_bytes(96, CW), LARGE = tab_bytes(170, CW);
  const bool small = S <= 96;
  if (mix) {  // mixed-radix rows: radix 24 S = 2304 alone (mixed_codes.cuh)
    if (S != 96) return -1;
    if (variant == JOINT_VARIANT)  // (head dim 128: act refuses the others)
      return out ? act<JOINT_VARIANT, SMALL, true, D, CW, true>(what, p, rows, s)
                 : act<JOINT_VARIANT, SMALL, false, D, CW, true>(what, p, rows, s);
    if (variant != (out ? MIX_VARIANT_MED3 : MIX_VARIANT)) return NO_INSTANCE;
    return out ? act<MIX_VARIANT_MED3, SMALL, true, D, CW, true>(what, p, rows, s)
               : act<MIX_VARIANT, SMALL, false, D, CW, true>(what, p, rows, s);
  }
  if (out) return small ? act_t<SMALL, true, D, CW>(variant, what, p, rows, s)
                        : act_t<LARGE, true, D, CW>(variant, what, p, rows, s);
  return small ? act_t<SMALL, false, D, CW>(variant, what, p, rows, s)
               : act_t<LARGE, false, D, CW>(variant, what, p, rows, s);
}
template <int D>
int dispatch_d(int variant, int S, bool out, What what, const Params* p, int rows, cudaStream_t s, int cw, bool mix) {
  return cw == 4 ? dispatch_cw<D, 4>(variant, S, out, what, p, rows, s, mix)
                 : dispatch_cw<D, 8>(variant, S, out, what, p, rows, s, mix);
}

// -1 for S outside 1..170 (the tables), a head dim other than 64 / 128 / 256 or cw other than
// 8 / 4 (bytes per codeword) or mixed-radix rows with S other than 96, NO_INSTANCE for a
// variant without a Med3x (or cw 4, or mixed-radix) instance
int dispatch(int variant, int S, bool out, What what, const Params* p, int rows, cudaStream_t s, int D, int cw,
             bool mix) {
  if (S < 1 || S > 170 || (cw != 8 && cw != 4)) return -1;
  if (D == 128) return dispatch_d<128>(variant, S, out, what, p, rows, s, cw, mix);
  if (D == 64) return dispatch_d<64>(variant, S, out, what, p, rows, s, cw, mix);
  if (D == 256) return dispatch_d<256>(variant, S, out, what, p, rows, s, cw, mix);
  return -1;
}

// The launch arguments that stay the same from call to call on one cache layout: the
// loader builds them once per layout (hqmq_decode.py `_PlanArgs` mirrors this struct field by
// field; kvq_hqmq_plan_size lets it check the size) and a call passes one pointer plus the
// per-call q / valid count / workspace / stream, not ~45 converted ctypes arguments (those
// cost 59-93 us of host time per eager call on the H200, NOTES.md third session call 6).
struct HqmqPlan {
  const void* kc; const void* kr; const void* km;  // K codes, radius codes, r_max (fp16 bits)
  const void* vc; const void* vr; const void* vm;
  const void* ktab; const void* vtab;  // [Hkv, 24 S] codebooks of cw bytes per codeword (fp16 x 4 or int8 x 4)
  // Med3x: flag words, outlier items, block starts; kf == nullptr: no outliers (the OUT=false
  // instance; the rest unused)
  const void* kf; const void* vf; const void* ko; const void* vo; const void* ki; const void* vi;
  long long k_cs, k_rs, k_ms, v_cs, v_rs, v_ms;  // per-(b, h) strides in elements
  long long k_fs, k_os, k_is, v_fs, v_os, v_is;  // Med3x strides: flag words / 8-byte items / ints
  int qtype, otype, variant, D, S, B, Hkv, gqa;
  int T;  // the capacity bound when a valid count is passed
  int steps_per_split, nsplit;
  int vlen;  // 1: made for calls with a device valid count, 0: without (the loader keys plans by it)
  float qk_scale;  // log2(e) / sqrt(D)
  int cw;  // bytes per codeword: 8 (fp16) or 4 (codebook=int8); in the struct's former tail padding
  int mix;  // 1: mixed-radix code rows (pack=mixed, S = 96, head dim 64 / 128 / 256: the MIX instances)
  int qsh;  // log2 of the CTAs per kv row (Params.qsh), 0 or 1; gqa: the heads of one CTA; in the former tail padding
};
// The Python mirror is laid out by ctypes with the C rules: these pin the layout it assumes
// (a field moved here without it fails the build, not a launch).
static_assert(sizeof(HqmqPlan) == 272, "HqmqPlan: change _PlanArgs in hqmq_decode.py with it");
static_assert(offsetof(HqmqPlan, k_cs) == 112 && offsetof(HqmqPlan, qtype) == 208 &&
                  offsetof(HqmqPlan, qk_scale) == 256,
              "HqmqPlan: change _PlanArgs in hqmq_decode.py with it");

// One decode call from a plan (the entries below): the split kernel of (variant, S,
// Med3x, D), then the combine into `out` (a FUSED_BUILD: the split kernel alone, counters given).
int run_plan(const HqmqPlan& a, const void* q, const int* vlen, const int* rstart, float* po, float* pm, float* pl,
             void* out, cudaStream_t s, int* counters = nullptr) {
  Params p;
  p.vlen = vlen;
  p.rstart = rstart;
  p.q = q; p.qtype = a.qtype;
  p.kc = (const uint8_t*)a.kc; p.kr = (const uint8_t*)a.kr; p.km = (const uint16_t*)a.km;
  p.vc = (const uint8_t*)a.vc; p.vr = (const uint8_t*)a.vr; p.vm = (const uint16_t*)a.vm;
  p.ktab = (const uint16_t*)a.ktab; p.vtab = (const uint16_t*)a.vtab;
  p.k_cs = a.k_cs; p.k_rs = a.k_rs; p.k_ms = a.k_ms; p.v_cs = a.v_cs; p.v_rs = a.v_rs; p.v_ms = a.v_ms;
  p.kf = (const uint32_t*)a.kf; p.vf = (const uint32_t*)a.vf; p.ko = (const uint2*)a.ko; p.vo = (const uint2*)a.vo;
  p.ki = (const int*)a.ki; p.vi = (const int*)a.vi;
  p.k_fs = a.k_fs; p.k_os = a.k_os; p.k_is = a.k_is; p.v_fs = a.v_fs; p.v_os = a.v_os; p.v_is = a.v_is;
  p.T = a.T; p.Hkv = a.Hkv; p.gqa = a.gqa; p.qsh = a.qsh; p.steps_per_split = a.steps_per_split; p.nsplit = a.nsplit;
  p.tab_bytes = tab_bytes(a.S, a.cw); p.qk_scale = a.qk_scale;
  p.po = po; p.pm = pm; p.pl = pl;
  p.counters = counters; p.out = out; p.otype = a.otype;
  if (FUSED_BUILD != (counters != nullptr)) return (int)cudaErrorInvalidValue;  // (fused: kvq_hqmq_run_fused)
  if (a.qsh < 0 || a.qsh > 1) return (int)cudaErrorInvalidValue;
  const int rows = (a.B * a.Hkv) << a.qsh;  // the grid's rows: 1 or 2 CTAs per kv row
  const int e = dispatch(a.variant, a.S, a.kf != nullptr, LAUNCH, &p, rows, s, a.D, a.cw, a.mix != 0);
  if (e) return e;
  if constexpr (FUSED_BUILD) return (int)cudaGetLastError();
  if (a.D == 64) return launch_combine<64>(po, pm, pl, out, a.otype, rows * a.gqa, a.nsplit, s);  // common.cuh
  if (a.D == 256) return launch_combine<256>(po, pm, pl, out, a.otype, rows * a.gqa, a.nsplit, s);
  return launch_combine<128>(po, pm, pl, out, a.otype, rows * a.gqa, a.nsplit, s);
}

}  // namespace

// Returns a cudaError_t (0 = launched), -1 (S too large for the tables) or NO_INSTANCE.
// kf == nullptr: no Med3x outliers (kf..v_is unused). The per-call entry (every argument
// converted by ctypes on every call); kvq_hqmq_run below is the planned one.
extern "C" int kvq_hqmq_decode(const void* q, int qtype, const void* kc, const void* kr, const void* km,
                               const void* vc, const void* vr, const void* vm, const void* ktab, const void* vtab,
                               long long k_cs, long long k_rs, long long k_ms, long long v_cs, long long v_rs,
                               long long v_ms, const void* kf, const void* vf, const void* ko, const void* vo,
                               const void* ki, const void* vi, long long k_fs, long long k_os, long long k_is,
                               long long v_fs, long long v_os, long long v_is, int B, int Hkv, int gqa, int T, int S,
                               int steps_per_split, int nsplit, float qk_scale, float* po, float* pm, float* pl,
                               void* out, int otype, int variant, const int* vlen, void* stream, int D, int cw,
                               int mix, const int* rstart, int qsh) {
  const HqmqPlan a = {kc, kr, km, vc, vr, vm, ktab, vtab, kf, vf, ko, vo, ki, vi,
                      k_cs, k_rs, k_ms, v_cs, v_rs, v_ms, k_fs, k_os, k_is, v_fs, v_os, v_is,
                      qtype, otype, variant, D, S, B, Hkv, gqa, T, steps_per_split, nsplit, vlen != nullptr, qk_scale,
                      cw, mix, qsh};
  return run_plan(a, q, vlen, rstart, po, pm, pl, out, (cudaStream_t)stream);
}

extern "C" int kvq_hqmq_plan_size() { return (int)sizeof(HqmqPlan); }

// One decode call from a plan (a HqmqPlan*: a type of the anonymous namespace in the
// signature would give the function internal linkage, and the library would not export it):
// q [B, Hq, 1, D] contiguous; vlen null, or a device int32 valid count (the plan must have
// been made for one: else -2); rstart null, or B device int32: each batch row's first key
// (a left-padded batch: Params.rstart); po / pm / pl the partials [B*Hq, nsplit, D] / [B*Hq, nsplit] x2
// (fp32), out [B*Hq, D] in the plan's otype. Launches only (no allocation, no
// synchronisation): capturable in a CUDA graph. Returns as kvq_hqmq_decode.
extern "C" int kvq_hqmq_run(const void* plan, const void* q, const int* vlen, const int* rstart, float* po, float* pm,
                            float* pl, void* out, void* stream) {
  const HqmqPlan& a = *static_cast<const HqmqPlan*>(plan);
  if ((vlen != nullptr) != (a.vlen != 0)) return -2;
  return run_plan(a, q, vlen, rstart, po, pm, pl, out, (cudaStream_t)stream);
}

// The call of a FUSED_BUILD (library.py FusedCombine), one launch: as kvq_hqmq_run, and
// counters: B * Hkv int32 at zero (each launch leaves them at zero), this call's alone
// while it runs. Returns as kvq_hqmq_run.
extern "C" int kvq_hqmq_run_fused(const void* plan, const void* q, const int* vlen, const int* rstart, float* po,
                                  float* pm, float* pl, void* out, int* counters, void* stream) {
  const HqmqPlan& a = *static_cast<const HqmqPlan*>(plan);
  if ((vlen != nullptr) != (a.vlen != 0)) return -2;
  if (!counters) return (int)cudaErrorInvalidValue;
  return run_plan(a, q, vlen, rstart, po, pm, pl, out, (cudaStream_t)stream, counters);
}

extern "C" int kvq_hqmq_fused_build() { return FUSED_BUILD; }

// Programmatic dependent launch of the combine on (1) or off (0): common.cuh pdl_on (library.py PDL).
extern "C" void kvq_hqmq_set_pdl(int on) { pdl_on = on; }

extern "C" int kvq_hqmq_num_variants() { return NVARIANTS; }

// CTAs per SM of a variant (out: its Med3x instance); < 0: -error, -1 bad S, NO_INSTANCE.
extern "C" int kvq_hqmq_occupancy(int variant, int S, int out, int D, int cw, int mix) {
  return dispatch(variant, S, out != 0, OCCUPANCY, nullptr, 0, nullptr, D, cw, mix != 0);
}

extern "C" int kvq_hqmq_num_regs(int variant, int S, int out, int D, int cw, int mix) {
  return dispatch(variant, S, out != 0, REGS, nullptr, 0, nullptr, D, cw, mix != 0);
}
