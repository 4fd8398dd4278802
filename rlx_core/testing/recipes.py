"""Recipe conformance: a recipe's tiny random model, built through `recipe.build` like a
checkpoint, must give the same outputs

* fused and composed (the recipe's profile, against every HIR block decomposed into
  primitives with fusion skipped),
* decoding with its KV cache and recomputing every position (causal LMs),
* for a batch of rows of different lengths (padded, masked) and for each row alone.

A recipe opts in with two methods (rlx_register_recipes documents them):
`tiny_config() -> dict` (a small config of its model type) and
`tiny_tensors(config, rng) -> dict` (random checkpoint tensors for that config).
A model that takes no token ids (a diffusion transformer) gives the kit its inputs itself:
`kit_rows(rng) -> [feed of one batch row]`, `kit_batch(rows) -> feed` and
`kit_outputs(feed) -> {name: [batch, ...]}`.
"""
from __future__ import annotations

import numpy as np
import pytest

from rlx_core.ir.dtype import DType
from rlx_core.ir.errors import ModelError
from rlx_core.runtime.encoder import Encoder
from rlx_core.runtime.model import CausalLM
from rlx_core.weights.checkpoint import Checkpoint

from .parity import TOL, assert_close
from .session import selected

# the composed build: every HIR block decomposed into primitives, nothing fused
COMPOSED = {"fusion": {"policy": "fusable", "skip": True}}
# a whole tiny model's outputs computed in another order: twice one op's tolerance (TOL;
# the project's recipes differ by 2.4e-6 at most, relative to the largest output)
MODEL_TOL_FACTOR = 2
LENGTHS = (5, 9, 2)           # rows of a batch (the longest beyond a tiny sliding window)


# ----------------------------------------------------------------------------- recipes
def all_recipes() -> dict:
    """name -> recipe, each registered recipe once (a recipe claims several model types)."""
    from rlx_core.plugins.manager import registry

    out: dict = {}
    for r in registry().recipes.values():
        out.setdefault(getattr(r, "name", type(r).__name__), r)
    return dict(sorted(out.items()))


def recipe_named(name: str):
    """The recipe called `name`, or claiming model type `name` (ModelError listing them)."""
    from rlx_core.plugins.manager import registry

    recipes = all_recipes()
    found = recipes.get(name) or registry().recipes.get(name)
    if found is None:
        raise ModelError(f"no recipe named {name!r}; recipes: {sorted(recipes)}")
    return found


def why_untestable(recipe) -> str:
    """Why the kit cannot build `recipe`'s tiny model ('' when it can)."""
    lacking = [m for m in ("tiny_config", "tiny_tensors") if not callable(getattr(recipe, m, None))]
    return f"recipe {recipe.name!r} provides no {' / '.join(lacking)}()" if lacking else ""


def check_recipe_option(name: str) -> None:
    """`--rlx-recipe NAME` must name a recipe the kit can test (ModelError otherwise)."""
    why = why_untestable(recipe_named(name))
    if why:
        raise ModelError(why)


def recipe_params(only=None) -> list:
    """pytest params of the recipes to check: `--rlx-recipe`'s, else those of `only` (names),
    else every registered one; one without a tiny model is skipped with the reason."""
    want = selected("rlx_recipe")
    keep = None if want is None else recipe_named(want)
    out = []
    for name, r in all_recipes().items():
        if (keep is not None and r is not keep) or (only is not None and name not in only):
            continue
        why = why_untestable(r)
        out.append(pytest.param(name, id=name, marks=(pytest.mark.skip(reason=why),) if why else ()))
    return out


@pytest.fixture
def rlx_recipe(request):
    """The recipe under test (parametrized by the kit's pytest plugin)."""
    if not hasattr(request, "param"):
        raise pytest.UsageError("the rlx_recipe fixture is parametrized by the rlx_core.testing "
                                "pytest plugin: load it with -p rlx_core.testing")
    return recipe_named(request.param)


