"""BERT / NomicBERT for RLX: encoder blocks (fused-QKV padding-mask attention, GELU FFN,
rotary SwiGLU layers, pooling, L2 normalize) and the recipes BertFlow and NomicBertFlow,
registered through the rlx plugin hooks. `rlx_core.load("minilm").embed([...])` gives
sentence-transformers' all-MiniLM-L6-v2 embeddings."""
from __future__ import annotations

from rlx_core.plugins import hookimpl

from .blocks import (BLOCKS, BertEncoderLayer, BertFlowBuilder, BertSelfAttention, BertSpec, ClsPool, Embed,
                     GatherAdd, GeluFfn, L2Normalize, MaxPool, MeanPool, NomicEncoderLayer, NomicMlp,
                     NomicSpec, ir_activation, pool_stage)
from .recipes import (BertFlow, BertRecipe, NomicBertFlow, NomicBertRecipe, bert_config, encoder_tensors,
                      nomic_config)
from .commands import rlx_register_commands  # noqa: F401
from .packaged import rlx_register_packaged_models  # noqa: F401


@hookimpl
def rlx_register_recipes(register):
    register(BertRecipe())
    register(NomicBertRecipe())


@hookimpl
def rlx_register_blocks(register):
    for name, factory in BLOCKS.items():
        register(name, factory)


__all__ = ["BertFlow", "NomicBertFlow", "BertRecipe", "NomicBertRecipe", "BertFlowBuilder", "BertSpec",
           "NomicSpec", "BertEncoderLayer", "BertSelfAttention", "NomicEncoderLayer", "NomicMlp", "GeluFfn",
           "GatherAdd", "Embed", "MeanPool", "ClsPool", "MaxPool", "L2Normalize", "bert_config",
           "nomic_config", "encoder_tensors", "ir_activation", "pool_stage"]
