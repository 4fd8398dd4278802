"""Qwen3.5 (Gated DeltaNet hybrid) as a whole model on the GPU: RLX's CUDA backend against HF
transformers on the same GPU (issue 45's GPU rows), each side in its own process.

The shape (`FULL`) is Qwen3.5-2B's text model as published (transformers' Qwen3_5TextConfig
for the 2B checkpoint): hidden 2048, 24 layers, every 4th one full attention (8 query / 2 KV
heads of 256, output gate, QK-norm, a quarter of each head rotated), the other 18 Gated
DeltaNet (16 key and 16 value heads, K = V = 128, conv width 4), a dense MLP of 6144, the
vocabulary of 248320, tied embeddings. Weights are random bf16 made on the device by a seeded
torch generator (the same in both processes): matrices N(0, 0.02), the (1 + w) norms 1, the
final norm 5 (logits wide enough for a clear greedy choice), the gated norm 1, A_log =
log U(1, 16), dt_bias 1. `--layers` (a multiple of 4) keeps the 3-linear-1-full mix.

Parts, batch 1, bf16:
* prefill   each of `--prefill` prompt lengths (8192, 32768) to its next token: RLX
            `generate(max_new_tokens=1)` (its `prefill_s`) against HF's forward with the cache
            (`attn_implementation="sdpa"`, `logits_to_keep=1`), median of `--reps` after a
            warm-up; HF runs flash-linear-attention's Triton kernels when `fla` is importable
            (carry the fla-core wheel): the HF side counts its calls into fla and says so,
            or that it fell back to the torch reference (target: RLX / HF <= 1.0)
* decode    `--new` greedy tokens after a `--decode-prompt`-token prompt: ms per token
            against the weight-read floor, the bytes of every weight (read once a step; the
            tied embedding once, as the head) over the HBM bandwidth: the nominal 4.8 TB/s of
            an H200 and the device-to-device copy rate measured in the run (read + write
            bytes, as llm_gpu.py) (target: <= 1.6x the floor); HF eager's decode beside it,
            and how many greedy tokens the two sides agree on
* memory    RLX's `memory_report()` after the decode (context ~1k) and after the longest
            prefill: `state_bytes` (the recurrent + conv states: constant in the context)
            and `kv_bytes - state_bytes` (the full-attention layers' KV cache: grows)

    python benchmarks/qwen35_gpu.py                                   # H200: everything
    python benchmarks/qwen35_gpu.py --sides rlx --prefill 8192        # RLX only
    .venv/bin/python benchmarks/qwen35_gpu.py --tiny --backend numpy --device cpu   # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import log, run_child  # noqa: E402

FULL = dict(layers=24, hidden=2048, inter=6144, vocab=248320, heads=8, kv_heads=2, head_dim=256,
            lin_heads=16, lin_dim=128)
TINY = dict(layers=4, hidden=128, inter=256, vocab=512, heads=4, kv_heads=2, head_dim=32,
            lin_heads=4, lin_dim=32)
# nominal HBM bytes per second by device name (the brief's floor is the H200's); the copy rate
# measured in the run is the floor on any card
HBM_BW = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12}
HEAD_SCALE = 5.0           # the final norm's (1 + w)


# ------------------------------------------------------------------------------ the model
def hf_config(shape: dict, max_pos: int) -> dict:
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                   for i in range(shape["layers"])]
    return dict(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], vocab_size=shape["vocab"],
                hidden_size=shape["hidden"], intermediate_size=shape["inter"],
                num_hidden_layers=shape["layers"],
                num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                head_dim=shape["head_dim"], layer_types=layer_types, linear_num_key_heads=shape["lin_heads"],
                linear_num_value_heads=shape["lin_heads"], linear_key_head_dim=shape["lin_dim"],
                linear_value_head_dim=shape["lin_dim"], linear_conv_kernel_dim=4,
                max_position_embeddings=max_pos, rms_norm_eps=1e-6, hidden_act="silu",
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                 "partial_rotary_factor": 0.25},
                tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                torch_dtype="bfloat16")


def hf_text_config(cfg: dict):
    import transformers

    return transformers.Qwen3_5TextConfig(**{k: v for k, v in cfg.items()
                                             if k not in ("model_type", "architectures", "torch_dtype")})


def param_shapes(cfg: dict) -> dict:
    """HF name -> shape of every parameter, from transformers' model on the meta device."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.Qwen3_5ForCausalLM(hf_text_config(cfg))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def random_weights(cfg: dict, device: str) -> dict:
    """HF name -> random bf16 torch tensor on `device`, the same in every process (one seeded
    generator a tensor, in name order)."""
    import torch

    out = {}
    for i, (name, shape) in enumerate(sorted(param_shapes(cfg).items())):
        gen = torch.Generator(device).manual_seed(1000 + i)
        if name.endswith("A_log"):
            t = torch.rand(shape, generator=gen, device=device).mul_(15).add_(1).log_()
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            t = torch.ones(shape, device=device)
        elif name == "model.norm.weight":
            t = torch.full(shape, HEAD_SCALE - 1.0, device=device)
        elif "norm" in name:                                 # (1 + w) RMSNorms: scale 1
            t = torch.zeros(shape, device=device)
        else:
            t = torch.randn(shape, generator=gen, device=device).mul_(0.02)
        out[name] = t.to(torch.bfloat16)
    return out


