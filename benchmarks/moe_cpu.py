"""MoE on the CPU (issue 44's CPU rows): an OLMoE-1B-7B-shaped random checkpoint written as a
q4_k GGUF by `rlx quantize`, decode and prefill on RLX's numba backend vs llama.cpp
(llama-cpp-python) on the same file, peak RSS vs file size; and one MoE layer's decode step
on the numba kernels vs the same ops legalized into their composites.

    .venv/bin/python benchmarks/moe_cpu.py [--layers 16] [--experts 64] [--k 8] [--hidden 2048]
        [--inter 1024] [--vocab 49152] [--heads 16] [--threads 2] [--prefill 128] [--decode 32]
        [--repeat 2] [--activations f32] [--sides numba llama.cpp] [--layer-steps 20] [--keep DIR]

The checkpoint (OLMoE-1B-7B's shape by default: 64 experts, top-8, 16 layers, hidden 2048,
expert width 1024, vocab 49152 (SmolLM2's tokenizer; OLMoE's is 50304)) has random f16 weights (std 0.02, norms 1), one safetensors
shard per layer, and is written to a q4_k GGUF by `rlx quantize` ("Q4_K_M-like": llama.cpp's
Q4_K_M keeps some tensors in q6_k; `rlx quantize` writes one scheme). Where `rlx quantize`
cannot write it, the script says why and stops. Shrink with --layers / --experts / --hidden /
--inter / --vocab while developing (k-quants need hidden and expert width multiples of 256).

Sides, each in its own process with `--threads` threads (numba's, BLAS's, llama.cpp's):
* numba      `rlx_core.load(gguf, backend="numba")` (`--activations int8`: with the profile's
             `[precision] activations = "int8"`, the counterpart of llama.cpp's q8 activations):
             a `--prefill`-token prompt (its time to the next token's logits) and `--decode`
             greedy tokens (ms per token), best and median of `--repeat` generate calls after
             a warm-up one; peak RSS (VmHWM)
* llama.cpp  the same file through llama-cpp-python's `eval` (prefill, then one-token evals),
             when installed; else "peer not installed" and no ratio
* layer      one MoE layer (router matmul, moe_route, moe_experts) at the checkpoint's layer
             shape, packed q4_k, one token (`--activations int8`: the experts' x through a
             fake_quantize to int8_b32 first): the numba runner with its kernels vs the same
             graph with moe_route / moe_experts legalized into their composites (every expert
             on every token), median ms per step of `--layer-steps` runs (best and CPU seconds
             beside), the route alone (numba's moe_route step, route_rows, beside the NumPy
             kernel it replaced), and the kernels' `--prefill`-token step
Prints the hardware, the load average, each side's numbers and the ratios numba / llama.cpp
(targets: decode <= 1.0x, prefill <= 0.7x, peak RSS <= file + 300 MB).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import log, run_child  # noqa: E402
from hardware import cpu_name  # noqa: E402

FULL = dict(layers=16, experts=64, k=8, hidden=2048, inter=1024, vocab=49152, heads=16)   # vocab: SmolLM2's tokenizer
LABEL = {"numba": "RLX numba, packed q4_k", "llama.cpp": "llama.cpp (llama-cpp-python)"}


# ------------------------------------------------------------------------------ the checkpoint
def hf_config(a) -> dict:
    return dict(model_type="olmoe", architectures=["OlmoeForCausalLM"], vocab_size=a.vocab,
                hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
                num_attention_heads=a.heads, num_key_value_heads=a.heads, num_experts=a.experts,
                num_experts_per_tok=a.k, norm_topk_prob=False, max_position_embeddings=4096,
                rms_norm_eps=1e-5, rope_theta=10000.0, clip_qkv=None, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float16")


def write_checkpoint(folder: str, a) -> None:
    """Random f16 OLMoE tensors (HF names, per-expert), one safetensors shard per layer."""
    import numpy as np
    from rlx_blocks_moe.recipes import hf_tensor_shapes

    def tensor(name, shape, rng):
        return (np.ones(shape, np.float16) if "norm" in name else
                (0.02 * rng.standard_normal(shape, np.float32)).astype(np.float16))

    cfg = hf_config(a)
    write_sharded(folder, cfg, hf_tensor_shapes(cfg), tensor)


def write_sharded(folder: str, cfg: dict, shapes: dict, tensor, tokenizer=None) -> None:
    """`tensor(name, shape, rng)` for every HF name in `shapes`, one safetensors shard per
    layer (a layer's tensors in memory at a time), the index, config.json and the tokenizer."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    shards: dict = {}
    for name, shape in shapes.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        shards.setdefault(layer, {})[name] = shape
    weight_map = {}
    for layer, layer_shapes in shards.items():
        fname = f"model-{layer}.safetensors"
        tensors = {n: tensor(n, sh, rng) for n, sh in layer_shapes.items()}
        save_file(tensors, os.path.join(folder, fname))
        weight_map.update({n: fname for n in tensors})
        del tensors
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    (tokenizer or save_tokenizer)(folder)


def save_tokenizer(folder: str) -> None:
    """SmolLM2's byte-level BPE tokenizer (the packaged model's) as the checkpoint's: llama.cpp
    loads no GGUF without a vocabulary."""
    import rlx_core

    tok = rlx_core.load("smollm2", backend="numpy", progress=False).tokenizer
    tok.backend.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}, f)


