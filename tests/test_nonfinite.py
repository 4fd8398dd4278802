"""A NaN or inf in a weight reaches the logits on every backend, and the runtime's finiteness
check says so: `CausalLM.logits`, `generate` (greedy, whose steps fetch only the arg-max and
the logits' sum, and sampled) and the Scheduler each raise ModelError "non-finite logits"
(issue 41, 2.3: a NaN f16 scale in SmolLM2's blk.0.attn_q gave finite, wrong logits on numba,
whose attention dropped NaN scores). The op-level cases are in rlx_core.testing.ops_suite
(test_nonfinite_*)."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_core.ir.errors import ModelError
from rlx_core.ir.quant import PackedTensor, QuantScheme
from rlx_core.pipeline import available_backends

pytest.importorskip("rlx_blocks_llama")

from tiny_models import LLAMA, llama_tensors, word_tokenizer  # noqa: E402

BACKENDS = [pytest.param(b.name, id=b.name, marks=() if ok else pytest.mark.skip(reason=f"{b.name}: {why}"))
            for b, ok, why in available_backends()]
PROMPT = [5, 9, 14, 3, 22]
Q = "model.layers.0.self_attn.q_proj.weight"
PACKED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")


def spoiled_model(backend: str, spoil: str, activations: str = "f32"):
    """The tiny LLaMA with its attention projections packed in q4_1, every weight finite but
    for one spoil: "nan_scale" (the first block's f16 scale of layer 0's q_proj row 3 is NaN,
    the bytes 00 7e of the issue), "inf_weight" (one element of layer 1's MLP down_proj, f32,
    is inf) or "nan_norm" (one element of layer 0's input norm weight is NaN: a NaN in the
    x of packed matmuls, which with int8 activations are rounded to int8 blocks first)."""
    from rlx_core.pipeline import select_backend
    from rlx_core.profile import CompileProfile
    from rlx_core.runtime.model import CausalLM

    if activations == "int8" and not {"fake_quantize", "quantize"} & select_backend(backend).supported_ops():
        pytest.skip(f"backend {backend!r} does not round activations to int8 (no quantize op)")
    t = llama_tensors(LLAMA, np.random.default_rng(3))
    s = QuantScheme.parse("q4_1")
    if spoil == "inf_weight":
        t["model.layers.1.mlp.down_proj.weight"][4, 7] = np.inf
    elif spoil == "nan_norm":
        t["model.layers.0.input_layernorm.weight"][5] = np.nan
    for name in [n for n in t if n.endswith(PACKED)]:
        raw = s.quantize(t[name])
        if spoil == "nan_scale" and name == Q:
            raw[3, :2] = (0x00, 0x7E)
        t[name] = PackedTensor(raw, s, t[name].shape, name)
    prof = CompileProfile().evolve(precision={"activations": activations})
    return CausalLM.from_tensors(LLAMA, t, tokenizer=word_tokenizer(False), backend=backend, profile=prof)


@pytest.mark.parametrize("spoil, activations", [("nan_scale", "f32"), ("inf_weight", "f32"),
                                                ("nan_norm", "f32"), ("nan_scale", "int8"),
                                                ("nan_norm", "int8")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nonfinite_weight_gives_non_finite_logits(backend, spoil, activations):
    from rlx_core.runtime.scheduler import Scheduler

    m = spoiled_model(backend, spoil, activations)
    with pytest.raises(ModelError, match="non-finite logits"):
        m.logits([PROMPT])
    with pytest.raises(ModelError, match="non-finite logits"):
        m.generate(PROMPT, max_new_tokens=3)
    with pytest.raises(ModelError, match="non-finite logits"):
        m.generate(PROMPT, max_new_tokens=3, do_sample=True, seed=1)
    with Scheduler(m, max_batch=2) as sched:
        req = sched.submit(PROMPT, max_tokens=3)
        with pytest.raises(ModelError, match="non-finite logits"):
            req.result(timeout=120)


@pytest.mark.parametrize("activations", ["f32", "int8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_model_unspoiled_is_finite(backend, activations):
    """The check above fails for the spoil, not for the packing: without it every logit is finite."""
    m = spoiled_model(backend, "none", activations)
    assert np.isfinite(m.logits([PROMPT])).all()
    assert len(m.generate(PROMPT, max_new_tokens=3)) == len(PROMPT) + 3


@pytest.fixture(scope="module")
def nan_gguf(tmp_path_factory) -> str:
    """The tiny LLaMA written as a q4_1 GGUF (`rlx quantize`'s writer), then the issue's edit:
    the bytes 00 7e (an f16 NaN) over the scale of blk.0.attn_q's first block."""
    from tiny_models import tiny_llama_folder

    from rlx_core.weights.checkpoint import load_checkpoint
    from rlx_core.weights.gguf_io import read_gguf
    from rlx_core.weights.gguf_write import write_gguf

    folder = tmp_path_factory.mktemp("nan_gguf")
    path = str(folder / "tiny.q4_1.gguf")
    write_gguf(load_checkpoint(tiny_llama_folder(folder / "hf")), path, "q4_1", echo=lambda *a: None)
    gf = read_gguf(path)
    info = next(t for t in gf.tensors if t.name == "blk.0.attn_q.weight")
    with open(path, "r+b") as f:
        f.seek(gf.data_start + info.offset)
        f.write(b"\x00\x7e")
    return path


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_scale_in_a_gguf_gives_non_finite_logits(nan_gguf, backend):
    import rlx_core

    m = rlx_core.load(nan_gguf, backend=backend)
    with pytest.raises(ModelError, match="non-finite logits"):
        m.logits([PROMPT])
    with pytest.raises(ModelError, match="non-finite logits"):
        m.generate(PROMPT, max_new_tokens=2)
