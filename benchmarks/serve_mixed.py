"""The Scheduler's mixed steps, A/B in one process (issue 48, serve_race.py's scenario 3
without HTTP): `--clients` greedy streams decode; once each has `--steady` tokens, `--window`
more make the "before" window; then a `--long-tokens` prompt arrives; "during" is every
inter-token gap overlapping its prefill (arrival to its first token). Each side is one
Scheduler over the same loaded model (`--model`, numba), kept for all its runs, run in turn
`--repeat` times (interleaved: mixed, alone, mixed, ...; a rehearsal of each first, so no
graph compiles in a measurement), at `--prefill-chunk` and `--stall-budget`:

* mixed: the prompt's pieces ride in the decode steps (Scheduler(mixed=True), the default);
* alone: each piece is a run of its own before the step (mixed=False: the scheduler before
  the mixed step).

Printed per run: p99 gap before / during and their ratio (the issue's target: <= 2x), the
longest gap, the long prompt's TTFT, the steps that carried a piece, and the process CPU
seconds of the during window (the streams' tokens included: a side whose streams wait makes
fewer); then the medians per side, the load average beside each, and the mixed side's
measured costs (a piece length -> what it adds to a step), which choose its pieces.

    RLX_NUM_THREADS=2 python benchmarks/serve_mixed.py [--repeat 3] [--long-tokens 600]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_race import slow_steps, step_medians, steps_around  # noqa: E402


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def percentile(xs: list, q: float) -> float:
    """Nearest rank."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))]


def ids(seed: int, n: int, vocab: int) -> list:
    import numpy as np

    return np.random.default_rng(seed).integers(100, min(vocab, 20000), n).tolist()


def scheduler(model, a, mixed: bool):
    """A side's Scheduler, kept for all its runs (its graphs stay compiled; its idle release
    is off, as the other side runs meanwhile)."""
    from rlx_core.runtime import scheduler as sched

    sched.IDLE_RELEASE_S = 1e9
    return sched.Scheduler(model, max_batch=a.clients + 1, prefill_chunk=a.prefill_chunk,
                           stall_budget=a.stall_budget, mixed=mixed, prefix_cache_mb=0)


def measure(s, model, a, seed: int) -> dict:
    arrivals: list = [[] for _ in range(a.clients)]

    def listener(i):
        return lambda ev: arrivals[i].append(time.perf_counter())

    streams = [s.submit(ids(seed + i, 12, model.vocab_size), max_tokens=100000, ignore_eos=True,
                        on_event=listener(i)) for i in range(a.clients)]

    def wait_tokens(n: int, since: float = 0.0) -> None:
        while any(sum(t > since for t in arr) < n for arr in arrivals):
            time.sleep(0.002)

    wait_tokens(a.steady)
    t_ready = time.perf_counter()
    wait_tokens(a.steady + a.window)
    first: list = []
    steps0, mixed0 = s.steps, s.mixed_steps
    cpu0, t_arrive = time.process_time(), time.perf_counter()
    long_ = s.submit(ids(seed + 99, a.long_tokens, model.vocab_size), max_tokens=2, ignore_eos=True,
                     on_event=lambda ev: first.append(time.perf_counter()))
    while not first:
        time.sleep(0.002)
    t_first, cpu1 = first[0], time.process_time()
    runs = steps_around([asdict(r) for r in s.step_log(t_ready)], t_arrive, t_first)
    steps, mixed_steps = s.steps - steps0, s.mixed_steps - mixed0
    wait_tokens(2, since=t_first)
    for r in streams:
        r.cancel()
    for r in streams + [long_]:
        r.result(600)
    gaps = [(t, t - p) for arr in arrivals for p, t in zip(arr, arr[1:])]
    before = [d for t, d in gaps if t_ready <= t - d and t <= t_arrive]
    during = [d for t, d in gaps if t > t_arrive and t - d < t_first]
    return {"before": percentile(before, 99), "during": percentile(during, 99), "longest": max(during),
            "ratio": percentile(during, 99) / percentile(before, 99), "ttft": t_first - t_arrive,
            "steps": steps, "mixed_steps": mixed_steps, "cpu": cpu1 - cpu0, **runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=600)
    ap.add_argument("--steady", type=int, default=4)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--stall-budget", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sides", nargs="+", default=["mixed", "alone"], choices=["mixed", "alone"])
    a = ap.parse_args()

    import rlx_core
    from hardware import cpu_name

    model = rlx_core.load(a.model, backend=a.backend, progress=False)
    threads = os.environ.get("RLX_NUM_THREADS")
    print(f"{cpu_name()} ({os.cpu_count()} logical cores), RLX_NUM_THREADS={threads}; "
          f"{a.model} on {a.backend}; {a.clients} streams, a {a.long_tokens}-token prompt, chunk "
          f"{a.prefill_chunk}, stall budget {a.stall_budget}", flush=True)
    scheds = {side: scheduler(model, a, side == "mixed") for side in a.sides}
    for side in a.sides:                                        # rehearsal: the graphs compiled
        measure(scheds[side], model, a, 7000)
    rows: dict = {side: [] for side in a.sides}
    for rep in range(a.repeat):
        for side in a.sides:
            load = loadavg()
            d = measure(scheds[side], model, a, 1000 * (rep + 1))
            rows[side].append(d)
            print(f"  {side:5s} run {rep + 1}: before {d['before'] * 1e3:.0f} ms, "
                  f"during {d['during'] * 1e3:.0f} ms (longest {d['longest'] * 1e3:.0f}), {d['ratio']:.2f}x; "
                  f"TTFT {d['ttft']:.2f} s; {d['steps']} steps ({d['mixed_steps']} mixed); "
                  f"CPU {d['cpu']:.2f} s  (load {load} -> {loadavg()})", flush=True)
            for line in (step_medians(d), slow_steps(d)):
                if line:
                    print(f"        {line}", flush=True)
    for side, ds in rows.items():
        med = {k: statistics.median(d[k] for d in ds) for k in ("before", "during", "ratio", "ttft", "cpu")}
        print(f"{side:5s} median of {len(ds)}: before {med['before'] * 1e3:.0f} ms, "
              f"during {med['during'] * 1e3:.0f} ms, {med['ratio']:.2f}x; TTFT {med['ttft']:.2f} s; "
              f"CPU {med['cpu']:.2f} s")
    if "mixed" in scheds:
        s, cost = scheds["mixed"], scheds["mixed"]._mixed_cost
        adds = ", ".join(f"{n}: {c:.2f}" for n, c in sorted(cost.items()))
        print(f"mixed: a decode step {s._step_cost * 1e3:.1f} ms (median of the last timed); what a piece "
              f"adds, in steps (median of its last): {adds}")
    for s in scheds.values():
        s.close()
    exe = os.path.relpath(sys.executable)
    print(f"reproduce: RLX_NUM_THREADS={threads or ''} {exe} {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
