"""What a loaded model holds in memory, by kind, on any backend: the weights (resident
params and derived ones, each buffer once), KV caches (states), the activation arenas of
its compiled runners, and what a backend's memory pool keeps beyond what is in use.
`kv_bytes` counts every state; `state_bytes` is the part of it whose states have no context
axis (a recurrent layer's conv and delta-rule states: constant in the context length)."""
from __future__ import annotations


def _nbytes(buf) -> int:
    return int(getattr(buf, "nbytes", 0) or 0)


def weight_bytes(shared: dict) -> int:
    """Resident params of a model's executables (`shared`: uploaded as (host, device) pairs,
    derived ones as device buffers), each buffer counted once."""
    seen: dict = {}
    for v in shared.values():
        buf = v[1] if isinstance(v, tuple) else v
        seen[id(buf)] = _nbytes(buf)
    return sum(seen.values())


def arena_bytes(exes) -> int:
    """The planned arenas of every live runner of `exes` (each runner holds its own)."""
    total = 0
    for exe in exes:
        for key in list(exe._runners):
            lir = exe.lir_cache.get(key)
            total += lir.arena_bytes if lir is not None else 0
    return total


def fixed_state_names(exes) -> set:
    """Names of the states of `exes` without a context ("ctx") axis: per-row states whose
    size does not grow with the context (recurrent states, ring buffers)."""
    return {n.name for exe in exes for n in exe.mir.nodes
            if n.op == "state" and "ctx" not in n.outs[0].dims}


def memory_report(model, extra_states=(), extra_exes=()) -> dict:
    """{"backend", "weights_bytes", "kv_bytes", "state_bytes", "arena_bytes",
    "pool_overhead_bytes", "total_bytes"} (+ the backend's own memory_stats): pool overhead
    is None where the backend has no pool (host memory); state_bytes is the part of
    kv_bytes held by states without a context axis (`fixed_state_names`)."""
    stores = [getattr(model, "states", None) or {}, *extra_states]
    kv = sum(_nbytes(b) for st in stores for b in st.values())
    exes = [*getattr(model, "_exes", {}).values(), *extra_exes]
    fixed = fixed_state_names(exes)
    state = sum(_nbytes(b) for st in stores for n, b in st.items() if n in fixed)
    stats = dict(model.backend.memory_stats())
    arena = int(stats.get("arena_bytes", arena_bytes(exes)))
    weights = weight_bytes(model._shared)
    pool = None
    if "pool_total_bytes" in stats:
        pool = max(int(stats["pool_total_bytes"]) - int(stats.get("pool_used_bytes", 0)), 0)
    out = {"backend": model.backend.name, "weights_bytes": weights, "kv_bytes": kv,
           "state_bytes": state, "arena_bytes": arena, "pool_overhead_bytes": pool,
           "total_bytes": weights + kv + arena + (pool or 0) + int(stats.get("scratch_bytes", 0))}
    out.update({k: v for k, v in stats.items() if k not in out})
    return out


__all__ = ["memory_report", "weight_bytes", "arena_bytes", "fixed_state_names"]
