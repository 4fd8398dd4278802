"""LLM decode/prefill on the GPU: RLX's CUDA backend against HF transformers on the same GPU.

Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, vocab
128256, tied embeddings) with random bf16 weights made here (numpy rng), batch 1:
decode ms/token over 128 new tokens after a 512-token prompt, and the 512-token prefill.

Packed rows (--packed q4_k,q8_0): the same random weights quantized here with
rlx_core.ir.quant (every matmul weight and the tied embedding, as PackedTensors), decoded in
the kernels; their floor is the packed bytes over the same copy bandwidth. `q4_k+int8`: that
scheme under `[precision] activations = "int8"` (the int8 dp4a GEMVs).

Peers: HF transformers eager (bf16, sdpa, dynamic cache) and HF with a static cache and
torch.compile(mode="reduce-overhead"). The bandwidth floor of a decode token is the
weight bytes over the device-to-device copy bandwidth measured in this run (bytes read
plus bytes written per second). Prints a table; --json writes every number.

    python benchmarks/llm_gpu.py [--layers 16] [--prompt 512] [--new 128] [--json out.json]
    python benchmarks/llm_gpu.py --batch 1 8 32 64 --prompt 256 --new 64    # batched decode
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
import traceback

import numpy as np

from common import llama_shapes, log, run_child

LLAMA_1B = dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0,
                max_position_embeddings=131072, hidden_act="silu", attention_bias=False, mlp_bias=False,
                rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                              "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                bos_token_id=128000, eos_token_id=128001, pad_token_id=None,
                architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")


# ----------------------------------------------------------------------------- weights
def make_weights(cfg: dict, seed: int = 0) -> dict:
    """HF-named random bf16 tensors (numpy, ml_dtypes.bfloat16), made on this machine: norms
    near one, the embedding N(0, 0.02), matrices N(0, 1/K)."""
    import ml_dtypes

    rng = np.random.default_rng(seed)

    def init(name, shape):
        if len(shape) == 1:
            return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(ml_dtypes.bfloat16)
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= 0.02 if "embed" in name else 1.0 / math.sqrt(shape[-1])
        return a.astype(ml_dtypes.bfloat16)
    return {k: init(k, s) for k, s in llama_shapes(cfg).items()}


def weight_bytes(t: dict) -> int:
    return sum(a.nbytes for a in t.values())


# ----------------------------------------------------------------------------- device facts
def warm_for(fn, seconds: float = 1.0) -> None:
    """Call fn until `seconds` have passed (at least once); a 32-token batch-1 run lasts ~40 ms.
    With one warm-up call, one H100 measured the batch-1 step at 1.331 ms in one run and 1.195
    in the next; with 1 s, three runs in a row agreed within 0.5%."""
    t0 = time.perf_counter()
    fn()
    while time.perf_counter() - t0 < seconds:
        fn()


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy, (read + write) bytes per second, median of `reps`."""
    import cupy as cp

    a = cp.empty(nbytes, cp.uint8)
    a.fill(1)
    b = cp.empty_like(a)
    s, e = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for i in range(reps + 3):
        s.record()
        cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice, 0)
        e.record()
        e.synchronize()
        if i >= 3:
            ts.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    del a, b
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes / statistics.median(ts)


# ----------------------------------------------------------------------------- RLX
def runtime_model(cfg, tensors, max_context: int, backend: str = "cuda", activations: str = "f32"):
    """The runtime's CausalLM of these tensors computing in bf16 (the peers' dtype); `activations`:
    the profile's [precision] activations (int8: packed matmuls take x in int8 blocks)."""
    from rlx_core.profile import CompileProfile, PrecisionConfig
    from rlx_core.runtime.model import CausalLM

    prof = CompileProfile("llama32_bf16", precision=PrecisionConfig(compute="bf16", activations=activations))
    return CausalLM.from_tensors(cfg, tensors, backend=backend, profile=prof, max_context=max_context)


