"""Encoder models: sentence embeddings from a recipe's encoder flow.

A recipe that builds encoders (an encoder family's plugin) returns an `Encoder` from
`build(ckpt, ...)`. The recipe provides `flow(config, pooling=...)` — a ModelFlow with inputs
`ids`, `positions` [batch, seq], optionally `token_type_ids`, and `key_mask` [batch,1,1,seq]
(bool), and taps `last_hidden_state`, `pooled` and `embedding` (pooled, L2-normalized) —
plus `max_positions(config)`, `embedding_dim(config)` and `default_profile`.

`Encoder.embed(texts)` tokenizes with the model's tokenizer (truncating, with a warning, at
the sentence-transformers `max_seq_length` or the model's position limit), sorts the texts by
length and batches similar lengths together (less padding), runs one compiled executable
whose `batch` and `seq` dims are symbolic, and returns the rows in input order. Where the
backend has cores to spare (`backend.data_parallel()`: the NumPy backend with an N-thread
BLAS), a packed batch runs as N parts side by side in threads, each on its own executable
(`Encoder.parts` overrides the count; 1 runs each batch whole).

`embed`, `forward` and `hidden_states` may be called from many threads at once: a call holds
its backend's lock (`model.backend_lock`: executables' arenas and the backend's stream serve
one run at a time), so concurrent calls give the results of the same calls made one at a time.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..ir.dtype import F32
from ..ir.errors import ModelError, WeightError
from ..pipeline import CompilePipeline, Executable, select_backend
from .args import bool_arg, id_matrix, int_arg, mask_arg, text_arg
from .model import backend_lock

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from tokenizers import Tokenizer as TkTokenizer

    from ..flow.ctx import BuiltModel
    from ..profile import ProfileLike
    from ..weights.tokenizer import Tokenizer

# sentence-transformers Pooling config keys -> our pooling names (None: not supported here)
_ST_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
               "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": None,
               "pooling_mode_weightedmean_tokens": None, "pooling_mode_lasttoken": None}
_ST_POOLING_NAMES = {"cls": "cls", "cls_token": "cls", "mean": "mean", "mean_tokens": "mean",
                     "max": "max", "max_tokens": "max"}


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightError(f"{path}: cannot read JSON ({e})") from e


def _pooling_from(cfg: dict, path: str) -> str:
    if isinstance(cfg.get("pooling_mode"), str):          # newer sentence-transformers layout
        name = cfg["pooling_mode"]
        if name not in _ST_POOLING_NAMES:
            raise ModelError(f"{path}: pooling_mode {name!r} is not supported; supported: cls, mean, max")
        return _ST_POOLING_NAMES[name]
    on = [k for k in _ST_POOLING if cfg.get(k)]
    pooling = _ST_POOLING[on[0]] if len(on) == 1 else None
    if pooling is None:
        raise ModelError(f"{path}: pooling {on or 'none'} is not supported; supported: exactly one of "
                         "pooling_mode_cls_token, pooling_mode_mean_tokens, pooling_mode_max_tokens")
    return pooling


def sentence_transformers_config(path: str) -> dict:
    """What a sentence-transformers folder says around its transformer: `max_seq_length`,
    `do_lower_case`, `pooling` (cls|mean|max) and `normalize` (a Normalize module follows).
    `path` is the transformer's folder (or the ST root); {} for a plain HF folder."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    root = None
    for cand in (folder, os.path.dirname(os.path.abspath(folder))):
        if os.path.isfile(os.path.join(cand, "modules.json")):
            root = cand
            break
    out: dict = {}
    sbc = None
    for where in (folder, root):
        if where and sbc is None:
            sbc = _read_json(os.path.join(where, "sentence_bert_config.json"))
    if isinstance(sbc, dict):
        if isinstance(sbc.get("max_seq_length"), int) and sbc["max_seq_length"] > 0:
            out["max_seq_length"] = sbc["max_seq_length"]
        out["do_lower_case"] = bool(sbc.get("do_lower_case", False))
    if root is None:
        return out
    modules = _read_json(os.path.join(root, "modules.json"))
    if not isinstance(modules, list):
        return out
    out["root"] = root
    for entry in modules:
        kind = str(entry.get("type", "")) if isinstance(entry, dict) else ""
        if kind.endswith("Pooling"):
            cfg_path = os.path.join(root, entry.get("path", ""), "config.json")
            cfg = _read_json(cfg_path)
            if isinstance(cfg, dict):
                out["pooling"] = _pooling_from(cfg, cfg_path)
        elif kind.endswith("Normalize"):
            out["normalize"] = True
    out.setdefault("normalize", False)
    return out


