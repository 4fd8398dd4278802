"""Generic vision-transformer blocks: patch embedding, class / register tokens, learned
position tables resized to another patch grid, pre-norm encoder layers (optional LayerScale,
GELU or SwiGLU FFN, fused QKV attention without or with a causal mask), token pooling and
the attention-probe pooling head. A vision family's plugin composes them with its own
checkpoint key names.

Resizing a position table is linear in the table: for a static grid the resampling weights
are two constant matrices (rows, columns), so the interpolated table is two matmuls on a
param, which the pipeline hoists to load time. The weights are torch's
`F.interpolate(mode="bicubic", align_corners=False)` ones for a target `size` (A = -0.75,
edge taps clamped) and, with antialias=True, its separable antialiased filter (A = -0.5,
support widened by the scale when shrinking), so the tables match torch's to float rounding.
"""
from __future__ import annotations

import math

import attrs
import numpy as np

from ..ir.errors import ModelError
from ..ir.ops import MaskKind
from .blocks import L2Normalize

RESIZE_MODES = ("bicubic", "bilinear")


# ------------------------------------------------------------------------------ resampling weights
def _cubic(x: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel with parameter a (torch: -0.75 plain, -0.5 antialiased)."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _plain_weights(n_in: int, n_out: int, mode: str) -> np.ndarray:
    """torch's upsample_bicubic2d / upsample_bilinear2d (align_corners=False) along one axis."""
    scale = n_in / n_out
    w = np.zeros((n_out, n_in))
    for i in range(n_out):
        real = scale * (i + 0.5) - 0.5
        if mode == "bicubic":                       # no clamp of the source index for cubic
            base = math.floor(real)
            t = real - base
            taps = (base - 1 + np.arange(4), _cubic(np.array([t + 1, t, 1 - t, 2 - t]), -0.75))
        else:
            real = max(real, 0.0)
            base = min(int(real), n_in - 1)
            t = real - base
            taps = (np.array([base, min(base + 1, n_in - 1)]), np.array([1 - t, t]))
        for j, c in zip(*taps):
            w[i, min(max(int(j), 0), n_in - 1)] += c
    return w


def _antialiased_weights(n_in: int, n_out: int, mode: str) -> np.ndarray:
    """torch's _upsample_{bicubic,bilinear}2d_aa along one axis (PIL's separable filters)."""
    scale = n_in / n_out
    support = (2.0 if mode == "bicubic" else 1.0) * max(scale, 1.0)
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    w = np.zeros((n_out, n_in))
    for i in range(n_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), n_in)
        x = (np.arange(lo, hi) - center + 0.5) * invscale
        f = _cubic(x, -0.5) if mode == "bicubic" else np.maximum(0.0, 1.0 - np.abs(x))
        total = f.sum()
        w[i, lo:hi] = f / total if total != 0 else f
    return w


def resize_weights(n_in: int, n_out: int, mode: str = "bicubic", antialias: bool = False) -> np.ndarray:
    """[n_out, n_in] float64: out = W @ in resizes one axis as torch's F.interpolate with
    size=n_out, align_corners=False (the same size gives the identity)."""
    if mode not in RESIZE_MODES:
        raise ModelError(f"resize mode {mode!r} is not supported; supported: {list(RESIZE_MODES)}")
    if n_in < 1 or n_out < 1:
        raise ModelError(f"cannot resize {n_in} positions to {n_out}")
    if n_in == n_out:
        return np.eye(n_in)
    return (_antialiased_weights if antialias else _plain_weights)(n_in, n_out, mode)


def resize_grid(table: np.ndarray, grid_in: tuple, grid_out: tuple, mode: str = "bicubic",
                antialias: bool = False) -> np.ndarray:
    """A [rows*cols, C] table laid out on `grid_in` resized to `grid_out` (host-side, float64
    accumulation): the reference for what ResizedPositions computes in the graph."""
    (hi, wi), (ho, wo) = grid_in, grid_out
    g = np.asarray(table, np.float64).reshape(hi, wi, -1)
    out = np.einsum("ip,jq,pqc->ijc", resize_weights(hi, ho, mode, antialias),
                    resize_weights(wi, wo, mode, antialias), g)
    return out.reshape(ho * wo, -1)


