"""Runtime models: load a checkpoint through the registered recipes, run logits, generate
text with prefill + KV-cache decode (one compiled decode graph per context length bucket)."""
from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import numpy as np

from .. import progress
from ..ir.dtype import F32
from ..ir.errors import ModelError, WeightError
from ..pipeline import StateStore, select_backend
from ..plugins.manager import registry
from ..plugins.providers import provider_hint
from ..profile import CompileProfile, ProfileLike
from .args import bool_arg, callable_arg, id_matrix, mask_arg, text_arg, token_id, token_rows
from .sampling import Sampling, SamplingParams, ask, check_constraint, prompt_token_logprobs, token_logprobs
from .stop_text import StopText

if TYPE_CHECKING:
    from ..backends.base import Backend
    from ..flow.ctx import BuiltModel
    from ..flow.flow import ModelFlow
    from ..flow.recipe import DecoderFlow
    from ..pipeline import Executable
    from ..weights.checkpoint import Checkpoint
    from ..weights.tokenizer import Tokenizer

CTX_BUCKET = 128


_BACKEND_LOCKS: dict = {}          # id(backend) -> (backend, its lock)
_LOCKS_GUARD = threading.Lock()


def backend_lock(backend: Backend) -> threading.RLock:
    """The lock a model's calls hold while they run on `backend`. One per backend, not per
    model: backends share a device stream, queue or activation arena between the runners
    of every model (CUDA), and measured on the NumPy backend (16 cores, a 135M-parameter decoder,
    8 threads) runs side by side were 2.3x slower than in turn (BLAS threads oversubscribed)."""
    with _LOCKS_GUARD:
        return _BACKEND_LOCKS.setdefault(id(backend), (backend, threading.RLock()))[1]


def resolve_profile(profile: ProfileLike, default: str, near: str | None = None) -> CompileProfile:
    return CompileProfile.resolve(profile, default, near)


class Recipe(Protocol):
    """What a registered recipe (the `rlx_recipes` hook) gives `load`: the model types it builds
    and `build`, which returns the runnable model (a CausalLM, an Encoder, or a plugin's own)."""
    name: str
    model_types: tuple

    def build(self, ckpt: Checkpoint, backend: str | None = None, profile: ProfileLike = None,
              **kw: Any) -> Any: ...


def find_recipe(model_type: str, source: str = "") -> Recipe:
    recipes = registry().recipes
    if model_type not in recipes:
        hint = provider_hint(model_type)
        add = f"; {hint}" if hint else ""
        raise ModelError(f"unknown architecture {model_type!r}{f' in {source}' if source else ''}; "
                         f"registered recipes: {sorted(recipes) or 'none'}{add}")
    return recipes[model_type]


def load(path_or_name: str, backend: str | None = None, profile: ProfileLike = None, progress: bool = True,
         **kw: Any) -> Any:
    """The model a registered recipe builds from a checkpoint (see rlx_core.load)."""
    from ..weights import load_checkpoint, resolve_model_path
    from ..weights.config import check_layer_counts

    path = resolve_model_path(str(path_or_name))
    ckpt = load_checkpoint(path, progress=progress, packed=True)
    check_layer_counts(ckpt.config, ckpt.tensors, ckpt.path)     # a model needs its blocks' tensors
    recipe = find_recipe(ckpt.architecture(), path)
    if ckpt.packed_names():          # a quantized file: the profile says how to hold it
        profile = resolve_profile(profile, getattr(recipe, "default_profile", "default"), path)
        ckpt = ckpt.held_as(profile.precision.weights)
    model = recipe.build(ckpt, backend=backend, profile=profile, **kw)
    if isinstance(model, CausalLM):  # its graphs compile on first use: bars then too
        model.progress = progress
    return model