def recipe_backend() -> str:
    """The backend the recipe checks run on: `--rlx-backend`'s, else numpy."""
    return selected("rlx_backend") or "numpy"


# ----------------------------------------------------------------------------- models
def tiny_checkpoint(recipe, rng) -> Checkpoint:
    """The recipe's tiny config with random tensors, as a checkpoint `recipe.build` reads."""
    config = dict(recipe.tiny_config())
    return Checkpoint(f"tiny-{recipe.name}", "tiny", config, recipe.tiny_tensors(config, rng), None)


def build(recipe, ckpt: Checkpoint, backend: str | None = None, profile=None):
    """`recipe.build(ckpt)`: a CausalLM, an Encoder or a model with the kit_* methods
    (anything else is a ModelError)."""
    model = recipe.build(ckpt, backend=backend or recipe_backend(), profile=profile)
    if not isinstance(model, (CausalLM, Encoder)) and not _feeds_itself(model):
        raise ModelError(f"recipe {recipe.name!r} built a {type(model).__name__}; the kit checks "
                         "CausalLM and Encoder models and models with kit_rows / kit_batch / kit_outputs")
    return model


def _feeds_itself(model) -> bool:
    return all(callable(getattr(model, m, None)) for m in ("kit_rows", "kit_batch", "kit_outputs"))


def composed_profile(model):
    return model.profile.evolve(name=f"{model.profile.name}+composed", **COMPOSED)


def sample_rows(model, rng, lengths=LENGTHS) -> list:
    """Rows of random token ids (not 0, the usual pad id) of the given lengths (or the
    model's own kit_rows)."""
    if _feeds_itself(model):
        return model.kit_rows(rng)
    vocab = int(model.config["vocab_size"])
    return [rng.integers(1, vocab, n).astype(np.int64) for n in lengths]


def padded(model, rows: list) -> tuple:
    """(ids, mask) of `rows` padded the model's way: left for a causal LM, right for an
    encoder; (its kit_batch, None) for a model that feeds itself."""
    if _feeds_itself(model):
        return model.kit_batch(rows), None
    s = max(len(r) for r in rows)
    ids = np.zeros((len(rows), s), np.int64)
    mask = np.zeros((len(rows), s), bool)
    for b, r in enumerate(rows):
        at = slice(s - len(r), s) if isinstance(model, CausalLM) else slice(0, len(r))
        ids[b, at], mask[b, at] = r, True
    return ids, mask


def outputs(model, ids, mask=None) -> dict:
    """Every output the model gives for padded ids: logits, or the encoder's outputs (or a
    model's kit_outputs of its kit_batch feed)."""
    if _feeds_itself(model):
        return model.kit_outputs(ids)
    if isinstance(model, CausalLM):
        return {"logits": model.logits(ids, mask)}
    return model.forward(ids, mask)


def assert_outputs_agree(got: dict, want: dict, what: str, mask=None) -> None:
    """Equal outputs (within a whole model's tolerance of their dtype); `mask` [batch, seq]
    limits per-token outputs to real tokens."""
    assert sorted(got) == sorted(want), f"{what}: outputs {sorted(got)}, expected {sorted(want)}"
    for name in want:
        g, w = np.asarray(got[name]), np.asarray(want[name])
        if mask is not None and g.shape[:2] == mask.shape:
            g, w = g[mask], w[mask]
        dt = DType.parse(g.dtype)
        tol = MODEL_TOL_FACTOR * TOL[dt] if dt.is_float else None
        assert_close(g, w, dt, f"{what}: output {name}", tol)


def assert_models_agree(a, b, ids, mask=None, what: str = "") -> None:
    """Models `a` and `b` give the same outputs for the padded `ids`."""
    assert_outputs_agree(outputs(a, ids, mask), outputs(b, ids, mask), what or "models differ", mask)


