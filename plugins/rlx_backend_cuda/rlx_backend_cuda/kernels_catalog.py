"""Representative specializations of every kernel template, for checking that all of
them compile (offline with nvcc, no GPU needed: `python -m rlx_backend_cuda.kernels_catalog [ARCH [JOBS]]`)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from rlx_core.ir.dtype import BF16, BOOL, C64, F16, F32, F64, I32, I64
from rlx_core.ir.rowkernels import REDUCTIONS

from . import codegen, rows, sources as S


def row_kernels() -> list:
    """Core's row kernels (rlx_core.ir.rowkernels) in this dialect: softmax, every reduce op
    (as rlx_reduce and through rlx_reduce_cols), argmax and topk, over float and integer dtypes;
    the decode step's logit sum with its cast to f32 in the store (ops._reduce_epilogue)."""
    out = []
    for dt in (F32, BF16, F16, F64):
        out.append((f"softmax {dt.value}", rows.source("softmax", dt, dt), "rlx_softmax"))
    for dt in (F32, BF16, F16, F64, I32, I64, BOOL):
        for op in REDUCTIONS:
            out.append((f"reduce {op} {dt.value}", rows.source("reduce", dt, dt, op), "rlx_reduce"))
            out.append((f"reduce_cols {op} {dt.value}", S.render(S.REDUCE_COLS, **rows.reduce_macros(op, dt, dt)),
                        "rlx_reduce_cols"))
        out.append((f"argmax {dt.value}", rows.source("argmax", dt, I64), "rlx_argmax"))
        out.append((f"topk {dt.value}", rows.source("topk", dt, dt), "rlx_topk"))
    to_f32 = codegen.epilogue_function((("cast", (("dtype", "f32"),), (0,)),), [BF16], F32, "rlx_epi")
    out.append(("reduce sum bf16 -> f32", rows.source("reduce", BF16, BF16, "sum", (to_f32, F32)), "rlx_reduce"))
    return out


# an attention's output gate (Qwen3.5's: o * sigmoid(gate)) as a fused_elementwise program
OUTPUT_GATE = (("activation", (("fn", "sigmoid"),), (1,)), ("binary", (("op", "mul"),), (0, 2)))