def _pad_batch(rows: list, pad_id: int) -> tuple:
    """Left-pad token rows (checked non-empty) into ids [B,S] and an attention mask."""
    s = max(len(r) for r in rows)
    ids = np.full((len(rows), s), pad_id, np.int64)
    mask = np.zeros((len(rows), s), bool)
    for b, r in enumerate(rows):
        ids[b, s - len(r):] = r
        mask[b, s - len(r):] = True
    return ids, mask


GREEDY_OUTPUTS = ("next_ids", "logits_sum")       # flow.blocks.GreedyNext


def updates_in_place(exe: Executable) -> bool:
    """Whether a decode graph has states without a context axis (a recurrent layer's conv
    and delta-rule states): a step reads and rewrites them whole, so it cannot run twice."""
    return any(n.op == "state" and "ctx" not in n.outs[0].dims for n in exe.mir.nodes)


def greedy_outputs(exe: Executable) -> bool:
    """Whether a generation graph also gives the greedy ids (every DecoderFlow recipe does)."""
    return set(GREEDY_OUTPUTS) <= {n for n, _ in exe.mir.outputs}


def fetch_greedy(exe, feed: dict, rows, banning, eos) -> np.ndarray | None:
    """Run one step fetching only the graph's arg-max ids [batch] and the finiteness check:
    the ids when the logits of `rows` are finite and no row of `banning` (rows that may not
    yet end) picked an EOS (banning only lowers EOS), else None: the caller runs the step
    again for the logits (it writes the same KV rows)."""
    return checked_greedy(exe.run(feed, fetch=GREEDY_OUTPUTS), rows, banning, eos)


def checked_greedy(out: dict, rows, banning, eos) -> np.ndarray | None:
    """fetch_greedy's ids and checks on a step's fetched greedy outputs `out`."""
    ids = out["next_ids"][:, -1]
    if not np.isfinite(out["logits_sum"][rows]).all() or np.isin(ids[banning], eos).any():
        return None
    return ids


@attrs.frozen
class Generation:
    """What `generate(..., return_dict=True)` gives: `ids` (the prompt and the new tokens, as
    generate returns them for ids in; text in too), `texts` (each row's new text for text in,
    else None), per row the `finish_reasons` ("stop": EOS, a stop string or a finished
    constraint; "length"), the `logprobs` (a TokenLogprob per new token, the ending EOS
    included, as in `ids`; None unless asked)
    and the `prompt_logprobs` (None for the first prompt token, then a TokenLogprob each;
    None unless asked). Rows are the prompts' in order, each repeated n times (its choices)
    when n > 1. Logprobs are of the raw logits (see rlx_core.runtime.sampling)."""
    ids: Any
    texts: list | None
    finish_reasons: list
    logprobs: list | None = None
    prompt_logprobs: list | None = None


