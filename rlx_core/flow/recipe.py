"""The shared shape of a decoder recipe (the decoder flows of the family plugins):
the inputs of each mode, the layer loop and the hooks a model author overrides.
Architectures fill in the embedding, the default layer, the final norm and the head."""
from __future__ import annotations

import abc

from typing import Callable

from ..ir.dtype import BOOL, F32, I32, I64
from ..ir.errors import ModelError
from ..profile import CompileProfile
from .blocks import PIECE_CTX, GreedyNext, mixed_split
from .flow import ModelFlow

MODES = ("prefill", "decode", "extend", "logits", "train", "mixed")
GENERATION = ("prefill", "decode", "extend")        # the modes that write the KV cache
CONTINUING = ("decode", "extend")         # the modes that read the caches (key mask over "ctx")
MIXED_ROWS, MIXED_PIECE = "rlx_mixed_rows", "rlx_mixed_piece"   # a mixed graph's counts, given in its config


class PickPosition:
    """Each row's hidden state at the position its one-hot `last_token` row marks ([batch, 1,
    seq] @ [batch, seq, hidden]: exact, one term per row is not zero), so the head then reads
    one position a row: the last real token of a piece whose tail is filler."""

    def emit(self, ctx, x):
        return ctx.m.matmul(ctx.inputs["last_token"], x)


class PickMixed:
    """A mixed graph's rows for the head: the D decode rows, then the piece's position that
    its one-hot `last_token` marks ([1, D + P, hidden] -> [D + 1, 1, hidden])."""

    def emit(self, ctx, x):
        m, split = ctx.m, mixed_split(ctx)
        if split is None:
            raise ModelError("pick_mixed: needs a mixed graph's inputs (cache_pos, piece_pos, last_token)")
        d, p = split
        rows = m.reshape(m.narrow(x, 1, 0, d), (d, 1, x.dims[-1]))
        last = m.matmul(ctx.inputs["last_token"], m.narrow(x, 1, d, p))
        return m.concat([rows, last], 0)


class LayerCtx:
    """What `.layer(fn)` hands `fn`: the layer index, its spec, the config, a fresh flow and
    the default stage (to wrap or replace)."""

    def __init__(self, recipe: "DecoderFlow", i: int):
        self._recipe, self._i = recipe, i
        self.spec = recipe.spec(i)
        self.config = recipe.cfg
        self.flow = ModelFlow(recipe.name)

    def index(self) -> int:
        return self._i

    def default_stage(self):
        return self._recipe.default_layer(self._i)


