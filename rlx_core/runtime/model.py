"""Runtime models: load a checkpoint through the registered recipes, run logits, generate
text with prefill + KV-cache decode (one compiled decode graph per context length bucket)."""
from __future__ import annotations

import os
import time
import warnings

import numpy as np

from ..ir.dtype import F32
from ..ir.errors import ModelError
from ..pipeline import StateStore, select_backend
from ..plugins.manager import registry
from ..profile import CompileProfile
from .sampling import choose, process_logits

# Which package adds which architecture, for the "unknown architecture" error.
KNOWN_PLUGINS = {"llama": "rlx-blocks-llama", "qwen3": "rlx-blocks-llama", "mistral": "rlx-blocks-llama",
                 "bert": "rlx-blocks-bert", "nomic_bert": "rlx-blocks-bert",
                 "gemma2": "rlx-blocks-gemma", "gemma3": "rlx-blocks-gemma",
                 "gemma3_text": "rlx-blocks-gemma", "flux": "rlx-blocks-flux"}
CTX_BUCKET = 128


def resolve_profile(profile, default: str, near: str | None = None) -> CompileProfile:
    return CompileProfile.resolve(profile, default, near)


def find_recipe(model_type: str, source: str = ""):
    recipes = registry().recipes
    if model_type not in recipes:
        hint = KNOWN_PLUGINS.get(model_type)
        add = f"; install {hint} to add it (pip install ./plugins/{hint.replace('-', '_')})" if hint else ""
        raise ModelError(f"unknown architecture {model_type!r}{f' in {source}' if source else ''}; "
                         f"registered recipes: {sorted(recipes) or 'none'}{add}")
    return recipes[model_type]


def load(path_or_name: str, backend: str | None = None, profile=None, progress: bool = True, **kw):
    from ..weights import load_checkpoint, resolve_model_path

    path = resolve_model_path(str(path_or_name))
    ckpt = load_checkpoint(path, progress=progress)
    recipe = find_recipe(ckpt.architecture(), path)
    return recipe.build(ckpt, backend=backend, profile=profile, **kw)


def id_matrix(ids) -> np.ndarray:
    """Token ids as an int64 [batch, seq] array (a 1-D sequence is one row); a clear error
    for anything else."""
    arr = np.asarray(ids)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
        raise ModelError(f"token ids must be a 1-D or 2-D integer array, got shape {arr.shape} "
                         f"of {arr.dtype}")
    return arr.astype(np.int64)


def _pad_batch(rows: list, pad_id: int) -> tuple:
    """Left-pad token rows into ids [B,S] and an attention mask."""
    if not rows or any(len(r) == 0 for r in rows):
        raise ModelError("every prompt needs at least one token")
    s = max(len(r) for r in rows)
    ids = np.full((len(rows), s), pad_id, np.int64)
    mask = np.zeros((len(rows), s), bool)
    for b, r in enumerate(rows):
        ids[b, s - len(r):] = r
        mask[b, s - len(r):] = True
    return ids, mask


