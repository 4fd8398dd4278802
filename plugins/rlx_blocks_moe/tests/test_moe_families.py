"""Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE against HF transformers: tiny random models (8 experts, top-2,
an uneven expert load) built in-process and saved as HF folders; their logits, greedy tokens,
left-padded batches and continuous batching on RLX; the forms expert tensors come in; bad
configs and tensors."""
from __future__ import annotations

import json

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.errors import ModelError, WeightError
from rlx_core.testing.parity import assert_greedy_agrees, backend_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 61
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, rms_norm_eps=1e-5, eos_token_id=2, pad_token_id=0)
# each family with the options that change what it computes: Qwen3-MoE's head_dim, normalized
# top-k and a dense layer; Qwen2-MoE's q/k/v biases, gated shared expert, a dense layer and a
# sliding window on layer 0; Mixtral's sliding window (shorter than the prompts); OLMoE's clip_qkv
TINY = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=40, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                       head_dim=12, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=20,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
                       use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, sliding_window=5)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=24, num_experts=8, num_experts_per_tok=2, clip_qkv=1.0)),
}


def uneven_router(model, scale: float = 0.3) -> None:
    """Random weights of a visible size, norms around 1, and an uneven expert load: every
    embedding shares one component, so the experts whose router rows lean towards it take most
    tokens, and routers' rows 0 and 1 are near zero, so those experts are seldom chosen."""
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif p.ndim >= 2:
                p.copy_(scale * torch.randn_like(p))
            if n.endswith("mlp.gate.weight"):
                p[:2] *= 0.05
        emb = model.get_input_embeddings().weight
        emb += 4 / 3 * scale * torch.sign(torch.randn(emb.shape[1]))


def hf_model(family: str, path, **overrides):
    cfg_cls, model_cls, opts = TINY[family]
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **opts, **overrides})
    torch.manual_seed(1)
    model = getattr(transformers, model_cls)(cfg)
    uneven_router(model)
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, hf_model(request.param, path), str(path)


def backends_here() -> list:
    """numpy, numba and OpenCL (and cuda, on the device), each skipped with its reason where it
    is not available here."""
    return backend_params(("numpy", "numba", "opencl", "cuda"))


def hf_logits(hf):
    def logits(prefix):
        with torch.no_grad():
            return hf(torch.tensor(prefix)).logits.numpy()
    return logits


@pytest.mark.parametrize("backend", backends_here())
def test_logits_match_hf(tiny, backend, rng):
    family, hf, path = tiny
    ids = rng.integers(1, VOCAB, (2, 13))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    got = rlx_core.load(path, backend=backend, progress=False).logits(ids)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1e-4, family


def test_router_load_is_uneven(tiny, rng):
    """The models under test really route unevenly (so a kernel that assumed balance would show):
    over 256 random tokens, one expert takes at least twice its share and two take under a
    quarter of theirs (400 draws of each family: at least 2.9x and 3 experts; 64 tokens, with
    the top expert at 30% of the picks, failed one draw in 300)."""
    family, hf, _ = tiny
    ids = torch.tensor(rng.integers(1, VOCAB, (8, 32)))
    picks = []
    hook = hf.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, o: picks.append(o[2]) and None)
    with torch.no_grad():
        hf(ids)
    hook.remove()
    counts = np.bincount(picks[0].numpy().ravel(), minlength=8)
    assert counts.max() >= 2 * counts.mean() and (counts < counts.mean() / 4).sum() >= 2, (family, counts)


def test_greedy_32_tokens_with_kv_cache(tiny, rng):
    family, hf, path = tiny
    rlx = rlx_core.load(path, backend="numpy", progress=False)
    ids = rng.integers(1, VOCAB, (1, 7))
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
                          max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0).numpy()
    got = rlx.generate(ids, max_new_tokens=32, min_new_tokens=32)
    assert_greedy_agrees(got, ref, hf_logits(hf), 2e-4, f"{family} greedy against HF")


def test_left_padded_batch_equals_one_by_one(tiny, rng):
    """Two prompts of different lengths generated as one left-padded batch give each the tokens
    it gets alone (padding tokens routed through experts must not reach any result)."""
    family, _, path = tiny
    rlx = rlx_core.load(path, backend="numpy", progress=False)
    rows = [rng.integers(1, VOCAB, n) for n in (9, 4)]
    ids = np.zeros((2, 9), np.int64)
    mask = np.zeros((2, 9), np.int64)
    for b, r in enumerate(rows):
        ids[b, 9 - len(r):], mask[b, 9 - len(r):] = r, 1
    got = rlx.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10)
    for b, r in enumerate(rows):
        alone = rlx.generate(r[None], max_new_tokens=10, min_new_tokens=10)
        assert got[b, -10:].tolist() == alone[0, -10:].tolist(), (family, b)