class DecoderFlow(abc.ABC):
    """Builds the logits / prefill / decode flow of a decoder-only config.

    Inputs: ids and positions [batch, seq]; key_mask [batch, 1, 1, seq] (decode and extend:
    the whole cache, "ctx"); prefill, decode and extend also cache_pos [batch], where the KV
    states are written. `extend` is a prefill that continues the cached sequences: its seq
    tokens go to cache_pos .. cache_pos + seq - 1, attention reads the caches (query i at
    cache_pos + i) and recurrent layers start from their state leaves; it compiles with the
    prefill preset. A prefix cache hit or a chunk of a long prompt runs through it.
    `logits` and `train` touch no cache and give every position's logits; `train` also takes
    labels [batch, seq] (the next token of each position; negative: ignored) and outputs
    `loss`, the mean token cross-entropy, for `rlx_core.value_and_grad(g, wrt, "loss")`.

    `mixed` (`for_mixed(cfg, rows, piece)`, both ints; or the config's MIXED_ROWS and
    MIXED_PIECE, so a recipe's own `flow(cfg, "mixed")` builds it) is one run doing a decode
    step of `rows` sequences AND an extend piece of `piece` tokens of one more sequence, so the
    weights are read once for both (chunked prefill inside the decode step). Its token axis
    is packed: ids and positions [1, rows + piece], the decode tokens first. The decode part
    has decode's key_mask [rows, 1, 1, ctx] and cache_pos [rows] over the KV states; the piece
    has extend's inputs renamed: piece_mask [1, 1, 1, piece_ctx], piece_pos [1] and
    last_token [1, 1, piece], over its own states (PIECE_PREFIX + the prefill's names, context
    PIECE_CTX). Everything per token runs on the packed rows; attention splits them
    (SelfAttention); the logits are [rows + 1, 1, vocab]: the decode rows, then the piece's
    marked token. A layer that does not split leaves no piece states: the caller compares the
    states with decode's and the prefill's and refuses the mode.
    """
    family = "decoder"
    profile_family = None          # preset family if not `family` (model types sharing presets)
    layer_ctx = LayerCtx

    def __init__(self, cfg: dict, mode: str = "prefill", batch="batch", seq="seq"):
        if mode not in MODES:
            raise ModelError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "mixed" and batch == "batch" and seq == "seq":     # (through a recipe's flow(cfg, mode))
            batch, seq = cfg.get(MIXED_ROWS), cfg.get(MIXED_PIECE)
        counts = isinstance(batch, int) and isinstance(seq, int) and batch > 0 and seq > 0
        if mode == "mixed" and not counts:
            raise ModelError(f"a mixed graph takes a positive int count of decode rows and piece tokens, "
                             f"got {batch!r} and {seq!r}")
        self.cfg, self.mode, self.batch = dict(cfg), mode, batch
        self.seq = 1 if mode == "decode" else seq
        self.name = f"{self.cfg.get('model_type', self.family)}_{mode}"
        self._last = mode in GENERATION or mode == "mixed"
        self._layer: Callable | None = None
        self._before: list = []
        self._after: list = []
        self._patches: list = []
        self._taps = False
        presets = self.profile_family or self.family
        self._profile = CompileProfile.preset(f"{presets}_{'decode' if mode == 'decode' else 'prefill'}")

    @classmethod
    def for_prefill(cls, cfg: dict, batch="batch", seq="seq"):
        return cls(cfg, "prefill", batch, seq)

    @classmethod
    def for_decode(cls, cfg: dict, batch="batch"):
        return cls(cfg, "decode", batch)

    @classmethod
    def for_extend(cls, cfg: dict, batch="batch", seq="seq"):
        return cls(cfg, "extend", batch, seq)

    @classmethod
    def for_mixed(cls, cfg: dict, rows: int, piece: int):
        return cls(cfg, "mixed", rows, piece)

    @classmethod
    def for_logits(cls, cfg: dict, batch="batch", seq="seq"):
        return cls(cfg, "logits", batch, seq)

    @classmethod
    def for_training(cls, cfg: dict, batch="batch", seq="seq"):
        return cls(cfg, "train", batch, seq)

    # -- hooks
    def last_token_logits(self, on: bool = True):
        self._last = on
        return self

    def layer(self, fn: Callable[[LayerCtx], object]):
        """Override each layer: `fn(ctx)` returns a flow or stage (ctx.default_stage() is the default)."""
        self._layer = fn
        return self

    def before_layers(self, fn: Callable[[ModelFlow], ModelFlow]):
        self._before.append(fn)
        return self

    def after_layers(self, fn: Callable[[ModelFlow], ModelFlow]):
        self._after.append(fn)
        return self

    def patch_flow(self, fn: Callable[[ModelFlow], ModelFlow]):
        self._patches.append(fn)
        return self

    def taps(self, on: bool = True):
        """Expose every layer's output as `layer.<i>` (finding the first non-finite layer)."""
        self._taps = on
        return self

    def profile_near(self, path):
        """Use a *.rlx.toml beside `path` if there is one."""
        self._profile = CompileProfile.resolve(None, self._profile.name, str(path))
        return self

    # -- what an architecture provides
    @abc.abstractmethod
    def spec(self, i: int):
        """The AttnSpec of layer i."""

    @abc.abstractmethod
    def default_layer(self, i: int):
        """The stage (or flow) of layer i when no `.layer()` override is given."""

    def num_layers(self) -> int:
        return int(self.cfg["num_hidden_layers"])

    def embed(self, f: ModelFlow) -> ModelFlow:
        return f.token_embed()

    @abc.abstractmethod
    def head(self, f: ModelFlow) -> ModelFlow:
        """Final norm, the last-token narrow when asked, and the LM head."""

    # -- building
    def flow(self) -> ModelFlow:
        f = ModelFlow(self.name).profile(self._profile)
        if self.mode == "mixed":
            self._mixed_inputs(f)
        else:
            f.input("ids", (self.batch, self.seq), I64).input("positions", (self.batch, self.seq), I64)
            f.input("key_mask", (self.batch, 1, 1, "ctx" if self.mode in CONTINUING else self.seq), BOOL)
        if self.mode in GENERATION:
            f.input("cache_pos", (self.batch,), I32)
        if self.mode == "extend":
            f.input("last_token", (self.batch, 1, self.seq), F32)
        if self.mode == "train":
            f.input("labels", (self.batch, self.seq), I64)
        f = self.embed(f)
        for fn in self._before:
            f = fn(f) or f
        for i in range(self.num_layers()):
            body = self._layer(self.layer_ctx(self, i)) if self._layer else self.default_layer(i)
            f.layer(i, lambda s, body=body: s.sequence(body) if isinstance(body, ModelFlow)
                    else s.raw_stage(body))
            if self._taps:
                f.output(f"layer.{i}")
        for fn in self._after:
            f = fn(f) or f
        if self.mode == "extend":
            f.raw_stage(PickPosition())
        elif self.mode == "mixed":
            f.raw_stage(PickMixed())
        f = self.head(f)
        for fn in self._patches:
            f = fn(f) or f
        if self.mode in GENERATION or self.mode == "mixed":          # greedy ids without fetching logits
            f.raw_stage(GreedyNext())
        elif self.mode == "train":
            f.cross_entropy_loss("labels")
        return f

    def _mixed_inputs(self, f: ModelFlow) -> None:
        """A mixed graph's inputs (see the class docstring)."""
        rows, piece = self.batch, self.seq
        f.input("ids", (1, rows + piece), I64).input("positions", (1, rows + piece), I64)
        f.input("key_mask", (rows, 1, 1, "ctx"), BOOL).input("cache_pos", (rows,), I32)
        f.input("piece_mask", (1, 1, 1, PIECE_CTX), BOOL).input("piece_pos", (1,), I32)
        f.input("last_token", (1, 1, piece), F32)
