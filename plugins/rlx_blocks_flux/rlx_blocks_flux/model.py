"""FluxModel: a FLUX transformer compiled from FluxFlow, with diffusers' forward signature and a
flow-matching Euler sampler, so a caller holding precomputed text embeddings runs the whole
denoising loop on any backend. One executable per input shape (the flow is built at fixed
sizes: a denoising loop keeps one shape for every step)."""
from __future__ import annotations

import math

import numpy as np

from rlx_core.ir.dtype import F32
from rlx_core.ir.errors import ModelError
from rlx_core.pipeline import select_backend
from rlx_core.runtime.model import backend_lock, resolve_profile

from .config import flux_arch


# ------------------------------------------------------------------------- schedule
def flux1_mu(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
             max_shift: float = 1.15) -> float:
    """diffusers' FluxPipeline calculate_shift: mu linear in the image token count."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def flux2_mu(image_seq_len: int, num_steps: int) -> float:
    """diffusers' Flux2Pipeline compute_empirical_mu."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200, m_10 = a2 * image_seq_len + b2, a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * num_steps + (m_200 - 200.0 * a))


def flow_match_sigmas(num_steps: int, mu: float) -> np.ndarray:
    """The f32 sigmas [num_steps + 1] of FlowMatchEulerDiscreteScheduler with dynamic
    (exponential) shifting, as FLUX pipelines set them: linspace(1, 1/n, n) shifted by mu,
    then a final 0. The same numpy f32 operations diffusers runs."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 1:
        raise ModelError(f"num_steps must be an integer >= 1, got {num_steps!r}")
    s = np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32)
    e = math.exp(mu)
    s = e / (e + (1 / s - 1) ** 1.0)
    return np.append(s.astype(np.float32), np.float32(0.0)).astype(np.float32)


# ------------------------------------------------------------------------- inputs
def _array(x, name: str, rank: tuple, dtype=np.float32) -> np.ndarray:
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as e:
        raise ModelError(f"{name}: not an array ({e})") from None
    if a.dtype.kind not in "fiu" or a.ndim not in rank:
        raise ModelError(f"{name}: expected a numeric array of rank {' or '.join(map(str, rank))}, got "
                         f"{a.dtype} of shape {list(a.shape)}")
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise ModelError(f"{name}: has non-finite values")
    return np.ascontiguousarray(a, dtype=dtype)


class FluxModel:
    """A FLUX.1 / FLUX.2 transformer: `forward(...)` (one model evaluation, diffusers' inputs)
    and `denoise(...)` (the flow-matching Euler loop)."""

    graph_modes = ("forward",)

    def __init__(self, recipe, config: dict, tensors: dict, backend=None, profile=None, source: str = ""):
        self.recipe, self.config, self.tensors = recipe, dict(config), tensors
        self.arch = flux_arch(self.config)
        self.source = str(source or config.get("_name_or_path") or "model")
        self.profile = resolve_profile(profile, recipe.default_profile, source or None)
        self.backend = select_backend(backend or self.profile.backend.name or None)
        self._lock = backend_lock(self.backend)
        self._exes: dict = {}
        self._shared: dict = {}

    def __repr__(self) -> str:
        a = self.arch
        return (f"FluxModel({self.source!r}, FLUX.{a.version}, {a.double} double + {a.single} single blocks, "
                f"hidden {a.hidden}, backend={self.backend.name!r})")

    # -- graphs
    def built(self, mode: str = "forward", batch: int = 1, img_len: int = 16, txt_len: int = 8,
              guidance: bool | None = None):
        """The flow at these sizes built on this model's tensors (HIR graph, params, stages and
        stream records), not yet compiled: what `executable` compiles and `rlx inspect` shows."""
        if mode != "forward":
            raise ModelError(f"mode {mode!r}: a FLUX model has one graph, 'forward'")
        flow = self.recipe.flow(self.config, batch, img_len, txt_len, guidance, self.profile)
        return flow.build(self.tensors, self.config, F32)

    def executable(self, batch: int, img_len: int, txt_len: int, guidance: bool):
        key = (batch, img_len, txt_len, guidance)
        with self._lock:
            if key not in self._exes:
                built = self.built("forward", *key)
                exe = built.compile(self.backend, self.profile, shared=self._shared)
                self._exes[key] = exe
            return self._exes[key]

    # -- running
    def feed(self, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance=None,
             pooled_projections=None) -> dict:
        """The checked graph inputs (ModelError naming the input that does not fit)."""
        a = self.arch
        x = _array(hidden_states, "hidden_states", (3,))
        b, si, c = x.shape
        if c != a.in_channels:
            raise ModelError(f"hidden_states: {c} channels per token, the model takes {a.in_channels} "
                             "(packed latents: in_channels)")
        e = _array(encoder_hidden_states, "encoder_hidden_states", (3,))
        if e.shape[0] != b or e.shape[2] != a.joint_dim:
            raise ModelError(f"encoder_hidden_states: expected [{b}, text tokens, {a.joint_dim}] "
                             f"(joint_attention_dim), got {list(e.shape)}")
        feed = {"hidden_states": x, "encoder_hidden_states": e,
                "timestep": self._per_row(timestep, "timestep", b)}
        for name, ids, n in (("img_ids", img_ids, si), ("txt_ids", txt_ids, e.shape[1])):
            ids = _array(ids, name, (2, 3))
            if ids.ndim == 3:                   # diffusers' deprecated [1, tokens, axes]
                ids = ids[0]
            if ids.shape != (n, len(a.axes)):
                what = "image tokens of hidden_states" if name == "img_ids" else "text tokens of encoder_hidden_states"
                raise ModelError(f"{name}: expected [{n}, {len(a.axes)}] ({n} {what}, one column per RoPE axis), "
                                 f"got {list(ids.shape)}")
            feed[name] = ids
        if guidance is not None and not a.guidance:
            raise ModelError("guidance: this model has no guidance embedder (guidance_embeds is false)")
        if a.guidance:
            if guidance is None:
                raise ModelError("guidance: this guidance-distilled model needs a guidance scale")
            feed["guidance"] = self._per_row(guidance, "guidance", b)
        if a.version == 1:
            if pooled_projections is None:
                raise ModelError(f"pooled_projections: FLUX.1 needs the pooled text embedding [{b}, {a.pooled_dim}]")
            p = _array(pooled_projections, "pooled_projections", (2,))
            if p.shape != (b, a.pooled_dim):
                raise ModelError(f"pooled_projections: expected [{b}, {a.pooled_dim}] (pooled_projection_dim), "
                                 f"got {list(p.shape)}")
            feed["pooled_projections"] = p
        elif pooled_projections is not None:
            raise ModelError("pooled_projections: FLUX.2 takes no pooled projections")
        return feed

    @staticmethod
    def _per_row(v, name: str, b: int) -> np.ndarray:
        a = _array(v, name, (0, 1))
        if a.ndim == 0 or a.shape == (1,):
            return np.full(b, a.reshape(-1)[0], np.float32)
        if a.shape != (b,):
            raise ModelError(f"{name}: expected a scalar or [{b}] (one per batch row), got {list(a.shape)}")
        return a

    def forward(self, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance=None,
                pooled_projections=None) -> np.ndarray:
        """One transformer evaluation, diffusers' inputs (timestep in [0, 1]) -> the predicted
        velocity [batch, image tokens, out channels]."""
        feed = self.feed(hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance,
                         pooled_projections)
        b, si, _ = feed["hidden_states"].shape
        exe = self.executable(b, si, feed["encoder_hidden_states"].shape[1], "guidance" in feed)
        with self._lock:
            return exe.run(feed)["logits"]

    __call__ = forward

    # -- rlx_core.testing's batch and fused/composed checks (this model takes no token ids)
    def kit_rows(self, rng) -> list:
        """Two single-sample inputs: a 2 x 3 latent grid, 5 text tokens, their own timesteps."""
        a = self.arch
        rows = []
        for t in (0.3, 0.8):
            r = {"hidden_states": rng.standard_normal((1, 6, a.in_channels)).astype(np.float32),
                 "encoder_hidden_states": rng.standard_normal((1, 5, a.joint_dim)).astype(np.float32),
                 "timestep": np.array([t], np.float32), "img_ids": latent_ids(2, 3, len(a.axes)),
                 "txt_ids": np.zeros((5, len(a.axes)), np.float32)}
            if a.guidance:
                r["guidance"] = np.array([3.5], np.float32)
            if a.version == 1:
                r["pooled_projections"] = rng.standard_normal((1, a.pooled_dim)).astype(np.float32)
            rows.append(r)
        return rows

    @staticmethod
    def kit_batch(rows: list) -> dict:
        """Rows stacked on the batch axis (the position ids are the same for every row)."""
        return {k: v if k.endswith("_ids") else np.concatenate([r[k] for r in rows]) for k, v in rows[0].items()}

    def kit_outputs(self, feed: dict) -> dict:
        return {"velocity": self.forward(**feed)}

    def denoise(self, latents, prompt_embeds, img_ids, txt_ids, num_steps: int = 28, guidance: float | None = 3.5,
                pooled_prompt_embeds=None, mu: float | None = None, callback=None) -> np.ndarray:
        """The flow-matching Euler loop of diffusers' FLUX pipelines from packed `latents`
        [batch, image tokens, in_channels]: sigmas from FlowMatchEulerDiscreteScheduler with
        dynamic shifting (mu from the image token count, FLUX.1's or FLUX.2's rule, unless
        given), each step x += (sigma_next - sigma) * v. `guidance` is ignored by a model
        without guidance embeds. `callback(i, sigma, latents)` after each step."""
        x = _array(latents, "latents", (3,))
        n = x.shape[1]
        if mu is None:
            mu = flux1_mu(n) if self.arch.version == 1 else flux2_mu(n, num_steps)
        sigmas = flow_match_sigmas(num_steps, float(mu))
        g = guidance if self.arch.guidance else None
        for i in range(num_steps):
            t = (sigmas[i] * np.float32(1000.0)) / np.float32(1000.0)      # the pipeline's timestep / 1000
            v = self.forward(x, prompt_embeds, np.full(x.shape[0], t, np.float32), img_ids, txt_ids, g,
                             pooled_prompt_embeds)
            x = (x + (sigmas[i + 1] - sigmas[i]) * v).astype(np.float32)
            if callback is not None:
                callback(i, float(sigmas[i]), x)
        return x


def latent_ids(height: int, width: int, axes: int = 3) -> np.ndarray:
    """Image position ids of a height x width grid of packed latent tokens, as FLUX pipelines
    make them: column 1 the row, column 2 the column, the others 0."""
    ids = np.zeros((height, width, axes), np.float32)
    ids[..., 1] = np.arange(height, dtype=np.float32)[:, None]
    ids[..., 2] = np.arange(width, dtype=np.float32)[None, :]
    return ids.reshape(height * width, axes)


__all__ = ["FluxModel", "flow_match_sigmas", "flux1_mu", "flux2_mu", "latent_ids"]
