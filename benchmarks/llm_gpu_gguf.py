"""Llama-3.2-1B-shaped decode at batch 1 on the GPU: RLX's cuda backend against llama.cpp's CUDA
build on the same GGUF files, F16, Q8_0 and Q4_K_M (issue 49's packed rows).

    python benchmarks/llm_gpu_gguf.py --llama-bin DIR [--dir /tmp/llama1b] [--files f16,q8_0,q4_k_m]
        [--layers 16] [--prompt 512] [--new 128] [--repeat 3] [--int8] [--files-only]

The F16 file: llm_gpu.py's shape (hidden 2048, 32 heads, 8 KV heads, intermediate 8192, tied
embeddings) with random weights (llm_gpu.make_weights: matrices N(0, 1/K), the embedding
N(0, 0.02), norms near one) and a made-up SPM vocabulary of 128256 tokens (both engines load it;
the prompt is random ids), written here with gguf's writer, once into `--dir`. llama.cpp's own
`llama-quantize` makes the Q8_0 and Q4_K_M files from it (Q4_K_M: llama.cpp's mix of q4_K and
q6_K), so both engines read the same bytes.

Sides, each file in its own process:
* rlx        `rlx_core.load(file, backend="cuda")`, compute bf16: a `--prompt`-id prompt and `--new`
             greedy tokens (EOS ignored), the median of `--repeat` generate calls after a warm-up one;
             `--int8`: a second row per packed file under `[precision] activations = "int8"` (x
             rounded to int8 blocks, multiplied in dp4a, as llama.cpp's q8_1 activations)
* llama.cpp  `llama-bench -m FILE -ngl 99 -fa 1 -p PROMPT -n NEW -d PROMPT -r REPEAT` (generation at
             depth PROMPT); a build that fails or crashes is reported so, with no ratio
Printed: the hardware; per file both sides' decode ms per token and prefill ms, and llama.cpp / RLX
decode (issue 49's target: >= 1.5 for Q8_0 and Q4_K_M).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import gguf_race, gpu_name, llama_quantized, log, rlx_gguf_decode  # noqa: E402
from llm_gpu import LLAMA_1B, make_weights  # noqa: E402

FILE_TYPES = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}      # llama-quantize's names


def gguf_names(cfg: dict) -> dict:
    """HF tensor name -> llama.cpp's GGUF name, for llm_gpu.make_weights' tensors."""
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(cfg["num_hidden_layers"]):
        names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{gg}.weight"
                      for hf, gg in per_layer.items()})
    return names


def write_f16(path: str, cfg: dict) -> None:
    """The F16 GGUF of make_weights(cfg) (norms f32, as llama.cpp's converter writes them)."""
    import gguf
    import numpy as np

    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("random-llama-1b")
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(1)
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens = special + [f"\u2581t{i}" for i in range(cfg["vocab_size"] - len(special))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - len(special)))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    names = gguf_names(cfg)
    for name, t in make_weights(cfg).items():
        w.add_tensor(names[name], t.astype(np.float32 if t.ndim == 1 else np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_files(a, cfg: dict) -> dict:
    """{kind: path} of the GGUF files, written once into `--dir` (kept between runs)."""
    os.makedirs(a.dir, exist_ok=True)
    kinds = a.files.split(",")
    path = {k: os.path.join(a.dir, f"llama1b-{a.layers}l-{k}.gguf") for k in {"f16", *kinds}}
    if not os.path.exists(path["f16"]):
        t0 = time.perf_counter()
        write_f16(path["f16"], cfg)
        size = os.path.getsize(path["f16"]) / 2**30
        log(f"wrote the F16 file: {size:.2f} GiB ({time.perf_counter() - t0:.0f}s)")
    llama_quantized(a.llama_bin, path, FILE_TYPES)
    return {k: path[k] for k in kinds if os.path.exists(path[k])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", help="the folder of llama-bench and llama-quantize "
                                        "(none: RLX alone, F16 only)")
    ap.add_argument("--dir", default="/tmp/llama1b")
    ap.add_argument("--files", default="f16,q8_0,q4_k_m")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--int8", action="store_true", help="a second RLX row per packed file: int8 activations")
    ap.add_argument("--activations", default="f32", help=argparse.SUPPRESS)       # (the child's)
    ap.add_argument("--files-only", action="store_true", help="write the files, measure nothing")
    ap.add_argument("--child-file", default=None)
    a = ap.parse_args()
    cfg = dict(LLAMA_1B, num_hidden_layers=a.layers)
    if a.child_file:
        out, _ = rlx_gguf_decode(a.child_file, "cuda", a.prompt, a.new, a.repeat, cfg["vocab_size"],
                                 a.activations)
        print(json.dumps(out), flush=True)
        return
    log(f"device: {gpu_name()}; Llama-3.2-1B shape, {a.layers} layers; prompt {a.prompt}, "
        f"{a.new} new tokens, median of {a.repeat}")
    files = make_files(a, cfg)
    if a.files_only:
        return
    args = [w for k in ("layers", "prompt", "new", "repeat") for w in (f"--{k}", str(getattr(a, k)))]
    int8 = [(" int8 act", ["--activations", "int8"])] if a.int8 else []
    gguf_race(os.path.abspath(__file__), files, args, a, "llama.cpp / RLX (target >= 1.5 packed)",
              lambda rlx, peer: peer["decode_ms"] / rlx["decode_ms"],
              lambda kind: [("", [])] + (int8 if kind != "f16" else []))

if __name__ == "__main__":
    main()
