"""Tokenizer: thin glue over `tokenizers.Tokenizer`, built the way transformers builds it.

Sources: an HF folder (`tokenizer.json`, or a BERT `vocab.txt`), or a GGUF file's metadata. The GGUF
builders mirror `transformers/integrations/gguf/gguf_tokenizer_mapping.py` so that ids match
`AutoTokenizer.from_pretrained(dir, gguf_file=...)`. A GGUF backend is built on first use, since
rebuilding a sentencepiece vocabulary's merges costs seconds that weight-only callers should not pay.
"""

from __future__ import annotations

import datetime
import functools
import gc
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from rlx_core import cache
from rlx_core.ir.errors import ModelError, WeightError

from .config import check_config

if TYPE_CHECKING:
    import tokenizers        # imported where a tokenizer is first built (it is slow to import)

_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokens llama.cpp also treats as end-of-generation (llama-vocab.cpp), so generation stops on them
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>")


class Tokenizer:
    """Text <-> ids plus the special-token facts a generation loop needs."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer | Callable[[], tokenizers.Tokenizer],
        *,
        name: str,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        pad_token_id: int | None = None,
        chat_template: str | None = None,
    ):
        deferred = callable(backend) and not hasattr(backend, "encode")   # (no tokenizers import here)
        self._make = cast("Callable[[], tokenizers.Tokenizer]", backend if deferred else (lambda: backend))
        self._backend: tokenizers.Tokenizer | None = None
        self.name = name
        self.special_tokens = dict(special_tokens or {})  # bos_token/eos_token/... -> text, for templates
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.bos_token_id = bos_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers.Tokenizer`, built now if it was deferred."""
        if self._backend is None:
            tk = self._make()
            # tokenizer.json may carry padding/truncation settings; transformers turns them off per call
            # unless asked, so ids here are the unpadded, untruncated ones
            tk.no_padding()
            tk.no_truncation()
            self._backend = tk
            self._make = lambda: tk      # (drops the builder: it may hold tokenizer.json's text)
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Through encode_batch: tokenizers releases the GIL there (not in encode), so a long
        prompt tokenized on a server's worker thread does not stall its event loop."""
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(self, texts: Iterable[str], add_special_tokens: bool = True) -> list[list[int]]:
        texts = [self._text(t) for t in texts]
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def _text(self, text) -> str:
        """`text` if tokenizers can take it: a str that is valid Unicode (no lone surrogates)."""
        if not isinstance(text, str):
            raise ModelError(f"{self.name}: text to encode is {type(text).__name__}, expected str")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ModelError(f"{self.name}: text to encode is not valid Unicode ({e.reason} at {e.start})") from None
        return text

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render `messages` with the model's jinja chat template, as transformers does (tokenize=False);
        `tools`: JSON-schema function definitions ({"type": "function", "function": {...}}), which
        the template shows the model (rlx_core.runtime.tools reads its calls back)."""
        if self.chat_template is None:
            raise ModelError(f"{self.name}: this model has no chat template")
        import jinja2

        template = _compile(self.chat_template)
        try:
            return template.render(
                messages=messages,
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:  # includes the template's own raise_exception(...)
            raise ModelError(f"{self.name}: chat template rejected the messages: {e}") from e

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name!r}, eos_token_ids={self.eos_token_ids}, bos_token_id={self.bos_token_id})"
        )


_TEMPLATES: dict[str, object] = {}


def _compile(template: str):
    """A jinja template in the same sandboxed environment transformers' apply_chat_template uses."""
    if template not in _TEMPLATES:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # jinja's own tojson escapes HTML characters; transformers' does not
            return json.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            _TEMPLATES[template] = env.from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ModelError(f"chat template does not compile: {e}") from e
    return _TEMPLATES[template]