def _fmt_rows(emb: np.ndarray) -> list:
    """Each row as shortest round-trip float32 strings."""
    return [r.tolist() for r in np.asarray(emb, np.float32).astype(str)]


class Encoder:
    """A text encoder compiled from a recipe's flow: `embed(texts)` -> [n, dim] float32."""

    def __init__(self, recipe: Any, config: dict, tensors: dict, tokenizer: Tokenizer | None = None,
                 backend: str | None = None, profile: ProfileLike = None,
                 source: str = "", st: dict | None = None, max_length: int | None = None,
                 pooling: str | None = None, flow_options: dict | None = None):
        from .model import resolve_profile

        self.recipe, self.config, self.tensors, self.tokenizer = recipe, dict(config), tensors, tokenizer
        self.source = str(source or config.get("_name_or_path") or "model")
        self.st = dict(st or {})
        self.profile = resolve_profile(profile, getattr(recipe, "default_profile", "encoder"), source or None)
        self.backend = select_backend(backend or self.profile.backend.name or None)
        self.max_positions = int(recipe.max_positions(self.config))
        self.dim = int(recipe.embedding_dim(self.config))
        self.pooling = pooling or self.st.get("pooling") or "mean"
        limit = max_length if max_length is not None else (
            self.st.get("max_seq_length") or self.max_positions)
        if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 2:
            raise ModelError(f"max_length must be an integer >= 2, got {limit!r}")
        if max_length is not None and max_length > self.max_positions:
            raise ModelError(f"max_length {max_length} is more than the model's "
                             f"{self.max_positions} positions")
        self.max_length = min(int(limit), self.max_positions)
        self.do_lower_case = bool(self.st.get("do_lower_case", False))
        self._exes: dict = {}            # (layout, part) -> Executable
        self._built: dict = {}           # layout -> (optimized graph, built flow)
        self.parts: int | None = None    # data-parallel parts per batch (None: the backend's choice)
        self._pool: tuple[int, ThreadPoolExecutor, int] | None = None    # (workers, pool, pid) for the parts
        self._shared: dict = {}
        self._truncating: TkTokenizer | None = None
        self._lock = backend_lock(self.backend)
        self.flow_options = dict(flow_options or {})     # extra recipe.flow() options
        self.last_timings: dict = {}

    @classmethod
    def from_tensors(cls, config: dict, tensors: dict, tokenizer: Tokenizer | None = None,
                     backend: str | None = None, profile: ProfileLike = None, recipe: Any = None,
                     **kw: Any) -> "Encoder":
        from .model import find_recipe

        recipe = recipe or find_recipe(config.get("model_type", ""))
        if hasattr(recipe, "tensors"):
            tensors = recipe.tensors(tensors)
        return cls(recipe, config, tensors, tokenizer, backend, profile, **kw)

    def __repr__(self) -> str:
        return (f"Encoder({self.source!r}, model_type={self.config.get('model_type')!r}, dim={self.dim}, "
                f"pooling={self.pooling!r}, max_length={self.max_length}, backend={self.backend.name!r})")

    # -- compiled graphs
    def executable(self, layout: str | None = None, part: int = 0) -> Executable:
        """The compiled encoder for a layout ("padded": ids [batch, seq] + key mask; "packed":
        the texts of a batch concatenated into one row of tokens; None: the recipe's choice for
        this backend). One executable serves every shape (specialized per shape, cached).
        `part` k > 0: another executable of the same graph, for the k-th part of a batch run
        concurrently (a runner's arena serves one run at a time); params are shared."""
        with self._lock:
            return self._executable(layout, part)

    graph_modes = ("padded", "packed")       # the layouts `built` and `executable` take

    def built(self, layout: str | None = None) -> BuiltModel:
        """The encoder flow of `layout` built on this model's tensors (HIR graph, params,
        stage records), not yet compiled: what `executable` compiles and `rlx inspect` shows."""
        opts = dict(self.flow_options)
        if layout is not None:
            opts["layout"] = layout
        flow = self.recipe.flow(self.config, pooling=self.pooling, backend=self.backend, **opts)
        return flow.build(self.tensors, self.config, F32,
                          ignore_unused=getattr(self.recipe, "ignore_unused", ()))

    def _executable(self, layout: str | None, part: int) -> Executable:
        key = layout or self.flow_options.get("layout")
        if (key, part) not in self._exes:
            if key not in self._built:
                built = self.built(layout)
                mir = CompilePipeline(self.profile, self.backend).optimize_cached(built.graph)
                self._built[key] = (mir, built)
            mir, built = self._built[key]
            # executables of one model share params uploaded (and hoisted ones computed) once
            exe = Executable(mir, self.backend, self.profile, source=built.graph, shared=self._shared)
            exe.set_params(built.params)
            self._exes[(key, part)] = exe
        return self._exes[(key, part)]

    @property
    def layout(self) -> str:
        """The layout embed() runs: packed when the recipe's flow for this backend is packed."""
        return "packed" if "seq_starts" in self.executable().mir.inputs else "padded"

    @staticmethod
    def _run_exe(exe, feed: dict, env: dict) -> dict:
        """Run, keeping at most RUNNER_CACHE shape specializations alive (least recently used
        go): every distinct shape costs a compiled runner and its arena."""
        out = exe.run(feed)
        runners = getattr(exe, "_runners", None)
        if isinstance(runners, dict):
            key = tuple(sorted({**exe.fixed_dims, **env}.items()))
            if key in runners:
                runners[key] = runners.pop(key)
            while len(runners) > Encoder.RUNNER_CACHE:
                old = next(iter(runners))
                runners.pop(old)
                getattr(exe, "lir_cache", {}).pop(old, None)
        return out

    RUNNER_CACHE = 8
    PACK_ALIGN = 16          # packed runs round their token count up to this (fewer shapes)
    PACK_MAX_TOKENS = 16384  # at most this many tokens per packed run

    # -- token ids
    def _check_rows(self, lengths, ids_max: int, ids_min: int) -> None:
        vocab = self.recipe_vocab()
        if vocab and (ids_min < 0 or ids_max >= vocab):
            raise ModelError(f"token id out of range [0, {vocab}): min {ids_min}, max {ids_max}")
        longest = max(lengths, default=0)
        if longest > self.max_positions:
            raise ModelError(f"a sequence of {longest} tokens is longer than the model's "
                             f"{self.max_positions} positions")
        if min(lengths, default=1) < 1:
            raise ModelError("every sequence needs at least one token")

    def recipe_vocab(self) -> int | None:
        v = self.config.get("vocab_size")
        return int(v) if isinstance(v, int) else None

    def forward(self, ids: Any, attention_mask: Any = None, token_type_ids: Any = None) -> dict:
        """Every output of the graph for right-padded ids [B,S] (`last_hidden_state`,
        `pooled`, `embedding`); rows of attention_mask mark real tokens."""
        ids = id_matrix(ids, self.recipe_vocab())
        self._check_rows([ids.shape[1]], 0, 0)
        mask = (np.ones(ids.shape, bool) if attention_mask is None
                else mask_arg("attention_mask", attention_mask, ids.shape))
        types = np.zeros(ids.shape, np.int64)
        if token_type_ids is not None:
            tv = self.config.get("type_vocab_size")
            tv = tv if isinstance(tv, int) and tv > 0 else None
            types = id_matrix(token_type_ids, tv, "token_type_ids")
            if types.shape != ids.shape:
                raise ModelError(f"token_type_ids shape {types.shape} does not match ids {ids.shape}")
        with self._lock:
            return self._run(ids, types, mask)

    def hidden_states(self, ids: Any, attention_mask: Any = None, token_type_ids: Any = None) -> np.ndarray:
        return self.forward(ids, attention_mask, token_type_ids)["last_hidden_state"]

    def _run(self, ids, types, mask) -> dict:
        """The padded executable on right-padded rows."""
        exe = self.executable("padded")
        b, s = ids.shape
        feed = {"ids": ids, "key_mask": mask[:, None, None, :]}
        if "positions" in exe.mir.inputs:
            feed["positions"] = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s))
        if "token_type_ids" in exe.mir.inputs:
            feed["token_type_ids"] = types
        return self._run_exe(exe, feed, {"batch": b, "seq": s})

    def _run_packed(self, exe, rows: list, n_seqs: int) -> dict:
        """The packed executable on rows [(ids, type_ids)]: one row of tokens, the token count
        rounded up to PACK_ALIGN by a padding segment, n_seqs segments (the unused ones empty)."""
        lens = np.array([len(r[0]) for r in rows], np.int64)
        real = int(lens.sum())
        total = -(-real // self.PACK_ALIGN) * self.PACK_ALIGN
        pad = total - real
        ids = np.full(total, int(self.config.get("pad_token_id") or 0), np.int64)
        types = np.zeros(total, np.int64)
        pos = np.zeros(total, np.int64)
        starts = np.zeros(n_seqs, np.int64)
        seg = np.zeros(n_seqs, np.int64)
        at = 0
        for i, (r, t) in enumerate(rows):
            n = len(r)
            ids[at:at + n], types[at:at + n], pos[at:at + n] = r, t, np.arange(n)
            starts[i], seg[i] = at, n
            at += n
        if pad:
            pos[at:] = np.arange(pad)
            starts[len(rows)], seg[len(rows)] = at, pad
        starts[len(rows) + (1 if pad else 0):] = total          # empty segments
        feed = {"ids": ids[None], "seq_starts": starts, "seq_lens": seg}
        if "positions" in exe.mir.inputs:
            feed["positions"] = pos[None]
        if "token_type_ids" in exe.mir.inputs:
            feed["token_type_ids"] = types[None]
        return self._run_exe(exe, feed, {"tokens": total, "seqs": n_seqs})

    PART_MIN_TOKENS = 128    # a batch is split into concurrent parts of at least this many tokens

    def split_parts(self, lengths: list, parts: int) -> list:
        """`lengths` (one batch) cut into at most `parts` consecutive runs of about equal
        tokens, each at least PART_MIN_TOKENS: [(begin, end)] positions into `lengths`."""
        total = sum(lengths)
        parts = max(1, min(parts, len(lengths), total // self.PART_MIN_TOKENS))
        cuts, at, done = [0], 0, 0
        for k in range(1, parts):
            goal = total * k / parts
            while at < len(lengths) - (parts - k) and done + lengths[at] / 2 < goal:
                done += lengths[at]
                at += 1
            cuts.append(max(at, cuts[-1] + 1))
        cuts.append(len(lengths))
        return list(zip(cuts[:-1], cuts[1:]))

    def _embed_pack(self, rows: list, idx: list, lengths: list, n_seqs: int, key: str,
                    out: np.ndarray) -> None:
        """out[idx] <- the packed run of rows[idx], in concurrent parts when the backend has
        cores to spare (each part on its own executable, so its own arena)."""
        want = self.parts if self.parts is not None else self.backend.data_parallel()
        spans = self.split_parts([lengths[i] for i in idx], int(want))

        exes = [self.executable(part=k) for k in range(len(spans))]

        def part(k: int) -> None:
            sub = idx[spans[k][0]:spans[k][1]]
            with self.backend.part_scope() if len(spans) > 1 else contextlib.nullcontext():
                res = self._run_packed(exes[k], [rows[i] for i in sub], n_seqs)[key]
            out[sub] = res[:len(sub)]

        if len(spans) == 1:
            return part(0)
        if self._pool is None or self._pool[0] < len(spans) - 1 or self._pool[2] != os.getpid():
            from concurrent.futures import ThreadPoolExecutor      # (a forked child has no threads)

            self._pool = (len(spans) - 1, ThreadPoolExecutor(len(spans) - 1, thread_name_prefix="rlx-embed"),
                          os.getpid())
        with self.backend.parallel_scope():
            futures = [self._pool[1].submit(part, k) for k in range(1, len(spans))]
            try:
                part(0)
            finally:
                errors = [f.exception() for f in futures]       # waits for every part
        for e in errors:
            if e is not None:
                raise e

    # -- text
    def _truncating_tokenizer(self, tokenizer: Tokenizer) -> TkTokenizer:
        if self._truncating is None:
            from tokenizers import Tokenizer as TkTokenizer

            tk = TkTokenizer.from_str(tokenizer.backend.to_str())
            tk.no_padding()
            tk.enable_truncation(self.max_length)
            self._truncating = tk
        return self._truncating

    def tokenize(self, texts: list, truncate: bool = True, item: str = "text", first: int = 0) -> tuple:
        """([(ids, type_ids)] per text, indices of the texts that were truncated). Messages
        name a text as f"{item} {first + i}" (embed_command says "line 3 of FILE")."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ModelError(f"{self.source} has no tokenizer (expected tokenizer.json, or vocab.txt for "
                             "a WordPiece vocabulary, beside config.json); embed token ids instead")
        for i, t in enumerate(texts):
            text_arg(f"{item} {first + i}", t)
        if self.do_lower_case:
            texts = [t.lower() for t in texts]
        encs = list(tokenizer.backend.encode_batch(texts))
        long = [i for i, e in enumerate(encs) if len(e.ids) > self.max_length]
        if long:
            worst = max(long, key=lambda i: len(encs[i].ids))
            words = item.split(" ", 1)
            plural = words[0] + ("s" if len(long) > 1 else "") + (" " + words[1] if len(words) > 1 else "")
            where = f"{words[0]} {first + worst}" + (" " + words[1] if len(words) > 1 else "")
            what = (f"{len(long)} {plural} longer than {self.max_length} tokens "
                    f"({where}: {len(encs[worst].ids)} tokens)")
            if not truncate:
                raise ModelError(f"{what}; the model takes at most {self.max_length} (truncation is off)")
            warnings.warn(f"{what} truncated to {self.max_length} tokens", stacklevel=3)
            cut = self._truncating_tokenizer(tokenizer).encode_batch([texts[i] for i in long])
            for i, e in zip(long, cut):
                encs[i] = e
        return [(e.ids, e.type_ids) for e in encs], long

    @staticmethod
    def plan_batches(lengths: list, batch_size: int) -> list:
        """Index lists: longest first; a batch is cut when it is full or when padding the next
        text to the batch's length would waste more than it saves."""
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        batches: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            if cur and (len(cur) >= batch_size or lengths[i] * 4 < lengths[cur[0]] * 3 and len(cur) >= 8):
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
        return batches

    def plan_packs(self, lengths: list, batch_size: int) -> list:
        """Index lists for packed runs: at most batch_size texts and PACK_MAX_TOKENS tokens each."""
        packs: list[list[int]] = []
        cur: list[int] = []
        tokens = 0
        cap = max(self.PACK_MAX_TOKENS, self.max_positions)
        for i, n in enumerate(lengths):
            if cur and (len(cur) >= batch_size or tokens + n > cap):
                packs.append(cur)
                cur, tokens = [], 0
            cur.append(i)
            tokens += n
        if cur:
            packs.append(cur)
        return packs

    def embed(self, texts_or_ids: Any, batch_size: int = 32, normalize: bool = True, truncate: bool = True,
              progress: bool = False, item: str = "text", first: int = 0) -> np.ndarray:
        """Embeddings [n, dim] float32 (a single string or id sequence gives [dim]).

        Strings are tokenized with the model's tokenizer; sequences of ints are token ids used
        as given (special tokens included). `normalize` L2-normalizes each row (pooled rows
        otherwise). Text longer than `max_length` tokens is truncated with a warning, or is an
        error with truncate=False."""
        # a packed run holds at most PACK_MAX_TOKENS tokens, so no more texts: a larger
        # batch_size would only size the run's segment arrays (batch_size + 1 of them)
        batch_size = min(int_arg("batch_size", batch_size, lo=1),
                         max(self.PACK_MAX_TOKENS, self.max_positions))
        normalize, truncate = bool_arg("normalize", normalize), bool_arg("truncate", truncate)
        with self._lock:
            return self._embed(texts_or_ids, batch_size, normalize, truncate, progress, item, first)

    def _embed(self, texts_or_ids, batch_size, normalize, truncate, progress, item, first) -> np.ndarray:
        single, rows = self._rows(texts_or_ids, truncate, item, first)
        out = np.zeros((len(rows), self.dim), np.float32)
        if rows:
            key = "embedding" if normalize else "pooled"
            lengths = [len(r[0]) for r in rows]
            self._check_rows(lengths, max(max(r[0], default=0) for r in rows),
                             min(min(r[0], default=0) for r in rows))
            bar = None
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(rows), desc="embedding", unit="text", file=sys.stderr)
            t0 = time.perf_counter()
            exe = self.executable()
            try:
                if "seq_starts" in exe.mir.inputs:
                    for idx in self.plan_packs(lengths, int(batch_size)):
                        self._embed_pack(rows, idx, lengths, int(batch_size) + 1, key, out)
                        if bar is not None:
                            bar.update(len(idx))
                else:
                    for idx in self.plan_batches(lengths, int(batch_size)):
                        s = lengths[idx[0]]
                        ids = np.zeros((len(idx), s), np.int64)
                        types = np.zeros((len(idx), s), np.int64)
                        mask = np.zeros((len(idx), s), bool)
                        for j, i in enumerate(idx):
                            n = lengths[i]
                            ids[j, :n], types[j, :n], mask[j, :n] = rows[i][0], rows[i][1], True
                        out[idx] = self._run(ids, types, mask)[key]
                        if bar is not None:
                            bar.update(len(idx))
            finally:
                if bar is not None:
                    bar.close()
            self.last_timings = {"embed_s": time.perf_counter() - t0, "texts": len(rows),
                                 "tokens": int(sum(lengths))}
        return out[0] if single else out

    def _rows(self, x, truncate: bool, item: str = "text", first: int = 0) -> tuple:
        """(single?, [(ids, type_ids)]) from a string, strings, an id sequence or id rows."""
        if isinstance(x, str):
            return True, self.tokenize([x], truncate, item, first)[0]
        if isinstance(x, np.ndarray):
            if not np.issubdtype(x.dtype, np.integer) and x.size:
                raise ModelError(f"token ids must be integers, got an array of {x.dtype}")
            if x.ndim == 1:
                return True, [(x.tolist(), [0] * len(x))]
            if x.ndim != 2:
                raise ModelError(f"token ids must be 1-D or 2-D, got shape {x.shape}")
            return False, [(r.tolist(), [0] * len(r)) for r in x]
        try:
            items = list(x)
        except TypeError:
            raise ModelError(f"embed() takes a string, a list of strings or token ids, got "
                             f"{type(x).__name__}") from None
        if not items:
            return False, []
        if all(isinstance(t, str) for t in items):
            return False, self.tokenize(items, truncate, item, first)[0]
        if all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in items):
            return True, [([int(t) for t in items], [0] * len(items))]
        rows = []
        for i, r in enumerate(items):
            if isinstance(r, str) or not hasattr(r, "__len__") or not all(
                    isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in r):
                raise ModelError(f"embed() takes strings or token-id sequences, not a mix: item {i} is "
                                 f"{type(r).__name__}")
            rows.append(([int(t) for t in r], [0] * len(r)))
        return False, rows


# ------------------------------------------------------------------------------ CLI glue
def _read_lines(file) -> list:
    if file == "-":
        return sys.stdin.read().splitlines()
    if hasattr(file, "read"):
        data = file.read()
        return (data.decode("utf-8") if isinstance(data, bytes) else data).splitlines()
    try:
        with open(file, encoding="utf-8") as f:
            return f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"{file}: cannot read the text file ({e})") from e


