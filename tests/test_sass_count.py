"""scripts/sass_count.py's reading of cuobjdump SASS (the row kernels' instruction counts of
docs/cuda.md), on a synthetic listing: no toolkit needed."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SASS = """
        Function : _Z16row_stats_kernelv
        .headerflags    @"EF_CUDA_SM90"
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;        /* 0x0000000402047981 */
        /*0020*/                   FMNMX R8, R4, R5, !PT ;                 /* 0x0000000504087209 */
        /*0030*/                   MUFU.EX2 R9, R8 ;                       /* 0x0000000800097308 */
        /*0040*/              @!P0 BRA 0x10 ;                              /* 0xfffffff000008947 */
        /*0050*/                   LDG.E R6, desc[UR4][R2.64] ;            /* 0x0000000402067981 */
        /*0060*/                   FADD R7, R6, R6 ;                       /* 0x0000000606077221 */
        /*0070*/                   BRA 0x50 ;                              /* 0xfffffff000007947 */
        /*0080*/                   EXIT ;                                  /* 0x000000000000794d */
"""


def _load():
    spec = importlib.util.spec_from_file_location("sass_count",
                                                  os.path.join(ROOT, "scripts", "sass_count.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tile_loop_is_the_innermost_loop_with_a_load():
    mod = _load()
    funcs = mod.functions(SASS)
    assert list(funcs) == ["_Z16row_stats_kernelv"]
    instrs = funcs["_Z16row_stats_kernelv"]
    assert len(instrs) == 9 and instrs[1] == (0x10, "LDG.E.128 R4, desc[UR4][R2.64]")
    body = mod.tile_loop(instrs)
    # both loops hold a load; the smaller one (0x50-0x70) is taken
    assert [mod.opcode(t) for t in body] == ["LDG", "FADD", "BRA"]
    assert mod.opcode("@!P0 BRA 0x10") == "BRA"
