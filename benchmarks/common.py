"""What the benchmarks share: the HF names and shapes of a Llama config's tensors, running
one side of a comparison in a child process of its own, the two sides of a race on the
same GGUF files (RLX's decode and llama.cpp's `llama-bench`), and module constants set from
the environment for an A/B of a tuning constant (RLX_BENCH_SET, applied on import)."""
import ast
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time


def log(*a):
    print(*a, flush=True)


def apply_settings(spec: str) -> dict:
    """Set module constants from `spec`, "package.module.NAME=value, ..." (values Python
    literals, tuples too): RLX_BENCH_SET, applied when a benchmark imports this module, so that its child
    processes (which inherit the environment) run with them too. A name that is not there
    already is refused: a misspelt constant would otherwise measure the default."""
    done = {}
    for item in filter(None, (s.strip() for s in re.split(r",\s*(?=[\w.]+\s*=)", spec.strip().rstrip(",")))):
        target, eq, value = item.partition("=")
        mod_name, _, attr = target.strip().rpartition(".")
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            raise SystemExit(f"RLX_BENCH_SET {item!r}: cannot import module {mod_name!r} ({e})") from None
        if not eq or not attr or not hasattr(mod, attr):
            raise SystemExit(f"RLX_BENCH_SET {item!r}: expected MODULE.NAME=VALUE naming a constant "
                             f"that {mod_name!r} has")
        try:
            val = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise SystemExit(f"RLX_BENCH_SET {item!r}: the value is no Python literal") from None
        setattr(mod, attr, val)
        done[target.strip()] = val
    return done


SETTINGS = apply_settings(os.environ.get("RLX_BENCH_SET", ""))
if SETTINGS:
    log(f"RLX_BENCH_SET: {SETTINGS}")


def llama_shapes(cfg: dict) -> dict:
    """HF name -> shape of every tensor of a Llama config (lm_head unless embeddings are tied)."""
    h, it, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // nh
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (nh * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                       p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, nh * d),
                       p + "mlp.gate_proj.weight": (it, h), p + "mlp.up_proj.weight": (it, h),
                       p + "mlp.down_proj.weight": (h, it)})
    return shapes


def run_child(cmd: list, side: str, timeout: float):
    """Run `cmd` (one side, in its own process); the last JSON line it printed, or None after
    logging why it failed."""
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
    if p.returncode or line is None:
        log(f"{side}: failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-2500:]}")
        return None
    log(f"{side}: done in {time.perf_counter() - t:.0f}s")
    return json.loads(line)


def gpu_name() -> str:
    """The GPU and driver nvidia-smi names (the hardware a GPU table is measured on)."""
    if not shutil.which("nvidia-smi"):
        return "no nvidia-smi"
    p = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True)
    return p.stdout.strip() or "no nvidia-smi"


def llama_quantized(llama_bin: str | None, path: dict, file_types: dict) -> None:
    """The files path[kind] for kind in file_types that are missing, made from path["f16"] by
    llama.cpp's `llama-quantize` (file_types: its names, e.g. Q4_K_M); each one it could not
    make (no llama_bin, or it failed) is logged."""
    for kind, file_type in file_types.items():
        if kind not in path or os.path.exists(path[kind]):
            continue
        if not llama_bin:
            log(f"{kind}: needs --llama-bin (llama-quantize writes it)")
            continue
        t0 = time.perf_counter()
        p = subprocess.run([os.path.join(llama_bin, "llama-quantize"), path["f16"], path[kind], file_type],
                           capture_output=True, text=True)
        if p.returncode:
            log(f"llama-quantize {file_type} failed (exit {p.returncode}): {(p.stdout + p.stderr)[-1500:]}")
            continue
        size = os.path.getsize(path[kind]) / 2**30
        log(f"llama-quantize {file_type}: {size:.2f} GiB ({time.perf_counter() - t0:.0f}s)")