def prompt(n: int, vocab: int):
    import numpy as np

    return np.random.default_rng(n).integers(3, vocab, (1, n)).astype(np.int64)


def copy_bandwidth_torch(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy through torch, (read + write) bytes per second, median of `reps`."""
    import torch

    a = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ts = []
    for i in range(reps + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        if i >= 3:
            ts.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(ts)


# ------------------------------------------------------------------------------ the RLX side
def reps_within(reps: int, first_s: float, seconds: float = 20.0) -> int:
    """The timed repeats after a first call of `first_s` (compile included): at most `reps`,
    fewer where they would take more than `seconds` (a slow side keeps the run in its lease)."""
    return max(1, min(reps, int(seconds / max(first_s, 1e-9))))


def prefill_by_op(model, ids) -> dict:
    """Where one prefill's device time goes: op -> (nodes, ms), eager with events between
    nodes (rlx_core.profiler), the most time first."""
    import numpy as np

    feed = lambda exe: dict(model._inputs(ids, np.ones(ids.shape, bool)),  # noqa: E731
                            cache_pos=np.zeros(len(ids), np.int32))
    return by_op(model, "prefill", feed, f"prefill {ids.shape[1]}", repeat=1, warmup=1, top=12, digits=3)


def by_op(model, graph: str, feed, what: str, repeat: int, warmup: int, top: int, digits: int) -> dict:
    """op -> (nodes, ms) of the `graph` executable run on `feed(exe)` (rlx_core.profiler, eager
    with events between nodes), the most time first; {} with the reason logged where it fails."""
    try:
        exe = model.executable(graph)
        prof = exe.profile(feed(exe), repeat=repeat, warmup=warmup)
        out = {o.op: (o.nodes, round(o.seconds * 1e3, digits)) for o in prof.by_op()[:top]}
        log(f"rlx {what} by op (eager, ms): total {prof.total_s * 1e3:.{digits}f}; {out}")
        return out
    except Exception:                                     # an explanation, not the measurement
        log(f"rlx {what} profile failed: {traceback.format_exc()[-1200:]}")
        return {}


def decode_step(model) -> dict:
    """The decode graph's step as it runs (the runner `generate` used, the one with the most
    launches): launches, launches by op, and on the GPU its CUDA graph replayed alone (ms)."""
    exe = model.executable("decode")
    runners = list(exe._runners.values())                 # (its specializations: batch, context bucket)
    if not runners:
        return {}
    r = max(runners, key=lambda x: len(getattr(x, "steps", ())))
    info = r.describe() if hasattr(r, "describe") else {}
    out = {"launches": info.get("steps"), "by_op": info.get("steps_by_op")}
    if hasattr(r, "replay_seconds") and info.get("graph"):
        out["graph_ms"] = min(r.replay_seconds(50) for _ in range(3)) * 1e3
    log(f"rlx decode step: {out}")
    return out


def decode_by_op(model, pos: int) -> dict:
    """Where one decode step's device time goes: op -> (nodes, ms), eager with events between
    nodes (rlx_core.profiler; launch gaps included, unlike the graph replay), the most time
    first. The step runs at position `pos` of the context the last generate used (it rewrites
    that position's KV and the recurrent states: run it after the decode timing)."""
    import numpy as np

    def feed(exe):
        mask = np.zeros((1, 1, 1, exe.fixed_dims["ctx"]), bool)
        mask[..., :pos + 1] = True
        return {"ids": np.full((1, 1), 7, np.int64), "positions": np.full((1, 1), pos, np.int64),
                "key_mask": mask, "cache_pos": np.full(1, pos, np.int32)}
    return by_op(model, "decode", feed, "decode step", repeat=5, warmup=2, top=14, digits=4)


def side_rlx(a, cfg: dict) -> dict:
    import ml_dtypes
    import numpy as np
    import torch

    from rlx_core.profile import CompileProfile, PrecisionConfig
    from rlx_core.runtime.model import CausalLM

    res: dict = {}
    on_gpu = a.backend == "cuda"
    if on_gpu:
        res["copy_bw"] = copy_bandwidth_torch()
    t0 = time.perf_counter()
    weights = random_weights(cfg, a.device)
    tensors = {k: v.view(torch.uint16).cpu().numpy().view(ml_dtypes.bfloat16) for k, v in weights.items()}
    del weights
    if on_gpu:
        torch.cuda.empty_cache()
    res["weight_bytes"] = sum(t.nbytes for t in tensors.values())
    prof = CompileProfile("qwen35_bf16", precision=PrecisionConfig(compute="bf16"))
    model = CausalLM.from_tensors(cfg, tensors, backend=a.backend, profile=prof,
                                  max_context=max(a.prefill + [a.decode_prompt]) + a.new + 64)
    res["load_s"] = time.perf_counter() - t0

    ids = prompt(a.decode_prompt, cfg["vocab_size"])
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=a.new)                       # compile + warm up
    res["first_generate_s"] = time.perf_counter() - t0
    dec, toks = [], None
    for _ in range(a.reps):
        out = model.generate(ids, max_new_tokens=a.new)
        dec.append(model.last_timings["decode_s_per_token"])
        toks = np.asarray(out)[0, a.decode_prompt:].tolist()
    res.update(decode_s=statistics.median(dec), decode_all_s=dec, tokens=toks,
               memory_decode=model.memory_report())
    log(f"rlx decode: {res['decode_s'] * 1e3:.3f} ms/token; memory {res['memory_decode']}")
    res["decode_step"] = decode_step(model)
    if a.decode_by_op:
        res["decode_step"]["by_op_ms"] = decode_by_op(model, a.decode_prompt + a.new)

    res["prefill"] = {}
    for n in a.prefill:
        ids = prompt(n, cfg["vocab_size"])
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1)                       # compile this length + warm up
        warm = time.perf_counter() - t0
        ts = []
        for _ in range(reps_within(a.reps, warm)):
            model.generate(ids, max_new_tokens=1)
            ts.append(model.last_timings["prefill_s"])
        res["prefill"][str(n)] = {"s": statistics.median(ts), "all_s": ts, "first_s": warm}
        log(f"rlx prefill {n}: {statistics.median(ts) * 1e3:.1f} ms (first call {warm:.1f} s)")
        if n in a.by_op:
            res["prefill"][str(n)]["by_op_ms"] = prefill_by_op(model, ids)
    res["memory_prefill"] = model.memory_report()
    res["memory_prefill_tokens"] = max(a.prefill, default=0)
    if a.decode_knockout and on_gpu:                      # (last: it leaves the step's values garbage)
        from gpu_kernels import decode_runner, knockout_table

        res["decode_step"]["knockout_us"] = knockout_table(decode_runner(model))
        log(f"rlx decode step, what each kind of launch costs in the graph (us): "
            f"{res['decode_step']['knockout_us']}")
    return res


