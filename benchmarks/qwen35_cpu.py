"""Qwen3.5 (Gated DeltaNet hybrid) on the CPU against llama.cpp (issue 45's CPU rows): a
Qwen3.5-2B-like random checkpoint written as a q4_k GGUF by `rlx quantize`, run on RLX's numba
backend and on llama.cpp (llama-cpp-python, arch `qwen35`) from the same file: decode ms per
token, the greedy tokens of both (compared), and prefill at several prompt lengths (time per
token: flat when prefill grows linearly in the length).

    .venv/bin/python benchmarks/qwen35_cpu.py [--layers 24] [--hidden 2048] [--inter 6144]
        [--vocab 49152] [--threads 2] [--prompt 128] [--decode 32] [--lengths 512,1024,2048,4096]
        [--repeat 2] [--activations f32] [--sides numba llama.cpp] [--parts logits decode prefill] [--keep DIR]

The shape (`FULL`) is Qwen3.5-2B-like (not checked against the published config.json here,
no network): hidden 2048, 24 layers, every
4th one full attention (8 query / 2 KV heads of 256, output gate, QK-norm, a quarter of each
head rotated), the other 18 Gated DeltaNet (16 key and 16 value heads, K = V = 128, conv
width 4), a dense MLP of 6144, tied embeddings; except the vocabulary: SmolLM2's tokenizer
(49152 tokens; Qwen3.5's is 248320), because llama.cpp loads no GGUF without a vocabulary.
`--layers` must be a multiple of 4 (the real layer mix: 3 linear, then 1 full). Weights are
random f16 (std 0.02; the (1 + w) norms 0, the gated norm 1, A_log = log U(1, 16), dt_bias 1),
written one safetensors shard per layer, then `rlx quantize -s q4_k` ("Q4_K_M-like": llama.cpp's
Q4_K_M keeps some tensors in q6_k; `rlx quantize` writes one scheme; the conv, A, dt_bias and
norms stay f32).

Each side and part runs in its own process with `--threads` threads (numba's, BLAS's,
llama.cpp's):
* logits   every position's logits of one 64-token prompt: the largest difference between the
           sides and the positions where their arg-maxes agree
* twin     (not run unless named) the logits part on an f32 copy of the file (every tensor
           dequantized): both engines multiply in f32 (on the q4_k file llama.cpp rounds the
           activations to q8_K), so what differs is only their order of operations; the copy
           is 4 bytes a weight: use a small --layers / --hidden
* decode   a `--prompt`-token prompt, then `--decode` greedy tokens: ms per token, best and
           median of `--repeat` runs after a warm-up; the tokens are compared between the sides;
           the process CPU time a token (a run's minus a 1-token run's; at --threads 1 the work
           itself, at more it also counts threads spinning at barriers)
* prefill  for each of `--lengths`, the time of one prompt of that length to its next token's
           logits (best of `--repeat`, after one warm-up call at the first length) and ms per
           1k tokens; also the process's CPU time (both threads: on a shared machine the wall
           time counts the waits for a core, the CPU time the work, for linearity)
Prints the hardware, the load average before and after, and numba / llama.cpp (target: decode
<= 1.0x; prefill: its ms per token constant from 512 to 4096).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import log, run_child  # noqa: E402
from hardware import cpu_name  # noqa: E402
from moe_cpu import peak_rss_mb, quantize, write_sharded  # noqa: E402

FULL = dict(layers=24, hidden=2048, inter=6144, vocab=49152, heads=8, kv_heads=2, head_dim=256,
            lin_heads=16, lin_dim=128)
LOGITS_PROMPT = 64   # tokens whose logits the sides compare
PARTS = ("logits", "decode", "prefill", "twin")
LABEL = {"numba": "RLX numba, packed q4_k", "llama.cpp": "llama.cpp (llama-cpp-python)"}


# ------------------------------------------------------------------------------ the checkpoint
def hf_config(a) -> dict:
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(a.layers)]
    return dict(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], vocab_size=a.vocab,
                hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
                num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
                layer_types=layer_types, linear_num_key_heads=a.lin_heads, linear_num_value_heads=a.lin_heads,
                linear_key_head_dim=a.lin_dim, linear_value_head_dim=a.lin_dim, linear_conv_kernel_dim=4,
                max_position_embeddings=8192, rms_norm_eps=1e-6, hidden_act="silu",
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                 "partial_rotary_factor": 0.25},
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                torch_dtype="float16")


def hf_shapes(cfg: dict) -> dict:
    """HF name -> shape of every tensor, from transformers' own model built on the meta device."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**cfg))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def random_tensor(name: str, shape: tuple, rng):
    """A random f16 value of a sane scale for the tensor's role."""
    import numpy as np

    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float16)
    if name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        return np.ones(shape, np.float16)
    if "norm" in name:                                   # (1 + w) RMSNorms: scale 1
        return np.zeros(shape, np.float16)
    return (0.02 * rng.standard_normal(shape, np.float32)).astype(np.float16)


