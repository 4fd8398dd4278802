"""A ViT-L/14 vision encoder on the GPU in bf16: RLX's cuda backend against HF transformers
eager and HF + torch.compile, each side in its own process (issue 46's GPU benchmark).

The model is a random HF `Dinov2Model` at DINOv2-L/14's shape (hidden 1024, 24 layers, 16
heads, MLP 4096, patch 14, LayerScale, config image size 518): DINOv2 rather than CLIP-L/14's
vision tower because it runs 518 x 518 natively (37 x 37 patches, 1370 tokens) and 224 x 224
through its resized position table (16 x 16 patches, 257 tokens), so one checkpoint gives
both sizes the issue names, and its LayerScale is the block the issue adds. It is made on the
GPU (seed 0), cast to bf16 and saved with save_pretrained; every side loads that folder:

* rlx      `rlx_core.load(folder, backend="cuda", profile=encoder preset with compute bf16)`,
           timing `model.embed_pixels(pixels)`: the plain call, its default batch_size 16, so
           the 64 images run as 4 pipelined parts (the host stages part i+1 while the GPU runs
           part i); and, as `rlx-bs64`, `model.embed_pixels(pixels, batch_size=64)`: one part
           (--rlx-batches picks the batch_size values; 0 is the default)
* eager    `AutoModel.from_pretrained(folder, dtype=bfloat16, attn_implementation="sdpa")`,
           timing the pooler_output of the same pixels
* compile  the same under `torch.compile(dynamic=False)` (its compile time printed apart)

Each timed call is the same work on every side: a batch of 64 preprocessed float32 pixel
tensors [64, 3, S, S] in host memory (random, the same in every process; image decoding and
preprocessing are not included) to the float32 pooled embeddings [64, 1024] in host memory
(HF: the upload, the bf16 cast, the forward, the download; RLX's embed_pixels does the same,
its check for non-finite pixels included: the graph's own, on the GPU), so the times are
wall times that include the synchronization. Besides, each side's device time alone is
printed: RLX's CUDA-graph replay timed with CUDA events (times the parts of a batch), HF's
forward on pixels already on the GPU in bf16 (CUDA-synchronized).

Printed per image size (224 and 518): best and median ms per batch of --repeat calls after
--warmup calls, images/s, rlx / eager and rlx / compile (target <= 1.0 against compile), and
the agreement of the pooled outputs: each side against the others (max |a - b| / max |b|,
worst cosine) and against an f32 reference (the eager model in f32 on the first 8 images),
so the race is of equal work. --profile prints RLX's profiler table (the top kernels) per size.

    python benchmarks/vision_gpu.py                                    # the H200 run
    python benchmarks/vision_gpu.py --tiny --device cpu --backend numpy  # a smoke test anywhere
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hardware import cpu_name, loadavg, stats  # noqa: E402

LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, mlp_ratio=4, patch_size=14,
             image_size=518, layerscale_value=1.0, use_swiglu_ffn=False)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=4, patch_size=14,
            image_size=70, layerscale_value=1.0, use_swiglu_ffn=False)
TARGETS = {"compile": 1.0}
REF_IMAGES = 8


def shape(args) -> tuple:
    """(config, image sizes, batch) of the run."""
    if args.tiny:
        return TINY, [int(s) for s in (args.sizes or "56,70").split(",")], args.batch or 4
    return LARGE, [int(s) for s in (args.sizes or "224,518").split(",")], args.batch or 64


def pixels(batch: int, size: int):
    """The batch: preprocessed-like float32 pixels [batch, 3, size, size], the same in every process."""
    import numpy as np

    return np.random.default_rng(size).standard_normal((batch, 3, size, size), dtype=np.float32)


def save_model(cfg: dict, folder: str, device: str) -> None:
    """A random Dinov2Model of `cfg`'s shape, made on `device` (fast init), saved in bf16."""
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Dinov2Model(transformers.Dinov2Config(**cfg))
    model.to(torch.bfloat16).eval().save_pretrained(folder)