class CausalLM:
    """A decoder-only language model compiled from a recipe's flows.

    `generate` and `logits` may be called from many threads at once: a call holds its
    backend's lock (`backend_lock`: the model's KV cache, executables and their arenas are
    one set, and the backend's stream is shared), so concurrent calls give the results of
    the same calls made one at a time."""

    def __init__(self, recipe: Any, config: dict, tensors: dict, tokenizer: Tokenizer | None = None,
                 backend: str | None = None, profile: ProfileLike = None, max_context: int | None = None,
                 source: str = ""):
        self.recipe, self.config, self.tensors, self.tokenizer = recipe, dict(config), tensors, tokenizer
        self.source = source or config.get("_name_or_path", "model")
        self.profile = resolve_profile(profile, recipe.default_profile, source or None)
        self.backend = select_backend(backend or self.profile.backend.name or None)
        self.max_positions = int(max_context or config.get("max_position_embeddings") or 2048)
        self.states = StateStore()
        self._shared: dict = {}
        self._exes: dict = {}
        self._lock = backend_lock(self.backend)
        self.last_timings: dict = {}
        self.progress = False        # bars while its graphs compile and specialize (rlx_core.progress)

    @classmethod
    def from_tensors(cls, config: dict, tensors: dict, tokenizer: Tokenizer | None = None,
                     backend: str | None = None, profile: ProfileLike = None, max_context: int | None = None,
                     recipe: Any = None) -> CausalLM:
        recipe = recipe or find_recipe(config.get("model_type", ""))
        return cls(recipe, config, tensors, tokenizer, backend, profile, max_context)

    # -- compiled graphs
    graph_modes = ("prefill", "decode", "extend", "logits")     # what `built` and `executable` take

    def built(self, mode: str = "prefill", taps: bool = False, rows: int = 0, piece: int = 0) -> BuiltModel:
        """The flow of `mode` built on this model's tensors (HIR graph, params, stage records),
        not yet compiled: what `executable` compiles and `rlx inspect` shows. Mode "mixed"
        (a decode step of `rows` rows with an extend piece of `piece` tokens in one run: see
        rlx_core.flow.recipe.DecoderFlow) takes both counts."""
        if mode == "mixed":
            flow = self._mixed_flow(rows, piece, taps)
        else:
            flow = self.recipe.flow(self.config, mode, taps=taps)
        try:
            return flow.build(self.tensors, self.config, F32,
                              ignore_unused=getattr(self.recipe, "ignore_unused", ()))
        except WeightError as e:        # the tensors disagree with the config: name the file
            raise WeightError(f"{self.source}: {e}") from None

    def executable(self, mode: str, taps: bool = False) -> Executable:
        """mode: logits (every position), prefill (last position, writes the KV cache), decode."""
        key = (mode, taps)
        with self._lock:
            if key not in self._exes:
                with progress.task(f"compiling {mode}", 2, self.progress):
                    progress.stage("build graph")
                    built = self.built(mode, taps)
                    progress.stage("optimize, bind params")
                    exe = built.compile(self.backend, self.profile, self.states, self._shared)
                exe.progress = self.progress
                self._exes[key] = exe
            return self._exes[key]

    def executable_over(self, mode: str, states: StateStore, rows: int = 0, piece: int = 0) -> Executable:
        """A new, uncached executable of `mode` over its own `states` (a StateStore: the
        batched KV cache of a Scheduler), sharing this model's resident params (`rows` and
        `piece`: a mixed graph's counts, see `built`)."""
        built = self.built(mode, rows=rows, piece=piece)
        return built.compile(self.backend, self.profile, states, self._shared)

    def _mixed_flow(self, rows: int, piece: int, taps: bool) -> ModelFlow:
        """The recipe's mixed flow: its counts go in the config (a recipe's `flow(cfg, mode)`
        keeps its own settings, e.g. a cache layout)."""
        from ..flow.recipe import MIXED_PIECE, MIXED_ROWS

        return self.recipe.flow({**self.config, MIXED_ROWS: rows, MIXED_PIECE: piece}, "mixed", taps=taps)

    def memory_report(self) -> dict:
        """Bytes held for this model: weights, KV cache, arenas, pool overhead (see
        rlx_core.runtime.memory)."""
        from .memory import memory_report

        with self._lock:
            return memory_report(self)

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

    @property
    def vocab_size(self) -> int | None:
        v = self.config.get("vocab_size")
        return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    def _check_length(self, seq: int) -> None:
        if seq > self.max_positions:
            raise ModelError(f"prompt of {seq} tokens is longer than the context of "
                             f"{self.max_positions} positions")

    def logits(self, ids: Any, attention_mask: Any = None) -> np.ndarray:
        """Logits [batch, seq, vocab] for token ids: equally long rows (left-padded, with
        attention_mask marking the real tokens), at least one row of at least one token (an
        empty batch is an error, not an empty result)."""
        ids = id_matrix(ids, self.vocab_size)
        self._check_length(ids.shape[1])
        mask = (np.ones(ids.shape, bool) if attention_mask is None
                else mask_arg("attention_mask", attention_mask, ids.shape))
        with self._lock:
            out = self.executable("logits").run(self._inputs(ids, mask))["logits"]
            self._check_finite(out, ids, mask)
        return out

    # -- generation
    def encode_prompt(self, text: str, chat: bool = False) -> list[int]:
        text = text_arg("prompt", text)
        if chat:
            return self.encode_chat([{"role": "user", "content": text}])
        return self._tokenizer().encode(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation ({"role", "content"} dicts) in the model's chat
        template, ending where the assistant's next answer starts."""
        tokenizer = self._tokenizer()
        return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ModelError(f"{self.source} has no tokenizer; pass token ids instead of text")
        return self.tokenizer

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return tuple(self.tokenizer.eos_token_ids)
        eos = self.config.get("eos_token_id")
        return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())

    def generate(self, prompt, max_new_tokens: int = 32, min_new_tokens: int = 0, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = 50, top_p: float | None = 1.0,
                 seed: int | None = None, stream=None, chat: bool = False, attention_mask=None,
                 return_dict: bool = False, **sampling: Any):
        """HF generate's meanings. Text in -> the new text out (a list of n texts when n > 1);
        ids in -> the prompt followed by the new tokens (2-D: padded like HF, rows that ended
        filled with the pad id; n > 1: each prompt row repeated n times). return_dict=True: a
        `Generation`. Further keywords are SamplingParams fields (min_p, typical_p,
        repetition_penalty, presence_penalty, frequency_penalty, logit_bias, stop, n,
        ignore_eos, logprobs, prompt_logprobs, constraint).
        `stream(token_ids_of_each_row)` is called after every step (holding the model's lock).
        Every argument is checked first: a bad one is a ModelError naming it."""
        params = SamplingParams.checked(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                                        do_sample=do_sample, temperature=temperature, top_k=top_k,
                                        top_p=top_p, seed=seed, **sampling)
        params.check_vocab(self.vocab_size)
        chat, return_dict = bool_arg("chat", chat), bool_arg("return_dict", return_dict)
        stream = callable_arg("stream", stream)
        text_in = isinstance(prompt, str)
        if text_in and attention_mask is not None:
            raise ModelError("attention_mask goes with token ids; a text prompt has none")
        if params.stop:
            self._tokenizer()                 # (stop strings are matched in the text)
        with self._lock:
            if text_in:
                rows, one_dim = token_rows("prompt (as tokenized)", self.encode_prompt(prompt, chat),
                                           self.vocab_size)
            elif attention_mask is not None:
                arr = id_matrix(prompt, self.vocab_size, "prompt")
                m = mask_arg("attention_mask", attention_mask, arr.shape)
                rows, one_dim = [arr[b][m[b]].tolist() for b in range(arr.shape[0])], False
            else:
                rows, one_dim = token_rows("prompt", prompt, self.vocab_size)
            self._check_length(max(map(len, rows)))
            self._check_choices(max(map(len, rows)), params)
            as_list = one_dim and not isinstance(prompt, np.ndarray) and params.n == 1
            out = self._generate(rows, as_list, text_in, params, stream)
            if return_dict:
                return out
            if out.texts is not None:
                return out.texts[0] if params.n == 1 else out.texts
            return out.ids

    def _check_choices(self, prompt_len: int, params: SamplingParams) -> None:
        """n choices of max_new_tokens each must fit the context beside the prompt."""
        if params.n > 1 and prompt_len + params.n * params.max_new_tokens > self.max_positions:
            raise ModelError(f"n ({params.n}) x max_new_tokens ({params.max_new_tokens}) with the prompt's "
                             f"{prompt_len} tokens is over the context of {self.max_positions} positions")

    def _generate(self, rows: list, as_list: bool, text_in: bool, sampling: SamplingParams,
                  stream) -> Generation:
        eos, pad = self._eos_and_pad()
        ids, mask = _pad_batch(rows, pad)
        room = self.max_positions - ids.shape[1]
        if sampling.max_new_tokens > room:
            warnings.warn(f"max_new_tokens={sampling.max_new_tokens} passes the context of "
                          f"{self.max_positions}; generating {room}", stacklevel=3)
            sampling = dataclasses.replace(sampling, max_new_tokens=room)
        run = _Decoding(self, ids, mask, sampling, eos, pad)
        new = run.tokens(stream)
        self.last_timings = run.timings
        prompt_lp = self._prompt_logprobs(rows, sampling) if sampling.prompt_logprobs is not None else None
        reasons = ["stop" if d else "length" for d in run.done]
        logprobs = run.logprobs
        texts = [run.text(b, new[b]) for b in range(len(new))] if text_in else None
        out: Any = (list(rows[0]) + [int(x) for x in new[0]] if as_list
                    else np.concatenate([run.ids_all, new], axis=1))
        return Generation(out, texts, reasons, logprobs, prompt_lp)

    def _prompt_logprobs(self, rows: list, sampling: SamplingParams) -> list:
        """Each prompt row's prompt logprobs (`prompt_token_logprobs`), repeated for its n choices."""
        k = sampling.prompt_logprobs
        exe = self.executable("logits")
        out = []
        for r in rows:
            ids = np.asarray([r], np.int64)
            lg = exe.run(self._inputs(ids, np.ones(ids.shape, bool)))["logits"][0]
            self._check_finite(lg, ids, np.ones(ids.shape, bool))
            out += [prompt_token_logprobs(lg, r, k)] * sampling.n
        return out

    def _eos_and_pad(self) -> tuple:
        """(the EOS ids, the pad id: the config's, else the first EOS, else 0), each checked
        against the vocabulary."""
        eos = tuple(token_id(f"{self.source}: eos_token_id", e, self.vocab_size) for e in self.eos_ids)
        pad = self.config.get("pad_token_id")
        pad = token_id(f"{self.source}: pad_token_id", pad, self.vocab_size) if pad is not None else (
            eos[0] if eos else 0)
        return eos, pad


