"""Where a CUDA-graph replay's device time goes, kernel by kernel: the replays run under
torch.profiler (CUPTI records every kernel of the process, cupy's graph nodes too), and each
kernel name's launches and device microseconds are averaged over the replays. Gaps between
kernels are not in the table: its sum against the replay's time says how much they cost."""
from __future__ import annotations

import collections


def kernel_table(runner, times: int = 20) -> dict:
    """{"replay_us": one replay, "kernels_us": the kernels' sum, "by_kernel": {name: [launches,
    us]} (a replay's, the most time first)} of `runner`'s captured CUDA graph."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    replay_us = runner.replay_seconds(times) * 1e6                  # (warm, and the time alone)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.replay_seconds(times - 1)                            # times replays in all
    rows: dict = {}
    for ev in prof.events():
        if ev.device_type == DeviceType.CUDA and "memcpy" not in ev.name.lower() and "memset" not in ev.name.lower():
            r = rows.setdefault(ev.name, [0, 0.0])
            r[0] += 1
            r[1] += ev.device_time
    by = {n: [round(c / times, 2), round(us / times, 2)] for n, (c, us) in
          sorted(rows.items(), key=lambda kv: -kv[1][1])}
    return {"replay_us": round(replay_us, 2), "kernels_us": round(sum(v[1] for v in by.values()), 2), "by_kernel": by}


def decode_runner(model):
    """The decode graph's runner `generate` used (of its specializations, the most launches)."""
    runners = list(model.executable("decode")._runners.values())
    return max(runners, key=lambda r: len(getattr(r, "steps", ()))) if runners else None


def step_kind(step) -> str:
    """A launch's kind in knockout_table: its op, and for a GEMV the bytes of weights it
    streams (which tells the gate/up GEMV from the down GEMV)."""
    nbytes = sum(n for _, n in step.reads)
    return f"{step.op} {nbytes / 1e6:.1f} MB" if nbytes else step.op


def knockout_table(runner, times: int = 50) -> dict:
    """What each kind of launch costs inside the captured step, where the launches overlap
    (programmatic dependent launch) and kernel_table's own times do not add up: the step is
    captured again without that kind's launches and replayed, against the whole step. The
    step's values are then garbage (only the times are read); the whole step is captured
    again at the end. {"replay_us": the whole step, "by_kind": {kind: [launches, us saved]}},
    the most saved first."""
    steps = list(runner.steps)
    kind_of = [step_kind(st) for st in steps]

    def replay_us(kept: list) -> float:
        runner.steps = kept
        runner._capture()
        return min(runner.replay_seconds(times) for _ in range(3)) * 1e6

    kinds = collections.Counter(kind_of)
    try:
        whole = replay_us(steps)
        saved = {k: [n, round(whole - replay_us([st for st, c in zip(steps, kind_of) if c != k]), 2)]
                 for k, n in kinds.items()}
    finally:
        runner.steps = steps
        runner._capture()
    return {"replay_us": round(whole, 2), "by_kind": dict(sorted(saved.items(), key=lambda kv: -kv[1][1]))}
