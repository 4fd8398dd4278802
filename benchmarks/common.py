"""What the benchmarks share: the HF names and shapes of a Llama config's tensors, and running
one side of a comparison in a child process of its own."""
import json
import subprocess
import time


def log(*a):
    print(*a, flush=True)


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
