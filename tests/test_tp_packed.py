"""Tensor parallelism of packed (GGUF-quantized) weights (issue 19): a rank binds only its
slice of each packed weight (whole rows, or the bytes of whole blocks of every row), a
row-parallel matmul whose K slice is not whole blocks runs replicated and says so, and
rank processes give the unsharded packed model's logits and greedy tokens. The model is
tiny_models.PACKED_LLAMA: q4_0, q4_1, q8_0, q4_k and q6_k weights, column-, row- and
vocab-parallel."""
from __future__ import annotations

from contextlib import nullcontext

import attrs
import numpy as np
import pytest

from rlx_core.ir.errors import ModelError
from rlx_core.ir.quant import PackedTensor
from rlx_core.passes.shard import bind_slices
from rlx_core.pipeline import CompilePipeline
from rlx_core.runtime.model import find_recipe
from rlx_core.runtime.tp import TensorParallel
from rlx_core.testing.parity import assert_greedy_agrees
from rlx_core.weights.checkpoint import Checkpoint
from tiny_models import PACKED_LLAMA, packed_llama_tensors

FALLBACK = "model.layers.2.self_attn.o_proj.weight"    # q6_k, K 256: not whole blocks per rank


def _model(seed: int):
    cfg = dict(PACKED_LLAMA, _seed=seed)
    tensors = packed_llama_tensors(cfg)
    return cfg, tensors, find_recipe("llama").build(Checkpoint("packed", "npz", cfg, tensors, None),
                                                    backend="numpy")


@pytest.fixture
def packed(rng):
    return _model(int(rng.integers(2 ** 31)))


def _rank(model, world: int, rank: int):
    """(the rank's decode MIR, its shard-pass log, its unfused sharded MIR)."""
    pipe = CompilePipeline(model.profile.evolve(parallel={"tensor": world}), model.backend)
    pipe.rank, pipe.graphs = rank, []
    mir = pipe.optimize(model.built("decode").graph)
    return mir, pipe.shard_log, dict(pipe.graphs)["shard"]


@pytest.mark.parametrize("world", [2, 4])
def test_rank_binds_only_its_slice_of_each_packed_weight(packed, world):
    cfg, tensors, m = packed
    whole = {k: v.nbytes for k, v in tensors.items() if isinstance(v, PackedTensor)}

    def parts(k):            # 2 kv heads: at tp 4 each rank holds one (of two), the fallback whole
        return 1 if k == FALLBACK else min(world, cfg["num_key_value_heads"]) \
            if k.endswith(("k_proj.weight", "v_proj.weight")) else world

    for rank in range(world):
        warns = pytest.warns(UserWarning, match="1 packed matmul.* run replicated")
        with warns if rank == 0 else nullcontext():          # (rank 0 says so)
            mir, log, g = _rank(m, world, rank)
        assert len(log) == 1 and f"'{FALLBACK}' runs replicated" in log[0] and "blocks of 256" in log[0]
        assert sum(n.op == "all_reduce" for n in g.nodes) == 2 * 3 + 1 - 1    # (the fallback's: none)
        bound = bind_slices([n for n in mir.nodes if n.op == "param"], tensors)
        sizes: dict = {}
        for n in mir.nodes:
            if n.op == "param" and n.a.get("scheme"):
                src = n.a["shard"][0] if n.a.get("shard") else n.name
                assert isinstance(bound[n.name], PackedTensor) and bound[n.name].raw.shape == n.outs[0].dims
                sizes[src] = sizes.get(src, 0) + bound[n.name].nbytes
        assert sorted(sizes) == sorted(whole)
        for k, size in sizes.items():          # its part, up to a zero row of padding
            assert whole[k] // parts(k) <= size <= whole[k] // parts(k) + tensors[k].raw.shape[1], k
        share = sum(whole[k] / parts(k) for k in whole)
        assert share <= sum(sizes.values()) <= share * 1.01 and share < sum(whole.values()) / world * 1.2


def test_row_parallel_slices_blocks_and_bind_checks_the_slice(packed):
    """A row-parallel slice is the bytes of whole blocks of each row: its logical K is the
    rank's K; the rank's slice decodes to the same columns of the whole weight."""
    _, tensors, m = packed
    mir, _, _ = _rank(m, 2, 1)
    name = "model.layers.1.mlp.down_proj.weight"                # q6_k, K 1024: 512 per rank
    node = next(n for n in mir.nodes if n.op == "param" and n.name == name)
    src, axis, start, length, padded = node.a["shard"]
    assert (src, axis) == (name, 1) and start == length == 2 * 210 and padded == length
    part = bind_slices([node], tensors)[name]
    assert part.shape == (256, 512) and part.scheme.name == "q6_k"
    np.testing.assert_array_equal(part.dequantize(), tensors[name].dequantize()[:, 512:])
    for bad in ((name, 3, 0, 1, 1), (name, 1, 7, 210, 210)):    # no such axis; not whole blocks
        node_bad = attrs.evolve(node, attrs=dict(node.attrs, shard=bad))
        with pytest.raises(ModelError, match=f"param '{name}': a tensor-parallel slice of a packed q6_k"):
            bind_slices([node_bad], {name: tensors[name]})


@pytest.mark.parametrize("world", [2, 4])
def test_packed_sharded_equals_unsharded(rng, world):
    seed = int(rng.integers(2 ** 31))
    cfg, _, ref = _model(seed)
    spec = {"config": cfg, "make_tensors": "tiny_models:packed_llama_tensors", "backend": "numpy"}
    ids = rng.integers(3, cfg["vocab_size"], (2, 6))
    prompt = ids[0].tolist()
    with TensorParallel(spec, world, timeout=60) as tp:
        got, want = tp.logits(ids), ref.logits(ids)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        out = tp.generate(prompt, max_new_tokens=8, min_new_tokens=8)
        assert_greedy_agrees(out, ref.generate(prompt, max_new_tokens=8, min_new_tokens=8), ref.logits,
                             4e-5 * np.abs(want).max(), "sharded against unsharded")
        assert len(out) == len(prompt) + 8
        held = [r["weights_bytes"] for r in tp.call("rlx_core.runtime.memory:memory_report")]
    whole = ref.memory_report()["weights_bytes"]       # (the same executables ran)
    assert all(whole / world <= b <= whole / world * 1.15 for b in held), (held, whole)
