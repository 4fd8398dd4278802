"""all-MiniLM-L6-v2 sentence embeddings on the CPU: RLX NumPy backend vs sentence-transformers
(PyTorch), same weights, same texts, same thread count, in one run.

    .venv/bin/python benchmarks/embed_cpu.py [--threads 2] [--repeat 30] [--model minilm]

Both sides embed the same 32 sentences of about 20 tokens each (batch size 32, normalized
embeddings, end to end from text: tokenization included). Timed calls are interleaved
(RLX, ST, RLX, ST, ...) after warm-up; the process is pinned to `--threads` cores when the
machine has more. Prints the hardware, min / median ms of each side, the ratio RLX / ST
(target <= 0.8) and the worst cosine between the two sides' vectors (sanity).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

SENTENCES = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "A man is playing a guitar on a street corner for a small crowd of tourists.",
    "Scientists have discovered a new species of frog in the rainforests of Central America.",
    "The stock market fell sharply on Monday after the central bank raised interest rates again.",
    "She spent the whole afternoon reading an old novel in the garden under the apple tree.",
    "Our team will meet on Thursday morning to review the budget for the next quarter.",
    "The recipe calls for two cups of flour, three eggs and a pinch of salt.",
    "Heavy rain is expected across the northern region, with flooding possible near the rivers.",
    "He forgot his umbrella at the train station and had to walk home in the storm.",
    "Machine learning models can translate text between many languages with surprising accuracy.",
    "The museum is closed on Mondays but opens late on Friday evenings during the summer.",
    "A group of children built an enormous sandcastle on the beach before the tide came in.",
    "Please remember to turn off the lights and lock the door when you leave the office.",
    "The new smartphone has a larger battery, a brighter screen and a faster processor.",
    "After years of research, the doctors finally found an effective treatment for the disease.",
    "The orchestra performed a beautiful symphony that moved many people in the audience to tears.",
    "Traffic on the highway was backed up for miles because of an accident near the bridge.",
    "My grandmother grows tomatoes, peppers and herbs in a tiny garden behind her house.",
    "The football match ended in a draw after both teams scored in the final ten minutes.",
    "Astronomers observed a distant galaxy whose light took billions of years to reach us.",
    "The company announced that it will hire two hundred engineers at its new research center.",
    "A cup of hot tea and a good book are the perfect way to spend a rainy day.",
    "The mountain trail is steep and rocky, so hikers should wear sturdy boots and carry water.",
    "Local volunteers cleaned up the park and planted dozens of trees along the river bank.",
    "The lecture explained how vaccines train the immune system to recognize harmful viruses.",
    "He practiced the piano every evening for months before the competition in the capital.",
    "The airline cancelled several flights due to a strike by air traffic controllers.",
    "Fresh bread from the bakery on the corner smells wonderful early in the morning.",
    "The city council voted to build a new library and a swimming pool downtown.",
    "Electric cars are becoming cheaper as battery technology improves and production grows.",
    "The detective carefully examined the footprints in the snow outside the old cabin.",
    "Students must submit their essays by Friday at noon through the online portal.",
]


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def pin(threads: int) -> str:
    """Pin this process to `threads` cores when it may run on more; returns a description."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return "not pinned (no sched_setaffinity)"
    if len(allowed) > threads:
        os.sched_setaffinity(0, allowed[:threads])
        return f"pinned to cores {allowed[:threads]} of {len(allowed)}"
    return f"all {len(allowed)} cores"


def stats(ts: list) -> tuple:
    s = sorted(ts)
    return s[0], s[len(s) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=30, help="timed calls of each side")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--model", default="minilm", help="a sentence-transformers folder, or 'minilm'")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the process to --threads cores")
    ap.add_argument("--generic", action="store_true",
                    help="also time RLX with generic IR ops only (no bert.dense custom kernel)")
    args = ap.parse_args()

    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)          # before numpy / torch load their BLAS
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    pinned = "not pinned (--no-pin)" if args.no_pin else pin(args.threads)

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    import rlx_core
    from rlx_core.weights import resolve_model_path

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    st = SentenceTransformer(path, device="cpu")
    rlx = rlx_core.load(path, backend="numpy", progress=False)
    texts = SENTENCES
    ntok = [len(ids) for ids, _ in rlx.tokenize(texts)[0]]

    def run_st():
        return st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True, show_progress_bar=False)

    def run_rlx():
        return rlx.embed(texts, batch_size=args.batch_size)

    gen = rlx_core.load(path, backend="numpy", progress=False, flow_options={"custom_kernels": False}) \
        if args.generic else None

    for _ in range(args.warmup):
        a, b = run_rlx(), run_st()
        if gen is not None:
            gen.embed(texts, batch_size=args.batch_size)
    cos = float(np.min(np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))
    t_rlx, t_st, t_gen = [], [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        run_rlx()
        t1 = time.perf_counter()
        run_st()
        t2 = time.perf_counter()
        t_rlx.append(t1 - t0)
        t_st.append(t2 - t1)
        if gen is not None:
            t2 = time.perf_counter()
            gen.embed(texts, batch_size=args.batch_size)
            t_gen.append(time.perf_counter() - t2)
    (r_min, r_med), (s_min, s_med) = stats(t_rlx), stats(t_st)

    import sentence_transformers

    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    blas = "?"
    try:
        cfg = np.show_config(mode="dicts")
        blas = cfg["Build Dependencies"]["blas"]["name"] + " " + cfg["Build Dependencies"]["blas"]["version"]
    except Exception:
        pass
    print(f"hardware: {cpu_name()}, {os.cpu_count()} cores, {args.threads} threads, {pinned}; load avg {load}")
    print(f"software: python {platform.python_version()}, numpy {np.__version__} ({blas}), torch {torch.__version__}, "
          f"sentence-transformers {sentence_transformers.__version__}, rlx {rlx_core.__version__}")
    print(f"model: {path}")
    print(f"input: {len(texts)} sentences, {min(ntok)}-{max(ntok)} tokens (mean {np.mean(ntok):.1f}), "
          f"batch size {args.batch_size}; {args.repeat} interleaved timed calls each after {args.warmup} warm-up")
    print(f"{'':24}{'min ms':>10}{'median ms':>12}")
    print(f"{'RLX numpy':24}{r_min * 1e3:10.1f}{r_med * 1e3:12.1f}")
    print(f"{'sentence-transformers':24}{s_min * 1e3:10.1f}{s_med * 1e3:12.1f}")
    if t_gen:
        g_min, g_med = stats(t_gen)
        print(f"{'RLX numpy, generic ops':24}{g_min * 1e3:10.1f}{g_med * 1e3:12.1f}   "
              f"({g_med / s_med:.2f}x ST: linear + gelu without the bert.dense kernel)")
    print(f"ratio RLX/ST: {r_med / s_med:.2f}x on medians, {r_min / s_min:.2f}x on minimums (target <= 0.8)")
    print(f"parity: worst cosine RLX vs ST {cos:.7f}")


if __name__ == "__main__":
    sys.exit(main())