def time_calls(fn, warmup: int, repeat: int) -> tuple:
    """(first call s, [timed call s], last output) of `fn` after `warmup` calls (the first included)."""
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        out = fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return first, ts, out


# ----------------------------------------------------------------------------- the sides
def replay_s(exe, feed: dict, times: int = 10) -> float | None:
    """RLX's device time of one forward: its runner's CUDA graph replayed alone (no host
    staging, upload or download); None where the runner has no graph."""
    runner, _, _ = exe.prepare(feed)
    return None if getattr(runner, "graph", None) is None else runner.replay_seconds(times)


def rlx_label(part: int) -> str:
    """The row of embed_pixels with batch_size `part` (0: the call without one)."""
    return "rlx" if not part else f"rlx-bs{part}"


def run_rlx(args, sizes, batch) -> dict:
    """Each of --rlx-batches timed in one process, one row each ({label: result} under "rows")."""
    import numpy as np

    import rlx_core
    from rlx_core.profile import CompileProfile

    prof = CompileProfile.preset("encoder").evolve(precision={"compute": args.dtype})
    t0 = time.perf_counter()
    model = rlx_core.load(args.model_path, backend=args.backend, profile=prof, progress=False)
    load_s = time.perf_counter() - t0
    default_part = inspect.signature(model.embed_pixels).parameters["batch_size"].default
    rows = {}
    for part in rlx_batches(args):
        kw = {"batch_size": part} if part else {}
        used = min(part or default_part, batch)
        row = rows[rlx_label(part)] = {"load_s": load_s, "backend": args.backend, "batch_size": used,
                                       "compute": model.profile.precision.compute.value, "sizes": {}}
        for size in sizes:
            px = pixels(batch, size)
            first, ts, out = time_calls(lambda: model.embed_pixels(px, **kw), args.warmup, args.repeat)
            np.save(f"{args.out}-{rlx_label(part)}-{size}.npy", np.asarray(out, np.float32))
            r = row["sizes"][size] = {"first_s": first, "times": ts}
            if args.backend == "cuda" and batch % used == 0:
                exe = model.executable("vision", size, size)
                try:                              # a side measurement: its failure is printed, not fatal
                    one = replay_s(exe, {"pixel_values": px[:used]})
                    r["device_s"] = one * (batch // used) if one else None
                    r["runner"] = exe.prepare({"pixel_values": px[:used]})[0].describe()
                except Exception as e:  # noqa: BLE001
                    print(f"RLX device time at {size}: not measured ({type(e).__name__}: {e})", flush=True)
    if args.profile:
        for size in sizes:
            px = pixels(batch, size)
            rep = model.executable("vision", size, size).profile({"pixel_values": px}, repeat=3, warmup=1)
            print(f"--- RLX profile, {size}x{size}, batch {batch} ---\n{rep.table(top=15)}", flush=True)
            rows[next(iter(rows))]["sizes"][size]["profile_by_op_ms"] = {
                o.op: [o.nodes, round(o.seconds * 1e3, 3)] for o in rep.by_op()}
    return {"rows": rows}


def rlx_batches(args) -> list:
    return [int(x) for x in str(args.rlx_batches).split(",") if x.strip()]


def run_torch(args, sizes, batch, compiled: bool) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModel

    dev = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    gpu = dev.type == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    t0 = time.perf_counter()
    model = AutoModel.from_pretrained(args.model_path, dtype=dtype, attn_implementation="sdpa").to(dev).eval()
    res = {"load_s": time.perf_counter() - t0, "torch": torch.__version__, "dtype": str(dtype),
           "attn": model.config._attn_implementation, "sizes": {}}
    fn = torch.compile(model, dynamic=False) if compiled else model

    def pooled(x):
        return fn(pixel_values=x).pooler_output

    with torch.inference_mode():
        for size in sizes:
            px = pixels(batch, size)

            def host_to_host():           # the timed call: host f32 pixels -> host f32 embeddings
                x = torch.from_numpy(px).to(dev).to(dtype)
                return pooled(x).float().cpu().numpy()
            first, ts, out = time_calls(host_to_host, args.warmup, args.repeat)
            np.save(f"{args.out}-{args.side}-{size}.npy", out)
            r = res["sizes"][size] = {"first_s": first, "times": ts}
            x = torch.from_numpy(px).to(dev).to(dtype)        # the forward alone, pixels resident

            def resident():
                y = pooled(x)
                sync()
                return y
            r["device_times"] = time_calls(resident, 1, args.repeat)[1]
        if not compiled:                 # the f32 reference of the first images
            model.float()
            for size in sizes:
                x = torch.from_numpy(pixels(batch, size)[:REF_IMAGES]).to(dev)
                np.save(f"{args.out}-ref-{size}.npy", model(pixel_values=x).pooler_output.cpu().numpy())
    if gpu:
        res["peak_bytes"] = torch.cuda.max_memory_allocated()
    return res


# ----------------------------------------------------------------------------- driver
def child(args) -> None:
    cfg, sizes, batch = shape(args)
    res = run_rlx(args, sizes, batch) if args.side == "rlx" else run_torch(args, sizes, batch,
                                                                           args.side == "compile")
    print("RESULT " + json.dumps(res), flush=True)


def agreement(a, b) -> tuple:
    """(max |a - b| / max |b|, worst cosine over rows) of two embedding batches."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    rel = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
    cos = float(np.min(np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))
    return rel, cos


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "? (no nvidia-smi)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny encoder (runs on a CPU in seconds)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the HF sides' torch device")
    ap.add_argument("--backend", default="cuda", help="RLX's backend (cuda; numpy or numba with --device cpu)")
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16", help="compute dtype of every side")
    ap.add_argument("--sides", default="rlx,eager,compile")
    ap.add_argument("--sizes", help="image sizes, comma-separated (default 224,518; tiny 56,70)")
    ap.add_argument("--batch", type=int, help="images per batch (default 64; tiny 4)")
    ap.add_argument("--rlx-batches", default="0,64",
                    help="RLX's embed_pixels batch_size values, a row each (0: the call without one, its "
                         "default; smaller than the batch: parts pipelined, the host staging part i+1 while "
                         "the GPU runs part i)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls first (the first one compiles)")
    ap.add_argument("--repeat", type=int, default=10, help="timed calls per side and size")
    ap.add_argument("--profile", action="store_true", help="print RLX's profiler table per size")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all sides together")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if args.side:
        return child(args)

    import numpy as np

    cfg, sizes, batch = shape(args)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    bad = [s for s in sides if s not in ("rlx", "eager", "compile")]
    if bad:
        raise SystemExit(f"unknown side(s) {bad}; expected of rlx, eager, compile")
    load0 = loadavg()
    res: dict = {}
    done: list = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "dinov2")
        t0 = time.perf_counter()
        save_model(cfg, folder, args.device)
        print(f"# random DINOv2 model saved in {time.perf_counter() - t0:.1f} s", flush=True)
        out = os.path.join(tmp, "out")
        for i, s in enumerate(sides):
            left = args.budget - (time.perf_counter() - start)
            timeout = max(10.0, left / (len(sides) - i))
            cmd = [sys.executable, os.path.abspath(__file__), "--side", s, "--model-path", folder, "--out", out,
                   "--device", args.device, "--backend", args.backend, "--dtype", args.dtype,
                   "--warmup", str(args.warmup), "--repeat", str(args.repeat), "--sizes", ",".join(map(str, sizes)),
                   "--batch", str(batch), "--rlx-batches", args.rlx_batches] + ["--tiny"] * args.tiny + ["--profile"] * args.profile
            t0 = time.perf_counter()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired as e:
                print(f"{s}: did not finish in {timeout:.0f} s; not measured\n{(e.stdout or b'')[-1500:]!r}")
                continue
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not line:
                print(f"{s}: failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[-3000:]}")
                continue
            print("\n".join(x for x in p.stdout.splitlines() if not x.startswith("RESULT ")), flush=True)
            got = json.loads(line[0][7:])
            rows = got["rows"] if "rows" in got else {s: got}
            res.update(rows)
            done.append(s)
            print(f"# {s}: done in {time.perf_counter() - t0:.0f} s (load {next(iter(rows.values()))['load_s']:.1f} s)",
                  flush=True)
        outs = {(s, size): np.load(f"{out}-{s}-{size}.npy") for s in res for size in sizes}
        refs = {size: np.load(f"{out}-ref-{size}.npy") for size in sizes if "eager" in res}

    import rlx_core

    torch_v = next((r["torch"] for r in res.values() if "torch" in r), "?")
    print(f"\nhardware: {gpu_name() if args.device == 'cuda' else 'no GPU'}; host {cpu_name()}, "
          f"{os.cpu_count()} cores; load avg (1, 5, 15 min) {load0} before, {loadavg()} after")
    print(f"software: python {platform.python_version()}, torch {torch_v}, rlx {rlx_core.__version__} "
          f"(backend {args.backend}), compute {args.dtype}")
    parts = ", ".join(f"{k} {r['batch_size']}" for k, r in res.items() if "batch_size" in r) or "-"
    print(f"model: random Dinov2Model, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
          f"{cfg['num_attention_heads']} heads, MLP {cfg['mlp_ratio'] * cfg['hidden_size']}, patch "
          f"{cfg['patch_size']}, LayerScale; batch {batch} (RLX's embed_pixels batch_size: "
          f"{parts}); "
          f"host f32 pixels in, host f32 pooled embeddings out "
          f"(no image decoding or preprocessing); {args.repeat} timed calls after {args.warmup} warm-up")
    for size in sizes:
        tokens = (size // cfg["patch_size"]) ** 2 + 1
        print(f"\n{size}x{size} ({tokens} tokens per image)")
        print(f"{'':10}{'best ms':>9}{'median ms':>11}{'images/s':>10}{'device ms':>11}   first call s")
        med = {}
        for s, r in res.items():
            rs = r["sizes"][str(size)]
            lo, med[s] = stats(rs["times"])
            dev = rs.get("device_s")
            dev_ms = dev * 1e3 if dev else (stats(rs["device_times"])[1] * 1e3 if "device_times" in rs else None)
            dev_txt = f"{dev_ms:11.1f}" if dev_ms else f"{'-':>11}"
            print(f"{s:10}{lo * 1e3:9.1f}{med[s] * 1e3:11.1f}{batch / med[s]:10.0f}{dev_txt}   {rs['first_s']:.1f}")
        for mine in (s for s in med if s.startswith("rlx")):
            for peer in ("eager", "compile"):
                if peer in med:
                    target = TARGETS.get(peer)
                    verdict = f" (target <= {target}x: {'met' if med[mine] / med[peer] <= target else 'NOT met'})" \
                        if target else ""
                    print(f"{mine} / {peer}: {med[mine] / med[peer]:.2f}x on medians{verdict}")
        names = [s for s in res]
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if i and a.startswith("rlx") and b.startswith("rlx"):
                    continue                       # (the rlx rows: each against the first)
                rel, cos = agreement(outs[(a, size)], outs[(b, size)])
                print(f"agreement {a} vs {b}: max |diff| / max |{b}| {rel:.2e}, worst cosine {cos:.5f}")
        if size in refs:
            for s in names:
                rel, cos = agreement(outs[(s, size)][:REF_IMAGES], refs[size])
                print(f"{s} vs the f32 reference ({REF_IMAGES} images): {rel:.2e} of max |ref|, worst cosine {cos:.5f}")
    ran = ", ".join(res) or "nothing"
    print(f"\n# ran: {ran}; {time.perf_counter() - start:.0f} s in all")
    if set(sides) - set(done):
        sys.exit(1)


if __name__ == "__main__":
    main()
