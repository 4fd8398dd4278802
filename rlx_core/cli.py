"""The `rlx` command (click).

Layout: shared plumbing first (the group, error handling, options every command can
reuse), then one section per command. To add a command, add a section with
`@main.command()`; it inherits the group's behaviour, as do the commands plugins register
through `rlx_register_commands` (added lazily: only `rlx --help` and a name that is no core
command build the plugin registry): an `RlxError` raised anywhere below prints one line
`error: ...` and exits with status 2, and plugin warnings print as one `warning: ...` line each.
Reuse `profile_option`, `backend_option` and `dim_option` (and, for a command running a
language model, the generate section's `model_profile_option`, `sampling_options` and
`load_causal_lm`) rather than redefining them, so every command spells its options the same way.
"""
from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path

import click
import numpy as np

from .ir.errors import RlxError
from .plugins.manager import core_version, reserve_commands
from .profile import CompileProfile

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# ============================================================================ plumbing
def one_line(e: BaseException) -> str:
    """An error message on one line (multi-line messages are joined with '; ')."""
    parts = [p.strip() for p in str(e).splitlines() if p.strip()]
    return "; ".join(parts) or type(e).__name__


def _show_warning(message, category, filename, lineno, file=None, line=None):
    click.echo(f"warning: {one_line(message)}", err=True)


def plugin_commands() -> dict:
    """name -> click.Command that plugins registered. A name a core command has never gets here:
    `reserve_commands` (below the last core command) makes such a plugin broken."""
    from .plugins.manager import registry

    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        return dict(registry().commands)


class RlxGroup(click.Group):
    """A click group whose commands report `RlxError` as `error: ...` with exit status 2, and
    which also offers the commands plugins registered."""

    def list_commands(self, ctx: click.Context) -> list:
        return sorted(set(super().list_commands(ctx)) | set(plugin_commands()))

    def get_command(self, ctx: click.Context, name: str):
        return super().get_command(ctx, name) or plugin_commands().get(name)

    def invoke(self, ctx: click.Context):
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            try:
                return super().invoke(ctx)
            except RlxError as e:
                click.echo(f"error: {one_line(e)}", err=True)
                ctx.exit(2)