def square_grid(n: int, what: str) -> int:
    """The side of a square grid of n positions (a trained position table), or a ModelError."""
    side = int(round(math.sqrt(n)))
    if side * side != n:
        raise ModelError(f"{what}: {n} positions do not form a square grid; cannot resize it")
    return side


# ------------------------------------------------------------------------------ helpers
def dense(ctx, x, key: str, bias: bool = True, act: str = "identity", out: int | None = None,
          scale: str = ""):
    """act(x @ W^T + b) for the HF-layout weight `<key>.weight` (relative to the layer prefix).
    `scale`: a vector (LayerScale) multiplying the output columns, folded into the weight
    and bias (diag(g) W and g * b: param-only, so computed once at load, and no product of
    the activations at run time)."""
    k = ctx.key(key)
    w = ctx.param(f"{k}.weight", (out, x.dims[-1]) if out else None)
    b = ctx.param(f"{k}.bias", (w.dims[0],)) if bias else None
    if scale:
        g = ctx.param(ctx.key(scale), (w.dims[0],))
        w = w * ctx.m.reshape(g, (w.dims[0], 1))
        b = b * g if b is not None else None
    y = ctx.m.linear(x, w, b)
    return y if act == "identity" else ctx.m.act(y, act)


def layer_norm(ctx, x, key: str, eps: float):
    d = x.dims[-1]
    k = ctx.key(key)
    return ctx.m.layer_norm(x, ctx.param(f"{k}.weight", (d,)), ctx.param(f"{k}.bias", (d,)), eps=eps)


def token_rows(ctx, key: str, dim: int):
    """A learned token table (`[D]`, `[1, D]`, `[1, n, D]` or `[n, D]` in the checkpoint) as [n, D]."""
    w = ctx.weights.get(ctx.key(key))
    shape = tuple(np.shape(w)) if w is not None else (1, 1, dim)
    p = ctx.param(ctx.key(key), shape)
    n = int(np.prod(shape)) // dim if shape and shape[-1] == dim else 0
    if n < 1:
        raise ModelError(f"{ctx.key(key)}: expected a table of rows of {dim} values, got shape {list(shape)}")
    return ctx.m.reshape(p, (n, dim))


def attend(ctx, q, k, v, heads: int, causal: bool = False, mask_input: str = ""):
    """softmax(q k^T / sqrt(d)) v ([B,Sq,heads*d] q, [B,Sk,heads*d] k and v): the `attention`
    op over every key, or causal (a text tower's), or over the keys flow input `mask_input`
    [B,1,1,Sk] (bool) keeps (variable-resolution images padded to one patch count)."""
    m = ctx.m
    b, sq, n = q.dims
    d = n // heads

    def split(t):
        return m.transpose(m.reshape(t, (b, t.dims[1], heads, d)), (0, 2, 1, 3))

    mask = None
    if mask_input:
        mask = ctx.inputs.get(mask_input)
        if mask is None:
            raise ModelError(f"attention: the flow has no {mask_input!r} input (the key mask)")
    o = m.attention(split(q), split(k), split(v), mask, None, scale=1.0 / math.sqrt(d),
                    mask_kind=MaskKind.CAUSAL if causal else MaskKind.NONE)
    return m.reshape(m.transpose(o, (0, 2, 1, 3)), (b, sq, n))


# ------------------------------------------------------------------------------ embedding blocks
def flow_input(ctx, name: str, stage: str):
    """The flow input `name` a stage reads: a ModelError naming the stage where the flow has none."""
    v = ctx.inputs.get(name)
    if v is None:
        raise ModelError(f"{stage}: the flow has no {name!r} input")
    return v