def quantize(src: str, dst: str) -> None:
    """`rlx quantize SRC DST -s q4_k`, in a process of its own (its peak RSS reported)."""
    rlx = os.path.join(os.path.dirname(sys.executable), "rlx")
    t0 = time.perf_counter()
    p = subprocess.run([rlx, "quantize", src, dst, "-s", "q4_k"], capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"rlx quantize failed (exit {p.returncode}): {(p.stdout + p.stderr)[-1500:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024     # the largest child so far
    log(f"{p.stdout.strip().splitlines()[-1]} ({time.perf_counter() - t0:.0f}s; peak RSS of the "
        f"benchmark's children so far {peak:.0f} MB)")


# ------------------------------------------------------------------------------ the sides
def side_numba(a) -> dict:
    import numpy as np

    import rlx_core

    profile = None
    if a.activations == "int8":        # the opt-in: packed matmuls' x rounded through int8 blocks
        from rlx_core.profile import CompileProfile
        profile = CompileProfile.from_toml_str('[precision]\nactivations = "int8"\n')
    m = rlx_core.load(a.gguf, backend="numba", progress=False, profile=profile)
    ids = np.random.default_rng(1).integers(3, a.vocab, (1, a.prefill))
    m.generate(ids, max_new_tokens=4, min_new_tokens=4)                      # compile + warm up
    runs = []
    for _ in range(a.repeat):
        m.generate(ids, max_new_tokens=a.decode, min_new_tokens=a.decode)
        t = m.last_timings
        runs.append({"prefill_s": t["prefill_s"], "decode_s": t["decode_s_per_token"]})
    return {"runs": runs}


def side_llamacpp(a) -> dict:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=a.gguf, n_threads=a.threads, n_threads_batch=a.threads,
                n_ctx=a.prefill + a.decode + 16, n_batch=a.prefill, verbose=False)
    ids = np.random.default_rng(1).integers(3, a.vocab, a.prefill).tolist()

    def last_logits():        # eval keeps only the last position's logits (logits_all off)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

    def once():
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        pre = time.perf_counter() - t0
        nxt = int(np.argmax(last_logits()))
        t0 = time.perf_counter()
        for _ in range(a.decode - 1):
            llm.eval([nxt])
            nxt = int(np.argmax(last_logits()))
        return {"prefill_s": pre, "decode_s": (time.perf_counter() - t0) / max(a.decode - 1, 1)}
    once()
    return {"runs": [once() for _ in range(a.repeat)]}


def layer_graph(a, schemes, tokens: int = 1):
    from rlx_core.ir.dtype import F32, U8
    from rlx_core.ir.graph import Builder
    from rlx_core.ir.quant import QuantScheme

    m = Builder("moe_layer", "mir")
    x = m.input("x", (tokens, a.hidden), F32)
    router = m.param("router", (a.experts, a.hidden), F32)
    weights, ids = m.add("moe_route", (m.matmul(x, router, trans_b=True),), k=a.k)
    if a.activations == "int8":        # the experts' x rounded through int8 blocks: their up pass in integers
        x = m.add("fake_quantize", (x,), scheme="int8_b32")
    stacks = []
    for name, (rows, cols) in zip(("gate", "up", "down"), ((a.inter, a.hidden), (a.inter, a.hidden),
                                                            (a.hidden, a.inter))):
        r, nbytes = QuantScheme.parse(schemes[0]).packed_shape((rows, cols))
        stacks.append(m.param(name, (a.experts, r, nbytes), U8))
    m.output("y", m.add("moe_experts", (x, weights, ids, *stacks), schemes=schemes,
                        int8_h=a.activations == "int8"))     # as pack_params sets it: h rounded too
    return m.build()


