"""cProfile of `generate` at one batch on the GPU (the 1B shape, random bf16 weights): where the
host time of a decode step goes beside the device's.

    python plugins/rlx_backend_cuda/tools/host_profile.py [--batch 64] [--layers 16]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
from llm_gpu import LLAMA_1B, make_weights, runtime_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    a = ap.parse_args()

    cfg = dict(LLAMA_1B, num_hidden_layers=a.layers)
    model = runtime_model(cfg, make_weights(cfg), a.prompt + a.new + 128)
    prompt = np.random.default_rng(1).integers(0, cfg["vocab_size"], (a.batch, a.prompt)).astype(np.int64)
    model.generate(prompt, max_new_tokens=a.new, min_new_tokens=a.new)
    pr = cProfile.Profile()
    pr.enable()
    model.generate(prompt, max_new_tokens=a.new, min_new_tokens=a.new)
    pr.disable()
    print(model.last_timings)
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