def _set_post_processor(tk, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> None:
    """transformers' `update_post_processor`: a template that adds BOS and/or EOS around each sequence."""
    from tokenizers import processors

    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    special = ([(bos, tk.token_to_id(bos))] if add_bos else []) + (
        [(eos, tk.token_to_id(eos))] if add_eos else []
    )
    tk.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _add_named(tk, special_tokens: dict[str, str]) -> None:
    """Named special tokens are added as special (never split, skipped on decode), as transformers does."""
    from tokenizers import AddedToken

    tokens = [AddedToken(t, special=True, normalized=False) for t in special_tokens.values()]
    if tokens:
        tk.add_special_tokens(tokens)


# ---------------------------------------------------------------------------------------------- HF folders


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or UTF-8
        raise WeightError(f"{path}: cannot read JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise WeightError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value) -> str | None:
    """tokenizer_config stores a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def tokenizer_from_folder(folder: str, config: dict) -> Tokenizer | None:
    """The tokenizer of an HF model folder, or None if it has neither tokenizer.json nor vocab.txt."""
    from tokenizers import Tokenizer as TkTokenizer

    tok_cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
    special_map = _read_json(os.path.join(folder, "special_tokens_map.json"))
    special = {}
    for key in _NAMED:
        text = _token_text(tok_cfg.get(key)) or _token_text(special_map.get(key))
        if text is not None:
            special[key] = text

    tj = os.path.join(folder, "tokenizer.json")
    vocab_txt = os.path.join(folder, "vocab.txt")
    if os.path.isfile(tj):
        try:
            tk = TkTokenizer.from_file(tj)
        except Exception as e:  # tokenizers raises plain Exception on malformed files
            raise WeightError(f"{tj}: cannot load tokenizer ({e})") from e
        _check_vocab(tk, tj)
    elif os.path.isfile(vocab_txt):
        tk = _wordpiece(vocab_txt, tok_cfg, special)
    else:
        return None
    _add_named(tk, special)
    if "add_bos_token" in tok_cfg or "add_eos_token" in tok_cfg or tk.post_processor is None:
        _set_post_processor(
            tk,
            special.get("bos_token"),
            special.get("eos_token"),
            bool(tok_cfg.get("add_bos_token")),
            bool(tok_cfg.get("add_eos_token")),
        )

    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()

    def tid(key):
        return tk.token_to_id(special[key]) if key in special else None

    gen_path = os.path.join(folder, "generation_config.json")
    gen = check_config(_read_json(gen_path), gen_path)
    eos = _ids(gen.get("eos_token_id")) + _ids(config.get("eos_token_id"))
    if tid("eos_token") is not None:
        eos.append(tid("eos_token"))
    bos = tid("bos_token") if "bos_token" in special else config.get("bos_token_id")
    pad = tid("pad_token") if "pad_token" in special else config.get("pad_token_id")
    return Tokenizer(
        tk,
        name=folder,
        special_tokens=special,
        eos_token_ids=eos,
        bos_token_id=bos,
        pad_token_id=pad,
        chat_template=template,
    )


def _check_vocab(tk, path: str) -> None:
    """Refuse what tokenizers loads but fails on at the first encode: no vocabulary, or a
    WordPiece vocabulary without its unknown token."""
    from tokenizers.models import WordPiece

    vocab = tk.get_vocab(with_added_tokens=True)
    if not vocab:
        raise WeightError(f"{path}: the tokenizer's vocabulary is empty")
    if isinstance(tk.model, WordPiece) and tk.model.unk_token not in vocab:
        raise WeightError(
            f"{path}: the WordPiece vocabulary lacks its unknown token {tk.model.unk_token!r}"
        )


def _wordpiece(vocab_txt: str, tok_cfg: dict, special: dict[str, str]):
    """A BERT WordPiece tokenizer from vocab.txt, configured like transformers' BertTokenizer."""
    from tokenizers import Tokenizer as TkTokenizer
    from tokenizers import decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    for key, default in (
        ("unk_token", "[UNK]"),
        ("sep_token", "[SEP]"),
        ("cls_token", "[CLS]"),
        ("pad_token", "[PAD]"),
        ("mask_token", "[MASK]"),
    ):
        special.setdefault(key, default)
    try:
        vocab = WordPiece.read_file(vocab_txt)
    except Exception as e:
        raise WeightError(f"{vocab_txt}: cannot read WordPiece vocabulary ({e})") from e
    tk = TkTokenizer(WordPiece(vocab, unk_token=special["unk_token"]))
    _check_vocab(tk, vocab_txt)
    tk.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=tok_cfg.get("tokenize_chinese_chars", True),
        strip_accents=tok_cfg.get("strip_accents"),
        lowercase=tok_cfg.get("do_lower_case", True),
    )
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece(prefix="##")
    cls, sep = special["cls_token"], special["sep_token"]
    if cls not in vocab or sep not in vocab:
        raise WeightError(
            f"{vocab_txt}: vocabulary lacks the {cls!r} / {sep!r} tokens a WordPiece tokenizer needs"
        )
    tk.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0",
        pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    return tk


# ---------------------------------------------------------------------------------------------- GGUF


# `tokenizer.ggml.model` values: byte-level BPE, and sentencepiece (named after the llama.cpp format's
# first model, as every file spells it)
_BYTE_LEVEL_BPE, _SENTENCEPIECE = "gpt2", "llama"
HF_TOKENIZER_KEY = "tokenizer.huggingface.json"
RLX_TOKENIZER_KEY = "rlx.tokenizer"      # special tokens and ids beside it (rlx quantize writes both)


def _tokenizer_from_hf_json(path: str, metadata: dict) -> Tokenizer:
    """The tokenizer `rlx quantize` stored: the HF tokenizer.json text and its special tokens."""
    from tokenizers import Tokenizer as TkTokenizer

    text = metadata[HF_TOKENIZER_KEY]
    try:
        extra = json.loads(metadata.get(RLX_TOKENIZER_KEY, "{}"))
        special, eos = extra.get("special_tokens", {}), extra.get("eos_token_ids", [])
        bos, pad = extra.get("bos_token_id"), extra.get("pad_token_id")
        ok = (isinstance(text, str) and isinstance(special, dict) and isinstance(eos, list)
              and all(isinstance(k, str) and isinstance(v, str) for k, v in special.items())
              and all(_is_id(i) for i in eos) and all(i is None or _is_id(i) for i in (bos, pad)))
    except (TypeError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise WeightError(f"{path}: GGUF metadata {HF_TOKENIZER_KEY!r} / {RLX_TOKENIZER_KEY!r} is malformed "
                          "(expected the tokenizer.json text and a JSON object of special tokens and ids)")

    def build():
        try:
            return TkTokenizer.from_str(text)
        except Exception as e:  # tokenizers raises plain Exception on malformed input
            raise WeightError(f"{path}: cannot load {HF_TOKENIZER_KEY} ({e})") from e

    template = metadata.get("tokenizer.chat_template")
    return Tokenizer(build, name=path, special_tokens=special, eos_token_ids=eos, bos_token_id=bos,
                     pad_token_id=pad, chat_template=template if isinstance(template, str) else None)


def _is_id(i) -> bool:
    return isinstance(i, int) and not isinstance(i, bool) and i >= 0


def tokenizer_from_gguf(path: str, metadata: dict) -> Tokenizer | None:
    """The tokenizer a GGUF file's metadata describes, or None if it has none this module can build."""
    if HF_TOKENIZER_KEY in metadata:
        return _tokenizer_from_hf_json(path, metadata)
    from .gguf_arch import GGUFArchitecture, registered_gguf_architecture

    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind not in (_BYTE_LEVEL_BPE, _SENTENCEPIECE) or not tokens:
        return None
    arch = metadata.get("general.architecture")
    family = registered_gguf_architecture(arch) or GGUFArchitecture("", "", {})    # (no quirks)

    def tok(key):
        i = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    special = {
        k: tok(g)
        for k, g in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
    }
    special = {k: v for k, v in special.items() if v is not None}
    if kind == _SENTENCEPIECE:
        for k, v in family.sentencepiece_special_tokens().items():
            special.setdefault(k, v)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == _SENTENCEPIECE))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)

    eos = _ids(metadata.get("tokenizer.ggml.eos_token_id")) + _ids(
        metadata.get("tokenizer.ggml.eot_token_id")
    )
    eos += [i for i, ty in enumerate(types) if ty == 3 and tokens[i] in _EOG_TEXTS]

    def build():
        gc_on = gc.isenabled()        # (the cyclic GC would walk every string and merge pair
        gc.disable()                  # made here, again and again: 0.1 s of a 262k vocabulary's build)
        try:
            return _build()
        except Exception as e:  # tokenizers raises plain Exceptions on inconsistent vocabularies
            raise WeightError(f"{path}: cannot build the {kind!r} tokenizer from GGUF metadata ({e})") from e
        finally:
            if gc_on:
                gc.enable()

    def _build():
        if kind == _BYTE_LEVEL_BPE:
            tk = _byte_level(tokens, metadata.get("tokenizer.ggml.merges") or [])
        else:
            tk = family.sentencepiece_tokenizer(tokens) or _sentencepiece_bpe(
                tokens, metadata.get("tokenizer.ggml.merges"), metadata.get("tokenizer.ggml.scores")
            )
        _add_gguf_tokens(tk, tokens, types, byte_level=kind == _BYTE_LEVEL_BPE)
        _set_split(tk, metadata.get("tokenizer.ggml.pre"))
        _add_named(tk, special)
        _set_post_processor(tk, special.get("bos_token"), special.get("eos_token"), add_bos, add_eos)
        return tk

    return Tokenizer(
        build,
        name=path,
        special_tokens=special,
        eos_token_ids=eos,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which byte-level BPE vocabularies are spelled."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@functools.cache
def _outside_byte_alphabet():
    """`search(token)`: a match when the token has a character outside GPT-2's byte alphabet (one
    regex scan in C, 3x faster over a vocabulary than a set per token)."""
    return re.compile("[^" + re.escape("".join(sorted(_bytes_to_unicode().values()))) + "]").search


def _byte_level(tokens: list[str], merges: list[str]):
    """transformers' GPT2Tokenizer backend: byte-level BPE."""
    from tokenizers import Tokenizer as TkTokenizer
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import BPE

    spelling = _bytes_to_unicode()
    outside = _outside_byte_alphabet()
    vocab = {
        t if outside(t) is None else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ")) for m in merges]
    tk = TkTokenizer(
        BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return tk


def vocabulary_merges(tokens: list[str], scores: list[float] | None) -> list[tuple[str, str]]:
    """The BPE merges of a sentencepiece vocabulary (for a family's `sentencepiece_tokenizer`):
    `_generate_merges` of the vocabulary `tokens` (id order) with `scores` (None: file order
    ranks them), kept in the compile cache as i32 id pairs: a 262k-token vocabulary takes seconds
    to split; read back, the pairs are taken from an object array (~0.05 s for 515k)."""
    k = cache.key("merges", "\0".join(tokens),
                  "file order" if scores is None else np.asarray(scores, np.float64).tobytes())
    body = cache.read("merges", k)
    ids = None if body is None or len(body) % 8 else np.frombuffer(body, np.int32)
    if ids is not None and (not ids.size or (ids.min() >= 0 and ids.max() < len(tokens))):
        names = np.array(tokens, dtype=object)
        return list(zip(names[ids[0::2]].tolist(), names[ids[1::2]].tolist()))
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = range(0, -len(tokens), -1) if scores is None else scores
    merges = _generate_merges(vocab, dict(zip(tokens, ranks)))
    cache.write("merges", k, np.asarray([vocab[t] for pair in merges for t in pair], np.int32).tobytes())
    return merges


def _generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a sentencepiece vocabulary: every split of a token into two tokens, best score
    first (transformers' `generate_merges`, whose tie order is kept)."""
    merges = []
    for merge, score in scores.items():
        local = [
            (merge[:i], merge[i:], score)
            for i in range(1, len(merge))
            if merge[:i] in vocab and merge[i:] in vocab
        ]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


_cached_merges = vocabulary_merges      # (its name in the compile cache's tests)


def _sentencepiece_bpe(tokens: list[str], merges: list[str] | None, scores: list[float] | None):
    """transformers' default backend for a GGUF sentencepiece vocabulary: BPE with byte fallback
    and a metaspace pre-tokenizer (a family whose HF tokenizer differs supplies its own)."""
    from tokenizers import Tokenizer as TkTokenizer
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = dict(zip(tokens, range(len(tokens))))
    if merges:
        pairs = [tuple(m.split(" ")) for m in merges]
    else:
        pairs = vocabulary_merges(tokens, list(scores or [0.0] * len(tokens)))
    tk = TkTokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return tk


def _add_gguf_tokens(tk, tokens: list[str], types: list[int], byte_level: bool) -> None:
    """CONTROL tokens (type 3) become special added tokens, USER_DEFINED ones (type 4) plain added tokens
    (transformers' `add_gguf_special_tokens`; a byte-level 'control' token outside the byte alphabet
    is a llama.cpp mislabel and is skipped)."""
    from tokenizers import AddedToken

    outside = _outside_byte_alphabet()
    kinds = [(i, ty) for i, ty in enumerate(types) if ty == 3 or ty == 4]     # (few of 50k-260k)
    control = [
        AddedToken(tokens[i], normalized=False, special=True)
        for i, ty in kinds
        if ty == 3 and (not byte_level or outside(tokens[i]) is None)
    ]
    if control:
        tk.add_special_tokens(control)
    # (asked one by one: listing a vocabulary of 50k-260k ids costs 30-200 ms)
    user = [AddedToken(tokens[i], normalized=False, special=False) for i, ty in kinds
            if ty == 4 and tk.token_to_id(tokens[i]) is not None]
    if user:
        tk.add_tokens(user)


_SPLIT_DIGITS_1_3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_DIGITS_1 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the split regex its merges were learned with (a subset of transformers' table)
_SPLITS = {
    "llama3": _SPLIT_DIGITS_1_3,
    "llama-v3": _SPLIT_DIGITS_1_3,
    "llama-bpe": _SPLIT_DIGITS_1_3,
    "smaug-bpe": _SPLIT_DIGITS_1_3,
    "dbrx": _SPLIT_DIGITS_1_3,
    "qwen2": _SPLIT_DIGITS_1,
    "deepseek-r1-qwen": _SPLIT_DIGITS_1,
}


def _set_split(tk, pre: str | None) -> None:
    from tokenizers import Regex, pre_tokenizers

    if (split := _SPLITS.get(pre)) is not None:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
