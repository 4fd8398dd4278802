"""all-MiniLM-L6-v2 sentence embeddings on the CPU: RLX on its numba backend and on the NumPy
backend vs sentence-transformers (PyTorch), same weights, same texts, same thread count, in
one run.

    .venv/bin/python benchmarks/embed_cpu.py [--threads 2] [--repeat 30] [--model minilm]

Every side embeds the same 32 sentences of about 20 tokens each (batch size 32, normalized
embeddings, end to end from text: tokenization included). Each side runs in its own process
(a BLAS or OpenMP pool left spinning by one side would otherwise slow the other), in
alternating rounds (numba, numpy, ST, numba, ...), all pinned to the same `--threads` cores
when the machine has more (RLX_NUM_THREADS sets numba's threads). The numba side is skipped,
with the reason, when that backend is not available. Prints the hardware and the load
average, min / median ms of each side over all rounds and each round's median (the spread),
each RLX side's first call (numba: loading or compiling its kernels), the ratios RLX / ST
(target <= 0.8 on numba) and the worst cosine between each RLX side's vectors and ST's.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hardware import cpu_name, pin, loadavg, stats  # noqa: E402

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


def child(args) -> None:
    """One side in its own process: load, warm up, time `--repeat` calls, print the times."""
    import json

    import numpy as np

    texts = SENTENCES
    path = args.model_path
    if args.child == "st":
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(args.threads)
        st = SentenceTransformer(path, device="cpu")

        def run():
            return st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True,
                             show_progress_bar=False)
    else:
        import rlx_core

        enc = rlx_core.load(path, backend=args.child, progress=False)

        def run():
            return enc.embed(texts, batch_size=args.batch_size)
    t0 = time.perf_counter()
    out = run()
    first = time.perf_counter() - t0
    for _ in range(args.warmup - 1):
        out = run()
    ts = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    np.save(args.out, out)
    print("RESULT " + json.dumps({"times": ts, "first": first}))


def spawn(side: str, args, out: str) -> list:
    import json
    import subprocess

    env = dict(os.environ)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", side, "--model-path", args.model_path,
           "--out", out, "--threads", str(args.threads), "--repeat", str(args.repeat),
           "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{side} run failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20, help="timed calls of each side per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (RLX process, ST process)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--model", default="minilm", help="a sentence-transformers folder, or 'minilm'")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the processes to --threads cores")
    ap.add_argument("--child", choices=["numba", "numpy", "st"], help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()

    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "RLX_NUM_THREADS"):
        os.environ[var] = str(args.threads)          # before numpy / torch load their BLAS
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pinned = "not pinned (--no-pin)" if args.no_pin else pin(args.threads)   # children inherit it
    if args.child:
        return child(args)

    import tempfile

    import numpy as np

    import rlx_core
    from rlx_core.ir.registry import registry
    from rlx_core.weights import resolve_model_path

    load0 = loadavg()
    args.model_path = resolve_model_path(args.model)
    enc = rlx_core.load(args.model_path, backend="numpy", progress=False)
    ntok = [len(ids) for ids, _ in enc.tokenize(SENTENCES)[0]]
    numba = registry().backends.get("numba")
    why = ("not installed (pip install ./plugins/rlx_backend_numba)" if numba is None
           else numba.availability()[1])
    sides = (["numba"] if not why else []) + ["numpy", "st"]
    times: dict = {s: [] for s in sides}
    rounds: dict = {s: [] for s in sides}
    firsts: dict = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        outs = {s: os.path.join(tmp, f"{s}.npy") for s in sides}
        for _ in range(args.rounds):
            for side in sides:
                res = spawn(side, args, outs[side])
                times[side] += res["times"]
                rounds[side].append(stats(res["times"])[1])
                firsts[side].append(res["first"])
        vec = {s: np.load(outs[s]) for s in sides}

    import sentence_transformers
    import torch

    def cos(a, b):
        return float(np.min(np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))

    blas = "?"
    try:
        cfg = np.show_config(mode="dicts")
        blas = cfg["Build Dependencies"]["blas"]["name"] + " " + cfg["Build Dependencies"]["blas"]["version"]
    except Exception:
        pass
    print(f"hardware: {cpu_name()}, {os.cpu_count()} cores, {args.threads} threads, {pinned}; "
          f"load avg (1, 5, 15 min) {load0} before, {loadavg()} after")
    print(f"software: python {platform.python_version()}, numpy {np.__version__} ({blas}), "
          f"torch {torch.__version__}, sentence-transformers {sentence_transformers.__version__}, "
          f"rlx {rlx_core.__version__}")
    print(f"model: {args.model_path}")
    print(f"input: {len(SENTENCES)} sentences, {min(ntok)}-{max(ntok)} tokens (mean {np.mean(ntok):.1f}), "
          f"batch size {args.batch_size}; each side in its own process, {args.rounds} rounds x "
          f"{args.repeat} timed calls after {args.warmup} warm-up")
    names = {"numba": "RLX numba", "numpy": "RLX numpy", "st": "sentence-transformers"}
    if why:
        print(f"RLX numba: skipped, the numba backend is not available: {why}")
    print(f"{'':24}{'min ms':>9}{'median ms':>11}   round medians ms   (first call per round, s)")
    for s in sides:
        lo, med = stats(times[s])
        spread = " ".join(f"{r * 1e3:.1f}" for r in rounds[s])
        first = " ".join(f"{f:.2f}" for f in firsts[s])
        print(f"{names[s]:24}{lo * 1e3:9.1f}{med * 1e3:11.1f}   {spread}   ({first})")
    s_min, s_med = stats(times["st"])
    for s in sides[:-1]:
        r_min, r_med = stats(times[s])
        target = " (target <= 0.8)" if s == "numba" else ""
        print(f"ratio {names[s]}/ST: {r_med / s_med:.2f}x on medians, "
              f"{r_min / s_min:.2f}x on minimums{target}")
    for s in sides[:-1]:
        print(f"parity: worst cosine {names[s]} vs ST {cos(vec[s], vec['st']):.7f}")


if __name__ == "__main__":
    sys.exit(main())
