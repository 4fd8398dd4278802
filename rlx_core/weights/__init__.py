"""The weights room: loading checkpoints (HF safetensors folders, GGUF files) and tokenizers.

Pure loading code: names and values come out exactly as transformers would load them, so model
code can be written against HF parameter names and config keys.
"""

from .checkpoint import Checkpoint, load_checkpoint
from .packaged import resolve_model_path
from .tokenizer import Tokenizer

__all__ = ["Checkpoint", "Tokenizer", "load_checkpoint", "resolve_model_path"]
