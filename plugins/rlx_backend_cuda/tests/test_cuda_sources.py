"""The kernel sources (rlx_backend_cuda/kernels/*.cu) and their loader, sources.render: no GPU
needed. That every catalog kernel compiles is `python -m rlx_backend_cuda.kernels_catalog`
(nvcc), run here when nvcc is installed for one kernel of each .cu file."""
import importlib.resources
import re
import shutil
import subprocess

import pytest
from rlx_core.ir.errors import BackendError

from rlx_backend_cuda import kernels_catalog, sources as S

CU = sorted(p.name for p in importlib.resources.files("rlx_backend_cuda").joinpath("kernels").iterdir()
            if p.name.endswith(".cu"))


def constants():
    """Every Source the module defines (the DQ schemes too), by name."""
    out = {k: v for k, v in vars(S).items() if isinstance(v, S.Source)}
    out.update({f"DQ_SCHEMES[{k}]": v for k, v in S.DQ_SCHEMES.items()})
    out.update({f"DQ_TC_VIEWS[{k}]": v for k, (_, v) in S.DQ_TC_VIEWS.items()})
    return out


def test_every_part_is_used_and_uses_its_defines():
    """Each part of each .cu file belongs to some Source, and names each define its @part line
    declares (a define the code never reads is a stale declaration)."""
    used = {p for src in constants().values() for p in src.parts}
    for file in CU:
        if file == "prelude.cu":
            continue
        parts = S._parts(file)
        assert parts, file
        for name, (_, defines, text) in parts.items():
            assert f"{file}:{name}" in used, f"{file}:{name} is in no Source"
            code = re.sub(r"//[^\n]*", "", text)
            for d in defines:
                assert re.search(rf"\b{d}\b", code), f"{file}:{name} declares {d} but never uses it"
            assert "$" not in code, f"{file}:{name} keeps a $ placeholder"


def test_render_writes_defines_then_parts_after_line_directives():
    src = S.render(S.CUMSUM, TX="float", TO="__half", ACC="float", LOAD="LD(ACC, v)", STORE="ST(__half, v)")
    assert src.startswith(S._file("prelude.cu"))
    tail = src[len(S._file("prelude.cu")):].split("\n")
    assert tail[:5] == ["#define LOAD(v) (LD(ACC, v))", "#define STORE(v) (ST(__half, v))", "#define TX float",
                        "#define TO __half", "#define ACC float"]
    first, defines, text = S._parts("rows.cu")["cumsum"]
    assert tail[5] == f'#line {first} "rows.cu"'
    # the #line is the file's own numbering: its line `first` is the part's first line
    assert S._file("rows.cu").split("\n")[first - 1] == text.split("\n")[0]
    assert "rlx_cumsum" in src and "$" not in src


def test_a_multi_line_define_continues_its_lines():
    src = S.render(S.KV_WRITE, T="float", TP="int", DIMS_ARGS="long long d0", NSTR_ARGS="long long ns0",
                   CSTR_ARGS="long long cs0", DECOMP="{ a; }\n{ b; }", AXIS=0)
    assert "#define DECOMP { a; } \\\n{ b; }\n" in src


def test_render_names_missing_and_unknown_defines():
    with pytest.raises(BackendError, match=r"rows.cu:cumsum.*missing: STORE, TO; unknown: TY"):
        S.render(S.CUMSUM, TX="float", ACC="float", LOAD="v", TY="float")


def test_an_unknown_part_or_file_is_named():
    with pytest.raises(BackendError, match=r"kernels/rows.cu has no part 'nope'"):
        S.render(S.Source("rows.cu:nope"))
    with pytest.raises(BackendError, match=r"kernels/nope.cu is missing"):
        S.render(S.Source("nope.cu:x"))


def test_generated_text_keeps_dollar_placeholders():
    """A str is source generated in Python (codegen.py, rows.py): filled as text, after the prelude."""
    assert S.render("typedef $ACC ACC;\n", ACC="double") == S._file("prelude.cu") + "typedef double ACC;\n"


def test_a_compile_error_quotes_the_kernel_file_line():
    src = S.render(S.GATHER, TT="float", TI="int")
    first, _, text = S._parts("index.cu")["gather"]
    log = f'/tmp/x/index.cu({first + 1}): error: identifier "y" is undefined'
    assert S.error_line(src, log) == f"\n  kernels/index.cu line {first + 1}: {text.split(chr(10))[1].strip()}"
    # a source without #line: the line of the source itself
    plain = "extern \"C\" __global__ void k(float* x) {\n  x[0] = y;\n}\n"
    assert S.error_line(plain, "kern.cu(2): error: identifier") == "\n  kernel source line 2: x[0] = y;"
    assert S.error_line(plain, "no line here") == ""


