"""Structured outputs: a JSON schema, a regex, a Lark or GBNF grammar or a list of choices
turned into per-step token masks by llguidance (a Rust grammar engine; no hand-written parser).

`constraint_factory(tokenizer, json_schema=...)` compiles and checks the grammar once per
request (an invalid or unsatisfiable one is a GrammarError naming what is wrong); calling the
factory gives a fresh `GrammarConstraint` per sequence, which the sampler drives through the
Constraint protocol of rlx_core.runtime.constraint (allowed / accept / finished).

Overlapping the mask with the device's step: llguidance computes a mask without holding the
GIL, so a runtime can launch a decode step, compute `allowed()` (one row) or
`allowed_masks(constraints)` (a batch, rows in parallel on llguidance's own threads) from a
worker thread while the device runs, and apply the masks when the logits come back. A mask
depends only on the tokens accepted so far, never on the step's logits.
"""
from __future__ import annotations

import json
import os
import threading
import weakref

import numpy as np

from ..ir.errors import ModelError


class GrammarError(ModelError):
    """A grammar, regex or JSON schema that cannot constrain generation: it does not compile,
    uses what the engine does not implement, or no output can satisfy it."""


KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf", "choice")

# JSON's whitespace between tokens, at most 40 characters a gap: llguidance's default allows any
# amount, which lets a small model pad an answer with blank lines until max_tokens. (A schema's
# own "x-guidance" options still win.)
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,40}"}

_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()


def _llg():
    import llguidance        # (imported on first use: requests without a grammar never pay for it)
    return llguidance


def ll_tokenizer(tokenizer, vocab_size: int | None = None):
    """llguidance's view of `tokenizer` (an rlx Tokenizer): its token trie, built once per
    tokenizer and width (~0.5 s for a 49k vocabulary). `vocab_size` is the width of the model's
    logits when it exceeds the tokenizer's: the extra ids are never allowed."""
    width = max(int(vocab_size or 0), tokenizer.vocab_size)
    with _LL_LOCK:
        per_width = _LL_TOKENIZERS.setdefault(tokenizer, {})
        if width not in per_width:
            eos = list(tokenizer.eos_token_ids)
            if not eos:
                raise GrammarError(f"{tokenizer.name}: a grammar needs the tokenizer's end-of-sequence "
                                   "token and this tokenizer names none")
            try:
                per_width[width] = _llg().LLTokenizer(tokenizer.backend.to_str(), n_vocab=width,
                                                      eos_token=eos)
            except (ValueError, RuntimeError) as e:
                raise GrammarError(f"{tokenizer.name}: llguidance cannot read this tokenizer ({e})") from e
        return per_width[width]


def _grammar_text(kind: str, spec) -> str:
    """llguidance's grammar definition for one request kind (not yet checked)."""
    m = _llg().LLMatcher
    if kind == "json_object":
        return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise GrammarError(f"json_schema is not valid JSON ({e})") from None
        if not isinstance(spec, (dict, bool)):
            raise GrammarError(f"json_schema must be a JSON object (a schema), got {type(spec).__name__}")
        try:
            return m.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"json_schema cannot be read: {e}") from None
    if kind == "choice":
        return m.grammar_from_lark(choice_lark(spec))
    if not isinstance(spec, str):
        raise GrammarError(f"{kind} must be a string, got {type(spec).__name__}")
    if kind == "regex":
        return m.grammar_from_regex(spec)
    if kind == "lark":
        return m.grammar_from_lark(spec)
    if kind == "gbnf":
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            return m.grammar_from_lark(any_to_lark(spec))
        except Exception as e:      # (the converter raises its own and plain errors)
            raise GrammarError(f"gbnf grammar does not parse: {e}") from None
    raise GrammarError(f"unknown grammar kind {kind!r}")


