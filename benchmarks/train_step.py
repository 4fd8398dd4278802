"""One training step (forward, backward, Adam update) of a SmolLM2-shaped Llama: RLX against PyTorch.

SmolLM2-135M shape (hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536, vocab
49152, tied embeddings; --layers shrinks it) with random weights made here (numpy rng, the
same in every process), one batch of random ids; the loss is the mean token cross-entropy.
RLX: `rlx_core.Trainer` on the recipe's cache-free `train` graph: the gradients of every
weight and Adam's update in one step graph, weights and moments kept on the backend (16-bit
weights with an f32 master copy). PyTorch: HF LlamaForCausalLM with the same weights,
`loss.backward()` and `torch.optim.Adam` (fused on cuda; eager, and torch.compile of the
model with --compile). Both sides update every weight and read back only the loss. Each side
runs in its own process; bf16 on cuda, fp32 on cpu. Prints ms/step (median of --reps after
--warmup), each side's loss at the first step (before any update: they agree when both
compute the same model) and RLX / peer.

    python benchmarks/train_step.py --layers 2 --seq 32                # cpu: numba (else numpy) vs torch
    python benchmarks/train_step.py --device cuda --compile            # the H100 run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from common import llama_shapes, log, run_child
from hardware import cpu_name

SMOLLM2 = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
               rms_norm_eps=1e-5, rope_theta=100000.0, hidden_act="silu", attention_bias=False, mlp_bias=False)
SIDES = ("rlx", "torch_eager", "torch_compile")
LR = 1e-4


def config(a) -> dict:
    return dict(SMOLLM2, num_hidden_layers=a.layers, max_position_embeddings=a.seq)


def make_weights(cfg: dict, seed: int = 0) -> dict:
    """HF-named float32 weights: norms at one, matrices N(0, 0.02)."""
    rng = np.random.default_rng(seed)
    shapes = llama_shapes(cfg)
    return {k: np.ones(s, np.float32) if k.endswith("norm.weight") else
            (0.02 * rng.standard_normal(s, dtype=np.float32)) for k, s in shapes.items()}


def make_batch(cfg: dict, a) -> tuple:
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg["vocab_size"], (a.batch, a.seq + 1)).astype(np.int64)
    return ids[:, :-1], ids[:, 1:]


def timed(step, a, sync=lambda: None) -> dict:
    for _ in range(a.warmup):
        loss = step()
    sync()
    times = []
    for _ in range(a.reps):
        t = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t)
    return {"ms": 1e3 * statistics.median(times), "ms_min": 1e3 * min(times), "loss": float(loss)}


def cpu_backend() -> str:
    """The default CPU backend: numba where it is installed and usable, else numpy."""
    from rlx_core.pipeline import available_backends

    return "numba" if any(b.name == "numba" and ok for b, ok, _ in available_backends()) else "numpy"


def rlx_child(a) -> dict:
    import rlx_core
    from rlx_core.ir.dtype import BF16, F32
    from rlx_core.runtime.model import find_recipe

    cfg = config(a)
    weights = make_weights(cfg)
    ids, labels = make_batch(cfg, a)
    bf16 = a.device == "cuda"
    if bf16:
        import ml_dtypes

        weights = {k: v.astype(ml_dtypes.bfloat16) for k, v in weights.items()}
    t = time.perf_counter()
    built = find_recipe("llama").flow_class.for_training(cfg, batch=a.batch, seq=a.seq).build(
        weights, dtype=BF16 if bf16 else F32)
    backend = a.backend or ("cuda" if a.device == "cuda" else cpu_backend())
    trainer = rlx_core.Trainer(built.graph, built.params, rlx_core.Adam(lr=LR), backend=backend)
    feed = {"ids": ids, "labels": labels, "positions": np.tile(np.arange(a.seq), (a.batch, 1)),
            "key_mask": np.ones((a.batch, 1, 1, a.seq), bool)}
    first = trainer.step(feed)                # specialize + first step outside the timing
    compile_s = time.perf_counter() - t
    res = timed(lambda: trainer.step(feed), a)
    return dict(res, backend=backend, compile_s=compile_s, nodes=len(trainer.graph.nodes), first_loss=first)


def torch_child(a, compiled: bool) -> dict:
    import torch
    import transformers

    cfg = config(a)
    weights = make_weights(cfg)
    ids, labels = make_batch(cfg, a)
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    hc = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    model = transformers.LlamaForCausalLM(hc)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    model = model.to(dev, dtype).train()
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.Adam(model.parameters(), lr=LR, **({"fused": True} if a.device == "cuda" else {}))
    tids, tlab = torch.from_numpy(ids).to(dev), torch.from_numpy(labels).to(dev)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = fwd(tids).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, cfg["vocab_size"]), tlab.reshape(-1))
        loss.backward()
        opt.step()
        return loss.detach()

    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    t = time.perf_counter()
    first = step().item()
    sync()
    first_s = time.perf_counter() - t
    res = timed(lambda: step().item(), a, sync)
    return dict(res, torch=torch.__version__, first_s=first_s, first_loss=first,
                threads=torch.get_num_threads() if a.device == "cpu" else None)


def hardware(device: str) -> str:
    if device == "cuda":
        import torch

        return f"GPU: {torch.cuda.get_device_name(0)}"
    import os

    return f"CPU: {cpu_name()} ({os.cpu_count()} cores)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if torch sees one")
    ap.add_argument("--backend", default=None, help="RLX backend (default: cuda on cuda, numba (else numpy) on cpu)")
    ap.add_argument("--compile", action="store_true", help="also torch.compile")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--child", choices=SIDES, default=None)
    ap.add_argument("--child-timeout", type=float, default=1800)
    a = ap.parse_args(argv)
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.child:
        out = rlx_child(a) if a.child == "rlx" else torch_child(a, a.child == "torch_compile")
        print(json.dumps(out), flush=True)
        return 0
    precision = "bf16" if a.device == "cuda" else "fp32"
    log(f"{hardware(a.device)}; SmolLM2 shape, {a.layers} layers, batch {a.batch} x seq {a.seq}, {precision}; "
        f"forward + backward + Adam on every weight; median of {a.reps} after {a.warmup} warmup; each side in its own process")
    res = {}
    for side in SIDES if a.compile else SIDES[:2]:
        cmd = [sys.executable, __file__, "--child", side, "--layers", str(a.layers), "--batch", str(a.batch),
               "--seq", str(a.seq), "--device", a.device, "--warmup", str(a.warmup), "--reps", str(a.reps)]
        if a.backend:
            cmd += ["--backend", a.backend]
        r = run_child(cmd, side, a.child_timeout)
        if r is not None:
            res[side] = r
            log(f"{side}: {r}")
    rl = res.get("rlx")
    lines = ["| side | ms/step (median) | ms/step (min) | first step's loss | RLX / side |", "|---|---|---|---|---|"]
    for side, r in res.items():
        name = f"rlx ({r['backend']})" if side == "rlx" else side
        ratio = f"{rl['ms'] / r['ms']:.2f}" if rl and side != "rlx" else "-"
        lines.append(f"| {name} | {r['ms']:.1f} | {r['ms_min']:.1f} | {r['first_loss']:.5f} | {ratio} |")
    print("\n".join(lines), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(res, args=vars(a)), f, indent=1)
    return 0 if len(res) == (3 if a.compile else 2) else 1


if __name__ == "__main__":
    sys.exit(main())