@attrs.frozen
class PatchEmbed:
    """Pixels [B, C, H, W] (flow input `input`) -> patch tokens [B, (H//p)*(W//p), D]: a conv
    with stride = kernel = p is a matmul over non-overlapping patches, so the image is cut
    into patches by reshape + transpose ([B, C, gh, p, gw, p] -> [B, gh, gw, C, p, p]) and the
    conv weight [D, C, p, p] flattened to [D, C*p*p]. Rows and columns past the last whole
    patch are dropped, as the conv does."""
    weight: str
    patch: int
    bias: bool = True
    input: str = "pixel_values"

    def emit(self, ctx, value):
        m, p = ctx.m, self.patch
        x = flow_input(ctx, self.input, "patch_embed")
        b, c, h, w = x.dims
        gh, gw = h // p, w // p
        if gh < 1 or gw < 1:
            raise ModelError(f"patch_embed: a {h}x{w} image is smaller than one {p}x{p} patch")
        if h != gh * p:
            x = m.narrow(x, 2, 0, gh * p)
        if w != gw * p:
            x = m.narrow(x, 3, 0, gw * p)
        x = m.transpose(m.reshape(x, (b, c, gh, p, gw, p)), (0, 2, 4, 1, 3, 5))
        x = m.reshape(x, (b, gh * gw, c * p * p))
        k = ctx.key(self.weight)
        wt = ctx.weights.get(f"{k}.weight")
        d = int(np.shape(wt)[0]) if wt is not None else None
        wp = ctx.param(f"{k}.weight", (d, c, p, p) if d else None)
        wf = m.reshape(wp, (wp.dims[0], c * p * p))
        return m.linear(x, wf, ctx.param(f"{k}.bias", (wp.dims[0],)) if self.bias else None)


@attrs.frozen
class InsertTokens:
    """Learned tokens (a class token, register tokens) inserted into [B, S, D] at position `at`."""
    key: str
    at: int = 0

    def emit(self, ctx, x):
        m = ctx.m
        b, s, d = x.dims
        rows = token_rows(ctx, self.key, d)
        tok = m.expand(m.reshape(rows, (1, rows.dims[0], d)), (b, rows.dims[0], d))
        parts = [m.narrow(x, 1, 0, self.at)] if self.at else []
        parts.append(tok)
        if self.at < s:
            parts.append(m.narrow(x, 1, self.at, s - self.at))
        return m.concat(parts, 1)


@attrs.frozen
class ResizedPositions:
    """x [B, prefix + gh*gw, D] + a learned position table whose first `prefix` rows belong
    to the class token and whose other rows lie on a square grid. When the grid is not
    (gh, gw), those rows are resized to it (torch's interpolate: `mode`, align_corners=False,
    `antialias`) as two matmuls by constant weight matrices: param-only, so computed once at
    load time. `interpolate=False` makes a size mismatch an error naming `config_key`."""
    key: str
    grid: tuple
    prefix: int = 1
    mode: str = "bicubic"
    antialias: bool = False
    interpolate: bool = True
    config_key: str = "image_size"

    def emit(self, ctx, x):
        m = ctx.m
        d = x.dims[-1]
        k = ctx.key(self.key)
        w = ctx.weights.get(k)
        n = int(np.prod(np.shape(w))) // d if w is not None else self.prefix + self.grid[0] * self.grid[1]
        table = m.reshape(ctx.param(k, tuple(np.shape(w)) if w is not None else (n, d)), (n, d))
        side = square_grid(n - self.prefix, k)
        gh, gw = self.grid
        if (gh, gw) != (side, side):
            if not self.interpolate:
                raise ModelError(f"{k}: the model's position table is for a {side}x{side} patch grid "
                                 f"({ctx.cfg(self.config_key)} {self.config_key}); these images give "
                                 f"{gh}x{gw} patches (resize them to the config's {self.config_key}, "
                                 "or interpolate the position encoding)")
            grid = m.narrow(table, 0, self.prefix, side * side)
            rows = m.constant(resize_weights(side, gh, self.mode, self.antialias).astype(np.float32))
            cols = m.constant(resize_weights(side, gw, self.mode, self.antialias).astype(np.float32))
            g = m.matmul(rows, m.reshape(grid, (side, side * d)))                 # [gh, side*D]
            g = m.reshape(m.transpose(m.reshape(g, (gh, side, d)), (1, 0, 2)), (side, gh * d))
            g = m.matmul(cols, g)                                                 # [gw, gh*D]
            g = m.reshape(m.transpose(m.reshape(g, (gw, gh, d)), (1, 0, 2)), (gh * gw, d))
            table = m.concat([m.narrow(table, 0, 0, self.prefix), g], 0) if self.prefix else g
        return x + m.reshape(table, (1, table.dims[0], d))