class _Decoding:
    """One generate call's steps: the prefill, then a decode step per token, each giving the
    next token of every row (`_next_ids`), which `_accept` takes, streams and checks for EOS."""

    def __init__(self, model: CausalLM, ids: np.ndarray, mask: np.ndarray, sampling: SamplingParams,
                 eos: tuple, pad: int):
        self.model, self.sampling = model, sampling
        self.eos, self.pad = eos, pad
        self.eos_arr = np.array(eos or (), np.int64)
        b, self.prompt_len = ids.shape
        n = sampling.n                            # each prompt row's choices: rows b*n .. b*n+n-1
        self.ctx = min(-(-(self.prompt_len + sampling.max_new_tokens) // CTX_BUCKET) * CTX_BUCKET,
                       model.max_positions)
        self.prefill = model.executable("prefill")
        self.prefill.fixed_dims = {"ctx": self.ctx}
        self.decode: Executable | None = None     # compiled once the first token is out (never for one token)
        self.greedy = self.overlap = False      # (the decode steps': set with `decode`)
        self.in_place = False                   # decode updates states in place (`_greedy_at`)
        self.rng = np.random.default_rng(sampling.seed)
        self.inputs = model._inputs(ids, mask)   # the prefill's: each prompt row once
        self.ids, self.mask = np.repeat(ids, n, 0), np.repeat(mask, n, 0)
        self.ids_all = self.ids
        rows = len(self.ids)
        self.full_mask = np.zeros((rows, self.ctx), bool)
        self.full_mask[:, :self.prompt_len] = self.mask
        self.last_pos = np.repeat(self.inputs["positions"][:, -1:], n, 0)
        self.cols: list = []                     # the new tokens, one column per step
        self.done = np.zeros(rows, bool)
        self.prompts = [self.ids[r][self.mask[r]].tolist() for r in range(rows)]
        self.out: list = [[] for _ in range(rows)]             # each row's new tokens (before it ended)
        self.constraints = ([check_constraint(sampling.constraint()) for _ in range(rows)]
                            if sampling.constraint is not None else None)
        self.stops = ([StopText(model.tokenizer, sampling.stop) for _ in range(rows)]
                      if sampling.stop else None)
        self.forced = np.zeros(rows, bool)       # rows whose finished constraint forced EOS this step
        self.asked: list | None = None           # the constraints' answers for the running step (`_ask`)
        self.logprobs: list | None = [[] for _ in range(rows)] if sampling.logprobs is not None else None
        # On a backend whose runs overlap the host (a GPU), the greedy step giving token t + 1
        # is queued before token t is read, fed token t's ids on the device: the device never
        # waits for the host. It is dropped where token t ends the rows or is not the greedy id.
        self.ahead: tuple | None = None           # (feed, wait) of the next step, queued early
        self.timings: dict = {}

    def tokens(self, stream) -> np.ndarray:
        """The new tokens [batch, n]: until every row has ended, or max_new_tokens."""
        n = self.sampling.max_new_tokens
        t0 = t1 = self.t_decode = time.perf_counter()
        if n:
            first = dict(self.inputs, cache_pos=np.zeros(len(self.inputs["ids"]), np.int32))
            greedy = greedy_outputs(self.prefill) and self.sampling.argmax
            logits, nxt = self._step(self.prefill, first, 0, greedy)
            if self.sampling.n > 1:
                logits, nxt = self._share_prefill(logits, nxt)
            t1 = self.t_decode = time.perf_counter()
        for t in range(n):
            if t:
                logits, nxt = self._decode_step(t, nxt)
            if nxt is None:
                nxt = self._chosen(logits, t)
            if self._accept(nxt, stream) or t == n - 1:
                break
        if self.ahead is not None:
            self.ahead[1]()             # (a step queued past the end: let it finish)
        t2 = time.perf_counter()
        new = np.stack(self.cols, 1) if self.cols else np.zeros((len(self.ids), 0), np.int64)
        steps = max(new.shape[1] - 1, 1)
        self.timings = {"prefill_s": t1 - t0, "decode_s_per_token": (t2 - self.t_decode) / steps,
                        "new_tokens": int(new.shape[1]), "prompt_tokens": int(self.prompt_len)}
        return new

    def _share_prefill(self, logits, nxt) -> tuple:
        """The prefill's (logits, ids) and KV rows (the model's states) of each prompt row
        repeated for its n choices: the prompt is prefilled once."""
        n = self.sampling.n
        backend, states = self.model.backend, self.model.states
        for node in self.prefill.mir.nodes:
            if node.op != "state":
                continue
            old = states[node.name]
            shape = tuple(old.shape)
            new = backend.zeros((shape[0] * n,) + shape[1:], node.outs[0].dtype)
            rest = (slice(None),) * (len(shape) - 1)
            for b in range(shape[0]):
                for j in range(n):
                    new = backend.copy_into(new, (slice(b * n + j, b * n + j + 1),) + rest,
                                            old, (slice(b, b + 1),) + rest)
            states[node.name] = new
        return tuple(None if a is None else np.repeat(a, n, 0) for a in (logits, nxt))

    def text(self, row: int, new: np.ndarray) -> str:
        """Row `row`'s new text: up to its EOS, or before its stop string."""
        if self.stops is not None and self.stops[row].stopped:
            return self.stops[row].text
        toks = [int(x) for x in new if not (self.done[row] and x in self.eos)]
        return self.model._tokenizer().decode(toks)

    def _greedy_of(self, out: dict, t: int):
        """The greedy ids [b] in a step's fetched outputs, or None (fetch_greedy's checks)."""
        banning: slice | list = slice(None) if self.sampling.bans_eos(t) else []
        return checked_greedy(out, slice(None), banning, self.eos_arr)

    def _step(self, exe, feed: dict, t: int, greedy: bool) -> tuple:
        """(None, the greedy ids [b]) where the greedy outputs give them (greedy: exe has
        them and nothing is sampled), else (this step's logits [b, vocab], None)."""
        if greedy:
            nxt = self._greedy_of(exe.run(feed, fetch=GREEDY_OUTPUTS), t)
            if nxt is not None:
                return None, nxt
        wait = exe.submit(feed, ("logits",))
        self._ask()
        return wait()["logits"][:, -1], None

    def _ask(self) -> None:
        """Each live row's constraint's answers for the step now running (`sampling.ask`): a
        grammar's mask is computed while the device runs the step."""
        if self.constraints is not None:
            self.asked = [None if d else ask(c) for d, c in zip(self.done, self.constraints)]

    def _feed(self, t: int, ids: np.ndarray) -> dict:
        """The inputs of the decode step giving token t, from token t - 1 (`ids` [b])."""
        s = self.prompt_len
        self.full_mask[:, s + t - 1] = True
        return {"ids": ids[:, None], "positions": self.last_pos + t,
                "key_mask": self.full_mask[:, None, None, :].copy(),
                "cache_pos": np.full(len(ids), s + t - 1, np.int32)}

    def _start_decode(self) -> Executable:
        decode = self.decode = self.model.executable("decode")
        decode.fixed_dims = {"ctx": self.ctx}
        self.greedy = greedy_outputs(decode) and self.sampling.argmax
        self.overlap = self.greedy and self.model.backend.overlaps
        self.in_place = updates_in_place(decode)
        self.t_decode = time.perf_counter()        # (its compile is not a decode step's time)
        return decode

    def _decode_step(self, t: int, last: np.ndarray) -> tuple:
        """`_step`'s (logits, ids) of the decode step giving token t from token t - 1 (`last`):
        run now, or queued ahead where runs overlap the host (`_queued`)."""
        decode = self.decode or self._start_decode()
        queued = self.ahead
        if queued is None:
            now = self._feed(t, last)
            if not (self.overlap and self._greedy_at(t)):
                return self._step(decode, now, t, self._greedy_at(t))
            queued = (now, decode.submit(now, GREEDY_OUTPUTS))
        return self._queued(decode, queued, t, last)

    def _queued(self, decode: Executable, queued: tuple, t: int, last: np.ndarray) -> tuple:
        """Read the `queued` (feed, wait) step giving token t, after queuing the one giving
        t + 1 (its ids chained from this one's on the device; `last` only gives their shape).
        Where this step's ids are not the choice (`checked_greedy`), the one queued after it is
        dropped and this step runs again for its logits (it writes the same KV rows)."""
        now, wait = queued
        self.ahead = None
        if t + 1 < self.sampling.max_new_tokens and self._greedy_at(t + 1):
            later = self._feed(t + 1, last)
            self.ahead = (later, decode.submit(later, GREEDY_OUTPUTS, chain={"ids": "next_ids"}))
        nxt = self._greedy_of(wait(), t)
        if nxt is not None:
            return None, nxt
        if self.ahead is not None:
            self.ahead[1]()
            self.ahead = None             # (its ids, chained, were this step's arg-max)
        return self._step(decode, dict(now, ids=self.cols[-1][:, None]), t, False)

    def _greedy_at(self, t: int) -> bool:
        """Whether the decode step giving token t may take the graph's greedy ids. Where they
        may be refused (EOS banned) the step runs again for its logits, rewriting the same KV
        rows; a state the step updates in place (a recurrent layer's) would be stepped twice,
        so such models fetch the logits at once while EOS is banned."""
        return self.greedy and not (self.in_place and self.sampling.bans_eos(t))

    def _chosen(self, logits: np.ndarray, t: int) -> np.ndarray:
        """The next tokens chosen from this step's logits (which must be finite): processed
        and chosen by the sampling parameters; a row whose constraint is finished gets EOS.
        Records the logprobs asked for (of the raw logits)."""
        if not np.isfinite(logits).all():
            self.model._check_finite(logits, self.ids, self.mask)
        sp, live = self.sampling, ~self.done
        cons = None
        if self.constraints is not None:
            if self.asked is None:
                self._ask()
            asked, self.asked = self.asked or [], None
            self.forced = np.array([a is not None and a.finished() for a in asked], bool)
            if self.forced.any() and not self.eos:
                raise ModelError(f"{self.model.source}: a constraint finished but the model has no EOS token")
            cons = [None if f else a for a, f in zip(asked, self.forced)]
        seen = [p + o for p, o in zip(self.prompts, self.out)] if sp.repetition_penalty != 1.0 else ()
        x = sp.process(logits, seen=seen, generated=self.out,
                       n_new=t, eos=self.eos, constraints=cons)
        x[~live | self.forced] = 0.0           # (rows that ended or are forced: any finite row)
        nxt = sp.choose(x, [self.rng] * len(x))
        nxt[self.forced] = self.eos[0] if self.eos else 0
        if self.logprobs is not None:
            for b, lp in zip(np.flatnonzero(live), token_logprobs(logits[live], nxt[live], sp.logprobs)):
                self.logprobs[b].append(lp)
        return nxt

    def _accept(self, nxt: np.ndarray, stream) -> bool:
        """Take a step's tokens (the pad id for rows that have ended), stream them, and say
        whether every row has now ended (an EOS unless ignore_eos, a forced EOS, a stop
        string)."""
        live = ~self.done
        nxt = np.where(self.done, self.pad, nxt.astype(np.int64))
        self.cols.append(nxt)
        if stream is not None:
            stream(nxt.tolist())
        is_eos = (nxt[:, None] == self.eos_arr).any(1)
        ends = live & (self.forced | (is_eos & (not self.sampling.ignore_eos)))
        for b in np.flatnonzero(live):
            tok = int(nxt[b])
            self.out[b].append(tok)
            if ends[b]:
                continue
            if self.constraints is not None:
                self.constraints[b].accept(tok)
            if self.stops is not None and self.stops[b].push(tok)[1]:
                ends[b] = True
        self.forced[:] = False
        self.done |= ends
        return bool(self.done.all())


class DecoderRecipe:
    """A recipe for a decoder-only causal LM whose layers a `DecoderFlow` subclass builds: a
    family sets `name`, `model_types` and `flow_class` (and, where its defaults differ,
    `default_profile` and `default_context`); `build` is the same for every such family."""
    name = ""
    model_types: tuple = ()
    flow_class: type[DecoderFlow] | None = None
    default_profile = "llama32_prefill"
    default_context = 2048            # the RoPE table length when the config states none
    ignore_unused = ("rotary_emb.inv_freq",)

    def flow(self, cfg: dict, mode: str, taps: bool = False) -> ModelFlow:
        if self.flow_class is None:
            raise ModelError(f"recipe {self.name or type(self).__name__!r} sets no flow_class")
        return self.flow_class(cfg, mode).taps(taps).flow()

    def build(self, ckpt: Checkpoint, backend: str | None = None, profile: ProfileLike = None,
              **kw: Any) -> CausalLM:
        cfg = dict(ckpt.config)
        if kw.get("max_context"):     # RoPE tables are sized by the context asked for, not the file's
            cfg["max_position_embeddings"] = min(kw["max_context"],
                                                 cfg.get("max_position_embeddings") or self.default_context)
        tensors = dict(ckpt.tensors)
        if cfg.get("tie_word_embeddings"):
            tensors.pop("lm_head.weight", None)
        return CausalLM(self, cfg, tensors, ckpt.tokenizer, backend, profile, source=ckpt.path, **kw)


__all__ = ["GREEDY_OUTPUTS", "greedy_outputs", "updates_in_place", "fetch_greedy", "CausalLM", "Sampling",
           "SamplingParams", "Generation",
           "DecoderRecipe", "load", "find_recipe", "resolve_profile", "backend_lock"]
