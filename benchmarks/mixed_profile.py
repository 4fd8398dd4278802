"""Where a mixed step's time goes (issue 48, scenario 3 of serve_race.py): the decode graph of
`--rows` streams at context `--ctx`, and the mixed graph of the same rows carrying a prefill
piece of each `--pieces` length after `--filled` prompt tokens (prefill states of context
`--piece-ctx`), each profiled per node (Executable.profile: the median of `--repeat` runs);
printed: every graph's run time, then, per piece length, what each op kind adds to the plain
step. So what a piece token costs (its matmul rows, its attention over the prompt so far) sits
beside what a stream row costs, without a server or the scheduler's policy in the way.

Feeds are synthetic (token 100 everywhere, states zero): the work depends on the shapes and
the masks only. Run it alone (under the bench lock), threads set by RLX_NUM_THREADS.

    RLX_NUM_THREADS=2 python benchmarks/mixed_profile.py --rows 8 --ctx 4096 --filled 2000 --pieces 1 4
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hardware import cpu_name, loadavg  # noqa: E402


def decode_feed(rows: int, ctx: int) -> dict:
    """A decode step of `rows` streams with ctx - 9 tokens cached each (their keys in the mask)."""
    mask = np.zeros((rows, 1, 1, ctx), bool)
    mask[..., :ctx - 8] = True
    return {"ids": np.full((rows, 1), 100, np.int64), "positions": np.full((rows, 1), ctx - 9, np.int64),
            "key_mask": mask, "cache_pos": np.full(rows, ctx - 9, np.int32)}


def mixed_feed(rows: int, ctx: int, piece: int, piece_ctx: int, filled: int) -> dict:
    """That step carrying a `piece`-token piece of a prompt with `filled` tokens prefilled."""
    d = decode_feed(rows, ctx)
    mask = np.zeros((1, 1, 1, piece_ctx), bool)
    mask[..., :filled + piece] = True
    last = np.zeros((1, 1, piece), np.float32)
    last[..., -1] = 1
    return {"ids": np.concatenate([d["ids"].T, np.full((1, piece), 100, np.int64)], 1),
            "positions": np.concatenate([d["positions"].T, np.arange(filled, filled + piece)[None]], 1),
            "key_mask": d["key_mask"], "cache_pos": d["cache_pos"], "piece_mask": mask,
            "piece_pos": np.array([filled], np.int32), "last_token": last}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--piece-ctx", type=int, default=1024)
    ap.add_argument("--filled", type=int, default=300)
    ap.add_argument("--pieces", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeat", type=int, default=15)
    a = ap.parse_args()
    if not (0 < a.filled and a.filled + max(a.pieces) <= a.piece_ctx and a.ctx >= 9):
        ap.error("need 0 < --filled, --filled + the longest piece <= --piece-ctx, --ctx >= 9")

    import rlx_core
    from rlx_core.flow.blocks import PIECE_CTX
    from rlx_core.pipeline import StateStore

    model = rlx_core.load(a.model, backend=a.backend, progress=False)
    print(f"{cpu_name()}, RLX_NUM_THREADS={os.environ.get('RLX_NUM_THREADS', 'unset')}; {a.model} on "
          f"{a.backend}; {a.rows} rows at ctx {a.ctx}, pieces after {a.filled} tokens (piece ctx "
          f"{a.piece_ctx}); median of {a.repeat}; load {loadavg()}", flush=True)
    dec = model.executable_over("decode", StateStore())
    dec.fixed_dims = {"ctx": a.ctx}
    reports = {"decode": dec.profile(decode_feed(a.rows, a.ctx), repeat=a.repeat, warmup=3)}
    for p in a.pieces:
        exe = model.executable_over("mixed", StateStore(), rows=a.rows, piece=p)
        exe.fixed_dims = {"ctx": a.ctx, PIECE_CTX: a.piece_ctx}
        reports[f"mixed +{p}"] = exe.profile(mixed_feed(a.rows, a.ctx, p, a.piece_ctx, a.filled),
                                             repeat=a.repeat, warmup=3)
    plain = reports["decode"]
    for name, r in reports.items():
        print(f"  {name:9s} run {r.run_s * 1e3:7.2f} ms ({r.run_s / plain.run_s:.2f} steps), "
              f"{len(r.nodes)} nodes")
    base = {o.op: o for o in plain.by_op()}
    for name, r in list(reports.items())[1:]:
        print(f"  {name}: what each op kind adds to the plain step (ms; nodes)")
        ops = {o.op: o for o in r.by_op()}
        added = {op: (ops[op].seconds if op in ops else 0.0) - (base[op].seconds if op in base else 0.0)
                 for op in set(ops) | set(base)}
        for op in sorted(added, key=lambda o: -added[o]):
            if abs(added[op]) >= 1e-4:
                was = f"{base[op].seconds * 1e3:.2f} ({base[op].nodes})" if op in base else "-"
                got = f"{ops[op].seconds * 1e3:.2f} ({ops[op].nodes})" if op in ops else "-"
                print(f"    {op:24s} {was:>14s} -> {got:>14s}  {added[op] * 1e3:+6.2f}")
    print(f"load at the end {loadavg()}")


if __name__ == "__main__":
    main()
