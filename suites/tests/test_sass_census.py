"""suites/bench/cuda/sass_census.py on SASS text (no cuobjdump, no GPU): the loop a
predicated backward branch closes, its trip length and opcodes, the conditional blocks in
it; an unpredicated branch back (out-of-line code returning) is not a loop."""
from __future__ import annotations

from kvqbench.suites.bench.cuda.sass_census import functions, loops

SASS = """
	code for sm_90a
		Function : _Z4demov
	.headerflags	@"EF_CUDA_SM90"
        /*0000*/                   MOV R1, c[0x0][0x28] ;                /* 0x0 */
        /*0010*/                   LDS R2, [R0] ;                        /* 0x0 */
        /*0020*/                   HFMA2 R3, R2, R2, R2 ;                /* 0x0 */
        /*0030*/              @!P1 BRA 0x60 ;                            /* 0x0 */
        /*0040*/                   FMUL R4, R4, R5 ;                     /* 0x0 */
        /*0050*/                   FMUL R6, R6, R5 ;                     /* 0x0 */
        /*0060*/                   HMMA.16816.F32 R8, R2, R3, R8 ;       /* 0x0 */
        /*0070*/               @P0 BRA 0x10 ;                            /* 0x0 */
        /*0080*/                   EXIT ;                                /* 0x0 */
        /*0090*/                   WARPSYNC.COLLECTIVE R32, 0xa0 ;       /* 0x0 */
        /*00a0*/                   BRA 0x40 ;                            /* 0x0 */
		Function : _Z5otherv
        /*0000*/                   EXIT ;                                /* 0x0 */
"""


def test_census_reads_loops_and_their_blocks():
    fns = functions(SASS)
    assert set(fns) == {"_Z4demov", "_Z5otherv"}
    assert len(fns["_Z4demov"]) == 11 and fns["_Z4demov"][3][1:] == ("BRA", "0x60", True)
    (lp,) = loops(fns["_Z4demov"])  # (the unpredicated BRA 0x40 at 0xa0 is not a loop)
    assert (lp["start"], lp["end"], lp["count"]) == (0x10, 0x70, 7)
    assert lp["opcodes"] == {"LDS": 1, "HFMA2": 1, "BRA": 2, "FMUL": 2, "HMMA": 1}
    assert lp["skips"] == [(0x30, 0x60, 2)]
    assert loops(fns["_Z5otherv"]) == []


def test_compare_names_identical_moved_new_and_gone_kernels():
    """--against: kernels matched by name (an appended default template argument ", 1>"
    matched to the name without it); opcodes and operands decide identical or not; addresses
    and predicates aside."""
    from kvqbench.suites.bench.cuda.sass_census import compare

    a = [(0, "MOV", "R1, R2", False), (16, "EXIT", "", False)]
    b = [(0, "MOV", "R1, R3", False), (16, "EXIT", "", False)]
    old = {"k<int, 2>(P)": a, "k<int, 3>(P)": a, "gone<1>(P)": a}
    new = {"k<int, 2, 1>(P)": [(32, *x[1:]) for x in a], "k<int, 3, 1>(P)": b, "k<int, 2, 2>(P)": a}
    assert compare(old, new) == {"identical": ["k<int, 2>(P)"], "differ": ["k<int, 3>(P)"],
                                 "gone": ["gone<1>(P)"], "new": ["k<int, 2, 2>(P)"]}