def rlx_gguf_decode(path: str, backend: str, prompt: int, new: int, repeat: int, vocab: int,
                    activations: str = "f32") -> tuple:
    """RLX on a GGUF file, compute bf16 (`activations`: the profile's [precision] activations): a
    `prompt`-id prompt (random ids below `vocab`) and `new` greedy tokens (EOS ignored), the median
    of `repeat` generate calls after a warm-up one: ({prefill_ms, decode_ms, load_and_warm_s}, the model)."""
    import numpy as np

    import rlx_core
    from rlx_core.profile import CompileProfile, PrecisionConfig

    t0 = time.perf_counter()
    prof = CompileProfile("bf16", precision=PrecisionConfig(compute="bf16", activations=activations))
    m = rlx_core.load(path, backend=backend, profile=prof, progress=False)
    ids = np.random.default_rng(3).integers(3, vocab, size=(1, prompt))
    m.generate(ids, max_new_tokens=16, min_new_tokens=16)
    pre, dec = [], []
    for _ in range(repeat):
        m.generate(ids, max_new_tokens=new, min_new_tokens=new)
        pre.append(m.last_timings["prefill_s"])
        dec.append(m.last_timings["decode_s_per_token"])
    return {"prefill_ms": 1e3 * float(np.median(pre)), "decode_ms": 1e3 * float(np.median(dec)),
            "load_and_warm_s": time.perf_counter() - t0}, m


def llama_bench(llama_bin: str, path: str, prompt: int, new: int, repeat: int) -> dict | None:
    """llama.cpp's `llama-bench -m path -ngl 99 -fa 1 -p prompt -n new -d prompt -r repeat`: prompt
    processing, and generation at depth `prompt` (as RLX's decode after its prompt); None after
    logging a build that failed or crashed."""
    cmd = [os.path.join(llama_bin, "llama-bench"), "-m", path, "-ngl", "99", "-fa", "1", "-p", str(prompt),
           "-n", str(new), "-d", str(prompt), "-r", str(repeat), "-o", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        log(f"llama.cpp on {path}: crashed or failed (exit {p.returncode}): {(p.stdout + p.stderr)[-1500:]}")
        return None
    out = {}
    for row in json.loads(p.stdout):
        ms = row["avg_ns"] / 1e6
        if row["n_gen"]:
            out["decode_ms"] = ms / row["n_gen"]
        elif row["n_prompt"]:
            out["prefill_ms"] = ms
    out["build"] = json.loads(p.stdout)[0].get("build_commit", "?")
    return out


def race_table(rows: list, ran_peer: bool, ratio_head: str, ratio) -> list:
    """Markdown lines of a GGUF race: rows of (file kind, RLX's dict or None, llama.cpp's or None);
    `ratio(rlx, peer)` the decode ratio its column `ratio_head` names. A side that failed gets no ratio."""
    def cell(side, key, fmt, ran=True):
        return format(side[key], fmt) if side and key in side else "failed" if ran else "not run"
    lines = [f"| file | RLX decode ms/token | llama.cpp decode | {ratio_head} | RLX prefill ms "
             "| llama.cpp prefill |", "|---|---|---|---|---|---|"]
    for kind, rlx, peer in rows:
        why = "RLX failed" if not rlx else "the peer failed" if ran_peer else "peer not run"
        r = f"{ratio(rlx, peer):.2f}" if rlx and peer else f"no ratio: {why}"
        cells = [kind, cell(rlx, "decode_ms", ".3f"), cell(peer, "decode_ms", ".3f", ran_peer), r,
                 cell(rlx, "prefill_ms", ".1f"), cell(peer, "prefill_ms", ".1f", ran_peer)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def gguf_race(script: str, files: dict, child_args: list, a, ratio_head: str, ratio,
              variants=lambda kind: [("", [])]) -> None:
    """Each GGUF file {kind: path}'s two sides, each in its own process: RLX (`script` run with
    `child_args` and `--child-file PATH`, printing rlx_gguf_decode's dict; once per (row suffix,
    more arguments) of `variants(kind)`) and, where `a.llama_bin`, llama-bench at `a.prompt` /
    `a.new` / `a.repeat`; each row's JSON, then the table."""
    rows = []
    for kind, path in files.items():
        peer = llama_bench(a.llama_bin, path, a.prompt, a.new, a.repeat) if a.llama_bin else None
        for suffix, more in variants(kind):
            rlx = run_child([sys.executable, script, *child_args, *more, "--child-file", path],
                            f"rlx {kind}{suffix}", timeout=1800)
            rows.append((kind + suffix, rlx, peer))
            log(json.dumps({"file": kind + suffix, "rlx": rlx, "llama.cpp": peer}))
    log("")
    for line in race_table(rows, bool(a.llama_bin), ratio_head, ratio):
        log(line)