@attrs.frozen
class PositionsAt:
    """x [B, S, D] + table[positions] (flow input `input` [B, S]): a text tower's positions."""
    key: str
    input: str = "positions"

    def emit(self, ctx, x):
        idx = flow_input(ctx, self.input, "positions_at")
        return x + ctx.m.gather(ctx.param(ctx.key(self.key)), idx)


@attrs.frozen
class PatchLinear:
    """Patches given already cut and flattened (flow input `input` [B, N, C*p*p]) through the
    linear patch embedding `<key>.weight` [D, C*p*p] (+ bias)."""
    key: str
    input: str = "pixel_values"

    def emit(self, ctx, value):
        x = flow_input(ctx, self.input, "patch_linear")
        return dense(ctx, x, self.key)


@attrs.frozen
class WeightedPositions:
    """x [B, N, D] + weights [B, N, R] @ table [R, D]: a learned position table resized per
    image by weights the host computes (grid_position_weights), one image's grid per row."""
    key: str
    input: str = "pos_weights"

    def emit(self, ctx, x):
        w = flow_input(ctx, self.input, "weighted_positions")
        table = ctx.param(ctx.key(self.key), (w.dims[-1], x.dims[-1]))
        return x + ctx.m.linear(w, table, None, transpose_w=False)


def grid_position_weights(side: int, grid: tuple, n: int, mode: str = "bilinear",
                          antialias: bool = True) -> np.ndarray:
    """[n, side*side] float32: row i resizes a side x side position table to token i of a
    (rows, cols) patch grid laid out row-major (torch's interpolate weights); rows past the
    grid (padding tokens) take the first position's, as the variable-resolution models do."""
    rows, cols = grid
    if rows * cols > n or rows < 1 or cols < 1:
        raise ModelError(f"a {rows}x{cols} patch grid does not fit {n} tokens")
    w = np.einsum("ip,jq->ijpq", resize_weights(side, rows, mode, antialias),
                  resize_weights(side, cols, mode, antialias)).reshape(rows * cols, side * side)
    out = np.empty((n, side * side))
    out[:rows * cols] = w
    out[rows * cols:] = w[0]
    return out.astype(np.float32)


@attrs.frozen
class TokenEmbed:
    """table[ids] for flow input `input`."""
    key: str
    input: str = "ids"

    def emit(self, ctx, value):
        idx = flow_input(ctx, self.input, "token_embed")
        return ctx.m.gather(ctx.param(ctx.key(self.key)), idx)


# ------------------------------------------------------------------------------ layers
@attrs.frozen
class VitLayerKeys:
    """Checkpoint names inside one layer (relative to its prefix). `layer_scale`: the two
    LayerScale vectors or () for none; `gate_up`: the fused [2I, D] SwiGLU input
    projection (x1 gated by SiLU, times x2) or "" for a GELU MLP through fc1 / fc2."""
    norm1: str = "layer_norm1"
    norm2: str = "layer_norm2"
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.out_proj"
    fc1: str = "mlp.fc1"
    fc2: str = "mlp.fc2"
    layer_scale: tuple = ()
    gate_up: str = ""


