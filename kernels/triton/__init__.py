"""The Triton backend: fused flash-decoding attention over packed KV caches, one module
per format (hqmq, naive_int, kivi, fp8), on `common.py`'s shared pieces.

One decode step: queries `q [B, Hq, 1, d]` (GQA: Hq = GROUP * Hkv, q head
`h*GROUP + i` reads kv head `h`) attend to ALL T valid cached keys of their kv
head, non-causally: `softmax(q K^T / sqrt(d)) V`. K and V are decoded from the
packed bytes inside the kernel, tile by tile in registers, and never written out.

Flash-decoding: the grid is (B*Hkv, NSPLIT). Each program takes one kv head (the
whole GQA group of queries, padded to 16 rows for `tl.dot`) and a contiguous run of
token tiles: decode a K tile, score it with one `tl.dot`, online softmax (base 2),
decode the V tile, accumulate with a second `tl.dot`. Partials are merged by
`combine_kernel`. NSPLIT gives about `programs_per_sm` programs per multiprocessor,
so batch 1 fills the GPU too.

Two decode paths (common.py says why): on a GPU with fp16/bf16 queries (`FAST`) tiles
are decoded straight to fp16 with bit tricks (inline PTX, no conversion instructions)
and the dots run on fp16 operands (bf16 queries are cast to fp16), fp32 accumulation;
under the CPU interpreter, or with fp32 queries, decoding is plain fp32 arithmetic
rounded to the cache dtype and the dots are fp32 (`input_precision="ieee"`): the tests
match `Quantizer.decode` to ~1e-6 there.

Buffers follow the store <-> kernel contract (kernels/layout.py): `[B, H, Tcap, ...]`
with T valid tokens; every buffer is indexed with its real per-(b, h) stride.

Entry points (what the formats register, kernels/formats/): `hqmq_decode_attention`,
`int_decode_attention`, `kivi_decode_attention`, `fp8_decode_attention`. Launch defaults
are the best of a sweep at B=8, T=32k on an H200 (reports/kernels/NOTES.md, run 8); each module
names its own. This backend imports neither the front (kernels/decode_attention.py) nor
the CUDA backend.
"""