def timed(run, steps: int) -> dict:
    """Median and best wall seconds of `steps` runs, and the least CPU seconds of one (this
    process's threads together: at one thread, robust to other jobs on the machine)."""
    walls, cpus = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return {"step_s": statistics.median(walls), "best_s": min(walls), "cpu_s": min(cpus)}


def side_layer(a) -> dict:
    """One MoE layer's decode step (and, with its kernels, its `--prefill`-token step) on the
    numba backend, with its kernels or (a.legalized) with moe_route / moe_experts left to
    their composites."""
    import numpy as np

    import rlx_core
    from rlx_core.ir.quant import QuantScheme

    if a.legalized:
        from rlx_backend_numba import NumbaBackend
        have = NumbaBackend.supported_ops
        NumbaBackend.supported_ops = lambda self: have(self) - {"moe_experts", "moe_route"}
    schemes = ("q4_k", "q4_k", "q4_k")
    q = QuantScheme.parse("q4_k")
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((1, a.hidden)).astype(np.float32)}
    params = {"router": (0.1 * rng.standard_normal((a.experts, a.hidden))).astype(np.float32)}
    for name, shape in (("gate", (a.inter, a.hidden)), ("up", (a.inter, a.hidden)), ("down", (a.hidden, a.inter))):
        one = q.quantize((0.02 * rng.standard_normal(shape)).astype(np.float32))
        params[name] = np.ascontiguousarray(np.broadcast_to(one, (a.experts,) + one.shape))  # the bytes, E times
    exe = rlx_core.compile(layer_graph(a, schemes), backend="numba", params=params)
    exe.run(inputs)
    out = timed(lambda: exe.run(inputs), a.layer_steps)
    if not a.legalized:              # the prefill step (the composites' would take minutes)
        many = {"x": rng.standard_normal((a.prefill, a.hidden)).astype(np.float32)}
        pre = rlx_core.compile(layer_graph(a, schemes, a.prefill), backend="numba", params=params)
        pre.run(many)
        out["prefill"] = timed(lambda: pre.run(many), max(3, a.layer_steps // 4))
    if not a.legalized:              # moe_route alone: the NumPy kernel, numba's step as the runner calls it
        from rlx_backend_numba.moe import prepare_moe_route
        from rlx_core.ir.numpy_kernels import KERNELS
        logits = rng.standard_normal((1, a.experts)).astype(np.float32)
        w, i = np.empty((1, a.k), np.float32), np.empty((1, a.k), np.int64)
        attrs = {"k": a.k, "order": "softmax_topk", "normalize": False}
        step = prepare_moe_route(attrs, [w, i], [logits]).bind(attrs, [w, i], logits)
        numpy_route = lambda: KERNELS["moe_route"](attrs, [w, i], logits)  # noqa: E731
        for key, call in (("route_s", numpy_route), ("route_numba_s", step)):
            call()
            t0 = time.perf_counter()
            for _ in range(1000):
                call()
            out[key] = (time.perf_counter() - t0) / 1000
    return out


# ------------------------------------------------------------------------------ plumbing
def peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM (Linux's ru_maxrss keeps the parent's peak across exec),
    else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            return int(f.read().split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(a) -> None:
    res = {"numba": side_numba, "llama.cpp": side_llamacpp, "layer": side_layer}[a.child](a)
    res["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(res), flush=True)


def spawn(a, side: str, extra: list = ()) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", side] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
        if k not in ("child", "sides", "keep", "legalized") and v is not None] + list(extra)
    os.environ.update(RLX_NUM_THREADS=str(a.threads), OMP_NUM_THREADS=str(a.threads),
                      OPENBLAS_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    return run_child(cmd, side + (" (legalized)" if "--legalized" in extra else ""), timeout=3600)


def have_llamacpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


def stats(runs: list, key: str) -> str:
    v = [r[key] * 1e3 for r in runs]
    return f"{min(v):.1f} [{statistics.median(v):.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in FULL.items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--activations", choices=["f32", "int8"], default="f32",
                    help='the numba side\'s `[precision] activations` ("int8": the opt-in, as llama.cpp\'s q8 activations)')
    ap.add_argument("--layer-steps", type=int, default=20)
    ap.add_argument("--sides", nargs="+", default=["numba", "llama.cpp", "layer"],
                    choices=["numba", "llama.cpp", "layer"])
    ap.add_argument("--keep", help="folder for the checkpoint and GGUF (kept; reused if the GGUF is there)")
    ap.add_argument("--child", choices=["numba", "llama.cpp", "layer"])
    ap.add_argument("--gguf")
    ap.add_argument("--legalized", action="store_true")
    a = ap.parse_args()
    if a.child:
        return child(a)
    log(f"hardware: {cpu_name()}, {os.cpu_count()} cores, {a.threads} threads; load avg "
        f"{os.getloadavg()[0]:.1f}; python {platform.python_version()}")
    log(f"shape: {a.layers} layers, {a.experts} experts top-{a.k}, hidden {a.hidden}, expert width "
        f"{a.inter}, vocab {a.vocab}, {a.heads} heads")
    folder = a.keep or tempfile.mkdtemp(prefix="rlx-moe-")
    os.makedirs(folder, exist_ok=True)
    try:
        a.gguf = os.path.join(folder, "olmoe-q4_k.gguf")
        if {"numba", "llama.cpp"} & set(a.sides) and not os.path.exists(a.gguf):
            src = os.path.join(folder, "hf")
            os.makedirs(src, exist_ok=True)
            t0 = time.perf_counter()
            write_checkpoint(src, a)
            log(f"random checkpoint written in {time.perf_counter() - t0:.0f}s")
            quantize(src, a.gguf)
            shutil.rmtree(src)
        report(a, run_sides(a))
    finally:
        if not a.keep:
            shutil.rmtree(folder, ignore_errors=True)


def run_sides(a) -> dict:
    res = {}
    for side in a.sides:
        if side == "llama.cpp" and not have_llamacpp():
            log("llama.cpp: peer not installed (pip install llama-cpp-python); no ratio")
            continue
        if side == "layer":
            res["layer"] = spawn(a, "layer")
            res["layer-legalized"] = spawn(a, "layer", ["--legalized"])
        else:
            res[side] = spawn(a, side)
    return res


def report(a, res: dict) -> None:
    file_mb = os.path.getsize(a.gguf) / 2**20 if os.path.exists(a.gguf) else None
    for side in ("numba", "llama.cpp"):
        r = res.get(side)
        if r:
            label = LABEL[side] + (f", {a.activations} activations" if side == "numba" else "")
            log(f"{label:44} prefill {a.prefill} tokens {stats(r['runs'], 'prefill_s')} ms, decode "
                f"{stats(r['runs'], 'decode_s')} ms/token ({1 / min(x['decode_s'] for x in r['runs']):.1f} tokens/s), "
                f"peak RSS {r['peak_rss_mb']:.0f} MB (best [median])")
    if res.get("numba") and file_mb:
        rss = res["numba"]["peak_rss_mb"]
        log(f"numba peak RSS {rss:.0f} MB vs file {file_mb:.0f} MiB + 300 MB: {rss - file_mb:+.0f} MB over the file "
            f"(target <= +300)")
    if res.get("numba") and res.get("llama.cpp"):
        for key, target in (("decode_s", "<= 1.0"), ("prefill_s", "<= 0.7")):
            q = min(r[key] for r in res["numba"]["runs"]) / min(r[key] for r in res["llama.cpp"]["runs"])
            log(f"ratio numba / llama.cpp {key[:-2]} (best): {q:.2f}x (target {target})")
    lay, leg = res.get("layer"), res.get("layer-legalized")
    if lay:
        log(f"one MoE layer, decode step (1 token, q4_k, {a.activations} activations): numba kernels {lay['step_s'] * 1e3:.2f} ms "
            f"(median; best {lay['best_s'] * 1e3:.2f}, CPU {lay['cpu_s'] * 1e3:.2f}), "
            f"moe_route alone: numba's step {lay['route_numba_s'] * 1e6:.1f} us (the NumPy kernel "
            f"{lay['route_s'] * 1e6:.0f} us)")
        p = lay["prefill"]
        log(f"one MoE layer, prefill step ({a.prefill} tokens): numba kernels {p['step_s'] * 1e3:.1f} ms (median; best "
            f"{p['best_s'] * 1e3:.1f}, CPU {p['cpu_s'] * 1e3:.1f})")
    if lay and leg:
        log(f"  legalized composites {leg['step_s'] * 1e3:.2f} ms: the kernels {leg['step_s'] / lay['step_s']:.1f}x "
            f"faster (peak RSS {lay['peak_rss_mb']:.0f} vs {leg['peak_rss_mb']:.0f} MB)")
    log(f"load avg at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