@click.group(cls=RlxGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(core_version(), "--version", "-V", prog_name="rlx",
                      message="%(prog)s %(version)s")
def main() -> None:
    """RLX: a small ML compiler and runtime for model builders.

    Graphs go HIR -> MIR -> LIR through a compile profile (a preset name or a
    *.rlx.toml file) and run on a backend provided by a plugin.
    """


def _profile_callback(ctx, param, value):
    return CompileProfile.resolve(value)


def profile_option(f):
    """--profile NAME|FILE: a preset name or a *.rlx.toml path, resolved to a CompileProfile."""
    return click.option(
        "--profile", "-p", "profile", metavar="NAME|FILE", default=None,
        callback=_profile_callback, expose_value=True,
        help="Compile profile: a preset name (default, llama32_prefill, fusable, debug, ...) "
             "or a *.rlx.toml file. Default: the `default` preset.")(f)


def backend_option(f):
    """--backend NAME: an explicit backend (default: the profile's, else the best available)."""
    return click.option(
        "--backend", "-b", "backend", metavar="NAME", default=None,
        help="Backend to compile for (see `rlx plugins`). Default: the profile's [backend] "
             "name, else the highest-priority available backend.")(f)


def _dims_callback(ctx, param, values):
    dims: dict = {}
    for item in values:
        name, sep, num = item.partition("=")
        name = name.strip()
        if not sep or not name or not num.strip().isdigit() or int(num) <= 0:
            raise click.BadParameter(f"{item!r}: expected NAME=N with a positive integer N "
                                     "(e.g. seq=128)", ctx=ctx, param=param)
        if name in dims and dims[name] != int(num):
            raise click.BadParameter(f"dim {name!r} given twice ({dims[name]} and {num})",
                                     ctx=ctx, param=param)
        dims[name] = int(num)
    return dims


def dim_option(f):
    """--dim NAME=N (repeatable): bind a symbolic dim; the command receives a dict."""
    return click.option(
        "--dim", "-d", "dims", metavar="NAME=N", multiple=True, callback=_dims_callback,
        help="Bind a symbolic dim, e.g. --dim seq=128 (repeat for several).")(f)


def echo_section(title: str, first: bool = False) -> None:
    """A `# title` header line, after a blank line unless it opens the output."""
    click.echo(f"# {title}" if first else f"\n# {title}" if title else "")


# ============================================================================ rlx plugins
def _backend_rows(reg) -> list:
    rows = []
    for name, b in reg.backends.items():
        try:
            ok, why = b.availability()
        except Exception as e:  # a backend's probe must not break the listing
            ok, why = False, f"availability() raised {type(e).__name__}: {e}"
        rows.append({"name": name, "priority": getattr(b, "priority", 0),
                     "target": getattr(b, "target", ""), "available": bool(ok),
                     "reason": "" if ok else str(why), "plugin": reg.owner.get(("backend", name), ""),
                     "kernel_paths": _kernel_paths(b) if ok else []})
    return sorted(rows, key=lambda r: (-r["priority"], r["name"]))


def _kernel_paths(b) -> list:
    """b.kernel_paths(), or one entry saying why it failed (the listing goes on)."""
    try:
        return [{"path": str(p["path"]), "on": bool(p["on"]), "reason": str(p.get("reason", ""))}
                for p in b.kernel_paths()]
    except Exception as e:
        return [{"path": "kernel_paths()", "on": False, "reason": f"raised {type(e).__name__}: {e}"}]


def plugins_report() -> dict:
    """Everything `rlx plugins` shows, as plain data."""
    from .plugins.manager import ALLOW_ENV, BLOCK_ENV, plugin_infos, registry

    infos = plugin_infos()
    reg = registry()
    own = reg.owner
    return {
        "version": core_version(),
        "env": {ALLOW_ENV: os.environ.get(ALLOW_ENV), BLOCK_ENV: os.environ.get(BLOCK_ENV)},
        "plugins": [i.to_dict() for i in infos],
        "backends": _backend_rows(reg),
        "blocks": {n: own.get(("block", n), "") for n in sorted(reg.blocks)},
        "recipes": {t: {"recipe": getattr(r, "name", ""), "plugin": own.get(("recipe", t), "")}
                    for t, r in sorted(reg.recipes.items())},
        "ops": {n: own.get(("op", n), "") for n in sorted(reg.ops)},
        "rules": {g: [getattr(r, "name", "?") for r in rs] for g, rs in sorted(reg.rules.items())},
        "weight_formats": {n: own.get(("weight format", n), "") for n in sorted(reg.weight_formats)},
        "packaged_models": {n: own.get(("packaged model", n), "") for n in sorted(reg.packaged_models)},
        "commands": {n: own.get(("command", n), "") for n in sorted(reg.commands)},
    }


def _table(rows: list, headers: list) -> list:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [("  " + fmt.format(*r)).rstrip() for r in [headers, *rows]]


@main.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def plugins_cmd(as_json: bool) -> None:
    """List plugins (loaded, disabled and broken, with the reason), backends with their
    availability, and what plugins registered.

    Which third-party plugins load is decided by RLX_PLUGINS (an allow-list; set but
    empty loads none) and RLX_DISABLE_PLUGINS (a block-list, which wins):
    comma-separated entry-point or distribution names. Built-ins always load.
    """
    rep = plugins_report()
    if as_json:
        click.echo(json.dumps(rep, indent=2))
        return
    short = lambda hooks: ",".join(h.removeprefix("rlx_register_") for h in hooks) or "-"  # noqa: E731
    click.echo("plugins:")
    rows = [[p["name"], p["version"] or "-", p["kind"], p["status"], short(p["hooks"])]
            for p in rep["plugins"]]
    for line, p in zip(_table(rows, ["NAME", "VERSION", "KIND", "STATUS", "HOOKS"]),
                       [None] + rep["plugins"]):
        click.echo(line)
        if p and p["error"]:
            click.echo(f"      {p['status']}: {p['error']}")
    click.echo("backends:")
    rows = [[b["name"], b["priority"], b["target"], "yes" if b["available"] else "no",
             b["plugin"]] for b in rep["backends"]]
    for line, b in zip(_table(rows, ["NAME", "PRIORITY", "TARGET", "AVAILABLE", "PLUGIN"]),
                       [None] + rep["backends"]):
        click.echo(line)
        if b and b["reason"]:
            click.echo(f"      unavailable: {b['reason']}")
        for p in b["kernel_paths"] if b else ():
            click.echo(f"      {p['path']}: " + ("on" if p["on"] else f"off ({p['reason']})"))
    for key, title in (("blocks", "blocks"), ("ops", "custom ops"),
                       ("weight_formats", "weight formats"), ("packaged_models", "packaged models"),
                       ("commands", "commands added by plugins")):
        if rep[key]:
            click.echo(f"{title}:")
            for line in _table([[n, p] for n, p in rep[key].items()], ["NAME", "PLUGIN"]):
                click.echo(line)
    if rep["recipes"]:
        click.echo("recipes:")
        rows = [[t, r["recipe"], r["plugin"]] for t, r in rep["recipes"].items()]
        for line in _table(rows, ["MODEL TYPE", "RECIPE", "PLUGIN"]):
            click.echo(line)
    if rep["rules"]:
        click.echo("fusion rules added by plugins:")
        for line in _table([[g, ", ".join(rs)] for g, rs in rep["rules"].items()], ["GROUP", "RULES"]):
            click.echo(line)
    env = {k: v for k, v in rep["env"].items() if v is not None}
    if env:
        click.echo("environment: " + ", ".join(f"{k}={v!r}" for k, v in env.items()))


# ============================================================================ rlx inspect
def _is_profile_target(target: str) -> bool:
    from .profile import PRESETS

    return target.endswith(".toml") or (target in PRESETS and not Path(target).exists())


def _pipeline_summary(pipe) -> list:
    lines = ["# passes: " + ", ".join(f"{name} ({n} nodes)" for name, n, _ in pipe.trace)]
    fused: dict = {}
    for rule, *_ in getattr(pipe, "fusion_log", []):
        fused[rule] = fused.get(rule, 0) + 1
    if fused:
        lines.append("# fused: " + ", ".join(f"{r} x{c}" for r, c in fused.items()))
    if getattr(pipe, "legalized", None):
        lines.append("# legalized for the backend: " + ", ".join(pipe.legalized))
    return lines


def check_dims(graph, dims: dict) -> None:
    """A usage error if `dims` names a dim the graph does not have."""
    symbols = graph.symbols()
    unknown = sorted(set(dims) - symbols)
    if unknown:
        raise click.BadParameter(f"the graph has no dim(s) {unknown}; its dims: "
                                 f"{sorted(symbols) or 'none (all static)'}", param_hint="--dim")


def lir_or_note(mir, dims: dict):
    """(LirModule, "") with `dims` bound, or (None, why not) when dims stay unbound."""
    from .ir.lir import plan
    from .pipeline import specialize

    check_dims(mir, dims)
    unbound = sorted(mir.symbols() - set(dims))
    if unbound:
        hint = " ".join(f"--dim {s}=N" for s in unbound)
        return None, f"LIR not planned: unbound dims {unbound}; bind them with {hint}"
    return plan(specialize(mir, dims) if dims else mir), ""


def _layers_callback(ctx, param, value):
    """'0-1', '3' or '0,5-7' -> a set of layer numbers."""
    if value is None:
        return None
    layers: set = set()
    for part in value.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise click.BadParameter(f"{value!r}: expected layer numbers and ranges such as 0-1, 3 "
                                     "or 0,5-7", ctx=ctx, param=param)
        layers.update(range(int(lo), int(hi if sep else lo) + 1))
    return layers


def draw_graph(graph, path: str, layers: set | None, leaves: dict | None = None) -> None:
    """Write `graph` (HIR/MIR Graph or LirModule) to `path` for --graph, saying on stderr what
    was written and, without Graphviz's `dot`, how to get the picture."""
    from .ir import dot
    from .ir.layers import layers_in

    g = getattr(graph, "graph", graph)
    have = layers_in(g, leaves)
    if layers is not None and not layers <= set(have):
        span = f"{have[0]}-{have[-1]}" if have else "none"
        raise click.BadParameter(f"the graph has no layer(s) {sorted(layers - set(have))}; its layers: "
                                 f"{span}", param_hint="--layers")
    files, note = dot.write(dot.graph_dot(graph, layers, leaves=leaves), path)
    drawn = f"; of its {len(have)} layers, {dot.runs_text(layers)} drawn" if layers is not None else ""
    click.echo(f"wrote {' and '.join(files)}: {'LIR' if g is not graph else g.level.upper()} of "
               f"{g.name}, {len(g.nodes)} nodes{drawn}", err=True)
    if layers is None and len(have) > 2 and len(g.nodes) > 300:
        click.echo(f"hint: --layers {have[0]}-{have[1]} draws two of its {len(have)} layers and "
                   "collapses the others", err=True)
    if note:
        click.echo(f"note: {path} not drawn: {note}", err=True)


def _ir_file_graph(level: str, source, mir, lir, note: str):
    """The graph of an IR file that --graph draws at `level` (`note`: why there is no LIR)."""
    if level == "hir":
        if source.level != "hir":
            raise click.BadParameter(f"the file holds {source.level.upper()}, not HIR", param_hint="--level")
        return source
    if level == "lir" and lir is None:
        raise click.BadParameter(note, param_hint="--level")
    return mir if level == "mir" else lir


def _inspect_model(target: str, mode, profile, backend, dims: dict, as_json: bool, graph_path,
                   level: str, layers, nodes: bool) -> None:
    from .inspection import Inspection
    from .ir.layers import hoisted_layers

    x = Inspection.load(target, mode, backend, profile)
    check_dims(x.mir, dims)
    x.bind(dims)
    if graph_path:
        graph = {"hir": x.built.graph, "mir": x.mir, "lir": x.lir}[level]
        draw_graph(graph, graph_path, layers, hoisted_layers(x.prologue) if level == "lir" else None)
    if as_json:
        click.echo(json.dumps(x.report(), indent=1, default=str))
    else:
        click.echo(x.text(nodes_of=(layers or set()) if nodes else None))


def _model_target(target: str) -> None:
    """An error naming MODEL|FILE when `target` is none of the things inspect reads."""
    from .ir.errors import WeightError
    from .profile import PRESETS
    from .weights.packaged import packaged_names

    names = packaged_names()
    if not Path(target).exists() and target.lower() not in names:
        raise WeightError(f"MODEL|FILE {target!r}: no such file or folder; expected an HF model folder, "
                          f"a GGUF file, a packaged model ({', '.join(names) or 'none registered'}), an IR "
                          f"JSON file or a profile (*.rlx.toml or a preset: {', '.join(sorted(PRESETS))})")


@main.command("inspect")
@click.argument("target", metavar="MODEL|FILE")
@profile_option
@backend_option
@dim_option
@click.option("--mode", "-m", metavar="NAME", default=None,
              help="Which graph of MODEL: prefill (default), decode or logits for a language "
                   "model; padded or packed for an encoder (default: the one it runs).")
@click.option("--json", "as_json", is_flag=True, help="Print the MODEL report as one JSON object.")
@click.option("--graph", "graph_path", metavar="PATH", default=None,
              help="Draw the graph into PATH: .dot (Graphviz source), or .svg/.png/.pdf (the .dot "
                   "is written beside it; drawing needs Graphviz's `dot` program).")
@click.option("--level", type=click.Choice(["hir", "mir", "lir"]), default="mir", show_default=True,
              help="The IR level --graph draws.")
@click.option("--layers", metavar="SPEC", default=None, callback=_layers_callback,
              help="Draw only these layers (e.g. 0-1, 3 or 0,5-7), each run of the others as "
                   "one box; with --nodes, list only their nodes.")
@click.option("--nodes", is_flag=True,
              help="Also list every node MODEL runs (LIR) with its kernel and buffer.")
def inspect_cmd(target: str, profile, backend: str | None, dims: dict, mode, as_json: bool,
                graph_path, level: str, layers, nodes: bool) -> None:
    """Show what a model's flow builds and what the compiler makes of it; print an IR file
    at every level, or print a resolved profile.

    MODEL (an HF folder, a GGUF file or a packaged name, see `rlx plugins`): its recipe and
    config (and where the checkpoint states each key), the flow's stages by layer, the node
    counts after every pass, where fusion fired, what was legalized and why, the LIR buffer
    plan (symbolic dims bound by --dim, else defaults: batch=1, seq=16, ctx=128), the params
    by group with dtype or packed scheme and bytes, and which kernel runs each node.

    FILE is an IR JSON file (HIR, MIR or LIR): an HIR graph is printed, then the MIR the
    compile pipeline makes of it under --profile for --backend, then the LIR (buffer plan)
    once every symbolic dim is bound with --dim. FILE may also be a *.rlx.toml profile or a
    preset name: its resolved settings are printed.

    --graph draws HIR, MIR or LIR (--level) of MODEL or FILE.
    """
    from click.core import ParameterSource

    ctx = click.get_current_context()
    flags = {"mode": "--mode", "as_json": "--json", "nodes": "--nodes", "graph_path": "--graph",
             "level": "--level", "layers": "--layers"}
    given = [f for p, f in flags.items() if ctx.get_parameter_source(p) is not ParameterSource.DEFAULT]
    if ("--level" in given and not graph_path) or ("--layers" in given and not (graph_path or nodes)):
        raise click.UsageError("--level and --layers choose what --graph draws (--layers also what "
                               "--nodes lists); add --graph PATH")
    if _is_profile_target(target):
        if given:
            raise click.UsageError(f"{', '.join(given)}: for a model or an IR file, not a profile")
        click.echo(CompileProfile.resolve(target).text())
        return
    if not target.lower().endswith(".json"):
        _model_target(target)
        model_profile = None if ctx.get_parameter_source("profile") is ParameterSource.DEFAULT else profile
        _inspect_model(target, mode, model_profile, backend, dims, as_json, graph_path, level, layers, nodes)
        return
    only_models = [g for g in given if g in ("--mode", "--json", "--nodes")]
    if only_models:
        raise click.UsageError(f"{', '.join(only_models)}: for a MODEL, not an IR file")
    from .ir.graph import HIR, Graph
    from .ir.serialize import load_json_file
    from .pipeline import CompilePipeline

    obj = load_json_file(target)
    if not isinstance(obj, Graph):                         # an LIR module: already planned
        echo_section("LIR (from file)", first=True)
        click.echo(obj.text())
        if graph_path:
            if level != "lir" and "--level" in given:
                raise click.BadParameter("the file holds LIR", param_hint="--level")
            draw_graph(obj, graph_path, layers)
        return
    check_dims(obj, dims)
    pipe = CompilePipeline(profile, backend)
    mir = pipe.optimize(obj)
    lir, note = lir_or_note(mir, dims)
    if graph_path:
        draw_graph(_ir_file_graph(level, obj, mir, lir, note), graph_path, layers)
    echo_section(f"{obj.level.upper()} ({len(obj.nodes)} nodes)", first=True)
    click.echo(obj.text())
    echo_section(f"MIR ({len(mir.nodes)} nodes; profile {profile.name}, backend {pipe.backend.name}"
                 + (", lowered from HIR" if obj.level == HIR else "") + ")")
    for line in _pipeline_summary(pipe):
        click.echo(line)
    click.echo(mir.text())
    if lir is None:
        echo_section(note)
        return
    bound = ", ".join(f"{k}={v}" for k, v in sorted(dims.items())) or "static"
    echo_section(f"LIR ({bound})")
    click.echo(lir.text())


# ============================================================================ rlx demo
def demo_graph(hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 128,
               eps: float = 1e-5):
    """One pre-norm transformer block, symbolic in `seq`: RMSNorm, GQA attention with RoPE,
    residual, RMSNorm, SwiGLU MLP, residual."""
    from .ir.graph import Graph

    hd = hidden // heads

    def block(m):
        x = m.input("x", (1, "seq", hidden))
        cos, sin = m.input("cos", ("seq", hd // 2)), m.input("sin", ("seq", hd // 2))
        p = {name: m.param(name, shape) for name, shape in [
            ("attn_norm", (hidden,)), ("wq", (heads * hd, hidden)), ("wk", (kv_heads * hd, hidden)),
            ("wv", (kv_heads * hd, hidden)), ("wo", (hidden, heads * hd)), ("mlp_norm", (hidden,)),
            ("w_gate", (ffn, hidden)), ("w_up", (ffn, hidden)), ("w_down", (hidden, ffn))]}

        def split(t, n):
            return m.transpose(m.reshape(t, (1, "seq", n, hd)), (0, 2, 1, 3))

        h = m.rms_norm(x, p["attn_norm"], eps=eps)
        q = split(m.linear(h, p["wq"]), heads)
        k = split(m.linear(h, p["wk"]), kv_heads)
        v = split(m.linear(h, p["wv"]), kv_heads)
        a = m.attention(m.rope(q, cos, sin), m.rope(k, cos, sin), v)
        a = m.reshape(m.transpose(a, (0, 2, 1, 3)), (1, "seq", heads * hd))
        x = x + m.linear(a, p["wo"])
        h = m.rms_norm(x, p["mlp_norm"], eps=eps)
        return {"out": x + m.swiglu(h, p["w_gate"], p["w_up"], p["w_down"])}

    return Graph.define("demo_block", block)


def demo_data(seq: int, hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 128,
              seed: int = 0) -> tuple:
    """(inputs, params) for `demo_graph`, float32, from a seeded generator."""
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    w = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)  # noqa: E731
    params = {"attn_norm": (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32),
              "wq": w(heads * hd, hidden), "wk": w(kv_heads * hd, hidden),
              "wv": w(kv_heads * hd, hidden), "wo": w(hidden, heads * hd),
              "mlp_norm": (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32),
              "w_gate": w(ffn, hidden), "w_up": w(ffn, hidden), "w_down": w(hidden, ffn)}
    inv = 10000.0 ** (-np.arange(hd // 2) / (hd // 2))
    ang = np.arange(seq)[:, None] * inv[None, :]
    inputs = {"x": rng.standard_normal((1, seq, hidden)).astype(np.float32),
              "cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32)}
    return inputs, params


def demo_reference(inputs: dict, params: dict, heads: int = 4, kv_heads: int = 2,
                   eps: float = 1e-5) -> np.ndarray:
    """The same block written directly in numpy, in float64."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    x, cos, sin = (inputs[k].astype(np.float64) for k in ("x", "cos", "sin"))
    _, seq, hidden = x.shape
    hd = hidden // heads

    def rms(t, wt):
        return t / np.sqrt(np.mean(t * t, -1, keepdims=True) + eps) * wt

    def rope(t):
        half = cos.shape[-1]
        t1, t2 = t[..., :half], t[..., half:2 * half]
        return np.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin, t[..., 2 * half:]], -1)

    def split(t, n):
        return t.reshape(1, seq, n, hd).transpose(0, 2, 1, 3)

    h = rms(x, p["attn_norm"])
    q, k, v = split(h @ p["wq"].T, heads), split(h @ p["wk"].T, kv_heads), split(h @ p["wv"].T, kv_heads)
    q, k = rope(q), rope(k)
    k, v = np.repeat(k, heads // kv_heads, 1), np.repeat(v, heads // kv_heads, 1)
    s = q @ k.swapaxes(-1, -2) / np.sqrt(hd)
    s = np.where(np.tril(np.ones((seq, seq), bool)), s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    a = (e / e.sum(-1, keepdims=True)) @ v
    x = x + a.transpose(0, 2, 1, 3).reshape(1, seq, hidden) @ p["wo"].T
    h = rms(x, p["mlp_norm"])
    g, u = h @ p["w_gate"].T, h @ p["w_up"].T
    return x + (g / (1 + np.exp(-g)) * u) @ p["w_down"].T


# max abs diff allowed vs the float64 reference, by compute dtype (values are O(1))
DEMO_TOL = {"f64": 1e-9, "f32": 1e-4, "f16": 2e-2, "bf16": 1e-1}


@main.command("demo")
@click.option("--seq", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="Sequence length bound at run time.")
@click.option("--hidden", type=click.IntRange(8, 4096), default=64, show_default=True,
              help="Hidden size (a multiple of 2*heads).")
@click.option("--heads", type=click.IntRange(2, 64), default=4, show_default=True,
              help="Query heads (kv heads are half of them: GQA).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the result line, not the IR.")
@profile_option
@backend_option
def demo_cmd(seq: int, hidden: int, heads: int, seed: int, quiet: bool, profile,
             backend: str | None) -> None:
    """Compile and run a small transformer block, printing each IR level.

    Builds one pre-norm block (RMSNorm, GQA attention with RoPE, SwiGLU MLP, residuals) as
    HIR, compiles it through the pipeline (MIR), plans it for --seq (LIR with its buffer
    plan), runs it on random weights and prints the max abs difference from the same block
    written directly in numpy (float64). Exits with status 1 if the difference is above
    the tolerance of the profile's compute dtype.
    """
    from .pipeline import CompilePipeline, Executable

    if hidden % (2 * heads):
        raise click.BadParameter(f"hidden {hidden} is not a multiple of 2*heads = {2 * heads}",
                                 param_hint="--hidden")
    kv_heads, ffn = heads // 2, 2 * hidden
    g = demo_graph(hidden, heads, kv_heads, ffn)
    inputs, params = demo_data(seq, hidden, heads, kv_heads, ffn, seed)
    pipe = CompilePipeline(profile, backend)
    mir = pipe.optimize(g)
    exe = Executable(mir, pipe.backend, pipe.profile, params, source=g)
    if not quiet:
        echo_section(f"HIR ({len(g.nodes)} nodes)", first=True)
        click.echo(g.text())
        echo_section(f"MIR ({len(mir.nodes)} nodes; profile {profile.name}, backend {pipe.backend.name})")
        for line in _pipeline_summary(pipe):
            click.echo(line)
        click.echo(mir.text())
        lir = exe.lir(seq=seq)
        echo_section(f"LIR (seq={seq}; param-only subgraphs hoisted to load time)")
        click.echo(lir.text())
        echo_section("")
    out = exe.run(inputs)["out"]
    ref = demo_reference(inputs, params, heads, kv_heads)
    diff = float(np.max(np.abs(out.astype(np.float64) - ref)))
    tol = DEMO_TOL.get(profile.precision.compute.value, 1e-4)
    ok = diff <= tol
    click.echo(f"result: out {out.dtype}{list(out.shape)} on {pipe.backend.name}; max abs diff vs "
               f"numpy (float64): {diff:.3e} ({'ok' if ok else 'ABOVE'} tolerance {tol:g})")
    if not ok:
        click.get_current_context().exit(1)


# ============================================================================ rlx generate
def model_profile_option(f):
    """--profile NAME|FILE for commands loading a model: resolved by the loader, near the weights."""
    return click.option(
        "--profile", "-p", "profile", metavar="NAME|FILE", default=None,
        help="Compile profile (preset name or *.rlx.toml). Default: a *.rlx.toml beside "
             "the weights, else the architecture's preset.")(f)


SAMPLING_OPTIONS = (
    click.option("--max-new-tokens", "-n", type=click.IntRange(1), default=128, show_default=True,
                 help="Most tokens to generate (stops earlier at end-of-sequence)."),
    click.option("--min-new-tokens", type=click.IntRange(0), default=0, show_default=True,
                 help="End-of-sequence is suppressed until this many tokens are out."),
    click.option("--temperature", "-t", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="Sample at this temperature. Default: greedy decoding."),
    click.option("--top-k", type=click.IntRange(0), default=50, show_default=True,
                 help="When sampling, keep the k most likely tokens (0: all)."),
    click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
                 help="When sampling, keep the smallest set of tokens whose probability reaches p."),
    click.option("--seed", type=int, default=None, help="Seed of the sampler."),
)


def sampling_options(f):
    """The sampling options of `generate` and `chat`; the command receives them as one dict
    `sampling` of CausalLM.generate keyword arguments."""
    @functools.wraps(f)
    def command(*args, **kw):
        t = kw.pop("temperature")
        kw["sampling"] = dict(max_new_tokens=kw.pop("max_new_tokens"),
                              min_new_tokens=kw.pop("min_new_tokens"), do_sample=t is not None,
                              temperature=t or 1.0, top_k=kw.pop("top_k") or None, top_p=kw.pop("top_p"),
                              seed=kw.pop("seed"))
        return f(*args, **kw)
    for option in reversed(SAMPLING_OPTIONS):
        command = option(command)
    return command


def load_causal_lm(model_name: str, backend: str | None, profile: str | None, command: str):
    """The model, loaded with progress bars and a summary line on stderr; an error for a
    model that does not generate text (an encoder)."""
    import time

    from .ir.errors import ModelError
    from .runtime.model import CausalLM, load

    t0 = time.perf_counter()
    model = load(model_name, backend=backend, profile=profile)
    if not isinstance(model, CausalLM):
        raise ModelError(f"{model_name} is not a causal language model ({type(model).__name__}, "
                         f"{model.config.get('model_type')}); rlx {command} needs one")
    click.echo(f"[{model_name}: {model.config.get('model_type')}, backend {model.backend.name}, "
               f"profile {model.profile.name}; loaded in {time.perf_counter() - t0:.1f}s]", err=True)
    return model


def echo_text(text: str) -> None:
    """Streamed text to stdout, as it comes (no newline)."""
    click.echo(text, nl=False)


def tp_option(per: str = "", more: str = ""):
    return click.option("--tp", type=click.IntRange(1), default=None,
                        help=f"Tensor-parallel ranks{per}, one process each (default: RLX_TP, else the "
                             f"profile's [parallel] tensor).{more}")


@main.command("generate")
@click.argument("model_name", metavar="MODEL")
@click.argument("prompt")
@sampling_options
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@model_profile_option
@backend_option
@tp_option("", " The text comes whole at the end.")
def generate_cmd(model_name: str, prompt: str, sampling: dict, chat: bool, profile: str | None,
                 backend: str | None, tp: int | None) -> None:
    """Generate text from PROMPT with MODEL, streaming tokens as they come.

    MODEL is an HF folder, a GGUF file, or the name of a packaged model that a plugin
    registered (`rlx plugins` lists them under "packaged models").
    """
    import sys

    from .runtime.text_stream import TextStream
    from .runtime.tp import TensorParallel, tensor_size

    world = tensor_size(tp, CompileProfile.resolve(profile) if profile else None)
    if world > 1:
        spec = {"model": model_name, "backend": backend, "profile": profile}
        click.echo(f"[{model_name}: starting {world} tensor-parallel ranks ...]", err=True)
        with TensorParallel(spec, world) as group:
            click.echo(group.generate(prompt, chat=chat, **sampling))
            t = group.last_timings
        click.echo(f"[tp={world}: {t['prompt_tokens']} prompt tokens in {t['prefill_s'] * 1e3:.0f} ms; "
                   f"{t['new_tokens']} new tokens at {t['decode_s_per_token'] * 1e3:.1f} ms/token]", err=True)
        return

    model = load_causal_lm(model_name, backend, profile, "generate")
    ids = model.encode_prompt(prompt, chat=chat)
    click.echo(f"[compiling the prefill graph for {len(ids)} prompt tokens ...]", err=True)
    model.executable("prefill")            # (decode compiles once the first token is out)
    model.generate([ids], stream=TextStream(model.tokenizer, model.eos_ids, echo_text), **sampling)
    click.echo()
    t = model.last_timings
    click.echo(f"[{t['prompt_tokens']} prompt tokens in {t['prefill_s'] * 1e3:.0f} ms; "
               f"{t['new_tokens']} new tokens at {t['decode_s_per_token'] * 1e3:.1f} ms/token]",
               err=True)
    sys.stdout.flush()


# ============================================================================ rlx profile
def _writable_file(ctx, param, value):
    """A path whose folder exists and is writable, checked before minutes of work."""
    if value is not None:
        folder = os.path.dirname(os.path.abspath(value))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise click.BadParameter(f"{value!r}: the folder {folder} does not exist or is not writable",
                                     ctx=ctx, param=param)
    return value


@main.command("profile")
@click.argument("model_name", metavar="MODEL")
@click.option("--prompt", default="The capital of France is Paris. The capital of Italy is",
              show_default=True, help="Prompt whose prefill is profiled.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--repeat", "-r", type=click.IntRange(1), default=10, show_default=True,
              help="Timed runs of each graph (times are their medians).")
@click.option("--decode-steps", type=click.IntRange(0), default=4, show_default=True,
              help="Decode steps run after the prefill; the last is profiled (0: prefill only).")
@click.option("--top", type=click.IntRange(1), default=10, show_default=True, help="Slowest nodes listed.")
@click.option("--trace", metavar="FILE", default=None, callback=_writable_file,
              help="Write a Chrome/Perfetto trace (JSON) of every node in every timed run.")
@click.option("--json", "as_json", is_flag=True, help="Print the reports as JSON.")
@model_profile_option
@backend_option
def profile_cmd(model_name: str, prompt: str, chat: bool, repeat: int, decode_steps: int, top: int,
                trace: str | None, as_json: bool, profile: str | None, backend: str | None) -> None:
    """Time every node of MODEL's prefill and decode graphs.

    Runs the prefill of --prompt and --decode-steps greedy decode steps as `rlx generate` would,
    then runs each graph again on the inputs it got (the prefill's, the last decode step's),
    --repeat times normally and --repeat times timing every node (host clock on the CPU and
    OpenCL, CUDA events on cuda). Prints per graph the slowest nodes and every op kind: median
    time, share, bytes moved and achieved GB/s against the backend's copy bandwidth.
    """
    from .profiler import profile_generation, write_chrome_trace

    model = load_causal_lm(model_name, backend, profile, "profile")
    reports = profile_generation(model, prompt, decode_steps, repeat, chat=chat)
    if as_json:
        click.echo(json.dumps({"model": model_name, "backend": model.backend.name,
                               "profile": model.profile.name,
                               "reports": {k: r.to_dict() for k, r in reports.items()}}, indent=1))
    else:
        for k, (mode, rep) in enumerate(reports.items()):
            echo_section(mode, first=k == 0)
            click.echo(rep.table(top))
    if trace:
        n = write_chrome_trace(trace, reports.values())
        click.echo(f"[wrote {trace}: {n} events; open it in https://ui.perfetto.dev or chrome://tracing]",
                   err=True)


# ============================================================================ rlx chat
@main.command("chat")
@click.argument("model_name", metavar="MODEL")
@click.option("--system", "-s", metavar="TEXT", default=None,
              help="System prompt (in the chat: /system TEXT changes it).")
@sampling_options
@model_profile_option
@backend_option
def chat_cmd(model_name: str, system: str | None, sampling: dict, profile: str | None,
             backend: str | None) -> None:
    """Chat with MODEL: each line is a message, answers stream as they come.

    The conversation goes through the model's chat template and is kept across turns.
    Commands: /reset forgets it, /system TEXT sets the system prompt (and starts over),
    /exit or end of input (Ctrl-D) quits. Lines may also be piped in: then no prompt is
    shown and only the answers go to stdout, one per line.
    """
    import sys

    from .runtime.chat import ChatSession, chat_loop

    model = load_causal_lm(model_name, backend, profile, "chat")
    session = ChatSession(model, system, **sampling)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        click.echo("[/help for commands; Ctrl-D quits]", err=True)

    def read() -> str | None:
        if not interactive:
            line = sys.stdin.readline()
            return line.rstrip("\n") if line else None
        try:
            return input("> ")
        except (EOFError, KeyboardInterrupt):
            click.echo(err=True)
            return None

    chat_loop(session, read, echo_text, lambda text: click.echo(text, err=True))


# ============================================================================ rlx embed
@main.command("embed")
@click.argument("model_name", metavar="MODEL")
@click.argument("texts", nargs=-1)
@click.option("--image", "images", is_flag=True,
              help="The arguments (or the lines of --file) are image files (PNG, JPEG, WebP, ...) to embed "
                   "with a vision MODEL: rlx embed MODEL --image a.png b.jpg.")
@click.option("--file", "-f", "file", metavar="FILE", default=None,
              help="Embed every line of FILE ('-' for stdin), one embedding per line.")
@click.option("--json", "json_out", is_flag=True, help="Print one JSON object with every embedding.")
@click.option("--batch-size", type=click.IntRange(1), default=32, show_default=True,
              help="Texts or images per compiled batch.")
@click.option("--no-normalize", is_flag=True, help="Skip the L2 normalization.")
@click.option("--no-truncate", is_flag=True,
              help="Fail on text longer than the model's limit instead of truncating it.")
def embed_cmd(model_name: str, texts: tuple, images: bool, file: str | None, json_out: bool, batch_size: int,
              no_normalize: bool, no_truncate: bool) -> None:
    """Embed TEXTS (or the lines of --file) with the encoder MODEL, or images with --image.

    MODEL is an HF folder or a packaged name of a model type with an encoder recipe
    (`rlx plugins` lists them), or a vision checkpoint: its images go through the
    checkpoint's own preprocessing (preprocessor_config.json), and one with a text tower
    embeds texts into the same space. Prints one vector per line, or JSON with --json.
    """
    from .runtime.encoder import embed_command

    embed_command(model_name, texts=list(texts) or None, file=file, json_out=json_out,
                  batch_size=batch_size, normalize=not no_normalize, no_truncate=no_truncate,
                  echo=click.echo, images=images)


# ============================================================================ rlx serve
@main.command("serve")
@click.argument("model_names", metavar="MODEL...", nargs=-1, required=True)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (0.0.0.0 exposes the server to the network).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to bind.")
@click.option("--max-batch", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="Most requests one causal model decodes in one batch.")
@click.option("--max-tokens", "default_max_tokens", type=click.IntRange(1), default=None,
              help="Chat completions' max_tokens when a request gives none. Default: the context left.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="info", show_default=True, help="uvicorn's log level.")
@click.option("--max-body-mb", type=click.FloatRange(0, min_open=True), default=8, show_default=True,
              help="Largest request body in MB; a larger one is refused (HTTP 413) before it is read.")
@click.option("--api-key", envvar="RLX_API_KEY", default=None, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and /metrics "
                   "(401 otherwise); /health and the chat page stay public.")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="An origin browsers may call the API from (repeatable; e.g. http://localhost:3000, or * "
                   "for any). Default: none.")
@click.option("--max-queue", type=click.IntRange(0), default=None,
              help="Most requests that may wait for a batch row per model; beyond them HTTP 429 with "
                   "Retry-After. Default: no bound.")
@click.option("--request-timeout", type=click.FloatRange(0, min_open=True), default=None, metavar="S",
              help="Cancel a generation running longer than S seconds (HTTP 504, or an error event in a "
                   "stream). Default: none.")
@click.option("--shutdown-grace", type=click.FloatRange(0), default=10, show_default=True, metavar="S",
              help="On SIGTERM: refuse new requests (503) and let running ones finish for up to S seconds, "
                   "then cancel the rest (streams end with finish_reason 'abort' and [DONE]).")
@click.option("--prefix-cache-mb", type=click.FloatRange(0), default=None,
              help="Memory for the scheduler's prefix cache (KV of shared prompt prefixes), in MB.")
@click.option("--prefill-chunk", type=click.IntRange(0), default=None, metavar="N",
              help="Prefill long prompts N tokens at a time between the batch's decode steps "
                   "(0: whole prompts; default: the profile's [runtime] prefill_chunk).")
@click.option("--stall-budget", type=click.FloatRange(0), default=None, metavar="F",
              help="While a batch decodes, a round's prefill may cost at most F times its decode step "
                   "(measured; pieces of at most --prefill-chunk tokens): streams slow to at most ~(1 + F)x "
                   "while a long prompt prefills. 0: fixed pieces of --prefill-chunk. Default: 0.35.")
@click.option("--idle-release", "idle_release_s", type=click.FloatRange(0), default=None, metavar="SECONDS",
              help="Idle this long, a model's scheduler gives its KV cache and compiled runners back "
                   "(rebuilt by the next request). Default: 30.")
@click.option("--no-mixed", "no_mixed", is_flag=True, default=False,
              help="Run each prefill piece as a run of its own between the batch's decode steps, not "
                   "inside them (mixed steps: on by default with chunked prefill, where the model's "
                   "layers allow).")
@model_profile_option
@backend_option
@tp_option(" per model (causal or encoder)")
def serve_cmd(model_names: tuple, host: str, port: int, max_batch: int, default_max_tokens: int | None,
              log_level: str, max_body_mb: float, api_key: str | None, cors_origins: tuple,
              max_queue: int | None, request_timeout: float | None, shutdown_grace: float,
              prefix_cache_mb: float | None, prefill_chunk: int | None, stall_budget: float | None,
              idle_release_s: float | None, no_mixed: bool, profile: str | None,
              backend: str | None, tp: int | None) -> None:
    """Serve MODEL(s) over OpenAI's HTTP API: /v1/models, /v1/completions,
    /v1/chat/completions (streaming too), /v1/embeddings (encoder models; vision models take
    images as base64 data URLs); /tokenize and /detokenize (vLLM's), /health (ready once every
    model is warm), /metrics (Prometheus) and a chat page at /.

    Each model is requested by its name as given here. Concurrent requests share a causal
    model's decode batch (continuous batching). Needs the serve extra:
    pip install 'rlx-core[serve]'.
    """
    from . import serve

    serve.require()
    options = {k: v for k, v in (("prefix_cache_mb", prefix_cache_mb), ("prefill_chunk", prefill_chunk),
                                 ("stall_budget", stall_budget), ("idle_release_s", idle_release_s))
               if v is not None}
    if no_mixed:
        options["mixed"] = False
    models, groups = serve.load_models(model_names, backend, profile, tp,
                                       echo=lambda t: click.echo(t, err=True), progress=True)
    click.echo(f"[serving {', '.join(models)} on http://{host}:{port}/v1 (max batch {max_batch})]", err=True)
    try:
        serve.run(models, host, port, max_batch, log_level, default_max_tokens, groups,
                  shutdown_grace=shutdown_grace, max_body_mb=max_body_mb, api_key=api_key or None,
                  cors_origins=cors_origins, max_queue=max_queue, request_timeout=request_timeout,
                  scheduler_options=options)
    finally:
        for g in groups.values():
            g.close()


@main.command("quantize")
@click.argument("src", metavar="SRC")
@click.argument("dst", metavar="DST")
@click.option("--scheme", "-s", default="q8_0", show_default=True, metavar="SCHEME",
              help="q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k (GGUF types llama.cpp reads too), "
                   "or RLX's own int8 / int4 blocks (int8_b64: block size 64; RLX reads these only); "
                   "f16 or bf16: unquantized (llama.cpp's F16 / BF16 files).")
def quantize_cmd(src: str, dst: str, scheme: str) -> None:
    """Write the HF model SRC (folder or packaged name) to the GGUF file DST with its matmul
    weights packed in SCHEME; `rlx generate DST ...` then runs it packed. DST is written whole
    or not at all, and never over a file of SRC."""
    from .ir.errors import WeightError
    from .weights import load_checkpoint, resolve_model_path
    from .weights.gguf_write import destination, parse_scheme, write_gguf

    q = parse_scheme(scheme)
    destination(dst, resolve_model_path(src))     # a bad DST is named before the load
    ckpt = load_checkpoint(src)
    if ckpt.format != "safetensors":
        raise WeightError(f"{src}: rlx quantize reads HF safetensors folders; this is a {ckpt.format} file")
    done = write_gguf(ckpt, dst, q, echo=click.echo)
    size = os.path.getsize(dst)
    click.echo(f"wrote {dst}: {done['quantized']} weights in {getattr(q, 'name', q)}, {size / 2**20:.1f} MiB")


# ============================================================================ rlx bisect
@main.command("bisect")
@click.argument("model_name", metavar="MODEL")
@click.option("--backend", "-b", "backend", metavar="NAME", required=True,
              help="The backend under test (see `rlx plugins`).")
@click.option("--ref", metavar="NAME", default=None, help="The reference backend. Default: numpy.")
@click.option("--input", "-i", "input_", metavar="TEXT|IDS", default=None,
              help="Text for the model's tokenizer, or token ids ('1,2,3'). Default: ids 1 to 8.")
@click.option("--pass", "pass_name", metavar="P", default=None,
              help="On --backend alone: 'all' finds the first pass after which the outputs change; "
                   "a pass name (lower, cse, fusion, ...) checks that pass.")
@click.option("--tol", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Relative tolerance of float values. Default per dtype: f32 1e-3, f16 5e-2, bf16 1e-1.")
@model_profile_option
def bisect_cmd(model_name: str, backend: str, ref: str, input_: str | None, pass_name: str | None,
               tol: float | None, profile: str | None) -> None:
    """Find where backend B's results first leave the reference's on MODEL.

    Runs MODEL's graph (a causal LM: every position's logits; an encoder: padded) on both
    backends at HIR, MIR before fusion, fused MIR and LIR, compares every intermediate value
    and prints, per level, the first node that diverges beyond its dtype's tolerance: its op,
    shapes, the flow block and layer that emitted it, its inputs and the max abs/rel error.
    Exit status 1 when the backends diverge (with --pass: when a pass changes the outputs).
    """
    from . import bisection

    if pass_name is not None:
        if ref is not None:
            raise click.UsageError("--ref does not apply with --pass: it runs --backend alone")
        report = bisection.bisect_passes(model_name, backend, input_, pass_name, tol=tol, profile=profile)
    else:
        report = bisection.bisect(model_name, backend, ref or "numpy", input_, tol=tol, profile=profile)
    click.echo(report.text())
    if report.first is not None:
        raise SystemExit(1)


# ============================================================================ rlx cache
@main.group("cache")
def cache_group() -> None:
    """The compile cache: optimized graphs and tokenizer merges kept across processes
    (RLX_COMPILE_CACHE: its folder, or 0 to turn it off)."""


@cache_group.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
def cache_ls(as_json: bool) -> None:
    """List the entries: kind, key, size, last use, the rlx version that wrote them."""
    import datetime

    from . import cache

    entries = cache.entries()
    if as_json:
        click.echo(json.dumps({"root": str(cache.root()), "bytes": cache.size(), "entries": entries}, indent=1))
        return
    if cache.root() is None:
        click.echo("compile cache: off (RLX_COMPILE_CACHE=0)")
        return
    click.echo(f"compile cache: {cache.root()} ({cache.size() / 2**20:.1f} MiB with blobs)")
    rows = [[e["kind"], e["key"][:16], f"{e['bytes'] / 2**10:.0f} KiB",
             datetime.datetime.fromtimestamp(e["used"]).strftime("%Y-%m-%d %H:%M"), e["rlx"]] for e in entries]
    for line in _table(rows, ["kind", "key", "size", "used", "rlx"]) if rows else ["(empty)"]:
        click.echo(line)


@cache_group.command("clear")
def cache_clear() -> None:
    """Remove every entry (models assembled from packages stay)."""
    from . import cache

    n, freed = cache.clear()
    click.echo(f"removed {n} files, {freed / 2**20:.1f} MiB from {cache.root()}")


reserve_commands(main.commands)        # every core command is defined above: plugins cannot take them


if __name__ == "__main__":  # pragma: no cover
    main()