# ------------------------------------------------------------------------------ the HF side
def count_fla_calls() -> dict:
    """Wrap fla's two gated-delta-rule entry points with call counters before transformers
    imports them (it resolves them by attribute at import): {name: calls}, or {} without fla."""
    import functools

    try:
        import fla.ops.gated_delta_rule as g
    except Exception as e:             # not installed: HF falls back to its torch reference
        log(f"hf: fla is not importable ({e!r}): HF runs its torch reference for the delta rule")
        return {}
    counts: dict = {}
    for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        fn = getattr(g, name, None)
        if fn is None:
            continue
        counts[name] = 0

        def wrapped(*args, _fn=fn, _name=name, **kw):
            counts[_name] += 1
            return _fn(*args, **kw)
        setattr(g, name, functools.wraps(fn)(wrapped))
    return counts


def fallback_warnings() -> list:
    """The warnings transformers logs about falling back to a torch path (its "fast path is
    not available" / "falling back to its reference PyTorch implementation"), as they come."""
    import logging

    seen: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if "fall" in text.lower() or "fast path" in text.lower():
                seen.append(text[:300])
    logging.getLogger("transformers").addHandler(Keep())
    return seen


def side_hf(a, cfg: dict) -> dict:
    import torch

    counts = count_fla_calls()
    warnings = fallback_warnings()
    import transformers

    res: dict = {"transformers": transformers.__version__, "torch": torch.__version__}
    dev = a.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    weights = random_weights(cfg, dev)
    with torch.device(dev):
        model = transformers.Qwen3_5ForCausalLM._from_config(hf_text_config(cfg), torch_dtype=torch.bfloat16,
                                                             attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"hf: state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    model.eval()
    del weights

    def prefill(ids):
        out = model(ids, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        return out.past_key_values, nxt

    with torch.no_grad():
        ids = torch.from_numpy(prompt(a.decode_prompt, cfg["vocab_size"])).to(dev)
        for rep in range(a.reps + 1):
            cache, nxt = prefill(ids)
            toks, t0 = [int(nxt)], time.perf_counter()
            for _ in range(a.new - 1):
                out = model(nxt, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                toks.append(int(nxt))                                   # (a sync a step, as generate)
            if rep:
                res.setdefault("decode_all_s", []).append((time.perf_counter() - t0) / max(a.new - 1, 1))
        res.update(decode_s=statistics.median(res["decode_all_s"]), tokens=toks)
        del cache
        log(f"hf decode: {res['decode_s'] * 1e3:.3f} ms/token")
        res["prefill"] = {}
        for n in a.prefill:
            ids = torch.from_numpy(prompt(n, cfg["vocab_size"])).to(dev)
            t0 = time.perf_counter()
            prefill(ids)                                                # Triton compile + warm up
            warm = time.perf_counter() - t0
            ts = []
            for _ in range(reps_within(a.reps, warm)):
                t0 = time.perf_counter()
                prefill(ids)
                ts.append(time.perf_counter() - t0)
            res["prefill"][str(n)] = {"s": statistics.median(ts), "all_s": ts, "first_s": warm}
            log(f"hf prefill {n}: {statistics.median(ts) * 1e3:.1f} ms (first call {warm:.1f} s)")
    res["fla_calls"], res["fallback_warnings"] = counts, warnings
    if dev == "cuda":
        res["peak_bytes"] = torch.cuda.max_memory_allocated()
    return res


# ------------------------------------------------------------------------------ report
def state_bytes_expected(cfg: dict, itemsize: int) -> int:
    """One row's recurrent + conv states: per linear layer [C, W - 1] + [H, K, V]."""
    k, v, h = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_num_value_heads"]
    conv_ch = 2 * cfg["linear_num_key_heads"] * k + h * v
    n_lin = cfg["layer_types"].count("linear_attention")
    return n_lin * (conv_ch * (cfg["linear_conv_kernel_dim"] - 1) + h * k * v) * itemsize


def report(a, cfg: dict, res: dict) -> None:
    rl, hf = res.get("rlx"), res.get("hf")
    log("")
    log(f"Qwen3.5-2B shape ({cfg['num_hidden_layers']} layers: "
        f"{cfg['layer_types'].count('linear_attention')} Gated DeltaNet + "
        f"{cfg['layer_types'].count('full_attention')} full attention; hidden {cfg['hidden_size']}, "
        f"vocab {cfg['vocab_size']}), bf16, batch 1; device {res.get('device', '?')}")
    if hf:
        calls = hf.get("fla_calls") or {}
        how = (f"fla's Triton kernels ({', '.join(f'{k} x{v}' for k, v in calls.items())})"
               if any(calls.values()) else "its torch reference (fla not used: a fallback)")
        log(f"HF: transformers {hf['transformers']}, torch {hf['torch']}, sdpa; "
            f"the delta rule ran through {how}")
        for w in hf.get("fallback_warnings") or []:
            log(f"HF warned: {w}")
    log("")
    log("| prefill tokens | RLX ms | HF ms | RLX / HF (target <= 1.0) |")
    log("|---|---|---|---|")
    for n in a.prefill:
        r = (rl or {}).get("prefill", {}).get(str(n))
        h = (hf or {}).get("prefill", {}).get(str(n))
        cell = lambda x: f"{x['s'] * 1e3:.1f}" if x else "failed / not run"  # noqa: E731
        ratio = f"{r['s'] / h['s']:.2f}" if r and h else "-"
        log(f"| {n} | {cell(r)} | {cell(h)} | {ratio} |")
    if rl:
        for n, r in rl.get("prefill", {}).items():
            if r.get("by_op_ms"):
                log(f"RLX prefill {n} by op (eager, events between nodes; nodes, ms): {r['by_op_ms']}")
        wb = rl["weight_bytes"]
        log("")
        bw = next((v for k, v in HBM_BW.items() if k in res.get("device", "")), None)
        floors = [(f"nominal HBM {bw / 1e12:.2f} TB/s", wb / bw)] if bw else []
        if rl.get("copy_bw"):
            floors.append((f"measured D2D copy {rl['copy_bw'] / 1e12:.2f} TB/s", wb / rl["copy_bw"]))
        d = rl["decode_s"]
        log(f"decode after a {a.decode_prompt}-token prompt, {a.new} new tokens: RLX {d * 1e3:.3f} ms/token"
            + (f", HF eager {hf['decode_s'] * 1e3:.3f} ms/token (HF / RLX {hf['decode_s'] / d:.2f})"
               if hf else ""))
        st = rl.get("decode_step") or {}
        if st.get("by_op_ms"):
            log(f"RLX decode step by op (eager, events between nodes; nodes, ms): {st['by_op_ms']}")
        if st.get("launches"):
            log(f"RLX decode step: {st['launches']} launches"
                + (f", its CUDA graph alone {st['graph_ms']:.3f} ms ({st['graph_ms'] / 1e3 / floors[0][1]:.2f}x "
                   f"the {floors[0][0]} floor)" if st.get("graph_ms") and floors else "")
                + f"; by op {st.get('by_op')}")
        if st.get("knockout_us"):
            log(f"RLX decode step, what each kind of launch costs in the graph ([launches, us]): "
                f"{st['knockout_us']}")
        log(f"weights {wb / 1e9:.3f} GB read a step: " + "; ".join(
            f"floor {f * 1e3:.3f} ms at the {name}: RLX {d / f:.2f}x it (target <= 1.6)"
            for name, f in floors))
        if hf and rl.get("tokens") and hf.get("tokens"):
            agree = next((i for i, (x, y) in enumerate(zip(rl["tokens"], hf["tokens"])) if x != y),
                         min(len(rl["tokens"]), len(hf["tokens"])))
            log(f"greedy tokens: RLX and HF agree on the first {agree} of {len(hf['tokens'])} (bf16 both; a "
                f"random model with tied embeddings tends to repeat one token: a weak check, the parity "
                f"tests are the strong one)")
        m1, m2 = rl["memory_decode"], rl["memory_prefill"]
        item = 2 if m1["state_bytes"] == state_bytes_expected(cfg, 2) else 4
        log("")
        log(f"| RLX memory_report | context ~{a.decode_prompt + a.new} | "
            f"context {rl['memory_prefill_tokens']} |")
        log("|---|---|---|")
        log(f"| state_bytes (recurrent + conv) | {m1['state_bytes']} | {m2['state_bytes']} |")
        log(f"| kv_bytes - state_bytes (full-attention KV) | {m1['kv_bytes'] - m1['state_bytes']} | "
            f"{m2['kv_bytes'] - m2['state_bytes']} |")
        log(f"state bytes by formula ({item}-byte elements): {state_bytes_expected(cfg, item)}; constant: "
            f"{m1['state_bytes'] == m2['state_bytes']}")
    if hf and hf.get("peak_bytes"):
        log(f"HF peak allocated {hf['peak_bytes'] / 1e9:.2f} GB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sides", default="rlx,hf")
    ap.add_argument("--prefill", default="8192,32768", help="prompt lengths of the prefill part")
    ap.add_argument("--decode-prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--by-op", default="", help="prompt lengths whose RLX prefill is profiled by op "
                    "(default: the shortest)")
    ap.add_argument("--decode-by-op", action="store_true", help="profile one RLX decode step by op (eager)")
    ap.add_argument("--decode-knockout", action="store_true",
                    help="what each kind of launch costs in RLX's captured decode step "
                         "(gpu_kernels.knockout_table)")
    ap.add_argument("--layers", type=int, default=0, help="a multiple of 4 (default: the shape's)")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (a CPU smoke run)")
    ap.add_argument("--backend", default="cuda", help="RLX's backend")
    ap.add_argument("--device", default="cuda", help="torch's device (weights, the HF side)")
    ap.add_argument("--budget", type=float, default=300, help="seconds a side may run")
    ap.add_argument("--json", default="")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    shape = dict(TINY if a.tiny else FULL)
    if a.layers:
        if a.layers % 4:
            ap.error(f"--layers {a.layers}: must be a multiple of 4 (3 Gated DeltaNet layers, then 1 full)")
        shape["layers"] = a.layers
    a.prefill = sorted(int(t) for t in a.prefill.split(",") if t)      # (none: decode only)
    a.by_op = [int(t) for t in a.by_op.split(",") if t] or a.prefill[:1]
    cfg = hf_config(shape, max(a.prefill + [a.decode_prompt]) + a.new + 64)
    if a.child:
        out = (side_rlx if a.child == "rlx" else side_hf)(a, cfg)
        print(json.dumps(out, default=str), flush=True)
        return 0
    res: dict = {"config": cfg}
    if a.device == "cuda":
        import torch

        res["device"] = torch.cuda.get_device_name(0)
    else:
        import platform

        res["device"] = f"{platform.processor() or platform.machine()} (CPU)"
    base = [sys.executable, os.path.abspath(__file__), f"--prefill={','.join(map(str, a.prefill))}",
            f"--decode-prompt={a.decode_prompt}", f"--new={a.new}", f"--reps={a.reps}",
            f"--by-op={','.join(map(str, a.by_op))}",
            *(["--decode-by-op"] if a.decode_by_op else []),
            *(["--decode-knockout"] if a.decode_knockout else []),
            f"--layers={shape['layers']}",
            f"--backend={a.backend}", f"--device={a.device}"] + (["--tiny"] if a.tiny else [])
    for side in a.sides.split(","):
        try:
            res[side] = run_child(base + ["--child", side], side, a.budget)
        except subprocess.TimeoutExpired:
            log(f"{side}: not done within --budget {a.budget:g} s")
            res[side] = None
        except Exception:
            log(f"{side}: {traceback.format_exc()[-1500:]}")
            res[side] = None
    report(a, cfg, res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
