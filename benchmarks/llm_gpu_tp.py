"""Tensor-parallel decode (issue 19): Llama-3.1-8B shape at tp = 1, 2 (4), one process per GPU.

Llama-3.1-8B shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab
128256, untied LM head) with random bf16 weights made on each rank (`rank_weights`: each
rank makes only the slices of each weight the sharding pass gives it), run through
rlx_core.runtime.tp.TensorParallel: the ranks are supervised processes, the collectives go
through NCCL (rlx_backend_cuda.nccl.NcclCommunicator) on the cuda backend, through the
shared-memory communicator on the CPU backends. For each tp:

- decode ms/step at each --batch (rows of --prompt random ids, --new greedy tokens, median
  of --reps) and tokens/s (batch / step);
- memory per rank (the model's memory_report; on cuda the device's used bytes too);
- all-reduce: the rank's decode graph has `n` all_reduce nodes of [batch, hidden] each;
  one is timed alone (median of 50) and printed as time per step (n x one) and as NCCL's
  bus bandwidth (bytes x 2(tp-1)/tp / time, the nccl-tests definition) next to the bus
  bandwidth of a 256 MiB all-reduce (what the link gives).

Targets (issue 19): batch-1 step at tp 2 <= 0.6x tp 1; batch-32 tokens/s at tp 2 >= 1.8x tp 1.

    python benchmarks/llm_gpu_tp.py --tp 1 2 [4] [--batch 1 32] [--json out.json]     # GPUs
    python benchmarks/llm_gpu_tp.py --backend numpy --tp 1 --layers 2 --batch 1 2 --prompt 4 --new 3 --reps 1
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from common import llama_shapes, log

LLAMA_8B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=500000.0,
                max_position_embeddings=131072, hidden_act="silu", attention_bias=False, mlp_bias=False,
                rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                              "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                bos_token_id=128000, eos_token_id=128001, architectures=["LlamaForCausalLM"],
                torch_dtype="bfloat16")
HERE = Path(__file__).stem            # the ranks import this file by this name (sys.path[0])


# ----------------------------------------------------------------------------- in the ranks
class RandomWeight:
    """A random bf16 weight made when read: `w[slices]` makes that part only (a rank's
    slice, bind_slices), np.asarray(w) the whole. Values depend on the name and the part."""

    def __init__(self, name: str, shape: tuple, scale: float, offset: float = 0.0):
        import ml_dtypes

        self.name, self.shape, self.ndim = name, tuple(shape), len(shape)
        self.dtype, self.scale, self.offset = np.dtype(ml_dtypes.bfloat16), scale, offset

    def __getitem__(self, idx):
        idx = (idx if isinstance(idx, tuple) else (idx,)) + (slice(None),) * self.ndim
        ranges = [range(*s.indices(n)) for s, n in zip(idx, self.shape)]
        seed = [zlib.crc32(self.name.encode())] + [r.start for r in ranges]
        a = np.random.default_rng(seed).standard_normal([len(r) for r in ranges], dtype=np.float32)
        a *= self.scale
        a += self.offset
        return a.astype(self.dtype)

    def __array__(self, dtype=None, copy=None):
        a = self[()]
        return a if dtype is None else a.astype(dtype)


def rank_weights(cfg: dict) -> dict:
    """HF-named random weights of a LLaMA config (make_tensors of the rank spec)."""
    shapes = llama_shapes(cfg)
    return {k: RandomWeight(k, s, 0.1, 1.0) if len(s) == 1 else
            RandomWeight(k, s, 0.02 if "embed" in k else s[-1] ** -0.5) for k, s in shapes.items()}


def _sync(model):
    if model.backend.name == "cuda":
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def rank_decode(model, batch: int, prompt: int, new: int, reps: int) -> dict:
    """Decode seconds per step (median of `reps` generate calls after one to compile) and
    the prefill, for `batch` rows of `prompt` random ids (the same on every rank)."""
    ids = np.random.default_rng(batch).integers(0, model.config["vocab_size"], (batch, prompt))
    model.generate(ids, max_new_tokens=new, min_new_tokens=new)
    dec, pre = [], []
    for _ in range(reps):
        model.generate(ids, max_new_tokens=new, min_new_tokens=new)
        dec.append(model.last_timings["decode_s_per_token"])
        pre.append(model.last_timings["prefill_s"])
    return {"decode_s": statistics.median(dec), "prefill_s": statistics.median(pre)}


def rank_memory(model) -> dict:
    """The model's memory_report; on cuda also the device's used bytes (this rank's GPU)."""
    out = {"report": {k: v for k, v in model.memory_report().items() if isinstance(v, (int, float, str))}}
    if model.backend.name == "cuda":
        import cupy

        free, total = cupy.cuda.runtime.memGetInfo()
        out["device_used_bytes"] = int(total - free)
        out["device"] = int(cupy.cuda.Device().id)
    return out


def rank_allreduce(model, batch: int, reps: int = 50) -> dict:
    """The all_reduce nodes of this rank's decode graph (their count and shape) and one of
    them timed alone on the bound communicator; a 256 MiB one for the link's bandwidth."""
    from rlx_core.ir import comm
    from rlx_core.ir.dtype import DType

    mir = model.executable("decode").mir
    nodes = [n for n in mir.nodes if n.op == "all_reduce"]
    c = comm.bound()
    hidden = model.config["hidden_size"]
    dt = nodes[0].outs[0].dtype if nodes else DType.F32
    dtype = dt.np
    out = {"count": len(nodes), "world": c.world}

    def timed(n_elems: int, k: int) -> float:
        if model.backend.name == "cuda":          # the runner's call: device buffers, its stream
            import cupy
            from rlx_backend_cuda.device import storage_dtype

            x = cupy.ones(n_elems, storage_dtype(dt))
            y = cupy.empty_like(x)
            stream = cupy.cuda.get_current_stream()

            def call():
                c.on_device("all_reduce", x, y, dtype, stream)
        else:
            x = np.ones(n_elems, dtype)
            y = np.empty_like(x)

            def call():
                c.all_reduce(x, y)
        ts = []
        for i in range(k + 3):
            _sync(model)
            t = time.perf_counter()
            call()
            _sync(model)
            if i >= 3:
                ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    n = batch * hidden
    out.update(elems=n, bytes=n * np.dtype(dtype).itemsize, seconds=timed(n, reps))
    big = (256 << 20) // np.dtype(dtype).itemsize
    out.update(big_bytes=big * np.dtype(dtype).itemsize, big_seconds=timed(big, 5))
    return out


# ----------------------------------------------------------------------------- the driver
def busbw(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' all-reduce bus bandwidth, bytes per second."""
    return nbytes * 2 * (world - 1) / world / seconds


def run_tp(world: int, cfg: dict, a, profile: str) -> dict:
    from rlx_core.runtime.tp import TensorParallel

    spec = {"config": cfg, "make_tensors": f"{HERE}:rank_weights", "backend": a.backend, "profile": profile,
            "max_context": a.prompt + a.new + 128}
    if a.backend == "cuda" and world > 1:
        spec["comm"] = "rlx_backend_cuda.nccl:NcclCommunicator"
    t = time.perf_counter()
    res: dict = {"world": world, "batches": {}}
    with TensorParallel(spec, world, timeout=a.rank_timeout) as g:
        res["start_s"] = time.perf_counter() - t
        log(f"tp={world}: {world} rank(s) ready in {res['start_s']:.0f}s")
        for b in a.batch:
            r = g.call(f"{HERE}:rank_decode", batch=b, prompt=a.prompt, new=a.new, reps=a.reps)[0]
            if world > 1:
                r["all_reduce"] = g.call(f"{HERE}:rank_allreduce", batch=b)[0]
            res["batches"][b] = r
            log(f"tp={world} batch {b}: decode {r['decode_s'] * 1e3:.3f} ms/step, "
                f"{b / r['decode_s']:.1f} tokens/s, prefill {r['prefill_s'] * 1e3:.1f} ms")
        res["memory"] = g.call(f"{HERE}:rank_memory")
    return res


def report(res: dict, a) -> str:
    runs = res["runs"]
    lines = ["| tp | batch | decode ms/step | tokens/s | step / tp 1 | tokens/s / tp 1 | all-reduce per step "
             "| all-reduces | one all-reduce | bus BW at that size | bus BW at 256 MiB |",
             "|---" * 11 + "|"]
    base = runs.get(1)
    for w, r in runs.items():
        for b, x in r["batches"].items():
            d = x["decode_s"]
            rel = base and base["batches"].get(b)
            ar = x.get("all_reduce")
            cells = [str(w), str(b), f"{d * 1e3:.3f}", f"{b / d:.1f}",
                     f"{d / rel['decode_s']:.2f}" if rel else "-",
                     f"{rel['decode_s'] / d:.2f}" if rel else "-"]
            if ar:
                per_step = ar["count"] * ar["seconds"]
                cells += [f"{per_step * 1e3:.3f} ms ({per_step / d:.0%} of the step)", str(ar["count"]),
                          f"{ar['seconds'] * 1e6:.1f} us ({ar['bytes'] / 1024:.0f} KiB)",
                          f"{busbw(ar['bytes'], ar['seconds'], w) / 1e9:.2f} GB/s",
                          f"{busbw(ar['big_bytes'], ar['big_seconds'], w) / 1e9:.1f} GB/s"]
            else:
                cells += ["-"] * 5
            lines.append("| " + " | ".join(cells) + " |")
    for w, r in runs.items():
        per = []
        for k, m in enumerate(r["memory"]):
            dev = f", device used {m['device_used_bytes'] / 1e9:.2f} GB (GPU {m['device']})" \
                if "device_used_bytes" in m else ""
            per.append(f"rank {k}: {m['report'].get('total_bytes', 0) / 1e9:.2f} GB held "
                       f"(weights {m['report'].get('weights_bytes', 0) / 1e9:.2f}){dev}")
        lines.append(f"tp={w} memory: " + "; ".join(per))
    two = runs.get(2)
    if base and two:
        for b, goal, what in ((1, 0.6, "batch-1 step at tp 2 / tp 1"),
                              (32, 1.8, "batch-32 tokens/s at tp 2 / tp 1")):
            if b in base["batches"] and b in two["batches"]:
                r = two["batches"][b]["decode_s"] / base["batches"][b]["decode_s"]
                v, ok = (r, r <= goal) if b == 1 else (1 / r, 1 / r >= goal)
                lines.append(f"target {what}: {v:.2f} ({'<=' if b == 1 else '>='} {goal}: "
                             f"{'met' if ok else 'MISSED'})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backend", default="cuda",
                    help="cuda (NCCL between ranks), or a CPU backend for a smoke run")
    ap.add_argument("--compute", default=None, help="compute dtype (default: bf16 on cuda, f32 elsewhere)")
    ap.add_argument("--rank-timeout", type=float, default=1800, help="seconds a rank may take to answer")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    cfg = dict(LLAMA_8B, num_hidden_layers=a.layers)
    compute = a.compute or ("bf16" if a.backend == "cuda" else "f32")
    dev = ""
    if a.backend == "cuda":
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        dev = f"{n} x {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}"
        if max(a.tp) > n:
            log(f"--tp {max(a.tp)} needs {max(a.tp)} GPUs; this machine has {n}")
            return 2
    log(f"Llama-3.1-8B shape, {a.layers} layers, random bf16 weights made per rank, compute {compute}, "
        f"backend {a.backend} {dev}; prompt {a.prompt}, {a.new} new tokens, batches {a.batch}, tp {a.tp}")
    with tempfile.TemporaryDirectory() as tmp:
        profile = os.path.join(tmp, "tp_bench.rlx.toml")
        Path(profile).write_text(f'[precision]\ncompute = "{compute}"\n', encoding="utf-8")
        res = {"date": datetime.date.today().isoformat(), "device": dev or a.backend, "config": cfg,
               "compute": compute, "runs": {}}
        for w in a.tp:
            res["runs"][w] = run_tp(w, cfg, a, profile)
    print(report(res, a), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