def write_checkpoint(folder: str, a) -> None:
    """Random f16 tensors (HF names), one safetensors shard per layer, config and tokenizer."""
    cfg = hf_config(a)
    write_sharded(folder, cfg, hf_shapes(cfg), random_tensor)


# ------------------------------------------------------------------------------ the sides
def prompt(a, n: int) -> list:
    import numpy as np

    return np.random.default_rng(n).integers(3, a.vocab, n).tolist()


class Rlx:
    def __init__(self, a):
        import rlx_core

        profile = None
        if a.activations == "int8":        # the opt-in: packed matmuls' x rounded through int8 blocks
            from rlx_core.profile import CompileProfile
            profile = CompileProfile.from_toml_str('[precision]\nactivations = "int8"\n')
        self.m = rlx_core.load(a.gguf, backend="numba", progress=False, profile=profile)

    def decode(self, ids: list, n: int) -> tuple:
        """(prefill s, decode s per token, the new tokens)."""
        import numpy as np

        out = self.m.generate(np.asarray([ids]), max_new_tokens=n, ignore_eos=True)
        t = self.m.last_timings
        new = np.asarray(out)[0, len(ids):].tolist()
        return t["prefill_s"], t["decode_s_per_token"], new

    def logits(self, ids: list):
        """[T, vocab] f32 logits of every position of one prompt."""
        import numpy as np

        return np.asarray(self.m.logits(np.asarray([ids])), np.float32)[0]

    def prefill(self, ids: list) -> float:
        import numpy as np

        self.m.generate(np.asarray([ids]), max_new_tokens=1, ignore_eos=True)
        return self.m.last_timings["prefill_s"]


class LlamaCpp:
    def __init__(self, a):
        from llama_cpp import Llama

        n_ctx = max([a.prompt + a.decode] + [int(t) for t in a.lengths.split(",")]) + 16
        self.llm = Llama(model_path=a.gguf, n_threads=a.threads, n_threads_batch=a.threads,
                         n_ctx=n_ctx, n_batch=512, n_ubatch=512, verbose=False,
                         logits_all=a.part == "logits")

    def _next(self) -> int:            # eval keeps only the last position's logits (logits_all off)
        import numpy as np

        return int(np.argmax(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))))

    def decode(self, ids: list, n: int) -> tuple:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        pre = time.perf_counter() - t0
        new = [self._next()]
        t0 = time.perf_counter()
        for _ in range(n - 1):
            self.llm.eval([new[-1]])
            new.append(self._next())
        return pre, (time.perf_counter() - t0) / max(n - 1, 1), new

    def logits(self, ids: list):
        import numpy as np

        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[:len(ids)], np.float32)

    def prefill(self, ids: list) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        self._next()
        return time.perf_counter() - t0


