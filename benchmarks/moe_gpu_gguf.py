"""A whole OLMoE-1B-7B-shaped model decoding at batch 1 on the GPU: RLX's cuda backend against
llama.cpp's CUDA build on the same GGUF files, F16 and Q4_K_M (issue 44's GPU batch-1 row).

    python benchmarks/moe_gpu_gguf.py --llama-bin DIR [--dir /tmp/olmoe] [--layers 16] [--tokenizer DIR]
        [--prompt 512] [--new 128] [--repeat 3] [--files f16,q4_k_m] [--profile]
    python benchmarks/moe_gpu_gguf.py --files f16,q4_k --layers 4 --profile    # RLX alone, no llama.cpp

The checkpoint is moe_cpu.py's (64 experts, top-8, 16 layers, hidden 2048, expert width 1024,
SmolLM2's vocabulary), random f16 weights (std 0.02, norms 1: slices of one seeded random pool,
so writing 7 B weights takes seconds, not minutes). `rlx quantize -s f16` writes it as
llama.cpp's `olmoe` F16 GGUF, and llama.cpp's own `llama-quantize` makes the Q4_K_M file from
that one (llama.cpp's mix of q4_K and q6_K), so both engines read the same files; file kind `q4_k`
is `rlx quantize -s q4_k`'s (every matmul q4_k: for RLX alone, where no llama.cpp is built).
`--tokenizer DIR` takes tokenizer.json from DIR (the GPU machine has no packaged SmolLM2 to
take it from).

Sides, each file in its own process:
* rlx        `rlx_core.load(file, backend="cuda")`, compute bf16: a `--prompt`-id prompt and
             `--new` greedy tokens (EOS ignored), the median of `--repeat` generate calls after a
             warm-up one; prefill ms and decode ms per token. `--profile`: also the decode step's
             launches by op and its CUDA graph replayed alone, and one step by op (eager, events
             between nodes: qwen35_gpu's decode_step and decode_by_op) and its graph's kernels
             (gpu_kernels.kernel_table: launches and device us of each kernel a replay runs)
* llama.cpp  (with `--llama-bin`) `llama-bench -m FILE -ngl 99 -fa 1 -p PROMPT -n NEW -d PROMPT -r REPEAT`: prompt
             processing, and generation at depth PROMPT (RLX's decode runs at depth PROMPT to
             PROMPT + NEW); a build that fails or crashes is reported so, with no ratio
Printed: the hardware, per file both sides' decode ms per token and prefill ms, and rlx / llama.cpp
(target for decode: <= 0.8).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import gguf_race, gpu_name, llama_quantized, log, rlx_gguf_decode  # noqa: E402
from moe_cpu import FULL, hf_config, write_sharded  # noqa: E402

FILE_TYPES = {"f16": "F16", "q4_k_m": "Q4_K_M"}      # llama-quantize's names
RLX_SCHEMES = {"f16": "f16", "q4_k": "q4_k"}          # the files `rlx quantize` writes


# ------------------------------------------------------------------------------ the files
def write_checkpoint(folder: str, a) -> None:
    """moe_cpu's checkpoint, its random matrices cut from one seeded pool (fast at 7 B weights)."""
    import numpy as np
    from rlx_blocks_moe.recipes import hf_tensor_shapes

    pool = (0.02 * np.random.default_rng(0).standard_normal(1 << 24, np.float32)).astype(np.float16)

    def tensor(name, shape, rng):
        n = int(np.prod(shape))
        if "norm" in name:
            return np.ones(shape, np.float16)
        if n > pool.size:
            return np.resize(pool, n).reshape(shape)
        start = int(rng.integers(0, pool.size - n + 1))
        return pool[start:start + n].reshape(shape)

    def copy_tokenizer(dst):     # --tokenizer's files, not the packaged SmolLM2's (absent on the GPU machine)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(a.tokenizer, name), dst)
    cfg = hf_config(a)
    write_sharded(folder, cfg, hf_tensor_shapes(cfg), tensor, copy_tokenizer if a.tokenizer else None)


def make_files(a) -> dict:
    """{kind: path} of the GGUF files, written once into `--dir` (kept between runs): f16 (and
    q4_k) by `rlx quantize`, q4_k_m from the f16 file by llama.cpp's `llama-quantize`."""
    os.makedirs(a.dir, exist_ok=True)
    kinds = a.files.split(",")
    path = {k: os.path.join(a.dir, f"olmoe-{k}.gguf") for k in {"f16", *kinds}}
    hf = os.path.join(a.dir, "hf")
    todo = [k for k in RLX_SCHEMES if k in path and not os.path.exists(path[k])]
    if todo:
        t0 = time.perf_counter()
        os.makedirs(hf, exist_ok=True)
        write_checkpoint(hf, a)
        log(f"wrote the f16 checkpoint ({time.perf_counter() - t0:.0f}s)")
        from rlx_core.weights import load_checkpoint
        from rlx_core.weights.gguf_write import write_gguf
        for k in todo:
            t0 = time.perf_counter()
            write_gguf(load_checkpoint(hf), path[k], RLX_SCHEMES[k], echo=log)
            log(f"rlx quantize -s {k}: {os.path.getsize(path[k]) / 2**30:.2f} GiB ({time.perf_counter() - t0:.0f}s)")
        shutil.rmtree(hf)
    llama_quantized(a.llama_bin, path, {k: t for k, t in FILE_TYPES.items() if k not in RLX_SCHEMES})
    return {k: path[k] for k in kinds if os.path.exists(path[k])}


# ------------------------------------------------------------------------------ the sides
def side_rlx(a) -> dict:
    out, m = rlx_gguf_decode(a.child_file, a.backend, a.prompt, a.new, a.repeat, a.vocab)
    if a.profile:
        from gpu_kernels import decode_runner, kernel_table
        from qwen35_gpu import decode_by_op, decode_step
        out["step"] = decode_step(m)
        out["kernels"] = kernel_table(decode_runner(m)) if a.backend == "cuda" else {}
        out["by_op_ms"] = decode_by_op(m, a.prompt + a.new)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in FULL.items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--llama-bin", help="the folder of llama-bench and llama-quantize (none: RLX alone)")
    ap.add_argument("--backend", default="cuda", help="RLX's backend (cuda; numpy for a smoke run)")
    ap.add_argument("--profile", action="store_true", help="RLX's decode step by op too")
    ap.add_argument("--files-only", action="store_true", help="write the files, measure nothing")
    ap.add_argument("--dir", default="/tmp/olmoe")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--files", default="f16,q4_k_m")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child-file", default=None)
    a = ap.parse_args()
    if a.child_file:
        print(json.dumps(side_rlx(a)), flush=True)
        return
    log(f"device: {gpu_name()}; shape: {a.layers} layers, {a.experts} experts top-{a.k}, hidden {a.hidden}, "
        f"expert width {a.inter}; prompt {a.prompt}, {a.new} new tokens, median of {a.repeat}")
    files = make_files(a)
    if a.files_only:
        return
    own = ("child_file", "profile", "files_only")
    args = [a2 for k, v in vars(a).items() if v not in (None, False) and k not in own
            for a2 in (f"--{k.replace('_', '-')}", str(v))] + ["--profile"] * a.profile
    gguf_race(os.path.abspath(__file__), files, args, a, "RLX / llama.cpp (target <= 0.8)",
              lambda rlx, peer: rlx["decode_ms"] / peer["decode_ms"])

if __name__ == "__main__":
    main()