@attrs.frozen
class VitLayerSpec:
    hidden: int
    heads: int
    eps: float = 1e-6
    act: str = "gelu"                  # IR activation of the GELU MLP
    qkv_bias: bool = True
    causal: bool = False               # a text tower's causal self-attention
    keys: VitLayerKeys = VitLayerKeys()
    mask_input: str = ""               # a flow input [B,1,1,S] (bool): the keys to attend to

    def __attrs_post_init__(self):
        if self.heads <= 0 or self.hidden % self.heads:
            raise ModelError(f"hidden size {self.hidden} is not a multiple of {self.heads} attention heads")


@attrs.frozen
class VitSelfAttention:
    """Fused-QKV self-attention (the three projections one matmul: their weights are
    concatenated at load time) with no mask (or a causal one), then the output projection
    (`out_scale`: a LayerScale vector folded into it, dense's `scale`)."""
    spec: VitLayerSpec
    out_scale: str = ""

    def emit(self, ctx, x):
        s, m, kk = self.spec, ctx.m, self.spec.keys
        d = s.hidden
        ws = [ctx.param(ctx.key(f"{n}.weight"), (d, d)) for n in (kk.q, kk.k, kk.v)]
        bs = [ctx.param(ctx.key(f"{n}.bias"), (d,)) for n in (kk.q, kk.k, kk.v)] if s.qkv_bias else None
        qkv = m.linear(x, m.concat(ws, 0), m.concat(bs, 0) if bs else None)
        q, k, v = (m.narrow(qkv, 2, i * d, d) for i in range(3))
        o = attend(ctx, q, k, v, s.heads, s.causal, s.mask_input)
        return dense(ctx, o, kk.o, out=d, scale=self.out_scale)


@attrs.frozen
class VitMlp:
    """fc2(act(fc1(x))), or SwiGLU down(silu(x1) * x2) with [x1; x2] = gate_up(x)
    (`out_scale`: a LayerScale vector folded into fc2, dense's `scale`)."""
    spec: VitLayerSpec
    out_scale: str = ""

    def emit(self, ctx, x):
        s, m, kk = self.spec, ctx.m, self.spec.keys
        if not kk.gate_up:
            return dense(ctx, dense(ctx, x, kk.fc1, act=s.act), kk.fc2, out=s.hidden, scale=self.out_scale)
        h = dense(ctx, x, kk.gate_up)
        n = h.dims[-1] // 2
        return dense(ctx, m.silu(m.narrow(h, 2, 0, n)) * m.narrow(h, 2, n, n), kk.fc2, out=s.hidden,
                     scale=self.out_scale)


@attrs.frozen
class VitLayer:
    """A pre-norm transformer layer: x + ls1 * attn(norm1(x)), then h + ls2 * mlp(norm2(h))
    (ls: LayerScale vectors, where the spec names them, folded into the output projections)."""
    spec: VitLayerSpec

    def emit(self, ctx, x):
        s = self.spec
        ls1, ls2 = s.keys.layer_scale or ("", "")
        h = x + ctx.emit(VitSelfAttention(s, ls1), layer_norm(ctx, x, s.keys.norm1, s.eps))
        return h + ctx.emit(VitMlp(s, ls2), layer_norm(ctx, h, s.keys.norm2, s.eps))


# ------------------------------------------------------------------------------ pooling and heads
@attrs.frozen
class TokenPool:
    """Token `index` of [B, S, D] -> [B, D] (the class token: 0)."""
    index: int = 0

    def emit(self, ctx, x):
        b, _, d = x.dims
        return ctx.m.reshape(ctx.m.narrow(x, 1, self.index, 1), (b, d))


