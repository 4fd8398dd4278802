"""Gradients of whole models built with the flow DSL against torch: a tiny Llama in the
recipes' cache-free `train` mode (loss = mean token cross-entropy, a graph output) and a
tiny BERT (loss = a random projection of last_hidden_state), each against the HF model with
the same weights after `loss.backward()`; every parameter's gradient, fp64 and fp32."""
from __future__ import annotations

import numpy as np
import pytest

import rlx_core
from rlx_core.ir.dtype import F32, F64
from rlx_core.ir.errors import ModelError
from rlx_core.pipeline import compile as compile_graph
from rlx_core.runtime.model import find_recipe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

B, S = 2, 7
LLAMA = dict(vocab_size=61, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
             num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0)
BERT = dict(vocab_size=53, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=40,
            max_position_embeddings=24, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12)


def _randomize(model, seed):
    """Random norm weights and biases, so a wrong one cannot hide; eval mode (no dropout)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n.lower():
                p.copy_(1 + 0.3 * torch.randn_like(p) if n.endswith("weight") else 0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.double().eval()


def _grads(built, feed, dtype):
    """value_and_grad of the graph's `loss` with respect to every param, run on numpy."""
    exe = compile_graph(rlx_core.value_and_grad(built.graph, list(built.params), output="loss"),
                        backend="numpy")
    exe.set_params({k: v.astype(dtype.np) for k, v in built.params.items()})
    return exe.run(feed)


def _compare(got, hf, names, rtol):
    grads = {n: p.grad.numpy() for n, p in hf.named_parameters() if n in names}
    assert sorted(grads) == sorted(names)
    scale = max(np.abs(g).max() for g in grads.values())
    for n, want in grads.items():
        # relative per tensor; a gradient that is zero in exact arithmetic (BERT's key bias)
        # is compared against the model's gradient scale
        tol = rtol * max(np.abs(want).max(), 1e-6 * scale)
        err = np.abs(got[f"grad_{n}"] - want).max()
        assert err <= tol, f"grad of {n}: max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_llama_gradients_match_torch(rng, tied):
    cfg = dict(LLAMA, tie_word_embeddings=tied)
    hf = _randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)), 3)
    weights = {n: p.detach().numpy() for n, p in hf.named_parameters()}
    ids = rng.integers(0, cfg["vocab_size"], (B, S))
    labels = np.concatenate([ids[:, 1:], rng.integers(0, cfg["vocab_size"], (B, 1))], 1)
    labels[0, 2] = labels[1, -1] = -100                      # ignored positions
    logits = hf(torch.tensor(ids)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg["vocab_size"]), torch.tensor(labels).reshape(-1),
                                             ignore_index=-100)
    loss.backward()
    feed = {"ids": ids, "positions": np.tile(np.arange(S), (B, 1)), "key_mask": np.ones((B, 1, 1, S), bool),
            "labels": labels}
    # static dims (tied) take the rules' one-GEMM paths; symbolic ones (untied) the batched ones
    dims = dict(batch=B, seq=S) if tied else {}
    flow = find_recipe("llama").flow_class.for_training(dict(cfg, model_type="llama"), **dims)
    for dtype, rtol in ((F64, 1e-5), (F32, 1e-3)):
        built = flow.build(weights, dtype=dtype)
        assert "cache_pos" not in built.graph.inputs and not built.graph.states
        got = _grads(built, feed, dtype)
        np.testing.assert_allclose(got["loss"], loss.item(), rtol=rtol)
        _compare(got, hf, list(built.params), rtol)


def test_tiny_bert_gradients_match_torch(rng):
    hf = _randomize(transformers.BertModel(transformers.BertConfig(**BERT), add_pooling_layer=False), 5)
    recipe = find_recipe("bert")
    weights = recipe.tensors({k: v.detach().numpy() for k, v in hf.state_dict().items()})
    ids, types = rng.integers(1, BERT["vocab_size"], (B, S)), rng.integers(0, 2, (B, S))
    mask = np.ones((B, S), bool)
    mask[1, 4:] = False                                       # a padded text
    r = rng.standard_normal((B, S, BERT["hidden_size"])) * mask[..., None]
    h = hf(torch.tensor(ids), attention_mask=torch.tensor(mask.astype(np.int64)),
           token_type_ids=torch.tensor(types)).last_hidden_state
    loss = (h * torch.tensor(r)).sum()
    loss.backward()

    def projection(m, x, ctx):                                # loss = sum(last_hidden_state * r)
        ctx.outputs["loss"] = m.sum(x * m.input("r", x.dims, x.dtype), (0, 1, 2))
        return x

    flow = recipe.flow_class(dict(BERT, model_type="bert")).after_layers(lambda f: f.custom(projection))
    feed = {"ids": ids, "token_type_ids": types, "positions": np.tile(np.arange(S), (B, 1)),
            "key_mask": mask[:, None, None, :]}
    for dtype, rtol in ((F64, 1e-5), (F32, 1e-3)):
        built = flow.build(weights, dtype=dtype)
        got = _grads(built, dict(feed, r=r.astype(dtype.np)), dtype)
        np.testing.assert_allclose(got["loss"], loss.item(), rtol=rtol)
        _compare(got, hf, list(built.params), rtol)


def test_train_mode_needs_integer_labels_of_the_logits_dims():
    from rlx_core.flow import ModelFlow

    f = ModelFlow("t").input("ids", (2, 3)).input("labels", (2, 4)).token_embed("e").cross_entropy_loss()
    with pytest.raises(ModelError, match=r"cross_entropy_loss: needs an integer input 'labels' of dims \(2, 3\)"):
        f.build({"e": np.zeros((5, 4), np.float32)})
    with pytest.raises(ModelError, match="mode must be one of"):
        find_recipe("llama").flow_class(dict(LLAMA, model_type="llama"), "training")
