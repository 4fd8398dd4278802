"""Image embeddings on the CPU: a ViT-B/16-shaped and a DINOv2-S/14-shaped random model, RLX
on its numba backend vs HF transformers eager (PyTorch), end to end from decoded images, in
one run.

    .venv/bin/python benchmarks/vision_cpu.py [--threads 2] [--rounds 3] [--repeat 5] [--models vit,dinov2]

Each model is a random HF checkpoint of the real shape (ViT-B/16: 12 layers, hidden 768,
224x224, pooler; DINOv2-S/14: 12 layers, hidden 384, config image size 518 with the real
checkpoint's 256 resize + 224 center crop, so its position table is resized to 16x16), saved
with save_pretrained beside the preprocessor_config.json of its family. Every side embeds the
same batch of 16 decoded RGB images (uint8 arrays of odd photo sizes): the checkpoint's
preprocessing (resize, crop, rescale, normalize; both sides through Pillow) and the forward
pass, RLX through `model.embed(images=..., batch_size=16)`, HF through its Pillow image
processor and the model's pooler_output. Each side runs in its own process (a BLAS or OpenMP
pool left spinning by one side would otherwise slow the other), in alternating rounds, all
pinned to the same `--threads` cores when the machine has more (RLX_NUM_THREADS sets numba's
threads, torch.set_num_threads HF's). Prints the hardware and the load average, min / median
ms of each side over all rounds and each round's median (the spread), RLX's first call
(compiling), the ratio RLX / HF (target <= 0.8) and the worst cosine between the two sides'
embeddings.

RLX's GEMMs are numpy's OpenBLAS; torch's are MKL's. The kernel set OpenBLAS runs is printed
(an environment's OPENBLAS_CORETYPE overrides OpenBLAS's own choice: on AMD Zen 5 its own
choice is the AVX-512 "SkylakeX" set, twice the f32 GEMM rate of the AVX2 "Haswell" one).
`--openblas-coretype NAME` sets it for both sides' processes, `auto` removes it (OpenBLAS
chooses); by default the environment's holds.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hardware import cpu_name, pin, loadavg, stats  # noqa: E402

BATCH = 16
# (height, width) of the decoded images: odd photo-like sizes, landscape and portrait
SIZES = [(375, 500), (480, 640), (333, 499), (500, 375), (427, 640), (640, 480), (281, 500), (512, 512)]
MODELS = {
    "vit": {"label": "ViT-B/16 (224)", "model_type": "vit",
            "config": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                           intermediate_size=3072, image_size=224, patch_size=16),
            "preprocessor": {"image_processor_type": "ViTImageProcessor", "do_resize": True,
                             "size": {"height": 224, "width": 224}, "resample": 2, "do_rescale": True,
                             "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
                             "image_std": [0.5, 0.5, 0.5]}},
    "dinov2": {"label": "DINOv2-S/14 (224 crop)", "model_type": "dinov2",
               "config": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, mlp_ratio=4,
                              image_size=518, patch_size=14, layerscale_value=1.0),
               "preprocessor": {"image_processor_type": "BitImageProcessor", "do_convert_rgb": True,
                                "do_resize": True, "size": {"shortest_edge": 256}, "resample": 3,
                                "do_center_crop": True, "crop_size": {"height": 224, "width": 224},
                                "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                                "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}},
}


def decoded_images() -> list:
    """The batch: BATCH random RGB uint8 arrays [H, W, 3] (the same in every process)."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (*SIZES[i % len(SIZES)], 3), dtype=np.uint8) for i in range(BATCH)]


def save_model(name: str, folder: str) -> None:
    """A random HF checkpoint of MODELS[name]'s shape, with its preprocessor_config.json."""
    import torch
    import transformers

    spec = MODELS[name]
    torch.manual_seed(0)
    if name == "vit":
        model = transformers.ViTModel(transformers.ViTConfig(**spec["config"]), add_pooling_layer=True)
    else:
        model = transformers.Dinov2Model(transformers.Dinov2Config(**spec["config"]))
    model.eval().save_pretrained(folder)
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump(spec["preprocessor"], f)


def child(args) -> None:
    """One side in its own process: load, warm up, time `--repeat` calls, print the times."""
    import numpy as np

    images = decoded_images()
    if args.child == "hf":
        import torch
        from transformers import AutoImageProcessor, AutoModel

        torch.set_num_threads(args.threads)
        proc = AutoImageProcessor.from_pretrained(args.model_path, backend="pil")
        model = AutoModel.from_pretrained(args.model_path).eval()

        def run():
            with torch.inference_mode():
                px = proc(images, return_tensors="pt")["pixel_values"]
                return model(pixel_values=px).pooler_output.numpy()
    else:
        import rlx_core

        model = rlx_core.load(args.model_path, backend=args.child, progress=False)

        def run():
            return model.embed(images=images, batch_size=BATCH)
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
    np.save(args.out, np.asarray(out, np.float32))
    print("RESULT " + json.dumps({"times": ts, "first": first}))


