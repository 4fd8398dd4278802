"""The pure parts of the GPU GGUF races (benchmarks/llm_gpu_gguf.py, moe_gpu_gguf.py): the F16
file the Llama race writes (llama.cpp's tensor names, the weights it was given, a file RLX
loads) and the table both print (no ratio where a side failed or did not run)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import common  # noqa: E402
import llm_gpu  # noqa: E402
import llm_gpu_gguf  # noqa: E402

TINY = dict(llm_gpu.LLAMA_1B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=300)
F16, F32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32


def test_the_f16_file_holds_the_weights_under_llama_cpp_names(tmp_path):
    import rlx_core

    path = str(tmp_path / "tiny.gguf")
    llm_gpu_gguf.write_f16(path, TINY)
    want = llm_gpu.make_weights(TINY)
    names = llm_gpu_gguf.gguf_names(TINY)
    got = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert set(got) == {names[k] for k in want}
    for hf, w in want.items():
        t = got[names[hf]]
        assert t.tensor_type == (F32 if w.ndim == 1 else F16)
        stored = np.float16 if w.ndim == 2 else np.float32
        a = np.asarray(t.data, np.float32).reshape(w.shape)
        np.testing.assert_array_equal(a, w.astype(np.float32).astype(stored))
    model = rlx_core.load(path, backend="numpy", progress=False)
    out = model.generate(np.array([[5, 6, 7]]), max_new_tokens=4, min_new_tokens=4)
    assert out.shape == (1, 7) and (out[0, 3:] < TINY["vocab_size"]).all()


def test_the_race_table_gives_a_ratio_only_where_both_sides_ran():
    rows = [("q4_k_m", {"decode_ms": 0.8, "prefill_ms": 3.9}, {"decode_ms": 1.2, "prefill_ms": 15.0}),
            ("q8_0", {"decode_ms": 0.9, "prefill_ms": 4.0}, None),
            ("f16", None, {"decode_ms": 1.3, "prefill_ms": 9.0})]
    lines = common.race_table(rows, True, "peer / RLX", lambda r, p: p["decode_ms"] / r["decode_ms"])
    assert lines[0].startswith("| file |") and "peer / RLX" in lines[0]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert cells[0] == ["q4_k_m", "0.800", "1.200", "1.50", "3.9", "15.0"]
    assert cells[1] == ["q8_0", "0.900", "failed", "no ratio: the peer failed", "4.0", "failed"]
    assert cells[2] == ["f16", "failed", "1.300", "no ratio: RLX failed", "failed", "9.0"]
    alone = common.race_table(rows[1:2], False, "peer / RLX", lambda r, p: 0.0)
    assert "not run" in alone[2] and "no ratio: peer not run" in alone[2]