def catalog() -> list:
    out = row_kernels()
    for t, acc in (("float", "float"), ("__nv_bfloat16", "float"), ("__half", "float"), ("double", "double")):
        vecs = ((4, 1, 4, 32), (8, 1, 8, 16), (16, 1, 8, 32), (24, 0, 8, 32)) if acc == "float" and t != "float" else ()
        for vpt, warp, vec, lanes in ((0, 0, 1, 32), (8, 0, 1, 32), (4, 1, 1, 32), (16, 1, 1, 32)) + vecs:
            for hr in (0, 1):
                out.append((f"rms {t} {vpt} {warp} {hr} vec {vec} lanes {lanes}", S.render(
                    S.RMS_NORM, TX=t, TR=t, TW=t, TH=t, TO=t, ACC=acc, HAS_R=hr, HAS_W=1, VPT=vpt, WARP=warp,
                    VEC=vec, LANES=lanes, EARLY=hr), "rlx_rms_norm"))
        for hr, vpt, vec in ((0, 0, 1), (1, 0, 1), (1, 3, 1)) + (((0, 8, 8), (1, 24, 8)) if acc == "float" and t != "float"
                                                              else ()):
            out.append((f"ln {t} {hr} {vpt} vec {vec}", S.render(
                S.LAYER_NORM, TX=t, TR=t, TG=t, TB=t, TH=t, TO=t, ACC=acc, HAS_R=hr, HAS_G=1, HAS_B=1, VPT=vpt,
                VEC=vec), "rlx_layer_norm"))
        out.append((f"softmax_grad {t}", S.render(S.SOFTMAX_GRAD, TY=t, TG=t, TO=t, ACC=acc), "rlx_softmax_grad"))
        for center in (0, 1):
            out.append((f"norm_grad {t} {center}", S.render(S.NORM_GRAD, TX=t, TW=t, TG=t, TO=t, ACC=acc,
                                                              CENTER=center), "rlx_norm_grad"))
        out.append((f"cumsum {t}", S.render(S.CUMSUM, TX=t, TO=t, ACC=acc, LOAD="LD(ACC, v)",
                                            STORE=f"ST({t}, v)"), "rlx_cumsum"))
        for il in (0, 1):
            out.append((f"rope {t} {il}", S.render(S.ROPE, TX=t, TC="float", TO=t, ACC=acc, INTERLEAVED=il,
                                                   TP="int", TN=t), "rlx_rope"))
            if t in ("__nv_bfloat16", "__half"):
                out.append((f"rope_vec {t} {il}", S.render(S.ROPE_VEC, TX=t, TC=t, TO=t, ACC="float",
                                                           INTERLEAVED=il), "rlx_rope_vec"))
        for mk, mm in ((1, 0), (2, 1), (0, 2)):
            common = dict(MASKKIND=mk, MASKMODE=mm, TM="bool" if mm == 1 else t, TP="long long", HAS_POS=1)
            isz = {"float": 4, "double": 8}.get(t, 2)
            for dk, dv, rows, vec in ((64, 64, 4, 16 // isz), (128, 128, 8, 16 // isz), (40, 24, 1, 1)):
                for nt, loads in ((S.ATTN_THREADS, S.ATTN_LOADS), S.ATTN_SMALL_GRID):
                    sh = S.attn_split_shape(dk, dv, vec, vec, rows, 8 if acc == "double" else 4, nt, loads)
                    src = S.render(S.ATTN_SPLIT, TQ=t, TK=t, TV=t, TO=t, ACC=acc, DK=dk, DV=dv, **sh, **common)
                    out.append((f"attn_split {t} {mk}{mm} {dk}/{dv} rows {rows} vec {vec} NT {nt}", src,
                                "rlx_attn_split"))
            out.append((f"mask_fill {t}", S.render(S.MASK_FILL, TS=t, TO=t, ACC=acc, **common), "rlx_mask_fill"))
            if acc == "float":
                for g, d, sk, vk in ((4, 64, 512, 16 // isz), (1, 256, 300, 1), (4, 128, 64, 16 // isz)):
                    src = S.render(S.ATTN_SHORT, TQ=t, TK=t, TV=t, TO=t, **S.attn_short_shape(g, d, sk, vk), **common)
                    out.append((f"attn_short {t} {mk}{mm} G{g} D{d} Sk{sk}", src, "rlx_attn_short"))
                for g, d, vk, qv in ((4, 64, 16 // isz, 1), (1, 128, 16 // isz, 0), (8, 128, 16 // isz, 1),
                                     *[(4, 256, 8, 1)] * (isz == 2)):         # (two loads a row)
                    sh = S.attn_decode_shape(g, d, vk, pair=True)
                    src = S.render(S.ATTN_DECODE, TQ=t, TK=t, TV=t, TO=t, QV=qv, HEADMASK=int(mm == 2), **sh,
                                   **common, **S.ATTN_DECODE_PLAIN)
                    out.append((f"attn_decode {t} {mk}{mm} G{g} D{d}", src, "rlx_attn_decode"))
                    if mk == 1:          # (with the step's RoPE and an output gate: a causal decode step)
                        dt = {"float": F32, "__nv_bfloat16": BF16, "__half": F16}[t]
                        gate = codegen.epilogue_function(OUTPUT_GATE, [dt, dt], dt, "rlx_epi")
                        fold = {**S.ATTN_DECODE_PLAIN, "ROPE": 1, "INTERLEAVED": int(d == 128), "TN": t,
                                "EPI": 1, "EPI_FN": gate, "EPI_CALL": "rlx_epi(o, e)", "TE": t, "TY": t}
                        src = S.render(S.ATTN_DECODE, TQ=t, TK=t, TV=t, TO=t, QV=qv, HEADMASK=0, **sh,
                                       **common, **fold)
                        out.append((f"attn_decode rope gate {t} G{g} D{d}", src, "rlx_attn_decode"))
            if t in ("__nv_bfloat16", "__half"):
                for d, vec, mt in ((64, 1, 2), (128, 0, 1), (128, 1, 2), (32, 1, 1), (96, 1, 2), (256, 1, 1)):
                    out.append((f"attn_tc {t} {d} MT {mt}", S.render(
                        S.ATTN_TC, T=t, MMAT="bf16" if "bf" in t else "f16", D=d, VEC=vec, MT=mt, **common),
                        "rlx_attn_tc"))
                for d, whole, cap in ((64, 0, 0), (128, 0, 1), (128, 1, 0), (256, 0, 0), (256, 1, 0)):
                    out.append((f"attn_wg {t} {mk}{mm} {d} whole {whole} cap {cap}", S.attn_wg_source(
                        d, T=t, MMAT="bf16" if "bf" in t else "f16", WHOLE=whole, CAP=cap,
                        KEYMASK=int(mm == 1 and d != 128), **common),        # (both boolean mask paths)
                        "rlx_attn_wg"))
        out.append((f"gather {t}", S.render(S.GATHER, TT=t, TI="long long"), "rlx_gather"))
    out.append(("gather u8", S.render(S.GATHER, TT="unsigned char", TI="int"), "rlx_gather"))
    for t, ti, tw in (("__nv_bfloat16", "int", "__nv_bfloat16"), ("__half", "long long", "float")):
        out.append((f"gather_norm {t} {ti} {tw}", S.render(S.GATHER_NORM, TT=t, TI=ti, TW=tw),
                    "rlx_gather_norm"))
    for rank in (1, 4):
        out.append((f"copy16 rank {rank}", codegen.copy16_source(rank), "rlx_copy16"))
    out.append(("cumsum bool", S.render(S.CUMSUM, TX="bool", TO="bool", ACC="long long", LOAD="(ACC)(v)",
                                        STORE="(v != 0)"), "rlx_cumsum"))
    for t in ("__nv_bfloat16", "__half"):
        for r, u, sw, ks, nm, rs in ((1, 4, 0, 1, 0, 0), (2, 8, 0, 2, 0, 0), (2, 4, 1, 1, 0, 0),
                                     (1, 2, 0, 4, 0, 0), (2, 2, 1, 8, 0, 0), (1, 2, 0, 1, 1, 0),
                                     (2, 2, 1, 4, 1, 0), (1, 2, 0, 8, 0, 1), (1, 2, 0, 2, 1, 1)):
            out.append((f"gemv {t} {r} {u} {sw} ks {ks} norm {nm} resid {rs}",
                        S.render(S.GEMV, T=t, TO=t, MMAX=4 if nm == 0 else 2, R=r, U=u, SWIGLU=sw, KS=ks,
                                 SWIGLU_OF=codegen.swiglu_of("float"), NORM=nm, TN="float" if rs else t,
                                 RESID=rs, EARLY=int(r == 1)), "rlx_gemv"))
        for mt, early, sw in ((1, 1, 0), (4, 0, 1), (8, 1, 0), (8, 1, 1)):
            out.append((f"gemv_tc {t} mt {mt} swiglu {sw}",
                        S.render(S.GEMV_TC, T=t, TO=t, MMAT="bf16" if "bf" in t else "f16", MT=mt, KC=128,
                                 EARLY=early, SWIGLU=sw, SWIGLU_OF=codegen.swiglu_of("float")),
                        "rlx_gemv_tc"))
    out.append(("naive", S.render(S.MATMUL_NAIVE, TA="int", TB="int", TO="int", ACC="long long",
                                  MAC="(s) + (a) * (b)"), "rlx_matmul_naive"))
    out.append(("naive bool", S.render(S.MATMUL_NAIVE, TA="bool", TB="bool", TO="bool", ACC="bool",
                                       MAC="(s) || ((a) && (b))"), "rlx_matmul_naive"))
    dims = ", ".join(f"long long d{j}" for j in range(4))
    ns = ", ".join(f"long long ns{j}" for j in range(4))
    cs = ", ".join(f"long long cs{j}" for j in range(4))
    dec = "\n".join(f"    {{ i64 c = r % d{j}; r /= d{j}; src += c * ns{j}; dst += c * cs{j};{' b = c;' if j == 0 else ''} }}"
                    for j in reversed(range(4)))
    out.append(("kv_write", S.render(S.KV_WRITE, T="__nv_bfloat16", TP="int", DIMS_ARGS=dims, NSTR_ARGS=ns,
                                     CSTR_ARGS=cs, DECOMP=dec, AXIS=2), "rlx_kv_write"))
    for unit, rank in (("uint4", 4), ("unsigned short", 4), ("unsigned char", 1)):
        out.append((f"copy_many {unit} {rank}", S.render(S.COPY_MANY, T=unit, RANK=rank), "rlx_copy_many"))
    # packed weights: every scheme, decode GEMV and dequantize, at each row alignment
    for kind, blk in [(k, 256 if k.endswith("_k") else 32) for k in S.DQ_SCHEMES] + [("int8", 64), ("int4", 8192)]:
        # (QX, the int8-activation form: at batch 1 with a norm, and at batch 8 with the SwiGLU;
        # both and the residual (at batch 2, x rounded in the block: QX 2) rounding their outputs
        # too: Q8)
        for al, t, mmax, qx in ((16, "__nv_bfloat16", 1, 0), (4, "float", 8, 0), (2, "__half", 2, 0),
                                (16, "__nv_bfloat16", 1, 1), (4, "__half", 8, 1), (2, "__nv_bfloat16", 2, 2)):
            out.append((f"dq_gemv {kind} {al} {t}{' qx' * qx}", S.dq_source(
                S.DQ_GEMV, kind, blk, T=t, TO=t, TB=t, ACC="float", A=al, MMAX=mmax, R=4 if mmax < 4 else 2, U=2,
                KW=2, XV=al % 2, SWIGLU=int(al == 4), EPILOGUE="v = v + LD(W, bias[n]);",
                SWIGLU_OF=codegen.swiglu_of("float"), EARLY=int(al != 2), NORM=int(al != 2), TN="float",
                RESID=int(al == 2), QX=qx, Q8=int(qx > 0), TC=0), "rlx_dq_gemv"))
        out.append((f"dq_gemv {kind} f64", S.dq_source(S.DQ_GEMV, kind, blk, T="double", TO="double", TB="double", ACC="double",
                                                       A=8, MMAX=1, R=4, U=2, KW=8, XV=0, SWIGLU=1, EPILOGUE="",
                                                       SWIGLU_OF=codegen.swiglu_of("double"), EARLY=1, NORM=0,
                                                       TN="double", RESID=0, QX=0, Q8=0, TC=0),
                    "rlx_dq_gemv"))
        if kind in S.DQ_TC_VIEWS:             # (the tensor-core form: plain, with the norm, SwiGLU, residual)
            for sw, res in ((0, 0), (1, 0), (0, 1)):
                bf = "__nv_bfloat16"
                out.append((f"dq_gemv {kind} tc {sw}{res}", S.dq_source(
                    S.DQ_GEMV, kind, blk, T=bf, TO=bf, TB="float", ACC="float", A=16, MMAX=1, R=16, U=1, KW=8,
                    XV=1, SWIGLU=sw, EPILOGUE="", SWIGLU_OF=codegen.swiglu_of("float"), EARLY=1, NORM=1 - res,
                    TN=bf, RESID=res, QX=0, Q8=0, TC=1), "rlx_dq_gemv"))
        for t, acc in (("float", "float"), ("__nv_bfloat16", "float"), ("double", "double")):
            staged = S.dq_dequant_shape(kind, blk, 8 if acc == "double" else 4)
            for stage in range(staged["STAGE"] + 1):
                shape = dict(staged, STAGE=stage)
                out.append((f"dequant {kind} {t} {stage}", S.dq_source(S.DQ_DEQUANT, kind, blk, TO=t, ACC=acc, A=4,
                                                                       YV=stage, **shape), "rlx_dequant"))
    for t in ("float", "__nv_bfloat16", "__half"):
        out.append((f"fake_q8 {t}", S.render(S.ROUND_Q8, ACC="float", A=16, T=t, TO=t, XV=1, NORM=0),
                    "rlx_fake_q8"))
        out.append((f"quant_q8 {t}", S.render(S.ROUND_Q8, ACC="float", A=16, T=t, TO=t, XV=int(t != "float"),
                                              NORM=int(t != "__half")), "rlx_quant_q8"))
    # elementwise programs over every op kind and dtype mix
    progs = [
        ((("binary", (("op", "add"),), (0, 1)), ("activation", (("fn", "gelu"),), (2,))), [BF16, BF16], BF16),
        ((("binary", (("op", "div"),), (0, 1)),), [I32, I32], I32),
        ((("binary", (("op", "pow"),), (0, 1)),), [I64, I32], I64),
        ((("binary", (("op", "max"),), (0, 1)),), [F64, F32], F64),
        ((("binary", (("op", "add"),), (0, 1)),), [BOOL, BOOL], BOOL),
        ((("compare", (("op", "lt"),), (0, 1)),), [F16, I32], BOOL),
        ((("where", (), (0, 1, 2)),), [BOOL, F32, F16], F32),
        ((("activation", (("fn", "abs"),), (0,)),), [I32], I32),
        ((("activation", (("fn", "rsqrt"),), (0,)),), [F64], F64),
        ((("cast", (("dtype", "bf16"),), (0,)),), [F64], BF16),
        ((("cast", (("dtype", "i32"),), (0,)),), [F16], I32),
        ((("fused_swiglu", (), (0, 1)),), [BF16, BF16], BF16),
        # complex64: arithmetic with real operands, negation, a select, a cast to real
        ((("binary", (("op", "mul"),), (0, 1)), ("binary", (("op", "div"),), (2, 1)),
          ("activation", (("fn", "neg"),), (3,)), ("binary", (("op", "sub"),), (4, 0))), [C64, F64], C64),
        ((("where", (), (0, 1, 2)),), [BOOL, C64, F32], C64),
        ((("cast", (("dtype", "bf16"),), (0,)),), [C64], BF16),
    ]
    for k, (prog, ins, od) in enumerate(progs):
        kinds = ["s"] * (len(ins) + 1)
        out.append((f"ew{k}", codegen.elementwise_source(prog, ins, od, kinds, 3, k % 2 == 0), "rlx_ew"))
        # vectorized: contiguous, a row-broadcast vector (a bias) and a scalar operand
        kinds = (["c", "r", "z"] * 2)[:len(ins)] + ["c"]
        out.append((f"ew{k} vec", codegen.elementwise_source(prog, ins, od, kinds, 2, k % 2 == 1, 8), "rlx_ew"))
    return out + moe_gdn()


def moe_gdn() -> list:
    """moe_experts' kernels (moe.py: dense in each dtype, packed in each scheme, gate/up fused or
    not, the sort, the combine) and gated_delta_rule's and causal_conv1d's (deltanet.py)."""
    silu = "v = (W)tof(ST(__nv_bfloat16, v)); { v = v / (1.0f + expf(-v)); }"
    out = [(f"moe sort {bm}", S.render(S.MOE_SORT, TI="long long", NE=64, BM=bm), "rlx_moe_sort") for bm in (0, 16)]
    for t, acc, vec in (("float", "float", 4), ("__nv_bfloat16", "float", 8), ("__half", "float", 8),
                        ("double", "double", 2)):
        for dual in (0, 1):
            out.append((f"moe dense {t} {dual}", S.render(S.MOE_DENSE, ACC=acc, T=t, TO=t, VEC=vec, MC=8, DUAL=dual,
                                                         EPILOGUE="v = v * 0.5f;" if dual else ""), "rlx_moe_gemv"))
        out.append((f"moe combine {t}", S.render(S.MOE_COMBINE, ACC=acc, TO=t, TW=t, TI="int", NE=64),
                    "rlx_moe_combine"))
        out.append((f"gdn {t}", S.render(S.GDN_RULE, T=t, ACC=acc, KD=128, VD=128, KPL=4, VPW=4, PF=4), "rlx_gdn"))
        if acc == "float":
            out.append((f"gdn prep {t}", S.render(S.GDN_PREP, T=t, C=64, KD=128, VD=128, TILE=32), "rlx_gdn_prep"))
            out.append((f"gdn scan {t}", S.render(S.GDN_SCAN, T=t, C=64, KD=128, VD=128, VS=16), "rlx_gdn_scan"))
        if t in ("__nv_bfloat16", "__half"):
            mm = {"T": t, "MMAT": "bf16" if "bf" in t else "f16", "KD": 128, "VD": 128}
            out.append((f"gdn tc prep {t}", S.render(S.GDN_TC_PREP, **mm), "rlx_gdn_tc_prep"))
            out.append((f"gdn tc scan {t}", S.render(S.GDN_TC_SCAN, BV=32, **mm), "rlx_gdn_tc_scan"))
            out.append((f"gdn tc out {t}", S.render(S.GDN_TC_OUT, **mm), "rlx_gdn_tc_out"))
        out.append((f"conv1d {t}", S.render(S.CONV1D, T=t, ACC=acc, WID=4, EPILOGUE="v = v + LD(W, bias[n]);"),
                    "rlx_conv1d"))
        out.append((f"conv1d state {t}", S.render(S.CONV1D_STATE, T=t, WID=4), "rlx_conv1d_state"))
        for cs in (1, 8) if acc == "float" else (1,):          # (8: a value head in 8 blocks of a cluster)
            lay = S.net_layout(128, 128, 1, 4, 16 // vec, cs)     # (vec: elements of 16 bytes)
            src = S.render(S.GDN_NET, T=t, ACC=acc, KD=128, VD=128, R=1, WID=4, EARLY=1, **lay)
            out.append((f"gdn net {t}" + " cluster" * (cs > 1), src, "rlx_gdn_net"))
    for kind in S.DQ_SCHEMES:
        src = S.DQ_COMMON + S.DQ_SCHEMES[kind] + S.DQ_QF + S.MOE_PACKED_TAIL
        out.append((f"moe packed {kind}", S.render(src, ACC="float", A=16, XV=1, T="__nv_bfloat16", TO="__nv_bfloat16",
                                                  MC=8, DUAL=1, EPILOGUE=silu,
                                                  **({"IB": 32} if "IB" in src.defines() else {})), "rlx_moe_gemv"))
        src = S.DQ_COMMON + S.DQ_SCHEMES[kind] + S.DQ_QF + S.MOE_GEMM_PACKED_TAIL
        out.append((f"moe gemm packed {kind}", S.render(src, ACC="float", A=16, T="__nv_bfloat16", MMAT="bf16", BK=128,
                                                       MT=2, TO="__nv_bfloat16", STAGES=1, DUAL=1, EPILOGUE=silu,
                                                       **({"IB": 32} if "IB" in src.defines() else {})), "rlx_moe_gemm"))
    for t, mmat in (("__nv_bfloat16", "bf16"), ("__half", "f16")):
        for mt, dual in ((1, 0), (2, 1)):
            out.append((f"moe gemm dense {t} {mt} {dual}", S.render(
                S.MOE_GEMM_DENSE, ACC="float", T=t, MMAT=mmat, BK=64, MT=mt, TO=t, STAGES=2, DUAL=dual,
                EPILOGUE="v = v * 0.5f;" if dual else ""), "rlx_moe_gemm"))
    return out


def check(arch: str = "sm_90", jobs: int | None = None) -> list:
    """Compile every catalog entry with nvcc, `jobs` at a time (default: a CPU each); returns the
    failures [(name, log)] in catalog order."""
    def compile_one(d, i, name, src, kname):
        p = os.path.join(d, f"k{i}.cu")
        with open(p, "w") as f:
            f.write(S.with_grid_wait(src, kname))     # (as device.kernel compiles it)
        cmd = ["nvcc", "-std=c++17", f"-arch={S.own_arch(src) or arch}", "-cubin", "-o", p + ".cubin", p]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return (name, r.stderr[-3000:]) if r.returncode else None

    with tempfile.TemporaryDirectory() as d, ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        done = pool.map(lambda e: compile_one(d, e[0], *e[1]), enumerate(catalog()))
        return [f for f in done if f is not None]


if __name__ == "__main__":  # pragma: no cover - developer tool
    f = check(*(sys.argv[1:2] or ["sm_90"]), *(int(j) for j in sys.argv[2:3]))
    for name, log in f:
        print("FAIL", name, "\n", log)
    print(f"{len(catalog()) - len(f)} compiled, {len(f)} failed")
    sys.exit(1 if f else 0)