def encoder_model_types() -> list:
    """The model types whose registered recipe builds encoders (it has `embedding_dim`), so a
    message can say which checkpoints `rlx embed` takes without the core naming them."""
    from ..plugins.manager import registry

    return sorted(t for t, r in registry().recipes.items() if callable(getattr(r, "embedding_dim", None)))


def embeds_images(model: Any) -> bool:
    """Whether `model` embeds images: a vision family's model says so (`embeds_images`), and
    takes `embed(images=[paths or encoded bytes], normalize=..., batch_size=...)`; core never
    decodes an image itself."""
    return bool(getattr(model, "embeds_images", False))


def _load_embedder(model: Any) -> Any:
    if isinstance(model, Encoder) or embeds_images(model):
        return model
    from .model import load

    m = load(str(model), progress=False)
    if not (isinstance(m, Encoder) or embeds_images(m)):
        raise ModelError(f"{model}: a {_kind(m)} model is not a text encoder; rlx embed needs an encoder "
                         "checkpoint (model types with an encoder recipe: "
                         f"{', '.join(encoder_model_types()) or 'none registered'}) or a vision one (a model "
                         "that embeds images)")
    return m


def _kind(m: Any) -> str:
    return str(getattr(m, "config", {}).get("model_type") or type(m).__name__)