def test_wgmma_operands_are_string_literal_defines():
    common = dict(T="__half", MMAT="f16", WHOLE=0, CAP=0, KEYMASK=0, MASKMODE=0, TM="__half", TP="int",
                  HAS_POS=0)
    src = S.attn_wg_source(64, MASKKIND=0, **common)
    assert '#define O_REGS "' + ", ".join(f"%{i}" for i in range(32)) + '"' in src
    assert '#define PV_A0 "32"' in src and '#define PV_ONE "37"' in src and "#define BF16 0" in src
    assert '#define BN 128' in src and '#define QK_A "64"' in src and '#define QK_ACC "66"' in src
    assert S.own_arch(src) == "sm_90a"
    # head_dim 256: a 64-key tile (S in 32 registers), O in 128
    src = S.attn_wg_source(256, MASKKIND=1, **common)
    assert '#define BN 64' in src and '#define S_REGS "' + ", ".join(f"%{i}" for i in range(32)) + '"' in src
    assert '#define QK_A "32"' in src and '#define PV_A0 "128"' in src and '#define PV_ONE "133"' in src
    assert S.attn_wg_smem(256) <= 227 * 1024 and S.attn_tc_smem(256, 1) <= 99 * 1024     # (H100's; sm_86's)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_one_kernel_of_each_name_compiles(tmp_path):
    """nvcc compiles the first catalog kernel of each name: every .cu file, and every kernel
    beside the prelude's helpers (one named as a kernel's shared array once failed only on the
    device). The catalog module compiles them all."""
    done, names = set(), set()
    for name, src, kname in kernels_catalog.catalog():
        files = set(re.findall(r'#line \d+ "(\w+\.cu)"', src))
        if files <= done and kname in names:
            continue
        done |= files
        names.add(kname)
        p = tmp_path / "k.cu"
        p.write_text(S.with_grid_wait(src, kname))
        # (NVRTC, which the backend uses, refuses an incompatible redeclaration: nvcc only warns, #159)
        arch = f"-arch={S.own_arch(src) or 'sm_90'}"
        cmd = ["nvcc", "-std=c++17", arch, "--diag-error=159", "-ptx", "-o", str(tmp_path / "k.ptx"), str(p)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, (name, r.stderr[-2000:])
    assert done == set(CU) - {"prelude.cu"}


def test_a_define_value_with_a_comment_or_directive_is_refused():
    """A value's line breaks become continuations: a // comment would swallow the lines after it."""
    for decomp in ("{ a; } // the first\n{ b; }", "{ a; }\n#pragma unroll\n{ b; }"):
        with pytest.raises(BackendError, match=r"define DECOMP holds a // comment or a # line"):
            S.render(S.KV_WRITE, T="float", TP="int", DIMS_ARGS="long long d0", NSTR_ARGS="long long ns0",
                     CSTR_ARGS="long long cs0", DECOMP=decomp, AXIS=0)


@pytest.mark.parametrize("pairs,sms,want", [(8, 132, 8), (16, 132, 8), (32, 132, 4), (64, 132, 2),
                                             (128, 132, 1), (256, 132, 1), (8, 16, 2)])
def test_decode_attention_cluster_shrinks_to_one_wave(pairs, sms, want):
    """attn_decode_cluster: ATTN_DECODE_CLUSTER blocks a (batch row, kv head) pair while their
    clusters fit one wave of the SMs, fewer as the pairs grow, one block a pair past a wave."""
    assert S.attn_decode_cluster(pairs, sms) == want


@pytest.mark.parametrize("g,blocks,sms,want", [(4, 16, 132, 4), (4, 64, 132, 2), (4, 128, 132, 1),
                                               (6, 16, 132, 2), (1, 8, 132, 1), (8, 8, 32, 4)])
def test_decode_attention_splits_query_heads_within_one_wave(g, blocks, sms, want, monkeypatch):
    """attn_decode_groups: the most power-of-two groups of a kv head's g query heads (down to one
    head a group) whose blocks still fit one wave of the GPU's SMs; ATTN_DECODE_HEADS bounds it."""
    assert S.attn_decode_groups(g, blocks, sms) == want
    monkeypatch.setattr(S, "ATTN_DECODE_HEADS", 2)
    assert S.attn_decode_groups(g, blocks, sms) == min(want, max(1, g // 2))
