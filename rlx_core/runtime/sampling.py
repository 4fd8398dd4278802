"""Next-token choice: one parameters class for `CausalLM.generate` and the Scheduler, with HF
generate's names and meanings where HF has them (OpenAI's for presence/frequency penalties
and logit_bias, vLLM's for n, ignore_eos, logprobs, prompt_logprobs).

A step's logits go through, in this order: the constraint's mask (disallowed tokens -inf),
the EOS ban until min_new_tokens, the repetition penalty (HF: over prompt + output), the
presence and frequency penalties (OpenAI: over the output), the logit bias; then greedy
takes the arg-max, sampling warps them (HF's order: temperature, top-k, top-p, min-p,
typical-p) and draws. Logprobs are of the model's raw distribution: a float64 log-softmax
of the logits the step computed, before any of this (as OpenAI and vLLM report them)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

import numpy as np

from ..ir.errors import ModelError
from .args import bool_arg, callable_arg, float_arg, int_arg, text_arg
from .constraint import Constraint, ConstraintFactory

MAX_LOGPROBS = 20            # OpenAI's top_logprobs range (0..20); vLLM's default cap too
# llama-server takes `stop` as a JSON array without a limit (OpenAI allows 4); every string is
# searched in the new text after each token, so a cap keeps a request from costing a scan of
# thousands of strings per token.
MAX_STOP_STRINGS = 64
MAX_LOGIT_BIAS = 100.0       # OpenAI: each bias in [-100, 100]
MAX_PENALTY = 2.0            # OpenAI: presence/frequency penalties in [-2, 2]


def _logit_bias(v) -> tuple:
    """((token_id, bias), ...) sorted by id from a {token_id: bias} dict (JSON's decimal string
    keys taken too) or pairs."""
    if v is None:
        return ()
    items = v.items() if isinstance(v, dict) else v
    out = {}
    try:
        pairs = [tuple(p) for p in items]
    except TypeError:
        raise ModelError(f"logit_bias must be a {{token_id: bias}} dict, got {type(v).__name__}") from None
    for pair in pairs:
        if len(pair) != 2:
            raise ModelError(f"logit_bias must be a {{token_id: bias}} dict, got the entry {pair!r}")
        k, b = pair
        if isinstance(k, str) and k.strip().isdigit():
            k = int(k)
        tok = int_arg("logit_bias key (a token id)", k)
        out[tok] = float_arg(f"logit_bias[{tok}]", b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return tuple(sorted(out.items()))


def _stop(v) -> tuple:
    if v is None:
        return ()
    if isinstance(v, str):
        v = (v,)
    if not isinstance(v, (list, tuple)):
        raise ModelError(f"stop must be a string or a list of strings, got {type(v).__name__}")
    if len(v) > MAX_STOP_STRINGS:
        raise ModelError(f"stop has {len(v)} strings; at most {MAX_STOP_STRINGS} are allowed")
    out = tuple(text_arg("stop", s) for s in v)
    if not all(out):
        raise ModelError("stop strings must be non-empty")
    return out


def _count(name: str, v) -> int | None:
    """None, or a logprobs count in [0, MAX_LOGPROBS]."""
    if v is None:
        return None
    if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)) or not 0 <= v <= MAX_LOGPROBS:
        raise ModelError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {v!r}")
    return int(v)


ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}   # OpenAI's / vLLM's names


@dataclass(frozen=True)
class SamplingParams:
    """How a generation chooses and stops, made once from checked arguments (`checked`).
    Where a setting makes the choice differ from the logits' arg-max or needs the logits,
    `argmax` is false (the graphs' greedy ids are then not the choice)."""
    max_new_tokens: int = 32
    min_new_tokens: int = 0          # EOS is banned until this many tokens are out
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float | None = 1.0
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()           # ((token_id, bias), ...)
    seed: int | None = None
    stop: tuple = ()                 # strings that end the text (not included)
    n: int = 1                       # choices per prompt, sharing its prefill
    ignore_eos: bool = False         # EOS does not end the sequence
    logprobs: int | None = None      # None, or how many top alternatives (0: the chosen token's only)
    prompt_logprobs: int | None = None
    constraint: ConstraintFactory | None = None

    def __post_init__(self):         # (a JSON round trip gives lists: back to tuples)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @classmethod
    def checked(cls, **kw: Any) -> SamplingParams:
        """The parameters from keywords (the fields; max_tokens and min_tokens as aliases),
        each checked: a bad one is a ModelError naming it and its range."""
        said = {name: name for name in ALIASES.values()}     # the name the caller used, for errors
        for alias, name in ALIASES.items():
            if alias in kw:
                if name in kw:
                    raise ModelError(f"pass {name} or {alias}, not both")
                kw[name], said[name] = kw.pop(alias), alias
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise ModelError(f"unknown sampling argument(s) {unknown}; expected some of "
                             f"{sorted(known | set(ALIASES))}")
        d = {f.name: f.default for f in fields(cls)} | kw
        max_name, min_name = said["max_new_tokens"], said["min_new_tokens"]
        max_new = int_arg(max_name, d["max_new_tokens"])
        min_new = int_arg(min_name, d["min_new_tokens"])
        if min_new > max_new:
            raise ModelError(f"{min_name} ({min_new}) is more than {max_name} ({max_new})")
        do_sample = bool_arg("do_sample", d["do_sample"])
        temperature = float_arg("temperature", 1.0 if d["temperature"] is None else d["temperature"], 0.0)
        if temperature == 0 and do_sample:
            raise ModelError("temperature must be > 0 when sampling (do_sample=True), got 0")
        return cls(
            max_new, min_new, do_sample, temperature,
            top_k=int_arg("top_k", d["top_k"], none=True),
            top_p=float_arg("top_p", d["top_p"], 0.0, 1.0, lo_open=True, none=True),
            min_p=float_arg("min_p", d["min_p"], 0.0, 1.0, none=True),
            typical_p=float_arg("typical_p", d["typical_p"], 0.0, 1.0, lo_open=True, none=True),
            repetition_penalty=float_arg("repetition_penalty", d["repetition_penalty"], 0.0, lo_open=True),
            presence_penalty=float_arg("presence_penalty", d["presence_penalty"], -MAX_PENALTY, MAX_PENALTY),
            frequency_penalty=float_arg("frequency_penalty", d["frequency_penalty"], -MAX_PENALTY,
                                        MAX_PENALTY),
            logit_bias=_logit_bias(d["logit_bias"]),
            seed=int_arg("seed", d["seed"], none=True),
            stop=_stop(d["stop"]),
            n=int_arg("n", d["n"], lo=1),
            ignore_eos=bool_arg("ignore_eos", d["ignore_eos"]),
            logprobs=_count("logprobs", d["logprobs"]),
            prompt_logprobs=_count("prompt_logprobs", d["prompt_logprobs"]),
            constraint=callable_arg("constraint", d["constraint"]))

    # OpenAI's / vLLM's names, read-only
    @property
    def max_tokens(self) -> int:
        return self.max_new_tokens

    @property
    def min_tokens(self) -> int:
        return self.min_new_tokens

    @property
    def processes(self) -> bool:
        """Whether a step's logits change before the choice (penalties, bias, a constraint)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or self.constraint is not None)

    @property
    def argmax(self) -> bool:
        """Whether each next token is its raw logits' arg-max and nothing else needs the logits
        (`checked_greedy` checks the EOS ban)."""
        return not (self.do_sample or self.processes or self.logprobs is not None)

    def bans_eos(self, n_new: int) -> bool:
        """Whether EOS may not be chosen after n_new new tokens."""
        return n_new < self.min_new_tokens

    def check_vocab(self, vocab: int | None) -> None:
        """logit_bias's token ids within the model's vocabulary."""
        for tok, _ in self.logit_bias:
            if vocab and tok >= vocab:
                raise ModelError(f"logit_bias key {tok} is not a token id in [0, {vocab})")

    # -- one step
    def process(self, logits: np.ndarray, *, seen: Sequence, generated: Sequence, n_new: int, eos: tuple,
                constraints: Sequence | None = None) -> np.ndarray:
        """float64 logits [batch, vocab] after the mask, the EOS ban, the penalties and the bias
        (the order in the module's docstring); seen[b] / generated[b]: row b's prompt + output
        ids / output ids."""
        x = np.array(logits, np.float64)
        if constraints is not None:
            mask_allowed(x, constraints)
        if self.bans_eos(n_new) and eos:
            x[:, list(eos)] = -np.inf
        if self.repetition_penalty != 1.0:
            repetition_penalty(x, seen, self.repetition_penalty)
        if self.presence_penalty or self.frequency_penalty:
            presence_frequency_penalty(x, generated, self.presence_penalty, self.frequency_penalty)
        if self.logit_bias:
            add_logit_bias(x, self.logit_bias)
        return x

    def choose(self, x: np.ndarray, rngs: Sequence) -> np.ndarray:
        """The next token [batch] from processed logits: arg-max, or a draw (rngs[b] row b's)."""
        bad = np.flatnonzero(~np.isfinite(x).any(-1))
        if bad.size:
            raise ModelError(f"no token may follow in row {int(bad[0])}: the constraint, the EOS ban "
                             "(min_new_tokens) and the logit bias leave none")
        if not self.do_sample:
            return np.argmax(x, axis=-1)
        w = warp(x, self.temperature, self.top_k, self.top_p, self.min_p, self.typical_p)
        p = np.exp(w - w.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.array([rng.choice(p.shape[-1], p=row) for rng, row in zip(rngs, p)])


Sampling = SamplingParams           # (the name `generate`'s code used)


def process_logits(logits: np.ndarray, *, n_new: int, min_new_tokens: int, eos_ids, inplace: bool = False):
    """Logits with EOS banned until min_new_tokens (the greedy path's one processing step)."""
    return SamplingParams(min_new_tokens=min_new_tokens).process(logits, seen=(), generated=(), n_new=n_new,
                                                                  eos=tuple(eos_ids))


def choose(logits: np.ndarray, rng, do_sample: bool, temperature: float, top_k, top_p) -> np.ndarray:
    """The next tokens of processed logits: arg-max, or a draw from one rng for every row."""
    p = SamplingParams(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    return p.choose(np.asarray(logits, np.float64), [rng] * len(logits))


# -- logits processors (each in place on float64 [batch, vocab]; one definition per rule)
def mask_allowed(x: np.ndarray, constraints: Sequence) -> None:
    """Row b's tokens its constraint does not allow to -inf. EOS is a token like the others
    here: allowed where the mask allows it (a complete output that may go on); a finished
    constraint forces it (the caller's choice, not a mask)."""
    for b, c in enumerate(constraints):
        if c is None:
            continue
        allowed = c.allowed()
        if allowed is not None:
            allowed = np.asarray(allowed, bool)
            if allowed.shape != (x.shape[1],):
                raise ModelError(f"constraint.allowed() must be a bool [{x.shape[1]}] array (the "
                                 "vocabulary), "
                                 f"got shape {allowed.shape}")
            x[b, ~allowed] = -np.inf


def repetition_penalty(x: np.ndarray, seen: Sequence, penalty: float) -> None:
    """HF's rule: a seen token's logit divided by the penalty when positive, multiplied when not."""
    for b, ids in enumerate(seen):
        if len(ids):
            u = np.unique(np.asarray(ids, np.int64))
            v = x[b, u]
            x[b, u] = np.where(v > 0, v / penalty, v * penalty)


def presence_frequency_penalty(x: np.ndarray, generated: Sequence, presence: float, frequency: float) -> None:
    """OpenAI's rule over the generated tokens: logit -= count * frequency + (count > 0) * presence."""
    for b, ids in enumerate(generated):
        if len(ids):
            count = np.bincount(np.asarray(ids, np.int64), minlength=x.shape[1])[:x.shape[1]]
            x[b] -= count * frequency + (count > 0) * presence


def add_logit_bias(x: np.ndarray, bias: Sequence) -> None:
    """OpenAI's logit_bias: each (token, bias) added to that token's logit in every row."""
    toks = np.array([t for t, _ in bias], np.int64)
    x[:, toks] += np.array([v for _, v in bias], np.float64)


def warp(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None,
         min_p: float | None = None, typical_p: float | None = None) -> np.ndarray:
    """float64 logits shifted so each row's max is 0, divided by the temperature (no overflow
    for any temperature > 0), then HF's top-k, top-p, min-p and typical-p filters (removed
    tokens -inf; each keeps at least one)."""
    x = np.array(logits, np.float64)
    x -= x.max(-1, keepdims=True)
    if temperature and temperature != 1.0:
        x /= temperature
    if top_k and 0 < top_k < x.shape[-1]:
        kth = np.partition(x, -top_k, axis=-1)[:, -top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    if top_p is not None and top_p < 1.0:
        x = _top_p(x, top_p)
    if min_p:
        p = _softmax(x)
        x = np.where(p < min_p * p.max(-1, keepdims=True), -np.inf, x)
    if typical_p is not None and typical_p < 1.0:
        x = _typical(x, typical_p)
    return x


def _softmax(x: np.ndarray) -> np.ndarray:
    p = np.exp(x - x.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _top_p(x: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(x, axis=-1, kind="stable")          # ascending, as HF
    sorted_x = np.take_along_axis(x, order, axis=-1)
    cum = np.cumsum(_softmax(sorted_x), axis=-1)
    remove = cum <= (1 - top_p)
    remove[:, -1] = False                                   # keep at least one
    rm = np.zeros_like(remove)
    np.put_along_axis(rm, order, remove, axis=-1)
    return np.where(rm, -np.inf, x)


def _typical(x: np.ndarray, mass: float) -> np.ndarray:
    """HF's TypicalLogitsWarper: keep the tokens whose surprisal is nearest the entropy, up to
    `mass` of probability."""
    logp = log_softmax(x)
    p = np.exp(logp)
    with np.errstate(invalid="ignore"):
        ent = -np.nansum(logp * p, -1, keepdims=True)
    shifted = np.abs(-logp - ent)
    order = np.argsort(shifted, axis=-1, kind="stable")
    sorted_shift = np.take_along_axis(shifted, order, -1)
    cum = np.cumsum(_softmax(np.take_along_axis(x, order, -1)), -1)
    last = np.minimum((cum < mass).sum(-1), x.shape[-1] - 1)
    remove = sorted_shift > np.take_along_axis(sorted_shift, last[:, None], -1)
    remove[:, 0] = False
    rm = np.zeros_like(remove)
    np.put_along_axis(rm, order, remove, axis=-1)
    return np.where(rm, -np.inf, x)


# -- logprobs
@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the `top` alternatives ((token, logprob), best first)."""
    token: int
    logprob: float
    top: tuple = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis."""
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _log_softmax_fast(logits: np.ndarray) -> np.ndarray:
    """log_softmax with the exponentials in float32 and their sum and the result in float64:
    within 1e-7 of it at half the time (a decode step pays this per token)."""
    x = np.asarray(logits, np.float32)
    m = x.max(-1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(-1, keepdims=True, dtype=np.float64)) + m
    return x - lse


def best_tokens(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest values of `row`, largest first, ties to the lower id (a stable
    sort's order) from a partition: a full sort of a 49k vocabulary took 4 ms a token."""
    k = min(k, row.size)
    kth = np.partition(row, row.size - k)[row.size - k]
    above = np.flatnonzero(row > kth)
    best = np.concatenate([above, np.flatnonzero(row == kth)[:k - above.size]])
    return best[np.lexsort((best, -row[best]))]


def token_logprobs(logits: np.ndarray, tokens: Any, k: int | None) -> list:
    """A TokenLogprob per row of the raw logits [rows, vocab] for tokens[row], with its k best."""
    lp = _log_softmax_fast(logits)
    out = []
    for row, tok in zip(lp, tokens):
        top: tuple = ()
        if k:
            top = tuple((int(t), float(row[t])) for t in best_tokens(row, k))
        out.append(TokenLogprob(int(tok), float(row[int(tok)]), top))
    return out


def prompt_token_logprobs(logits: np.ndarray, prompt: Sequence, k: int | None) -> list:
    """The prompt's logprobs from the logits at its positions [seq, vocab]: None for the first
    token (nothing predicts it), then each token under the logits before it."""
    return [None] + token_logprobs(logits[:-1], prompt[1:], k)


@dataclass(frozen=True)
class Asked:
    """A constraint's answers for the coming step (`ask`), taken while the device runs it: the
    sampler reads them as it would the constraint's."""
    mask: np.ndarray | None
    done: bool

    def allowed(self) -> np.ndarray | None:
        return self.mask

    def finished(self) -> bool:
        return self.done


def ask(c: Constraint) -> Asked:
    return Asked(c.allowed(), c.finished())


def check_constraint(c: Any) -> Constraint:
    if not all(callable(getattr(c, m, None)) for m in ("allowed", "accept", "finished")):
        raise ModelError("constraint() must give a Constraint (allowed, accept, finished), got "
                         f"{type(c).__name__}")
    return c


__all__ = ["SamplingParams", "Sampling", "TokenLogprob", "MAX_LOGPROBS", "MAX_STOP_STRINGS", "warp",
           "process_logits", "choose", "mask_allowed", "repetition_penalty", "presence_frequency_penalty",
           "add_logit_bias", "log_softmax",
           "token_logprobs", "prompt_token_logprobs", "check_constraint", "Asked", "ask"]
