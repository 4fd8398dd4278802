"""What logprobs cost a decode step (issue 47: <= 5%), SmolLM2 on the CPU.

The same greedy generation three ways, interleaved, in one process on one compiled model:
  greedy       the fast path: the graph's arg-max ids, no logits fetched
  logits       logprobs=0: the step's logits fetched, the chosen token's log-probability
  top-5        logprobs=5: also the five most likely tokens' log-probabilities
Prints each side's decode ms per token (`last_timings`, best and median of --repeat runs) and
the ratio of logprobs=5 to logprobs=0 (the logprobs themselves) and to the fast path (what a
request asking for logprobs pays in all). Tokens must agree (exit 1 otherwise).

    .venv/bin/python benchmarks/logprobs_cpu.py [--backend numba] [--tokens 64] [--repeat 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hardware import cpu_name, loadavg, stats  # noqa: E402

SIDES = {"greedy": {}, "logits": {"logprobs": 0}, "top-5": {"logprobs": 5}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.environ.setdefault("NUMBA_NUM_THREADS", str(a.threads))
    import rlx_core

    print(f"hardware: {cpu_name()}, {os.cpu_count()} cores, {a.threads} threads; load {loadavg()}")
    m = rlx_core.load("smollm2", backend=a.backend, progress=False)
    prompt = m.encode_prompt("Write a long story about a lighthouse keeper.", chat=True)
    times: dict = {s: [] for s in SIDES}
    tokens: dict = {}
    for r in range(a.repeat + 1):                       # (the first round compiles: not timed)
        for side, kw in SIDES.items():
            out = m.generate([prompt], max_new_tokens=a.tokens, min_new_tokens=a.tokens, return_dict=True, **kw)
            tokens.setdefault(side, out.ids[0].tolist())
            if r:
                times[side].append(m.last_timings["decode_s_per_token"] * 1e3)
    for side in SIDES:
        lo, med = stats(times[side])
        print(f"{side:8s} decode {lo:.2f} [{med:.2f}] ms/token (best [median])")
    base, lp0, lp5 = (stats(times[s])[0] for s in SIDES)
    print(f"top-5 logprobs / logits fetched: {lp5 / lp0:.3f}x; logprobs=5 / fast path: {lp5 / base:.3f}x "
          f"(target <= 1.05x); load {loadavg()}")
    if len({tuple(t) for t in tokens.values()}) != 1:
        raise SystemExit("the sides' tokens differ")


if __name__ == "__main__":
    main()
