"""GGUF architectures of the MoE families (placeholder until written)."""
from rlx_core.plugins import hookimpl


@hookimpl
def rlx_register_gguf_architectures(register):
    pass
