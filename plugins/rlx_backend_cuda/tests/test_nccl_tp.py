"""Tensor parallelism over NCCL (issue 19): a sharded tiny model with its collectives on NCCL
across 2 GPUs equals the unsharded model, on the numpy backend (collectives staged through
the GPUs) and on the cuda backend (the runner's collectives on its stream, in its CUDA
graphs). Skipped with fewer than 2 GPUs."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="cupy (cupy-cuda12x) is not installed")
try:
    from cupy.cuda import nccl  # noqa: F401
    GPUS = cupy.cuda.runtime.getDeviceCount()
except Exception as e:  # noqa: BLE001 - no NCCL or no driver: skip with the reason
    pytest.skip(f"NCCL or CUDA unavailable: {e}", allow_module_level=True)
if GPUS < 2:
    pytest.skip(f"tensor parallelism over NCCL needs 2 GPUs, found {GPUS}", allow_module_level=True)

from rlx_core.runtime.model import CausalLM, find_recipe  # noqa: E402
from rlx_core.runtime.tp import TensorParallel  # noqa: E402

PROMPT = [5, 7, 9, 11, 13, 3]


@pytest.mark.parametrize("backend,tol", [("numpy", 1e-5), ("cuda", 1e-4)])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text"])
def test_nccl_sharded_equals_unsharded(tmp_path, model_type, backend, tol):
    r = find_recipe(model_type)
    cfg = r.tiny_config()
    tensors = r.tiny_tensors(cfg, np.random.default_rng(0))
    np.savez(tmp_path / "w.npz", **tensors)
    ref = CausalLM.from_tensors(cfg, tensors, backend=backend)
    spec = {"config": cfg, "tensors": str(tmp_path / "w.npz"), "backend": backend,
            "comm": "rlx_backend_cuda.nccl:NcclCommunicator"}
    ids = np.array([PROMPT])
    with TensorParallel(spec, 2, timeout=120) as tp:
        want = ref.logits(ids)
        np.testing.assert_allclose(tp.logits(ids), want, rtol=tol, atol=tol * np.abs(want).max())
        assert tp.generate(PROMPT, max_new_tokens=12) == ref.generate(PROMPT, max_new_tokens=12)
