"""The ModelFlow DSL: stages, context, generic blocks."""
from .blocks import AttnSpec, SelfAttention
from .ctx import BuiltModel, FlowCtx, FlowStage
from .flow import ModelFlow

__all__ = ["ModelFlow", "FlowCtx", "FlowStage", "BuiltModel", "AttnSpec", "SelfAttention"]
