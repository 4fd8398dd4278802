"""One denoising step of a FLUX-sized transformer: RLX against diffusers, each side in its own
process (issue 14's benchmark).

Full shape (default): FLUX.1-dev's transformer (19 double + 38 single blocks, hidden 3072 =
24 heads x 128, text width 4096, guidance embeds) on a 1024 x 1024 image: 4096 latent tokens
+ 512 text tokens, batch 1, random bf16 weights made in the run. Sides:

* rlx      FluxModel on the cuda backend under profiles/flux2.rlx.toml (bf16 compute; the
           weights are made on the host, bf16, and made resident by set_params)
* eager    diffusers' FluxTransformer2DModel in bf16, weights initialized on the GPU
* compile  the same under torch.compile (its compile time is printed apart)

Printed: ms per step (median of --steps after a warm-up step), peak GPU memory, the ratios
rlx / eager and rlx / compiled against the targets (<= 0.8 and <= 1.0), and the step's FLOP
count with the floor it implies at the bf16 matmul rate measured in the eager process. A side
that runs past --budget seconds is stopped and reported as such (what ran is printed).

    python benchmarks/flux_gpu.py                     # the H100 run
    python benchmarks/flux_gpu.py --small --device cpu --sides rlx,eager   # a smoke test anywhere
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

FULL = dict(num_layers=19, num_single_layers=38, num_attention_heads=24, attention_head_dim=128,
            joint_attention_dim=4096, pooled_projection_dim=768, in_channels=64, guidance_embeds=True,
            axes_dims_rope=[16, 56, 56], patch_size=1)
SMALL = dict(num_layers=2, num_single_layers=2, num_attention_heads=4, attention_head_dim=32,
             joint_attention_dim=64, pooled_projection_dim=32, in_channels=16, guidance_embeds=True,
             axes_dims_rope=[8, 12, 12], patch_size=1)
TARGETS = {"eager": 0.8, "compile": 1.0}


def shapes(args) -> tuple:
    cfg = dict(SMALL if args.small else FULL)
    if args.double is not None:
        cfg["num_layers"] = args.double
    if args.single is not None:
        cfg["num_single_layers"] = args.single
    side = 16 if args.small else 64            # latent tokens per image side (1024 px / 16)
    return cfg, side, (32 if args.small else 512)


def step_flops(cfg: dict, img: int, txt: int) -> float:
    """Multiply-adds x 2 of one transformer step (the matmuls and attention products; the
    norms, modulation and embeddings are below 0.1%)."""
    h = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    s = img + txt
    per_token = 12 * h * h                      # double: qkv 3h^2 + out h^2 + MLP 8h^2; single: the same
    attn = 2 * s * s * h                        # q k^T and p v
    layers = cfg["num_layers"] + cfg["num_single_layers"]
    return 2.0 * layers * (per_token * s + attn)


def inputs(cfg: dict, side: int, txt: int, np):
    from rlx_blocks_flux import latent_ids

    rng = np.random.default_rng(0)
    return {"hidden_states": rng.standard_normal((1, side * side, cfg["in_channels"])).astype(np.float32),
            "encoder_hidden_states": rng.standard_normal((1, txt, cfg["joint_attention_dim"])).astype(np.float32),
            "pooled_projections": rng.standard_normal((1, cfg["pooled_projection_dim"])).astype(np.float32),
            "timestep": np.array([0.5], np.float32), "guidance": np.array([3.5], np.float32),
            "img_ids": latent_ids(side, side), "txt_ids": np.zeros((txt, 3), np.float32)}


# ----------------------------------------------------------------------------- the sides
def run_rlx(args, cfg, side, txt) -> dict:
    import ml_dtypes
    import numpy as np

    from rlx_blocks_flux import FluxModel, FluxRecipe, tensor_shapes
    from rlx_blocks_flux.config import flux_arch
    from rlx_core.profile import CompileProfile

    full_cfg = dict(cfg, _class_name="FluxTransformer2DModel")
    shapes_ = tensor_shapes(flux_arch(full_cfg))
    gpu = args.device == "cuda"
    dt = ml_dtypes.bfloat16 if gpu else np.float32
    # one pool of random values; every weight is a slice of it (same statistics, no 24 GB of
    # host random numbers); set_params makes each resident on its own
    biggest = max(int(np.prod(s)) for s in shapes_.values())
    pool = (np.random.default_rng(1).standard_normal(biggest + 4096, dtype=np.float32) * 0.02).astype(dt)
    tensors = {k: pool[i % 4096: i % 4096 + int(np.prod(s))].reshape(s) for i, (k, s) in enumerate(shapes_.items())}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    profile = CompileProfile.from_toml_path(os.path.join(root, "profiles", "flux2.rlx.toml"))
    if not gpu:
        profile = profile.evolve(precision={"compute": "f32"})
    backend = "cuda" if gpu else args.cpu_backend
    model = FluxModel(FluxRecipe(), full_cfg, tensors, backend=backend, profile=profile, source="random")
    feed = inputs(cfg, side, txt, np)
    t0 = time.perf_counter()
    model.forward(**feed)                          # compile + upload + first step
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = model.forward(**feed)
        times.append(time.perf_counter() - t0)
    if args.profile:                             # where the step's time goes, by op kind
        img, tl = feed["hidden_states"].shape[1], feed["encoder_hidden_states"].shape[1]
        exe = model.executable(1, img, tl, "guidance" in feed)
        print(exe.profile(model.feed(**feed), repeat=2, warmup=1).table(), flush=True)
    peak = None
    if gpu:
        try:
            import cupy as cp

            peak = cp.get_default_memory_pool().total_bytes()
        except Exception:  # noqa: BLE001 - memory is a nicety of the report
            peak = None
    return {"ms": 1e3 * sorted(times)[len(times) // 2], "first_s": first, "peak_bytes": peak,
            "finite": bool(np.isfinite(out).all()), "backend": backend, "profile": profile.name,
            "compute": profile.precision.compute.value}


def run_torch(args, cfg, side, txt, compiled: bool) -> dict:
    import numpy as np
    import torch
    from diffusers import FluxTransformer2DModel

    gpu = args.device == "cuda"
    dev = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    with dev:
        model = FluxTransformer2DModel(**cfg).to(dtype).eval()
    feed = {k: torch.from_numpy(v).to(dev) for k, v in inputs(cfg, side, txt, np).items()}
    feed = {k: (v.to(dtype) if k in ("hidden_states", "encoder_hidden_states", "pooled_projections") else v)
            for k, v in feed.items()}
    rate = None
    if gpu:                                        # the bf16 matmul rate this GPU reaches
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            a @ a
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
        rate = 20 * 2 * 8192 ** 3 / (time.perf_counter() - t0)
        del a
        torch.cuda.reset_peak_memory_stats()
    fn = torch.compile(model) if compiled else model
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    with torch.inference_mode():
        t0 = time.perf_counter()
        fn(**feed)
        sync()
        first = time.perf_counter() - t0
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out = fn(**feed).sample
            sync()
            times.append(time.perf_counter() - t0)
    return {"ms": 1e3 * sorted(times)[len(times) // 2], "first_s": first,
            "peak_bytes": torch.cuda.max_memory_allocated() if gpu else None,
            "finite": bool(torch.isfinite(out).all()), "matmul_flops": rate,
            "torch": torch.__version__, "dtype": str(dtype)}


# ----------------------------------------------------------------------------- driver
def child(args) -> None:
    cfg, side, txt = shapes(args)
    res = run_rlx(args, cfg, side, txt) if args.side == "rlx" else run_torch(args, cfg, side, txt,
                                                                             args.side == "compile")
    print("RESULT " + json.dumps(res), flush=True)


def gb(n) -> str:
    return f"{n / 2 ** 30:.1f} GB" if n else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="a small transformer (runs on a CPU in seconds)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--cpu-backend", default="numpy", help="the rlx backend with --device cpu")
    ap.add_argument("--sides", default="rlx,eager,compile")
    ap.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up step")
    ap.add_argument("--double", type=int, help="double blocks instead of the shape's")
    ap.add_argument("--single", type=int, help="single blocks instead of the shape's")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all sides together")
    ap.add_argument("--profile", action="store_true",
                    help="with --side rlx: print the profiler's table of one step")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        return child(args)
    cfg, side, txt = shapes(args)
    img = side * side
    flops = step_flops(cfg, img, txt)
    print(f"# FLUX.1 transformer step: {cfg['num_layers']} double + {cfg['num_single_layers']} single blocks, "
          f"hidden {cfg['num_attention_heads'] * cfg['attention_head_dim']}, {img} image + {txt} text tokens, "
          f"batch 1; {flops / 1e12:.3g} TFLOP; device {args.device}")
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    res: dict = {}
    start = time.perf_counter()
    for i, s in enumerate(sides):
        left = args.budget - (time.perf_counter() - start)
        timeout = max(10.0, left / (len(sides) - i))
        cmd = [sys.executable, os.path.abspath(__file__), "--side", s, "--device", args.device, "--steps",
               str(args.steps), "--cpu-backend", args.cpu_backend] + (["--small"] * args.small) + \
              (["--double", str(args.double)] if args.double is not None else []) + \
              (["--single", str(args.single)] if args.single is not None else [])
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"{s:>8}: did not finish in {timeout:.0f} s (compile + {args.steps + 1} steps); not measured")
            continue
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            print(f"{s:>8}: failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[-1500:]}")
            continue
        r = res[s] = json.loads(line[0][7:])
        extra = f"first step {r['first_s']:.1f} s" + ("" if r["finite"] else "; NON-FINITE output")
        print(f"{s:>8}: {r['ms']:8.1f} ms/step  peak {gb(r['peak_bytes'])}  ({extra})")
    rate = next((r.get("matmul_flops") for r in res.values() if r.get("matmul_flops")), None)
    if rate:
        print(f"   floor: {1e3 * flops / rate:8.1f} ms/step  (bf16 matmul at the measured {rate / 1e12:.0f} TFLOP/s)")
    if "rlx" in res:
        for peer, target in TARGETS.items():
            if peer in res:
                ratio = res["rlx"]["ms"] / res[peer]["ms"]
                print(f"   rlx / {peer}: {ratio:.2f}x (target <= {target}x: {'met' if ratio <= target else 'not met'})")
    ran = ", ".join(res) or "nothing"
    print(f"# ran: {ran}; shape {'small' if args.small else 'FLUX.1-dev'}"
          + (f" with {cfg['num_layers']}+{cfg['num_single_layers']} blocks" if args.double is not None
             or args.single is not None else ""))


if __name__ == "__main__":
    main()