def child(a) -> None:
    side = (Rlx if a.child == "numba" else LlamaCpp)(a)
    res: dict = {}
    if a.part == "logits":
        import numpy as np

        np.save(a.out, side.logits(prompt(a, LOGITS_PROMPT)))
    elif a.part == "decode":
        ids = prompt(a, a.prompt)
        side.decode(ids, 4)                                                     # compile + warm up
        runs, cpu = [], []
        for _ in range(a.repeat):          # CPU time a token: a run's minus a 1-token run's (its prefill)
            c0 = time.process_time()
            runs.append(side.decode(ids, a.decode))
            c1 = time.process_time()
            side.decode(ids, 1)
            cpu.append(((c1 - c0) - (time.process_time() - c1)) / max(a.decode - 1, 1))
        res = {"decode_s": [r[1] for r in runs], "prefill_s": [r[0] for r in runs], "tokens": runs[0][2],
               "decode_cpu_s": cpu, "same_tokens_each_run": all(r[2] == runs[0][2] for r in runs)}
    else:
        lengths = [int(x) for x in a.lengths.split(",")]
        side.prefill(prompt(a, lengths[0]))          # compile + warm up (once: a 4k prompt takes minutes)
        for t in lengths:
            ids = prompt(a, t)
            res[str(t)], res[f"cpu {t}"] = [], []
            for _ in range(a.repeat):
                c0 = time.process_time()
                res[str(t)].append(side.prefill(ids))
                res[f"cpu {t}"].append(time.process_time() - c0)
            log(f"  {a.child} prefill {t}: {min(res[str(t)]) * 1e3:.0f} ms")
    res["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(res), flush=True)


# ------------------------------------------------------------------------------ plumbing
def f32_twin(src: str, dst: str) -> None:
    """dst: the GGUF src with every tensor dequantized to f32 (same metadata), so that both
    engines multiply in f32 and only their order of operations differs."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        array = f.types[0] == gguf.GGUFValueType.ARRAY
        w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1] if array else None)
    for t in r.tensors:
        w.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype(np.float32)
                     .reshape(tuple(int(d) for d in reversed(t.shape))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def spawn(a, side: str, part: str) -> dict | None:
    twin = part == "twin"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", side,
           "--part", "logits" if twin else part] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
        if k not in ("child", "part", "sides", "parts", "keep", "out", "gguf", "twin") and v is not None]
    cmd.append(f"--gguf={a.twin if twin else a.gguf}")
    if part in ("logits", "twin"):
        cmd.append(f"--out={a.out}.{side}.npy")
    os.environ.update(RLX_NUM_THREADS=str(a.threads), OMP_NUM_THREADS=str(a.threads),
                      OPENBLAS_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    res = run_child(cmd, f"{side} {part}", timeout=3600)
    if res is not None and part in ("logits", "twin"):
        import numpy as np

        res["logits"] = np.load(f"{a.out}.{side}.npy")
    return res


def have_llamacpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


def ms(v: list) -> str:
    return f"{min(v) * 1e3:.1f} [{statistics.median(v) * 1e3:.1f}]"


def compare_logits(x, y) -> None:
    """The two sides' logits of one prompt: largest difference relative to the largest |logit|,
    and the positions where their arg-maxes agree."""
    import numpy as np

    diff = np.abs(x - y).max() / np.abs(y).max()
    agree = int((x.argmax(-1) == y.argmax(-1)).sum())
    top2 = np.sort(y, -1)[:, -2:]
    log(f"  logits of a {len(x)}-token prompt, numba vs llama.cpp: max |diff| {diff:.1e} of max |logit|; "
        f"arg-max equal at {agree} of "
        f"{len(x)} positions; llama.cpp's top-1 - top-2 margin median "
        f"{np.median(top2[:, 1] - top2[:, 0]):.2f}, "
        f"|diff| median {np.median(np.abs(x - y)):.3f}")


def report(a, res: dict) -> None:
    lengths = [int(t) for t in a.lengths.split(",")]
    for part, what in (("logits", "the q4_k file"), ("twin", "its f32 twin (every tensor dequantized)")):
        lx, ly = res.get(("numba", part)), res.get(("llama.cpp", part))
        if lx and ly:
            log(f"on {what}:")
            compare_logits(lx["logits"], ly["logits"])
    for side in ("numba", "llama.cpp"):
        r = res.get((side, "decode"))
        if r:
            label = LABEL[side] + (f", {a.activations} activations" if side == "numba" else "")
            log(f"{label:30} decode {ms(r['decode_s'])} ms/token ({1 / min(r['decode_s']):.1f} "
                f"tokens/s) after a {a.prompt}-token prompt ({ms(r['prefill_s'])} ms); peak RSS "
                f"{r['peak_rss_mb']:.0f} MB "
                f"(best [median]); process CPU {ms(r['decode_cpu_s'])} ms/token (all threads: a spinning "
                "thread's wait counts)")
    d, p = res.get(("numba", "decode")), res.get(("llama.cpp", "decode"))
    if d and p:
        same = sum(x == y for x, y in zip(d["tokens"], p["tokens"]))
        first = next((i for i, (x, y) in enumerate(zip(d["tokens"], p["tokens"])) if x != y), None)
        log(f"ratio numba / llama.cpp decode (best): {min(d['decode_s']) / min(p['decode_s']):.2f}x "
            "(target <= 1.0)")
        log(f"greedy tokens: {same} of {len(d['tokens'])} equal" + ("" if first is None else
            f" (first difference at token {first}: numba {d['tokens'][first]}, "
            f"llama.cpp {p['tokens'][first]})"))
        log(f"  numba     {d['tokens']}\n  llama.cpp {p['tokens']}")
    rows = {s: res.get((s, "prefill")) for s in ("numba", "llama.cpp")}
    if any(rows.values()):
        log(f"{'prefill T':>9} {'numba ms':>10} {'ms / 1k tok':>12} {'llama.cpp ms':>13} {'ms / 1k tok':>12} "
            f"{'numba / llama.cpp':>18}")
        for t in lengths:
            n = min(rows["numba"][str(t)]) if rows["numba"] else None
            q = min(rows["llama.cpp"][str(t)]) if rows["llama.cpp"] else None
            cell = (lambda x: (f"{x * 1e3:>10.0f} {x / t * 1e6:>12.1f}" if x else f"{'-':>10} {'-':>12}"))
            log(f"{t:>9} {cell(n)} {cell(q):>26} {(f'{n / q:.2f}' if n and q else '-'):>18}")
        for side, r in rows.items():
            if r and len(lengths) > 1:
                a0, a1 = lengths[0], lengths[-1]
                for what, key in (("wall", ""), ("CPU", "cpu ")):
                    t0, t1 = min(r[f"{key}{a0}"]), min(r[f"{key}{a1}"])
                    per = " ".join(f"{min(r[f'{key}{t}']) / t * 1e3:.1f}" for t in lengths)
                    log(f"{side} prefill, {what} time: ms per token {per}; at {a1} / at {a0}: "
                        f"{t1 / a1 / (t0 / a0):.2f} (1.0: linear); slope "
                        f"{(t1 - t0) / (a1 - a0) * 1e3:.2f} ms per "
                        f"added token")
    log(f"load avg at the end {os.getloadavg()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in FULL.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--activations", choices=["f32", "int8"], default="f32",
                    help='the numba side\'s `[precision] activations` ("int8": the opt-in, as llama.cpp\'s q8 activations)')
    ap.add_argument("--sides", nargs="+", default=["numba", "llama.cpp"], choices=["numba", "llama.cpp"])
    ap.add_argument("--parts", nargs="+", default=list(PARTS[:3]), choices=PARTS)
    ap.add_argument("--keep", help="folder for the checkpoint and GGUF (kept; reused if the GGUF is there)")
    ap.add_argument("--child", choices=["numba", "llama.cpp"])
    ap.add_argument("--part", choices=PARTS[:3])
    ap.add_argument("--out")
    ap.add_argument("--gguf")
    a = ap.parse_args()
    if a.child:
        return child(a)
    if a.layers % 4:
        raise SystemExit(f"--layers {a.layers}: must be a multiple of 4 (3 linear-attention layers, "
                         "then 1 full)")
    log(f"hardware: {cpu_name()} ({platform.machine()}), {os.cpu_count()} cores, {a.threads} threads; "
        f"load avg {os.getloadavg()}; python {platform.python_version()}")
    log(f"shape: {a.layers} layers ({a.layers // 4 * 3} Gated DeltaNet, {a.layers // 4} full attention), "
        f"hidden {a.hidden}, MLP {a.inter}, vocab {a.vocab}, attention {a.heads}/{a.kv_heads} heads of "
        f"{a.head_dim}, "
        f"GDN {a.lin_heads} heads of {a.lin_dim}, tied embeddings, q4_k")
    folder = a.keep or tempfile.mkdtemp(prefix="rlx-qwen35-")
    os.makedirs(folder, exist_ok=True)
    try:
        a.gguf = os.path.join(folder, f"qwen35-{a.layers}l-q4_k.gguf")
        a.out = os.path.join(folder, "logits")
        if not os.path.exists(a.gguf):
            src = os.path.join(folder, "hf")
            os.makedirs(src, exist_ok=True)
            t0 = time.perf_counter()
            write_checkpoint(src, a)
            log(f"random checkpoint written in {time.perf_counter() - t0:.0f}s")
            quantize(src, a.gguf)
            shutil.rmtree(src)
        log(f"GGUF {a.gguf}: {os.path.getsize(a.gguf) / 2**20:.0f} MiB")
        res = {}
        a.twin = os.path.join(folder, f"qwen35-{a.layers}l-f32.gguf")
        if "twin" in a.parts and not os.path.exists(a.twin):
            f32_twin(a.gguf, a.twin)
        for part in a.parts:
            for side in a.sides:
                if side == "llama.cpp" and not have_llamacpp():
                    log("llama.cpp: peer not installed (pip install llama-cpp-python); no ratio")
                    continue
                res[(side, part)] = spawn(a, side, part)
        report(a, res)
    finally:
        if not a.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
