"""Runtime: models built from recipes, generation, sampling."""
from .model import CausalLM, find_recipe, load, resolve_profile

__all__ = ["CausalLM", "find_recipe", "load", "resolve_profile"]
