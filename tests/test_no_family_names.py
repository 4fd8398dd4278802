"""The core names no model family (issue 42): no identifier or string in rlx_core/ names llama,
qwen, gemma, bert, nomic, flux, smollm, minilm or mistral. Comments and docstrings may, since they
only explain; names that are someone else's API may too (upstream's compile-profile presets, the
llama.cpp project and its llama-cpp-python binding, the few format words listed in FOREIGN_NAMES).
A family's knowledge lives in its plugin, reached through the hooks."""
from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

import pytest

from rlx_core.ir.errors import ModelError
from rlx_core.plugins import hookimpl, temporary_plugin
from rlx_core.profile import PRESET_TABLE
from rlx_core.runtime.encoder import embed_command, encoder_model_types
from tiny_models import tiny_llama_folder

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / "rlx_core"
FAMILIES = ("llama", "qwen", "gemma", "bert", "nomic", "flux", "smollm", "minilm", "mistral")
FAMILY = re.compile("|".join(FAMILIES), re.IGNORECASE)

# Names that are not ours to rename, removed from a string or identifier before it is checked.
PROJECT_NAMES = r"llama[._-]cpp(?:[._-]python)?"          # the llama.cpp project, its Python binding
PRESET_NAMES = "|".join(sorted(PRESET_TABLE, key=len, reverse=True))   # CompileProfile.llama32_prefill ...
FOREIGN = re.compile(rf"\b(?:{PROJECT_NAMES}|{PRESET_NAMES})\b", re.IGNORECASE)
# Format vocabulary another project defined, allowed in the one file that speaks that format.
FOREIGN_NAMES = {
    "rlx_core/flow/rope.py": r"\bllama3\b",                          # HF rope_scaling's rope_type
    "rlx_core/runtime/encoder.py": r"\bsentence_bert_config\.json\b",  # sentence-transformers' file
    "rlx_core/weights/gguf_write.py": r"^LlamaFileType$",            # gguf-py's enum of general.file_type
    "rlx_core/weights/tokenizer.py":
        r"^Bert(?:Normalizer|PreTokenizer)$"          # the tokenizers library's WordPiece classes
        r'|^"(?:llama|llama3|llama-v3|llama-bpe|qwen2|deepseek-r1-qwen)"$',  # tokenizer.ggml.model / .pre
}

# identifiers and strings (Python 3.12+ splits an f-string: its literal parts are FSTRING_MIDDLE)
CHECKED = {tokenize.NAME, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}


def docstring_spans(tree: ast.AST) -> list:
    """(start, end) of every string that stands alone as a statement: docstrings, and the odd
    string used as a block comment."""
    return [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str)]


def family_names(source: str, rel: str = "") -> list:
    """(line, token) for each identifier or non-docstring string of `source` that names a family."""
    spans = docstring_spans(ast.parse(source))
    allowed = re.compile(FOREIGN_NAMES[rel], re.IGNORECASE) if rel in FOREIGN_NAMES else None
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in CHECKED:
            continue                                    # comments, operators, numbers
        if tok.type == tokenize.STRING and any(a <= tok.start and tok.end <= b for a, b in spans):
            continue
        text = FOREIGN.sub("", tok.string)
        if allowed is not None:
            text = allowed.sub("", text)
        if FAMILY.search(text):
            found.append((tok.start[0], tok.string))
    return found


def core_files() -> list:
    return sorted(p for p in CORE.rglob("*.py") if "tests" not in p.relative_to(CORE).parts)


def rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_core_names_no_family():
    hits = [f"{rel(p)}:{line}: {name}" for p in core_files()
            for line, name in family_names(p.read_text(encoding="utf-8"), rel(p))]
    assert not hits, ("rlx_core names a model family; move it into the family's plugin "
                      "(or rename it for what it does):\n" + "\n".join(hits))


def test_the_scan_sees_names_in_code_and_strings_only():
    source = '''"""Llama docstring."""
import os  # a qwen comment
gemma_window = 4
x = os.path.join("bert", "ok")
def f():
    """A FLUX docstring."""
    "a mistral block comment"
    return f"{x}-smollm2", "llama.cpp", "llama-cpp-python", "llama32_prefill", "qwen3_decode"
class MiniLMThing:
    pass
'''
    found = family_names(source)
    assert [line for line, _ in found] == [3, 4, 8, 9], found
    assert [name for _, name in found][:2] == ["gemma_window", '"bert"'] and found[3][1] == "MiniLMThing"
    assert "smollm2" in found[2][1]


def test_foreign_names_are_allowed_only_in_their_file():
    source = 'KIND = "llama3"\n'
    assert family_names(source, "rlx_core/flow/rope.py") == []
    assert family_names(source, "rlx_core/flow/blocks.py") == [(1, '"llama3"')]


# --------------------------------------------------------------------------- messages from the registry
class _ToyEncoderRecipe:
    model_types = ["toy_encoder"]

    def build(self, ckpt, **kw):
        raise AssertionError("never built here")

    def embedding_dim(self, config):
        return 4


class _ToyEncoderPlugin:
    @hookimpl
    def rlx_register_recipes(self, register):
        register(_ToyEncoderRecipe())


def test_encoder_model_types_come_from_the_registered_recipes():
    before = encoder_model_types()
    assert "toy_encoder" not in before and before == sorted(before)
    with temporary_plugin(_ToyEncoderPlugin(), "test-toy-encoder"):
        assert encoder_model_types() == sorted(before + ["toy_encoder"])
    assert encoder_model_types() == before


def test_embed_on_a_decoder_lists_the_encoder_types(tmp_path):
    folder = tiny_llama_folder(tmp_path / "tiny")
    with temporary_plugin(_ToyEncoderPlugin(), "test-toy-encoder"):
        with pytest.raises(ModelError, match=r"a llama model is not a text encoder; .*encoder recipe: "
                                             r"(.*, )?toy_encoder\b"):
            embed_command(folder, ["w1 w2"], echo=lambda line: None)