def choice_lark(choices) -> str:
    """A Lark grammar whose outputs are exactly the given strings."""
    if (isinstance(choices, str) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise GrammarError("choice must be a non-empty list of non-empty strings")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


class ConstraintFactory:
    """One request's compiled grammar: calling it gives a fresh constraint for one sequence."""

    def __init__(self, tokenizer, kind: str, grammar: str, vocab_size: int | None = None):
        llg = _llg()
        self.kind = kind
        self.tokenizer = ll_tokenizer(tokenizer, vocab_size)
        self.vocab_size = self.tokenizer.vocab_size
        self.eos_ids = tuple(self.tokenizer.eos_tokens)
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise GrammarError(f"{kind}: {_first_lines(messages[0])}")
        self._start = llg.LLMatcher(self.tokenizer, grammar, log_level=0)   # (compiled once)
        if self._start.is_error():
            raise GrammarError(f"{kind}: {_first_lines(self._start.get_error())}")
        self.warnings = messages

    def __call__(self) -> GrammarConstraint:
        return GrammarConstraint(self._start.deep_copy(), self)

    def __repr__(self) -> str:
        return f"ConstraintFactory({self.kind}, vocab={self.vocab_size})"


def _first_lines(message: str, n: int = 6) -> str:
    return "\n".join(message.strip().splitlines()[:n])


class GrammarConstraint:
    """One sequence's place in the grammar (an llguidance matcher)."""

    def __init__(self, matcher, factory: ConstraintFactory):
        self.matcher, self.factory = matcher, factory

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next; EOS among them once the output so
        far is complete (it may still go on: a number, a regex's repetition)."""
        self._check()
        bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        return np.unpackbits(bits, count=self.factory.vocab_size, bitorder="little").view(bool)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"{self.factory.kind}: token {int(token)} is not allowed here "
                               f"({_first_lines(self.matcher.get_error())})")

    def finished(self) -> bool:
        """The grammar is complete and nothing may follow but EOS."""
        self._check()
        return self.matcher.is_stopped()

    def accepting(self) -> bool:
        """The output so far is complete (EOS may end it), though it may also go on."""
        return self.matcher.is_accepting()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"{self.factory.kind}: the grammar engine stopped: "
                               f"{_first_lines(self.matcher.get_error())}")


def allowed_masks(constraints: list[GrammarConstraint]) -> np.ndarray:
    """bool [len(constraints), vocab]: every row's `allowed()` computed in parallel on
    llguidance's threads, without the GIL (rows of one tokenizer width)."""
    if not constraints:
        return np.zeros((0, 0), bool)
    width = constraints[0].factory.vocab_size
    if any(c.factory.vocab_size != width for c in constraints):
        raise GrammarError("allowed_masks: the constraints are for vocabularies of different sizes")
    for c in constraints:
        c._check()
    words = (width + 31) // 32
    bitmask = np.zeros((len(constraints), words), np.int32)
    _executor().unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(constraints)],
                                        bitmask.ctypes.data, words * 4, len(constraints))
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=width, bitorder="little")
    return bits.view(bool)


_EXECUTOR = None


def _executor():
    """llguidance's thread pool for batches: RLX_NUM_THREADS threads (as the CPU backend uses),
    else its own default (most cores)."""
    global _EXECUTOR
    with _LL_LOCK:
        if _EXECUTOR is None:
            raw = os.environ.get("RLX_NUM_THREADS", "")
            _EXECUTOR = _llg().LLExecutor(int(raw) if raw.isdigit() and int(raw) > 0 else None)
        return _EXECUTOR


def constraint_factory(tokenizer, *, json_schema=None, json_object: bool = False, regex: str | None = None,
                       lark: str | None = None, gbnf: str | None = None, choice=None,
                       vocab_size: int | None = None) -> ConstraintFactory:
    """The compiled constraint of exactly one kind of grammar for `tokenizer` (an rlx Tokenizer).
    `vocab_size`: the width of the model's logits, when wider than the tokenizer (the masks
    are that wide, the extra ids never allowed)."""
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("lark", lark),
                               ("gbnf", gbnf), ("choice", choice)) if v is not None}
    if json_object:
        given["json_object"] = True
    if len(given) != 1:
        raise GrammarError(f"give exactly one of {', '.join(KINDS)}; got "
                           f"{', '.join(given) or 'none'}")
    (kind, spec), = given.items()
    if tokenizer is None:
        raise GrammarError(f"{kind}: a grammar needs the model's tokenizer and this model has none")
    return ConstraintFactory(tokenizer, kind, _grammar_text(kind, spec), vocab_size)


__all__ = ["GrammarError", "ConstraintFactory", "GrammarConstraint", "constraint_factory",
           "allowed_masks", "ll_tokenizer", "choice_lark", "KINDS"]
