"""Weights asked into L2 while a step's latency-bound kernels leave DRAM idle.

A decode step alternates GEMVs, which stream their weights near DRAM's rate, with kernels
that read little and wait on latency (attention, RoPE, the Gated DeltaNet step): for those
microseconds DRAM has nothing to do. Where such a stretch follows a GEMV, a side branch of the
captured graph, forked once that GEMV is done, asks L2 for the first bytes the GEMVs right
after the stretch will stream (sources.L2_PREFETCH), up to a share of L2, so that those GEMVs
find them there. The branch is a hint: nothing reads its result, only the step's end waits
for it. CONFIG["l2_prefetch"] switches it on (sm_90: bulk prefetches).
"""
from __future__ import annotations

import numpy as np

from . import device, sources
from .values import CONFIG

L2_SHARE = 0.5              # of L2 one stretch's prefetch may ask for
UNDER_GEMV = 0              # bytes of the next GEMV's weights asked for as each GEMV starts that
                            # another follows directly (0: none; the GEMVs reach ~3.4 of ~4.2 TB/s)
EVICT_LAST = 0              # the prefetched lines at evict_last priority in L2 (kernels/prefetch.cu)
CHUNK = 1 << 16             # bytes one bulk prefetch asks for
BLOCKS, THREADS = 4, 128    # the prefetch kernel's grid: chunks asked for at once
RANGES = 4                  # (address, bytes) ranges one launch takes (the kernel's arguments)


def plan(steps: list, budget: int, under: int = 0) -> dict:
    """{i: ranges} for steps (each with `.reads`, runner.Step's): the (address, bytes) ranges to
    ask for beside step i, forked when the steps before it are done:
    - i the first of a stretch that streams no weights after a step that does: the streaming
      steps right after the stretch, in order, `budget` bytes at most;
    - with `under` > 0, i a streaming step that another follows directly: that one's first
      `under` bytes (an equal first part of each of its ranges), fetched while step i streams."""
    out = {}
    for i in range(1, len(steps)):
        if not steps[i].reads and steps[i - 1].reads:
            j = next((k for k in range(i, len(steps)) if steps[k].reads), len(steps))
            ranges = _first_bytes(steps, j, budget)
        elif under and steps[i].reads and i + 1 < len(steps) and steps[i + 1].reads:
            ranges = _first_bytes(steps[:i + 2], i + 1, under)
        else:
            continue
        if ranges:
            out[i] = ranges
    return out


def _first_bytes(steps: list, j: int, budget: int) -> list:
    """The first `budget` bytes the streaming steps j, j + 1, .. read, in order: each whole
    while the budget lasts, then an equal first part of each range of the next one."""
    ranges: list = []
    left = budget
    while j < len(steps) and steps[j].reads and left >= 16:
        reads = steps[j].reads
        each = left if sum(n for _, n in reads) <= left else left // len(reads)
        taken = [(p, min(n, each)) for p, n in reads]
        ranges += taken
        left -= sum(n for _, n in taken)
        j += 1
    return _merged(ranges)


def _merged(ranges: list) -> list:
    """ranges with each one that starts where the one before it ends joined to it."""
    out: list = []
    for p, n in ranges:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((p, n))
    return out


def missing() -> str:
    """Why no prefetch branches are woven into this GPU's steps; '' where they are."""
    inf = device.info()
    why = device.l2_prefetch_missing(inf.get("cc", (0, 0)), bool(inf.get("hip")))
    if not why and not inf.get("l2"):
        why = "the GPU reports no L2 size"
    return why


def woven(b, steps: list, make_step) -> list:
    """`steps` with the plan's branches: before each planned step a fork (the side stream waits
    for the main stream's work so far, then the prefetch launches run on it), and a join at
    the end (the main stream waits for the side stream). make_step(node, fn): a Step. `steps`
    itself where CONFIG["l2_prefetch"] is off or the GPU cannot (`missing`)."""
    if not CONFIG["l2_prefetch"] or missing():
        return steps
    todo = plan(steps, int(device.info()["l2"] * L2_SHARE), UNDER_GEMV)
    if not todo:
        return steps
    cp = device.cupy()
    fn = b.kernel(sources.render(sources.L2_PREFETCH, EVICT_LAST=EVICT_LAST), "rlx_l2_prefetch")
    raw = getattr(fn, "fn", fn)          # a plain launch: no programmatic edge on the side stream
    main, side = b.stream, cp.cuda.Stream(non_blocking=True)
    forked, joined = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)

    def fork(ranges: list):
        launches = [_args(ranges[k:k + RANGES]) for k in range(0, len(ranges), RANGES)]

        def run():
            forked.record(main)
            side.wait_event(forked)
            for args in launches:
                raw((BLOCKS,), (THREADS,), args, 0, side)
        return run

    def join():
        joined.record(side)
        main.wait_event(joined)

    out = []
    for i, st in enumerate(steps):
        if i in todo:
            out.append(make_step(st.node, fork(todo[i])))
        out.append(st)
    out.append(make_step(steps[-1].node, join))
    return out


def _args(ranges: list) -> tuple:
    """rlx_l2_prefetch's arguments for up to RANGES ranges (the rest empty)."""
    args: list = []
    for k in range(RANGES):
        p, n = ranges[k] if k < len(ranges) else (0, 0)
        args += [np.uint64(p), np.int64(n)]
    return (*args, np.int32(CHUNK))