@attrs.frozen
class SelectToken:
    """One token per sequence at a position the host picks (a text's EOS or last token):
    sum over tokens of x * onehot, flow input `input` [B, S] float with a single 1 per row
    (exact: the other terms are zeros)."""
    input: str = "pool_onehot"

    def emit(self, ctx, x):
        sel = flow_input(ctx, self.input, "select_token")
        b, s, _ = x.dims
        return ctx.m.sum(x * ctx.m.reshape(sel, (b, s, 1)), (1,))


@attrs.frozen
class MeanTokens:
    """The mean over every token of [B, S, D]."""

    def emit(self, ctx, x):
        return ctx.m.mean(x, (1,))


@attrs.frozen
class Dense:
    """act(x @ W^T (+ b)) for `<key>.weight`: a pooler or a projection."""
    key: str
    bias: bool = True
    act: str = "identity"

    def emit(self, ctx, x):
        return dense(ctx, x, self.key, self.bias, self.act)


@attrs.frozen
class AttentionProbeHead:
    """Attention-probe pooling (a multihead attention pooling head): a learned query
    `probe` attends over the tokens through torch's nn.MultiheadAttention (packed
    `in_proj_weight` [3D, D] / `in_proj_bias`, `out_proj`), then h + mlp(LN(h)); [B, D]."""
    prefix: str
    heads: int
    eps: float = 1e-6
    act: str = "gelu_tanh"
    mask_input: str = ""               # a flow input [B,1,1,S] (bool): the tokens to pool over

    def emit(self, ctx, x):
        m = ctx.m
        b, s, d = x.dims
        p = ctx.key(self.prefix)
        probe = m.expand(m.reshape(token_rows(ctx, f"{self.prefix}.probe", d), (1, 1, d)), (b, 1, d))
        w = ctx.param(f"{p}.attention.in_proj_weight", (3 * d, d))
        bias = ctx.param(f"{p}.attention.in_proj_bias", (3 * d,))
        q = m.linear(probe, m.narrow(w, 0, 0, d), m.narrow(bias, 0, 0, d))
        kv = m.linear(x, m.narrow(w, 0, d, 2 * d), m.narrow(bias, 0, d, 2 * d))
        o = attend(ctx, q, m.narrow(kv, 2, 0, d), m.narrow(kv, 2, d, d), self.heads, False, self.mask_input)
        h = dense(ctx, o, f"{self.prefix}.attention.out_proj", out=d)
        y = dense(ctx, layer_norm(ctx, h, f"{self.prefix}.layernorm", self.eps), f"{self.prefix}.mlp.fc1",
                  act=self.act)
        h = h + dense(ctx, y, f"{self.prefix}.mlp.fc2", out=d)
        return m.reshape(h, (b, d))


VISION_BLOCKS = {
    "vision.patch_embed": PatchEmbed, "vision.insert_tokens": InsertTokens,
    "vision.resized_positions": ResizedPositions, "vision.positions_at": PositionsAt,
    "vision.token_embed": TokenEmbed, "vision.patch_linear": PatchLinear,
    "vision.weighted_positions": WeightedPositions, "vision.layer": VitLayer, "vision.self_attention": VitSelfAttention,
    "vision.mlp": VitMlp, "vision.token_pool": TokenPool, "vision.select_token": SelectToken,
    "vision.mean_tokens": MeanTokens, "vision.dense": Dense, "vision.attention_probe_head": AttentionProbeHead,
    "vision.l2_normalize": L2Normalize,
}

__all__ = ["PatchEmbed", "InsertTokens", "ResizedPositions", "PositionsAt", "TokenEmbed", "VitLayerKeys",
           "VitLayerSpec", "VitSelfAttention", "VitMlp", "VitLayer", "TokenPool", "SelectToken", "MeanTokens",
           "Dense", "AttentionProbeHead", "L2Normalize", "VISION_BLOCKS", "resize_weights", "resize_grid", "PatchLinear", "WeightedPositions", "grid_position_weights",
           "square_grid", "attend", "dense", "layer_norm", "token_rows", "RESIZE_MODES"]