class CausalLM:
    """A decoder-only language model compiled from a recipe's flows."""

    def __init__(self, recipe, config: dict, tensors: dict, tokenizer=None, backend=None,
                 profile=None, max_context: int | None = None, source: str = ""):
        self.recipe, self.config, self.tensors, self.tokenizer = recipe, dict(config), tensors, tokenizer
        self.source = source or config.get("_name_or_path", "model")
        self.profile = resolve_profile(profile, recipe.default_profile, source or None)
        self.backend = select_backend(backend or self.profile.backend.name or None)
        self.max_positions = int(max_context or config.get("max_position_embeddings") or 2048)
        self.states = StateStore()
        self._shared: dict = {}
        self._exes: dict = {}
        self.last_timings: dict = {}

    @classmethod
    def from_tensors(cls, config: dict, tensors: dict, tokenizer=None, backend=None, profile=None,
                     max_context: int | None = None, recipe=None):
        recipe = recipe or find_recipe(config.get("model_type", ""))
        return cls(recipe, config, tensors, tokenizer, backend, profile, max_context)

    # -- compiled graphs
    def executable(self, mode: str, taps: bool = False):
        """mode: logits (every position), prefill (last position, writes the KV cache), decode."""
        key = (mode, taps)
        if key not in self._exes:
            flow = self.recipe.flow(self.config, mode, taps=taps)
            built = flow.build(self.tensors, self.config, F32,
                               ignore_unused=getattr(self.recipe, "ignore_unused", ()))
            exe = built.compile(self.backend, self.profile, self.states)
            exe.shared = self._shared
            exe.set_params(built.params)
            self._exes[key] = exe
        return self._exes[key]

    def _debug(self) -> bool:
        return os.environ.get("RLX_DEBUG") == "1" or self.profile.passes.verify_each

    def _check_finite(self, logits: np.ndarray, ids, mask) -> None:
        if np.isfinite(logits).all():
            return
        where = ""
        if self._debug():
            exe = self.executable("logits", taps=True)
            outs = exe.run(self._inputs(ids, mask))
            n = self.config.get("num_hidden_layers", 0)
            bad = [i for i in range(n) if not np.isfinite(outs[f"layer.{i}"]).all()]
            where = f"; first non-finite layer output: layer {bad[0]}" if bad else "; every layer output is finite (the head is not)"
        else:
            where = " (set RLX_DEBUG=1 to find the first layer that produced them)"
        raise ModelError(f"{self.source}: non-finite logits{where}")

    def _inputs(self, ids, mask):
        pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int64)
        return {"ids": ids, "positions": pos, "key_mask": mask[:, None, None, :]}

    def _check_ids(self, ids: np.ndarray) -> None:
        vocab = self.config.get("vocab_size")
        if ids.size and vocab and (ids.min() < 0 or ids.max() >= vocab):
            raise ModelError(f"token id out of range [0, {vocab}): min {ids.min()}, max {ids.max()}")
        if ids.shape[1] > self.max_positions:
            raise ModelError(f"prompt of {ids.shape[1]} tokens is longer than the context of "
                             f"{self.max_positions} positions")

    def logits(self, ids, attention_mask=None) -> np.ndarray:
        """Logits [batch, seq, vocab] for token ids (left-padded rows with attention_mask)."""
        ids = id_matrix(ids)
        self._check_ids(ids)
        mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask, bool)
        out = self.executable("logits").run(self._inputs(ids, mask))["logits"]
        self._check_finite(out, ids, mask)
        return out

    # -- generation
    def encode_prompt(self, text: str, chat: bool = False) -> list:
        if self.tokenizer is None:
            raise ModelError(f"{self.source} has no tokenizer; pass token ids instead of text")
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(text)

    @property
    def eos_ids(self) -> tuple:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return tuple(self.tokenizer.eos_token_ids)
        eos = self.config.get("eos_token_id")
        return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())

    def generate(self, prompt, max_new_tokens: int = 32, min_new_tokens: int = 0, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = 50, top_p: float | None = 1.0,
                 seed: int | None = None, stream=None, chat: bool = False, attention_mask=None):
        """HF generate's meanings. Text in -> the new text out; ids in -> the prompt followed by
        the new tokens (2-D: padded like HF, rows that ended filled with the pad id).
        `stream(token_ids_of_each_row)` is called after every step."""
        text_in = isinstance(prompt, str)
        if text_in:
            rows = [self.encode_prompt(prompt, chat)]
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (list, tuple, np.ndarray)):
            rows = [list(map(int, r)) for r in prompt]
        else:
            arr = id_matrix(prompt)
            if attention_mask is not None:
                m = np.asarray(attention_mask, bool)
                rows = [list(arr[b][m[b]]) for b in range(arr.shape[0])]
            else:
                rows = [list(r) for r in arr]
        if temperature is not None and temperature <= 0 and do_sample:
            raise ModelError(f"temperature must be > 0 when sampling, got {temperature}")
        eos = self.eos_ids
        eos_arr = np.array(eos or (), np.int64)
        pad = self.config.get("pad_token_id")
        pad = pad if pad is not None else (eos[0] if eos else 0)
        ids, mask = _pad_batch(rows, pad)
        self._check_ids(ids)
        b, s = ids.shape
        room = self.max_positions - s
        if max_new_tokens > room:
            warnings.warn(f"max_new_tokens={max_new_tokens} passes the context of {self.max_positions}; "
                          f"generating {room}", stacklevel=2)
            max_new_tokens = room
        ctx = min(-(-(s + max_new_tokens) // CTX_BUCKET) * CTX_BUCKET, self.max_positions)
        prefill, decode = self.executable("prefill"), self.executable("decode")
        prefill.fixed_dims = decode.fixed_dims = {"ctx": ctx}
        rng = np.random.default_rng(seed)
        inputs = self._inputs(ids, mask)
        t0 = time.perf_counter()
        logits = prefill.run(inputs, cache_pos=np.zeros(b, np.int32))["logits"][:, -1]
        t1 = time.perf_counter()
        full_mask = np.zeros((b, ctx), bool)
        full_mask[:, :s] = mask
        positions = inputs["positions"][:, -1:]
        cols: list = []                          # the new tokens, one column per step
        done = np.zeros(b, bool)
        for t in range(max_new_tokens):
            if not np.isfinite(logits).all():
                self._check_finite(logits, ids, mask)
            lg = process_logits(logits, n_new=t, min_new_tokens=min_new_tokens, eos_ids=eos,
                                inplace=True)       # (this step's logits are ours alone)
            nxt = choose(lg, rng, do_sample, temperature, top_k, top_p).astype(np.int64)
            nxt = np.where(done, pad, nxt)
            cols.append(nxt)
            if stream is not None:
                stream(nxt.tolist())
            done |= (nxt[:, None] == eos_arr).any(1)
            if done.all() or t == max_new_tokens - 1:
                break
            full_mask[:, s + t] = True
            positions = positions + 1
            logits = decode.run({"ids": nxt[:, None], "positions": positions,
                                 "key_mask": full_mask[:, None, None, :],
                                 "cache_pos": np.full(b, s + t, np.int32)})["logits"][:, -1]
        t2 = time.perf_counter()
        new = np.stack(cols, 1) if cols else np.zeros((b, 0), np.int64)
        steps = max(new.shape[1] - 1, 1)
        self.last_timings = {"prefill_s": t1 - t0, "decode_s_per_token": (t2 - t1) / steps,
                             "new_tokens": int(new.shape[1]), "prompt_tokens": int(s)}
        if text_in:
            toks = [int(x) for x in new[0] if not (done[0] and x in eos)]
            return self.tokenizer.decode(toks)
        if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], (list, tuple, np.ndarray)):
            return list(rows[0]) + [int(x) for x in new[0]]
        return np.concatenate([ids, new], axis=1)


__all__ = ["CausalLM", "load", "find_recipe", "resolve_profile", "KNOWN_PLUGINS"]