def openblas_core() -> str:
    """The kernel set numpy's OpenBLAS runs in this process ("?" where not found)."""
    import ctypes
    import glob

    import numpy as np

    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in glob.glob(os.path.join(libs, "*openblas*.so*")):
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename",
                     "openblas_get_corename"):
            if hasattr(lib, name):
                fn = getattr(lib, name)
                fn.restype = ctypes.c_char_p
                return fn().decode()
    return "?"


def spawn(side: str, args, model_path: str, out: str) -> dict:
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--child", side, "--model-path", model_path,
           "--out", out, "--threads", str(args.threads), "--repeat", str(args.repeat),
           "--warmup", str(args.warmup)]
    res = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True)
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{side} run failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5, help="timed calls of each side per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (RLX process, HF process)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--models", default="vit,dinov2", help=f"comma-separated, of {sorted(MODELS)}")
    ap.add_argument("--backend", default="numba", help="RLX's backend (numba; numpy for a comparison)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the processes to --threads cores")
    ap.add_argument("--openblas-coretype", default="",
                    help="OPENBLAS_CORETYPE for both sides (auto: unset, OpenBLAS chooses; default: as set)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()

    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "RLX_NUM_THREADS"):
        os.environ[var] = str(args.threads)          # before numpy / torch load their BLAS
    if args.openblas_coretype == "auto":
        os.environ.pop("OPENBLAS_CORETYPE", None)
    elif args.openblas_coretype:
        os.environ["OPENBLAS_CORETYPE"] = args.openblas_coretype
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    pinned = "not pinned (--no-pin)" if args.no_pin else pin(args.threads)   # children inherit it
    if args.child:
        return child(args)

    import tempfile

    import numpy as np

    import rlx_core
    from rlx_core.ir.registry import registry

    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; expected of {sorted(MODELS)}")
    backend = registry().backends.get(args.backend)
    why = (f"not installed (pip install ./plugins/rlx_backend_{args.backend})" if backend is None
           else backend.availability()[1])
    if why:
        raise SystemExit(f"RLX backend {args.backend} is not available: {why}")
    load0 = loadavg()
    rlx_side = f"RLX {args.backend}"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            folder = os.path.join(tmp, name)
            save_model(name, folder)
            sides = [args.backend, "hf"]
            times: dict = {s: [] for s in sides}
            rounds: dict = {s: [] for s in sides}
            firsts: dict = {s: [] for s in sides}
            outs = {s: os.path.join(tmp, f"{name}-{s}.npy") for s in sides}
            for _ in range(args.rounds):
                for side in sides:
                    res = spawn(side, args, folder, outs[side])
                    times[side] += res["times"]
                    rounds[side].append(stats(res["times"])[1])
                    firsts[side].append(res["first"])
            a, b = np.load(outs[args.backend]), np.load(outs["hf"])
            cos = float(np.min(np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))
            results[name] = (sides, times, rounds, firsts, cos)

    import torch
    import transformers
    from PIL import __version__ as pil_version

    blas = "?"
    try:
        cfg = np.show_config(mode="dicts")
        blas = cfg["Build Dependencies"]["blas"]["name"] + " " + cfg["Build Dependencies"]["blas"]["version"]
    except Exception:
        pass
    print(f"hardware: {cpu_name()}, {os.cpu_count()} cores, {args.threads} threads, {pinned}; "
          f"load avg (1, 5, 15 min) {load0} before, {loadavg()} after")
    core = os.environ.get("OPENBLAS_CORETYPE")
    blas += f", kernels {openblas_core()}" + (f" (OPENBLAS_CORETYPE={core})" if core else " (its own choice)")
    print(f"software: python {platform.python_version()}, numpy {np.__version__} ({blas}), "
          f"torch {torch.__version__}, transformers {transformers.__version__}, pillow {pil_version}, "
          f"rlx {rlx_core.__version__}")
    print(f"input: {BATCH} decoded RGB images of {len(SIZES)} odd photo sizes ({SIZES[0][0]}x{SIZES[0][1]} ...), "
          f"preprocessing + forward, batch {BATCH}; each side in its own process, {args.rounds} rounds x "
          f"{args.repeat} timed calls after {args.warmup} warm-up")
    for name, (sides, times, rounds, firsts, cos) in results.items():
        print(f"\n{MODELS[name]['label']}")
        print(f"{'':24}{'min ms':>9}{'median ms':>11}   round medians ms   (first call per round, s)")
        for s in sides:
            lo, med = stats(times[s])
            spread = " ".join(f"{r * 1e3:.0f}" for r in rounds[s])
            first = " ".join(f"{f:.2f}" for f in firsts[s])
            label = rlx_side if s != "hf" else "HF eager (torch)"
            print(f"{label:24}{lo * 1e3:9.1f}{med * 1e3:11.1f}   {spread}   ({first})")
        r_min, r_med = stats(times[args.backend])
        h_min, h_med = stats(times["hf"])
        print(f"ratio {rlx_side}/HF: {r_med / h_med:.2f}x on medians, {r_min / h_min:.2f}x on minimums "
              f"(target <= 0.8)")
        print(f"parity: worst cosine {rlx_side} vs HF {cos:.7f}")


if __name__ == "__main__":
    sys.exit(main())
