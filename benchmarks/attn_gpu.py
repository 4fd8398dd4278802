"""Prefill attention alone on the GPU: the cuda backend's kernels against torch's SDPA (flash),
in one process (issue 45's prefill, issue 49's "every long-sequence attention").

Batch 1, bf16, causal, Qwen3.5's full-attention shape by default (8 query heads on 2 KV heads,
head_dim 256). Kernels, each on the same inputs:
* wg      rlx_attn_wg, Hopper's wgmma (sm_90 only)
* tc      rlx_attn_tc, mma.sync (sm_80 and up)
* split   rlx_attn_split, the split-K CUDA-core kernel (decode's; the fallback)
* sdpa    torch.nn.functional.scaled_dot_product_attention under the flash backend
          (enable_gqa; where flash refuses GQA, K and V expanded to every query head first)
The rounds interleave the kernels; each keeps its best and median time (CUDA events around the kernel alone: rlx's run_profiled
steps, torch's events); TFLOP/s counts the causal half (4 * H * D * S(S+1)/2). Each kernel's
output is compared with SDPA's (max abs difference over max abs value, printed, not asserted).

    python benchmarks/attn_gpu.py                                  # 8192 and 32768, D 256, GQA 4
    python benchmarks/attn_gpu.py --seq 8192 --heads 24 --kv-heads 24 --dim 128 --kernels wg,tc,sdpa
    python benchmarks/attn_gpu.py --seq 257,1370 --batch 64 --heads 16 --kv-heads 16 --dim 64 --no-causal \
        --kernels wg,sdpa                                         # ViT-L/14's at 224 and 518 pixels

`--mask` passes an all-ones [B, 1, 1, S] padding mask (what a model's prefill carries), so the
kernels take their masked path.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import log  # noqa: E402


def rlx_exe(B: int, S: int, H: int, KVH: int, D: int, causal: bool, mask: bool):
    """A compiled attention graph (cuda, bf16)."""
    import rlx_core
    from rlx_core.ir.dtype import BF16, BOOL
    from rlx_core.ir.graph import Graph

    def f(m):
        q, k, v = (m.input(n, (B, h, S, D), BF16) for n, h in (("q", H), ("k", KVH), ("v", KVH)))
        pad = m.input("mask", (B, 1, 1, S), BOOL) if mask else None
        return m.attention(q, k, v, pad, mask_kind="causal" if causal else "none")
    return rlx_core.compile(Graph.define(f"attn{S}", f), backend="cuda")


def rlx_timer(exe, inputs: dict, kernel: str):
    """fn() -> (seconds of the attention's steps, output) with the backend switched to `kernel`."""
    from rlx_backend_cuda import set_config

    runner = exe.runner(exe._bind_dims(inputs))

    def run():
        set_config(tc_attention=kernel != "split", wg_attention=kernel == "wg")
        try:
            out, steps = runner.run_profiled(inputs)
        finally:
            set_config(tc_attention=True, wg_attention=True)
        return sum(t for _, t in steps), out
    return run


def sdpa_timer(q, k, v, causal: bool):
    """fn() -> (seconds, output) of torch's flash SDPA; and how K and V were given."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    G = q.shape[1] // k.shape[1]
    how = "enable_gqa"
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            kk, vv, kw = k, v, {"enable_gqa": True}
        except RuntimeError:
            kk, vv, kw = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), {}
            how = "K, V expanded"
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            a.record()
            o = F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, **kw)
            b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3, o
    return run, how


def one_length(a, S: int) -> dict:
    import ml_dtypes
    import torch

    B, H, KVH, D = a.batch, a.heads, a.kv_heads, a.dim
    gen = torch.Generator(device="cuda").manual_seed(S)
    q, k, v = (torch.randn((B, h, S, D), generator=gen, device="cuda", dtype=torch.bfloat16)
               for h in (H, KVH, KVH))
    host = {n: t.view(torch.uint16).cpu().numpy().view(ml_dtypes.bfloat16) for n, t in zip("qkv", (q, k, v))}
    if a.mask:
        host["mask"] = np.ones((B, 1, 1, S), np.bool_)
    pairs = S * (S + 1) // 2 if a.causal else S * S
    flops = 4.0 * B * H * D * pairs
    kernels = a.kernels.split(",")
    timers = {}
    if "sdpa" in kernels:
        timers["sdpa"], how = sdpa_timer(q, k, v, a.causal)
        log(f"S {S}: sdpa flash with {how}")
    exe = rlx_exe(B, S, H, KVH, D, a.causal, a.mask)
    for kern in kernels:
        if kern != "sdpa":
            timers[kern] = rlx_timer(exe, host, kern)
    ref = None
    if "sdpa" in timers:
        ref = timers["sdpa"]()[1].float().cpu().numpy()
    times: dict = {n: [] for n in timers}
    errs = {}
    for r in range(a.rounds):
        for n, fn in timers.items():
            if n == "split" and r >= a.split_rounds:
                continue
            t, out = fn()
            if r == 0 and ref is not None and n != "sdpa":
                o = np.asarray(next(iter(out.values())), np.float32)        # (rlx's outputs come as numpy)
                errs[n] = float(np.abs(o - ref).max() / np.abs(ref).max())
            if r > 0 or a.rounds == 1:                      # round 0 warms up (compiles)
                times[n].append(t)
    res = {}
    for n, ts in times.items():
        ts = ts or [float("nan")]
        best, med = min(ts), statistics.median(ts)
        res[n] = {"best_ms": best * 1e3, "median_ms": med * 1e3, "tflops": flops / best / 1e12,
                  "rel_err_vs_sdpa": errs.get(n)}
        e = f", max |diff| / max |sdpa| {errs[n]:.2e}" if n in errs else ""
        log(f"S {S} {n:6s} best {best * 1e3:9.3f} ms  median {med * 1e3:9.3f} ms  {flops / best / 1e12:6.1f} TFLOP/s{e}")
    if "sdpa" in res:
        for n in res:
            if n != "sdpa":
                log(f"S {S} {n:6s} / sdpa: {res[n]['best_ms'] / res['sdpa']['best_ms']:.2f}x")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", default="8192,32768")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--mask", action="store_true", help="an all-ones padding mask beside the causal one")
    ap.add_argument("--kernels", default="wg,tc,split,sdpa")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds (the first warms up)")
    ap.add_argument("--split-rounds", type=int, default=3, help="rounds of the (slow) split-K kernel")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    import torch

    kind = ("causal" if a.causal else "not causal") + (", a padding mask" if a.mask else "")
    log(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; B {a.batch}, "
        f"{a.heads}/{a.kv_heads} heads, D {a.dim}, bf16, {kind}")
    res = {str(S): one_length(a, int(S)) for S in a.seq.split(",")}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
