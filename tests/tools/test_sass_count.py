"""scripts/sass_count.py's reading of cuobjdump SASS (the row kernels' instruction counts of
docs/cuda.md), on a synthetic listing: no toolkit needed."""
import importlib.util
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def test_budgets_by_instance():
    mod = _load()
    assert mod.instance("void row_stats_kernel<float, (Xf)2, false, true>") == ("row_stats", "cap", True)
    assert mod.instance("void row_grad_kernel<float, __nv_bfloat16, (Xf)1, false>") == (
        "row_grad", "affine", False)
    assert mod.budget("void row_stats_kernel<float, (Xf)0, false, false>") == 32
    assert mod.budget("void row_stats_kernel<float, (Xf)1, false, false>") == 32
    assert mod.budget("void row_stats_kernel<__nv_bfloat16, (Xf)2, false, false>") == 44
    assert mod.budget("void row_grad_kernel<float, __half, (Xf)1, false>") == 48
    assert mod.budget("void row_grad_kernel<float, __half, (Xf)2, true>") == 68
    # the kernels before the transform kinds (a bool kTransform, no Xf) fall to the plain lines
    assert mod.budget("void row_stats_kernel<float, true, false, false>") == 32


def test_check_fails_over_budget(tmp_path, monkeypatch, capsys):
    """--check on a listing whose row_stats tile loop runs 40 instructions per logit."""
    mod = _load()
    body = "\n".join(f"        /*{0x10 * (i + 1):04x}*/                   FADD R7, R6, R6 ;"
                     for i in range(40 * mod.PER_THREAD - 2))
    end = 0x10 * (40 * mod.PER_THREAD)
    sass = ("        Function : _Z16row_stats_kernelv\n"
            "        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;\n"
            f"{body}\n"
            f"        /*{end - 0x10:04x}*/                   BRA 0x0 ;\n"
            f"        /*{end:04x}*/                   EXIT ;\n")
    obj = tmp_path / "rows.o"
    obj.write_bytes(b"")

    class Done:
        stdout = sass

    monkeypatch.setattr(mod, "cuobjdump", lambda required=True: "cuobjdump")
    monkeypatch.setattr(mod.subprocess, "run", lambda *a, **k: Done())
    monkeypatch.setattr(mod, "demangle", lambda name: "void row_stats_kernel<float, (Xf)1, false, false>")
    assert mod.main(["--object", str(obj), "--check"]) == 1
    assert "over budget" in capsys.readouterr().out


def _installed_sm90a_extension():
    """flce's installed extension where it holds sm_90a code (CI's wheel does): its SASS is the
    kernels' as shipped, and reading it saves compiling flce_rows.cu again (30-80 s)."""
    import glob

    import flce

    if "sm_90a" not in flce.build_info().get("sass", []):
        return None
    found = glob.glob(os.path.join(os.path.dirname(flce.__file__), "_C*.so"))
    return found[0] if found else None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc: the sm_90a SASS is not built")
def test_row_kernels_within_budget_sm90a():
    """The real kernels for sm_90a (the installed extension's, else compiled here): every
    row_stats / row_grad instance within its BUDGETS line."""
    mod = _load()
    if mod.cuobjdump(required=False) is None:
        pytest.skip("no cuobjdump")
    obj = _installed_sm90a_extension()
    assert mod.main(["--check"] + (["--object", obj] if obj else [])) == 0