def test_continuous_batching_equals_alone(tiny):
    """The Scheduler admits a second MoE request while the first decodes: each gets the tokens
    `generate` gives it alone."""
    from rlx_core.runtime.scheduler import Scheduler

    family, _, path = tiny
    lm = rlx_core.load(path, backend="numpy", progress=False)
    rng = np.random.default_rng(5)
    jobs = [(rng.integers(3, VOCAB, 9).tolist(), 12), (rng.integers(3, VOCAB, 4).tolist(), 6)]
    reqs: list = []

    def second(ev):
        if len(reqs) == 1 and len(reqs[0].token_ids) >= 3:
            reqs.append(sched.submit(jobs[1][0], max_tokens=jobs[1][1], ignore_eos=True))

    with Scheduler(lm, max_batch=2) as sched:
        reqs.append(sched.submit(jobs[0][0], max_tokens=jobs[0][1], ignore_eos=True, on_event=second))
        first = reqs[0].result(120)
        assert len(reqs) == 2, "the second request was never admitted"
        got = [first, reqs[1].result(120)]
        assert sched.max_rows == 2              # they shared decode steps
    for (ids, n), c in zip(jobs, got):
        want = lm.generate(np.array([ids]), max_new_tokens=n, min_new_tokens=n)[0, len(ids):]
        assert c.token_ids == want.tolist(), family


# ------------------------------------------------------------------ the forms of expert tensors
def _resave(path, out, rename):
    """Copy the HF folder `path` to `out` with its tensors rewritten by `rename(dict) -> dict`."""
    from safetensors.numpy import load_file, save_file

    out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    save_file(rename(load_file(str(path / "model.safetensors"))), str(out / "model.safetensors"))
    return str(out)


def _fused(tensors: dict) -> dict:
    """transformers 5's in-memory layout: experts.gate_up_proj [E, 2I, H], experts.down_proj."""
    import re

    out, per = {}, {}
    for k, v in tensors.items():
        m = re.match(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$", k)
        if m:
            per.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = v
        else:
            out[k.replace("block_sparse_moe.", "mlp.")] = v
    for layer, leaves in per.items():
        g, u, d = (("w1", "w3", "w2") if "w1" in leaves else ("gate_proj", "up_proj", "down_proj"))
        stack = {n: np.stack([leaves[n][e] for e in sorted(leaves[n])]) for n in (g, u, d)}
        out[f"{layer}.mlp.experts.gate_up_proj"] = np.concatenate([stack[g], stack[u]], axis=1)
        out[f"{layer}.mlp.experts.down_proj"] = stack[d]
    return out


def test_fused_gate_up_checkpoint_equals_per_expert(tiny, tmp_path, rng):
    family, _, path = tiny
    import pathlib

    fused = _resave(pathlib.Path(path), tmp_path / "fused", _fused)
    ids = rng.integers(1, VOCAB, (1, 11))
    a = rlx_core.load(path, backend="numpy", progress=False).logits(ids)
    b = rlx_core.load(fused, backend="numpy", progress=False).logits(ids)
    np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ bad input
def _config_with(path, tmp_path, **changes):
    import shutil

    out = tmp_path / "changed"
    shutil.copytree(path, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def test_more_experts_per_token_than_experts_names_the_key(tiny, tmp_path):
    family, _, path = tiny
    bad = _config_with(path, tmp_path, num_experts_per_tok=9)
    with pytest.raises(ModelError, match=r"num_experts_per_tok = 9 exceeds the 8 experts"):
        rlx_core.load(bad, backend="numpy", progress=False)


def test_missing_expert_tensor_names_it(tiny, tmp_path):
    import pathlib

    family, _, path = tiny
    leaf = "block_sparse_moe.experts.5.w3" if family == "mixtral" else "mlp.experts.5.up_proj"
    name = f"model.layers.0.{leaf}.weight"
    bad = _resave(pathlib.Path(path), tmp_path / "bad", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(WeightError, match=f"tensor '{name}' is missing"):
        rlx_core.load(bad, backend="numpy", progress=False)


def test_misshaped_expert_tensor_names_it(tiny, tmp_path):
    import pathlib

    family, _, path = tiny
    leaf = "block_sparse_moe.experts.3.w2" if family == "mixtral" else "mlp.experts.3.down_proj"
    name = f"model.layers.0.{leaf}.weight"
    bad = _resave(pathlib.Path(path), tmp_path / "bad",
                  lambda t: {k: (v[:, :-1].copy() if k == name else v) for k, v in t.items()})
    with pytest.raises(WeightError, match=f"tensor '{name}' has shape"):
        rlx_core.load(bad, backend="numpy", progress=False)


def test_experts_beyond_the_count_are_refused(tiny, tmp_path):
    family, _, path = tiny
    saved = json.loads(open(f"{path}/config.json").read())
    key = "num_local_experts" if "num_local_experts" in saved else "num_experts"
    bad = _config_with(path, tmp_path, **{key: 6})
    with pytest.raises(WeightError, match=r"is expert 6, but the config has 6 experts"):
        rlx_core.load(bad, backend="numpy", progress=False)


def test_disagreeing_expert_counts_are_refused(tmp_path):
    from rlx_blocks_moe.config import num_experts

    with pytest.raises(ModelError, match="num_experts = 8 and num_local_experts = 4 disagree"):
        num_experts({"num_experts": 8, "num_local_experts": 4})