def rlx_runtime(cfg, tensors, prompt, n_new, reps, cublas=True, activations="f32", knockout=False):
    """RLX through the runtime (CausalLM.from_tensors + generate); knockout: what each kind
    of launch costs inside the captured decode step (gpu_kernels.knockout_table)."""
    t0 = time.perf_counter()
    model = runtime_model(cfg, tensors, prompt.shape[1] + n_new + 128, activations=activations)
    res = {}
    toks = model.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new)   # compile + warm up
    res["first_generate_s"] = time.perf_counter() - t0
    warm_for(lambda: model.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new))
    pre, dec = [], []
    for _ in range(reps):
        toks = model.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new)
        pre.append(model.last_timings["prefill_s"])
        dec.append(model.last_timings["decode_s_per_token"])
    res.update(prefill_s=statistics.median(pre), decode_s=statistics.median(dec),
               tokens=np.asarray(toks)[0, prompt.shape[1]:].tolist(), engine="runtime CausalLM")
    if knockout:                              # (it leaves the step's values garbage: after the tokens)
        from gpu_kernels import decode_runner, knockout_table

        res["knockout_us"] = knockout_table(decode_runner(model))
        log(f"rlx decode step ({activations} activations), what each kind of launch costs in the graph (us): "
            f"{res['knockout_us']}")
    try:
        from rlx_backend_cuda import set_config

        if cublas:            # the same decode with cuBLAS for the matmuls (16-bit weights only)
            set_config(gemv=False)
            model.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new)
            d2 = []
            for _ in range(max(1, reps // 2)):
                model.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new)
                d2.append(model.last_timings["decode_s_per_token"])
            res["decode_s_cublas"] = statistics.median(d2)
            set_config(gemv=True)
    except Exception as e:  # a comparison, not the measurement
        res["decode_s_cublas_error"] = repr(e)
    try:
        exe = model.executable("decode")
        res["decode_runners"] = [r.describe() for r in exe._runners.values()]
    except Exception:
        pass
    return res


def llama_graphs(cfg, S, ctx):
    """A Llama decoder built directly with the core builder (the fallback engine): bf16
    params, KV cache states written by kv_write at `pos`, causal attention with `pos`."""
    from rlx_core.ir.dtype import BF16, F32, I32, I64
    from rlx_core.ir.graph import Graph
    from rlx_core.ir.ops import MaskKind

    h, nh, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, it, v, L = cfg.get("head_dim") or h // nh, cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    eps = cfg["rms_norm_eps"]

    def f(m):
        ids = m.input("ids", (1, S), I64)
        pos = m.input("pos", (1,), I32)
        cos, sin = m.input("cos", (1, S, d // 2), F32), m.input("sin", (1, S, d // 2), F32)
        emb = m.param("model.embed_tokens.weight", (v, h), BF16)
        x = m.gather(emb, ids)
        for i in range(L):
            def p(n, s):
                return m.param(f"model.layers.{i}.{n}", s, BF16)
            hh = m.rms_norm(x, p("input_layernorm.weight", (h,)), eps=eps)
            q = m.transpose(m.reshape(m.linear(hh, p("self_attn.q_proj.weight", (nh * d, h))), (1, S, nh, d)), (0, 2, 1, 3))
            k = m.transpose(m.reshape(m.linear(hh, p("self_attn.k_proj.weight", (kvh * d, h))), (1, S, kvh, d)), (0, 2, 1, 3))
            vv = m.transpose(m.reshape(m.linear(hh, p("self_attn.v_proj.weight", (kvh * d, h))), (1, S, kvh, d)), (0, 2, 1, 3))
            q, k = m.rope(q, cos, sin), m.rope(k, cos, sin)
            kc = m.kv_write(m.state(f"k{i}", (1, kvh, ctx, d), BF16), k, pos)
            vc = m.kv_write(m.state(f"v{i}", (1, kvh, ctx, d), BF16), vv, pos)
            a = m.attention(q, kc, vc, None, pos, mask_kind=MaskKind.CAUSAL)
            a = m.reshape(m.transpose(a, (0, 2, 1, 3)), (1, S, nh * d))
            x = x + m.linear(a, p("self_attn.o_proj.weight", (h, nh * d)))
            hh = m.rms_norm(x, p("post_attention_layernorm.weight", (h,)), eps=eps)
            x = x + m.swiglu(hh, p("mlp.gate_proj.weight", (it, h)), p("mlp.up_proj.weight", (it, h)),
                             p("mlp.down_proj.weight", (h, it)))
        x = m.rms_norm(m.narrow(x, 1, S - 1, 1), m.param("model.norm.weight", (h,), BF16), eps=eps)
        return {"logits": m.cast(m.linear(x, emb), F32)}
    return Graph.define(f"llama_{S}", f)


def rope_tables(cfg, positions):
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = 1.0 / (cfg["rope_theta"] ** (np.arange(0, d, 2) / d))
    ang = np.asarray(positions, np.float64)[:, None] * inv[None]
    return np.cos(ang).astype(np.float32)[None], np.sin(ang).astype(np.float32)[None]


def rlx_graph(cfg, tensors, prompt, n_new, reps):
    """RLX with the builder-made graphs (used when the runtime path is unavailable)."""
    import rlx_core
    from rlx_core.pipeline import StateStore

    S = prompt.shape[1]
    ctx = -(-(S + n_new) // 128) * 128
    states = StateStore()
    t0 = time.perf_counter()
    pre = rlx_core.compile(llama_graphs(cfg, S, ctx), backend="cuda", params=tensors, states=states)
    dec = rlx_core.compile(llama_graphs(cfg, 1, ctx), backend="cuda", states=states)
    dec.set_params({k: v for k, v in pre._params.items() if k in dec.param_specs})
    c, s = rope_tables(cfg, np.arange(S))

    def gen():
        ta = time.perf_counter()
        lg = pre.run({"ids": prompt, "pos": np.zeros(1, np.int32), "cos": c, "sin": s})["logits"]
        tb = time.perf_counter()
        out = []
        for t in range(n_new):
            nxt = int(np.argmax(lg[0, -1]))
            out.append(nxt)
            if t == n_new - 1:
                break
            cc, ss = rope_tables(cfg, [S + t])
            lg = dec.run({"ids": np.array([[nxt]]), "pos": np.array([S + t], np.int32), "cos": cc, "sin": ss})["logits"]
        tc = time.perf_counter()
        return tb - ta, (tc - tb) / max(n_new - 1, 1), out
    gen()
    res = {"first_generate_s": time.perf_counter() - t0}
    p, d = [], []
    for _ in range(reps):
        a, b, toks = gen()
        p.append(a)
        d.append(b)
    res.update(prefill_s=statistics.median(p), decode_s=statistics.median(d), tokens=toks,
               engine="builder graph (fallback)")
    from rlx_backend_cuda import set_config

    set_config(gemv=False)
    gen()
    res["decode_s_cublas"] = statistics.median([gen()[1] for _ in range(max(1, reps // 2))])
    set_config(gemv=True)
    res["decode_runners"] = [r.describe() for r in dec._runners.values()]
    try:                                   # where a decode step's device time goes, by op
        cc, ss = rope_tables(cfg, [S])
        prof = dec.profile({"ids": np.array([[1]]), "pos": np.array([S], np.int32), "cos": cc, "sin": ss},
                           repeat=3)
        res["decode_profile_ms"] = {o.op: (o.nodes, round(o.seconds * 1e3, 4)) for o in prof.by_op()}
        res["decode_profile_total_ms"] = round(prof.total_s * 1e3, 4)
        log(f"decode step device time by op (eager, events between steps): total "
            f"{res['decode_profile_total_ms']} ms (graph replay run {prof.run_s * 1e3:.3f} ms); "
            f"{res['decode_profile_ms']}")
    except Exception:
        log(f"profile failed: {traceback.format_exc()[-1500:]}")
    return res


def packed_tensors(tensors: dict, scheme: str) -> dict:
    """Every 2-D weight quantized to `scheme` (threads: numpy releases the GIL), norms kept."""
    from concurrent.futures import ThreadPoolExecutor

    from rlx_core.ir.quant import PackedTensor, QuantScheme

    s = QuantScheme.parse(scheme)

    def one(item):
        k, v = item
        if v.ndim != 2:
            return k, v
        return k, PackedTensor(s.quantize(np.asarray(v, np.float32)), s, v.shape, k)
    with ThreadPoolExecutor(16) as ex:
        return dict(ex.map(one, tensors.items()))


def rlx_packed(cfg, tensors, prompt, a, bw, bf16_decode):
    """Decode/prefill with packed weights, one row per entry of --packed: a scheme, `+int8`
    after it for int8 activations."""
    import cupy as cp

    rows = {}
    for entry in filter(None, a.packed.split(",")):
        scheme, _, act = entry.partition("+")
        try:
            t = time.perf_counter()
            pt = packed_tensors(tensors, scheme)
            nbytes = sum(getattr(v, "nbytes", 0) for v in pt.values())
            log(f"{scheme}: quantized in {time.perf_counter() - t:.1f}s, {nbytes / 1e9:.3f} GB")
            r = rlx_runtime(cfg, pt, prompt, a.new, a.reps, cublas=False, activations=act or "f32",
                            knockout=a.decode_knockout)
            r.update(weight_bytes=nbytes, floor_s=nbytes / bw)
            r["x_floor"] = r["decode_s"] / r["floor_s"]
            if bf16_decode:
                r["bf16_over_this"] = bf16_decode / r["decode_s"]
            log(f"rlx {entry}: decode {r['decode_s'] * 1e3:.3f} ms/token = {r['x_floor']:.2f}x its floor "
                f"{r['floor_s'] * 1e3:.3f} ms; bf16 decode / this {r.get('bf16_over_this', 0):.2f}; "
                f"prefill {r['prefill_s'] * 1e3:.3f} ms; runners {r.get('decode_runners')}")
            rows[entry] = r
            del pt
        except Exception:
            rows[entry] = {"error": traceback.format_exc()[-3000:]}
            log(f"rlx {entry} failed:\n{rows[entry]['error']}")
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def packed_table(res: dict) -> str:
    lines = ["| packed | weights GB | decode ms/token | floor ms | x floor | bf16 decode / this | prefill ms |",
             "|---|---|---|---|---|---|---|"]
    for k, r in (res.get("packed") or {}).items():
        if "error" in r:
            lines.append(f"| {k} | failed | | | | | |")
            continue
        lines.append(f"| {k} | {r['weight_bytes'] / 1e9:.3f} | {r['decode_s'] * 1e3:.3f} | {r['floor_s'] * 1e3:.3f} | "
                     f"{r['x_floor']:.2f} | {r.get('bf16_over_this', 0):.2f} | {r['prefill_s'] * 1e3:.3f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- HF peers
def hf_model(cfg, tensors):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype")})
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(hc, torch_dtype=torch.bfloat16)
    sd = {k: torch.from_numpy(np.ascontiguousarray(v).view(np.uint16)).view(torch.bfloat16) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    assert not missing and not unexpected, (missing, unexpected)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.eval()
    return model


def hf_eager(model, prompt, n_new, reps):
    import torch

    ids = torch.from_numpy(prompt).cuda()

    def once():
        with torch.no_grad():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                out = model(ids, use_cache=True, logits_to_keep=1)
            except TypeError:
                out = model(ids, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            past, toks = out.past_key_values, [nxt]
            for _ in range(n_new - 1):
                out = model(nxt, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                toks.append(nxt)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
        return t1 - t0, (t2 - t1) / (n_new - 1), [int(t[0, 0]) for t in toks]      # row 0's tokens
    once()
    runs = [once() for _ in range(reps)]
    return {"prefill_s": statistics.median(r[0] for r in runs), "decode_s": statistics.median(r[1] for r in runs),
            "tokens": runs[-1][2]}


def hf_compiled(model, prompt, n_new, reps):
    """Static cache + torch.compile(mode="reduce-overhead"): generate() compiles the forward
    itself when cache_implementation="static" (its default CompileConfig is reduce-overhead)."""
    import torch
    from transformers import CompileConfig

    ids = torch.from_numpy(prompt).cuda()
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = CompileConfig(mode="reduce-overhead", fullgraph=True)

    def gen(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(2):            # compiles and records the graphs
        gen(n_new)
        gen(1)
    warm = time.perf_counter() - t0
    full = [gen(n_new) for _ in range(reps)]
    one = [gen(1) for _ in range(reps)]
    pre = statistics.median(one)
    return {"prefill_s": pre, "decode_s": (statistics.median(full) - pre) / (n_new - 1), "compile_s": warm}


def check(cfg, tensors, n_layers=2, S=32, n_new=6):
    """Correctness on the same model: RLX runtime on cuda vs on numpy (last-token logits and
    greedy tokens), and HF eager vs RLX numpy (logits), with the first `n_layers` layers."""
    import torch

    c = dict(cfg, num_hidden_layers=n_layers)
    t = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers}
    prompt = np.random.default_rng(2).integers(0, c["vocab_size"], size=(1, S)).astype(np.int64)
    out = {}
    lg, toks = {}, {}
    for be in ("cuda", "numpy"):
        m = runtime_model(c, t, S + n_new + 8, backend=be)
        lg[be] = m.logits(prompt)[0, -1].astype(np.float64)
        toks[be] = np.asarray(m.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new))[0, S:].tolist()
    hf = hf_model(c, t)
    with torch.no_grad():
        lg["hf"] = hf(torch.from_numpy(prompt).cuda()).logits[0, -1].float().cpu().numpy().astype(np.float64)
    del hf

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))
    out = {"layers": n_layers, "prompt": S, "logits_rel_cuda_vs_numpy": rel(lg["cuda"], lg["numpy"]),
           "logits_rel_hf_vs_numpy": rel(lg["hf"], lg["numpy"]),
           "argmax": {k: int(np.argmax(v)) for k, v in lg.items()},
           "tokens_cuda": toks["cuda"], "tokens_numpy": toks["numpy"]}
    log(f"check: {out}")
    return out


# ----------------------------------------------------------------------------- batched decode
BATCH_SIDES = ("rlx", "hf_eager", "hf_compiled")


def batch_child(side: str, a) -> dict:
    """One side's decode ms/step at each batch of --batch (a process of its own): rows of
    --prompt random ids, --new greedy tokens; the device memory high-water mark."""
    import cupy as cp
    import torch

    cfg = dict(LLAMA_1B, num_hidden_layers=a.layers)
    tensors = make_weights(cfg)
    rng = np.random.default_rng(1)
    prompts = {b: rng.integers(0, cfg["vocab_size"], (b, a.prompt)).astype(np.int64) for b in a.batch}
    out = {}
    if side == "rlx":
        out["floor_s"] = weight_bytes(tensors) / copy_bandwidth()     # (weights read once a step)
        model = runtime_model(cfg, tensors, a.prompt + a.new + 128)
        del tensors
        tabled: set = set()
        for b, prompt in prompts.items():
            warm_for(lambda: model.generate(prompt, max_new_tokens=a.new, min_new_tokens=a.new))
            dec = []
            for _ in range(a.reps):
                model.generate(prompt, max_new_tokens=a.new, min_new_tokens=a.new)
                dec.append(model.last_timings["decode_s_per_token"])
            out[b] = {"decode_s": statistics.median(dec)}
            if a.decode_kernels or a.decode_knockout:     # (the decode runners this batch added: its step)
                from gpu_kernels import kernel_table, knockout_table

                fresh = [r for r in model.executable("decode")._runners.values()
                         if id(r) not in tabled and getattr(r, "steps", None)]
                tabled.update(map(id, fresh))
                if a.decode_kernels:
                    out[b]["kernels"] = [kernel_table(r) for r in fresh]
                if a.decode_knockout:
                    out[b]["knockout_us"] = [knockout_table(r) for r in fresh]
        out["peak_bytes"] = cp.get_default_memory_pool().total_bytes()
        return out
    model = hf_model(cfg, tensors)
    del tensors
    torch.cuda.reset_peak_memory_stats()
    for b, prompt in prompts.items():
        t = time.perf_counter()
        r = (hf_eager if side == "hf_eager" else hf_compiled)(model, prompt, a.new, a.reps)
        out[b] = {"decode_s": r["decode_s"], "wall_s": time.perf_counter() - t}
    out["peak_bytes"] = torch.cuda.max_memory_allocated()
    return out


def batch_main(a) -> int:
    """Each side in its own process, then the table: ms/step and tokens/s per batch, the
    batch-B step over the batch-1 step, and RLX over each peer at the same batch."""

    import torch

    log(f"GPU: {torch.cuda.get_device_name(0)}; Llama-3.2-1B shape ({a.layers} layers), bf16, prompt "
        f"{a.prompt}, {a.new} new tokens, batches {a.batch}; each side in its own process")
    res = {}
    for side in a.sides:
        cmd = [sys.executable, __file__, "--child", side, "--layers", str(a.layers), "--prompt", str(a.prompt),
               "--new", str(a.new), "--reps", str(a.reps), "--batch", *map(str, a.batch),
               *(["--decode-kernels"] if a.decode_kernels else []),
               *(["--decode-knockout"] if a.decode_knockout else [])]
        r = run_child(cmd, side, a.child_timeout)
        if r is not None:
            res[side] = {int(k) if k.isdigit() else k: v for k, v in r.items()}
    lines = ["| batch | " + " | ".join(f"{s} ms/step | {s} tokens/s" for s in res) + " | RLX step / its batch-1 step | "
             + " | ".join(f"RLX / {s}" for s in res if s != "rlx") + " |",
             "|---" * (1 + 2 * len(res) + 1 + sum(s != "rlx" for s in res)) + "|"]
    for b in a.batch:
        cells = []
        for s in res:
            d = res[s][b]["decode_s"]
            cells += [f"{d * 1e3:.3f}", f"{b / d:.0f}"]
        rl = res.get("rlx")
        ratio = [f"{rl[b]['decode_s'] / rl[a.batch[0]]['decode_s']:.2f}" if rl else "-"]
        ratio += [f"{rl[b]['decode_s'] / res[s][b]['decode_s']:.2f}" if rl else "-" for s in res if s != "rlx"]
        lines.append(f"| {b} | " + " | ".join(cells + ratio) + " |")
    if "rlx" in res:
        for b in a.batch:
            log(f"rlx batch {b}: decode {res['rlx'][b]['decode_s'] * 1e3:.3f} ms/step")
        fl = res["rlx"]["floor_s"]
        lines.append(f"weight-read floor {fl * 1e3:.3f} ms/step (weights over the copy rate measured in the rlx "
                     f"process); RLX batch-1 step {res['rlx'][a.batch[0]]['decode_s'] / fl:.2f}x it")
    lines.append("peak device memory: " + ", ".join(f"{s} {res[s]['peak_bytes'] / 1e9:.2f} GB" for s in res)
                 + " (RLX: the CuPy pool's total; HF: torch's max allocated)")
    for b in a.batch if a.decode_kernels and "rlx" in res else ():
        for t in res["rlx"][b].get("kernels", []):
            lines.append(f"rlx batch {b}, a replay of the decode step: {t['replay_us']} us, its kernels "
                         f"{t['kernels_us']} us; the most time first (launches, us):")
            lines += [f"  {n[:90]}: {c}, {us}" for n, (c, us) in list(t["by_kernel"].items())[:14]]
    for b in a.batch if a.decode_knockout and "rlx" in res else ():
        for t in res["rlx"][b].get("knockout_us", []):
            lines.append(f"rlx batch {b}, the decode step without each kind of launch: replay "
                         f"{t['replay_us']} us; saved (launches, us): {t['by_kind']}")
    print("\n".join(lines), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engine", choices=["auto", "runtime", "graph"], default="auto")
    ap.add_argument("--no-compiled-peer", action="store_true")
    ap.add_argument("--rlx-only", action="store_true", help="skip the HF peers (a quick RLX-only check)")
    ap.add_argument("--packed", default="q4_k,q8_0", help="packed-weight rows (schemes, comma-separated, "
                                                         "`+int8` after one: int8 activations; '' skips)")
    ap.add_argument("--json", default="")
    ap.add_argument("--check-layers", type=int, default=2, help="layers of the cuda-vs-numpy-vs-HF check (0: skip)")
    ap.add_argument("--batch", type=int, nargs="+", default=None,
                    help="batched decode instead: ms/step per batch, each side in its own process")
    ap.add_argument("--sides", nargs="+", choices=BATCH_SIDES, default=list(BATCH_SIDES))
    ap.add_argument("--child", choices=BATCH_SIDES, default=None)
    ap.add_argument("--child-timeout", type=float, default=400)
    ap.add_argument("--decode-kernels", action="store_true",
                    help="with --batch: each batch's decode step kernel by kernel (gpu_kernels.kernel_table)")
    ap.add_argument("--decode-knockout", action="store_true",
                    help="runtime engine (and --batch): what each kind of launch costs inside the decode "
                         "step (gpu_kernels.knockout_table), for the bf16 and each packed row (each batch)")
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(batch_child(a.child, a)), flush=True)
        return 0
    if a.batch:
        return batch_main(a)
    cfg = dict(LLAMA_1B, num_hidden_layers=a.layers)
    import cupy as cp
    import torch

    gpu = torch.cuda.get_device_name(0)
    log(f"GPU: {gpu}; torch {torch.__version__}; cupy {cp.__version__}")
    bw = copy_bandwidth()
    t = time.perf_counter()
    tensors = make_weights(cfg)
    wb = weight_bytes(tensors)
    floor = wb / bw
    log(f"weights: {wb / 1e9:.3f} GB (made in {time.perf_counter() - t:.1f}s); D2D copy {bw / 1e12:.2f} TB/s "
        f"(read+write); decode floor {floor * 1e3:.3f} ms/token")
    prompt = np.random.default_rng(1).integers(0, cfg["vocab_size"], size=(1, a.prompt)).astype(np.int64)
    if a.check_layers:
        try:
            res_check = check(cfg, tensors, a.check_layers)
        except Exception:
            res_check = {"error": traceback.format_exc()[-3000:]}
            log(f"check failed:\n{res_check['error']}")
    res = {"gpu": gpu, "date": datetime.date.today().isoformat(), "config": cfg, "weight_bytes": wb,
           "copy_bw": bw, "floor_s": floor, "prompt": a.prompt, "new": a.new,
           "check": res_check if a.check_layers else None}
    rl = None
    engines = {"auto": ["runtime", "graph"], "runtime": ["runtime"], "graph": ["graph"]}[a.engine]
    for eng in engines:
        try:
            t = time.perf_counter()
            if eng == "runtime":
                r = rlx_runtime(cfg, tensors, prompt, a.new, a.reps, knockout=a.decode_knockout)
            else:
                r = rlx_graph(cfg, tensors, prompt, a.new, a.reps)
            log(f"rlx ({r['engine']}): done in {time.perf_counter() - t:.1f}s: prefill {r['prefill_s'] * 1e3:.3f} ms, "
                f"decode {r['decode_s'] * 1e3:.3f} ms/token (cuBLAS GEMV: {r.get('decode_s_cublas', 0) * 1e3:.3f}); "
                f"runners {r.get('decode_runners')}")
            res[f"rlx_{eng}"] = r
            rl = rl or r
        except Exception:
            log(f"rlx engine {eng} failed:\n{traceback.format_exc()[-3000:]}")
            res[f"rlx_{eng}_error"] = traceback.format_exc()[-3000:]
    res["rlx"] = rl
    res["packed"] = rlx_packed(cfg, tensors, prompt, a, bw, rl and rl.get("decode_s"))
    print(packed_table(res), flush=True)
    if a.rlx_only:
        for eng in engines:
            r = res.get(f"rlx_{eng}")
            if r:
                log(f"rlx {r['engine']}: decode {r['decode_s'] * 1e3:.3f} ms/token = "
                    f"{r['decode_s'] / floor:.2f}x floor; prefill {r['prefill_s'] * 1e3:.3f} ms")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
        return 0
    import gc

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    model = hf_model(cfg, tensors)
    del tensors
    t = time.perf_counter()
    res["hf_eager"] = hf_eager(model, prompt, a.new, a.reps)
    log(f"hf eager: done in {time.perf_counter() - t:.1f}s")
    if not a.no_compiled_peer:
        try:
            t = time.perf_counter()
            res["hf_compiled"] = hf_compiled(model, prompt, a.new, a.reps)
            log(f"hf static+compile: done in {time.perf_counter() - t:.1f}s")
        except Exception:
            res["hf_compiled_error"] = traceback.format_exc()[-2000:]
            log(f"hf static+compile failed:\n{res['hf_compiled_error']}")
    table = report(res) + "\n\n" + packed_table(res)
    print(table, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


def report(res: dict) -> str:
    ms = lambda s: f"{s * 1e3:.3f}" if s else "-"  # noqa: E731
    fl = res["floor_s"]
    he = res["hf_eager"]
    hc = res.get("hf_compiled") or {}
    rl = res.get("rlx") or {}
    lines = [f"GPU {res['gpu']}, {res['date']}; Llama-3.2-1B shape ({res['config']['num_hidden_layers']} layers), "
             f"bf16, batch 1, prompt {res['prompt']}, {res['new']} new tokens",
             f"weights {res['weight_bytes'] / 1e9:.3f} GB; D2D copy {res['copy_bw'] / 1e12:.2f} TB/s (read+write); "
             f"decode floor {ms(fl)} ms/token",
             "",
             "| engine | decode ms/token | x floor | HF eager / this (decode) | prefill ms | this / HF eager (prefill) |",
             "|---|---|---|---|---|---|"]

    def row(name, r):
        if not r:
            return f"| {name} | failed | | | | |"
        d, p = r.get("decode_s"), r.get("prefill_s")
        return (f"| {name} | {ms(d)} | {d / fl:.2f} | {he['decode_s'] / d:.2f} | {ms(p)} | "
                f"{p / he['prefill_s']:.2f} |")
    for key in ("rlx_runtime", "rlx_graph"):
        r = res.get(key)
        if not r:
            continue
        lines.append(row(f"RLX cuda ({r.get('engine', '?')})", r))
        if r.get("decode_s_cublas"):
            lines.append(row("  same, cuBLAS instead of rlx_gemv for decode", {"decode_s": r["decode_s_cublas"],
                                                                         "prefill_s": r["prefill_s"]}))
    lines.append(row("HF eager (sdpa, dynamic cache)", he))
    lines.append(row("HF static cache + torch.compile(reduce-overhead)", hc) if hc else
                 "| HF static cache + torch.compile(reduce-overhead) | failed / skipped | | | | |")
    if rl.get("tokens") and he.get("tokens"):
        agree = 0
        for x, y in zip(rl["tokens"], he["tokens"]):
            if x != y:
                break
            agree += 1
        lines.append("")
        lines.append(f"greedy tokens: RLX and HF eager agree on the first {agree} of {len(he['tokens'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