def embed_command(model: Any, texts: str | list[str] | None = None, file: str | None = None,
                  json_out: bool = False, batch_size: int = 32, normalize: bool = True,
                  no_truncate: bool = False, echo: Callable[[str], Any] = print,
                  progress: bool | None = None, images: bool = False) -> np.ndarray:
    """What `rlx embed MODEL "text" ... [--json]` / `rlx embed MODEL --file lines.txt` /
    `rlx embed MODEL --image a.png b.jpg` does.

    `model`: a path, a packaged name, an Encoder or a model that embeds images (see
    embeds_images). `file`: a path or "-" (stdin), one text per line (empty lines included).
    With `images`, the texts (or the file's lines) are image paths, read by the model's own
    preprocessing. A vision model with a text tower (image-text pairs) embeds texts too, into the
    images' space. Prints one line per item (the vector, values separated by spaces, loadable
    by numpy.loadtxt) or, with json_out, one JSON object {"model", "dim", "normalized",
    "count", "embeddings"}. A progress bar goes to stderr for long text files. Errors are
    RlxErrors (the CLI prints them as one `error:` line); text longer than the model's limit
    is truncated with a warning, or an error with no_truncate (text encoders only)."""
    texts = [texts] if isinstance(texts, str) else list(texts or ())
    what = "image paths" if images else "texts"
    if texts and file is not None:
        raise ModelError(f"give {what} or --file, not both")
    if file is not None:
        texts = _read_lines(file)
    elif not texts:
        raise ModelError(f"nothing to embed: give one or more {what}, or --file FILE (one per line)")
    if images and no_truncate:
        raise ModelError("--no-truncate applies to texts; images are resized by the model's preprocessing")
    m = _load_embedder(model)
    if images or not isinstance(m, Encoder):
        emb = _embed_with_vision_model(model, m, texts, images, batch_size, normalize, no_truncate)
    else:
        if progress is None:
            progress = file is not None and len(texts) > 8 * batch_size
        # messages count from 1, as a user reading the command line or the file does
        item = f"line of {'stdin' if file == '-' else file}" if file is not None else "text"
        emb = m.embed(texts, batch_size=batch_size, normalize=normalize, truncate=not no_truncate,
                      progress=progress, item=item, first=1)
    if json_out:
        body = ",".join("[" + ",".join(r) + "]" for r in _fmt_rows(emb))
        name = model if isinstance(model, (str, os.PathLike)) else getattr(model, "source", model)
        head = json.dumps({"model": str(name), "dim": int(emb.shape[-1]), "normalized": bool(normalize),
                           "count": int(len(texts))})
        echo(head[:-1] + f', "embeddings": [{body}]}}')
    else:
        for r in _fmt_rows(emb):
            echo(" ".join(r))
    return emb


def _embed_with_vision_model(name: Any, m: Any, items: list, images: bool, batch_size: int,
                             normalize: bool, no_truncate: bool) -> np.ndarray:
    """Images (paths) or, for a model with a text tower, texts through a vision model."""
    if images and not embeds_images(m):
        raise ModelError(f"{name}: a {_kind(m)} model embeds texts, not images; --image needs a vision "
                         "checkpoint")
    if not images:
        if not getattr(m, "embeds_texts", False):
            raise ModelError(f"{name}: a {_kind(m)} model embeds images only; give image paths with --image")
        if no_truncate:
            raise ModelError(f"{name}: --no-truncate applies to text encoders; this model's text tower "
                             "truncates at its position limit")
    kw = {"images" if images else "texts": items}
    emb = np.asarray(m.embed(**kw, normalize=normalize, batch_size=batch_size), np.float32)
    if emb.ndim != 2 or len(emb) != len(items):
        raise ModelError(f"{name}: the model returned embeddings of shape {emb.shape} for {len(items)} inputs")
    return emb


__all__ = ["Encoder", "embed_command", "embeds_images", "encoder_model_types", "sentence_transformers_config"]
