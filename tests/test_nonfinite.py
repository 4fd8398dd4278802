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


def spoiled_model(backend: str, spoil: str):
    """The tiny LLaMA with layer 0's q_proj packed in q4_1, every weight finite but for one
    spoil: "nan_scale" (the first block's f16 scale of q_proj row 3 is NaN, the bytes 00 7e
    of the issue) or "inf_weight" (one element of layer 1's o_proj, f32, is inf)."""
    from rlx_core.runtime.model import CausalLM

    t = llama_tensors(LLAMA, np.random.default_rng(3))
    s = QuantScheme.parse("q4_1")
    raw = s.quantize(t[Q])
    if spoil == "nan_scale":
        raw[3, :2] = (0x00, 0x7E)
    else:
        t["model.layers.1.self_attn.o_proj.weight"][4, 7] = np.inf
    t[Q] = PackedTensor(raw, s, t[Q].shape, Q)
    return CausalLM.from_tensors(LLAMA, t, tokenizer=word_tokenizer(False), backend=backend)


@pytest.mark.parametrize("spoil", ["nan_scale", "inf_weight"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nonfinite_weight_gives_non_finite_logits(backend, spoil):
    from rlx_core.runtime.scheduler import Scheduler

    m = spoiled_model(backend, spoil)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_model_unspoiled_is_finite(backend):
    """The check above fails for the NaN, not for the packing: without it every logit is finite."""
    from rlx_core.runtime.model import CausalLM

    t = llama_tensors(LLAMA, np.random.default_rng(3))
    s = QuantScheme.parse("q4_1")
    t[Q] = PackedTensor(s.quantize(t[Q]), s, t[Q].shape, Q)
    m = CausalLM.from_tensors(LLAMA, t, tokenizer=word_tokenizer(False), backend=backend)
    assert np.isfinite(m.logits([PROMPT])).all()