# ----------------------------------------------------------------------------- checks
def check_fused_equals_composed(recipe, ckpt: Checkpoint, rng) -> None:
    """The recipe's profile against COMPOSED on a padded batch: a padding query row of a causal
    LM attends to no key, and the composed softmax must give it zeros as the kernels do (a NaN
    there reaches the real tokens through the next layer's values)."""
    model = build(recipe, ckpt)
    composed = build(recipe, ckpt, profile=composed_profile(model))
    ids, mask = padded(model, sample_rows(model, rng))
    what = f"{recipe.name}: profile {model.profile.name!r} against {composed.profile.name!r}"
    assert_models_agree(model, composed, ids, mask, what=what)


def decode_logits(model: CausalLM, ids: np.ndarray, prompt: int) -> np.ndarray:
    """Logits at positions prompt-1 .. n-1 of rows `ids` [batch, n]: a prefill of the first
    `prompt` tokens, then one decode step per token, each reading the KV cache (the tokens
    are given, not sampled: teacher forcing)."""
    b, n = ids.shape
    ctx = n + 3                             # unused cache columns stay masked
    prefill, decode = model.executable("prefill"), model.executable("decode")
    prefill.fixed_dims = decode.fixed_dims = {"ctx": ctx}
    pos = np.broadcast_to(np.arange(n, dtype=np.int64), (b, n))
    mask = np.zeros((b, ctx), bool)
    mask[:, :prompt] = True
    out = [prefill.run({"ids": ids[:, :prompt], "positions": pos[:, :prompt],
                        "key_mask": mask[:, None, None, :prompt],
                        "cache_pos": np.zeros(b, np.int32)})["logits"][:, -1]]
    for t in range(prompt, n):
        mask[:, t] = True
        out.append(decode.run({"ids": ids[:, t:t + 1], "positions": pos[:, t:t + 1],
                               "key_mask": mask[:, None, None, :], "cache_pos": np.full(b, t, np.int32)}
                              )["logits"][:, -1])
    return np.stack(out, 1)


def check_decode_equals_recompute(recipe, ckpt: Checkpoint, rng) -> None:
    """Causal LMs: the logits of decode steps over the KV cache against every position's."""
    model = build(recipe, ckpt)
    if not isinstance(model, CausalLM):
        pytest.skip(f"recipe {recipe.name!r} builds {type(model).__name__} models; decoding is for "
                    "causal LMs")
    ids = np.stack(sample_rows(model, rng, (max(LENGTHS),) * 2))
    prompt = 3
    full = model.logits(ids)[:, prompt - 1:]
    assert_outputs_agree({"logits": decode_logits(model, ids, prompt)}, {"logits": full},
                         f"{recipe.name}: prefill of {prompt} tokens + decode steps against recompute")


def check_batch_equals_rows(recipe, ckpt: Checkpoint, rng) -> None:
    """Each row of a padded batch (its real tokens) against the row run alone; an encoder's
    embed() (sorted, batched, packed where the backend has the kernels) against one by one."""
    model = build(recipe, ckpt)
    rows = sample_rows(model, rng)
    ids, mask = padded(model, rows)
    batch = outputs(model, ids, mask)
    for b, r in enumerate(rows):
        got = {k: v[b][mask[b]] if mask is not None and v.shape[:2] == mask.shape else v[b]
               for k, v in batch.items()}
        alone = {k: v[0] for k, v in outputs(model, *(padded(model, [r]) if mask is None else (r[None],))).items()}
        size = "" if mask is None else f" ({len(r)} tokens)"
        assert_outputs_agree(got, alone, f"{recipe.name}: row {b}{size} of a padded batch against alone")
    if isinstance(model, Encoder):
        lists = [r.tolist() for r in rows]
        one_by_one = np.concatenate([model.embed([x], batch_size=1) for x in lists])
        assert_outputs_agree({"embedding": model.embed(lists, batch_size=len(rows))},
                             {"embedding": one_by_one}, f"{recipe.name}: embed() of a batch against one "
                                                        "row at a time")
