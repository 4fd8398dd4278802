"""JSON round trip of every level. Loading checks every field (attrs through the op table's
schema) and raises SerializeError naming the file and the place (node index, field)."""
from __future__ import annotations

import base64
import json
import math

import numpy as np

from .dtype import DType
from .graph import FORMAT, VERSION, Graph, Node
from .lir import LirModule, Slot, plan
from .errors import RlxError, SerializeError
from .ops import brief, get_op
from .shape import Shape
from .verify import verify

def graph_to_json(g) -> str:
    return g.to_json()


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string"}


def _need(d, key, typ, where):
    if not isinstance(d, dict):
        raise SerializeError(f"{where}: expected an object, got {type(d).__name__}")
    if key not in d:
        raise SerializeError(f"{where}: missing key {key!r}")
    v = d[key]
    if not isinstance(v, typ):
        raise SerializeError(f"{where}.{key}: expected {_JSON_TYPES[typ]}, got {brief(v)}")
    return v


def _ref(r, where):
    if (not isinstance(r, list) or len(r) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                           for x in r)):
        raise SerializeError(f"{where}: a value reference must be [node, output], got {brief(r)}")
    return (r[0], r[1])


def _node(nd, w, memo: dict):
    """One node object; every field checked, attrs through the op table's schema. The checked
    attrs and shapes are kept in `memo` by the text of (op, attrs, outs): a model repeats the
    same few dozen nodes once per layer, and checking each copy again costs most of a load."""

    op = _need(nd, "op", str, w)
    name = _need(nd, "name", str, w)
    inputs = tuple(_ref(r, f"{w}.inputs") for r in _need(nd, "inputs", list, w))
    raw_outs = _need(nd, "outs", list, w)
    given = _need(nd, "attrs", dict, w)
    key = None if any(isinstance(v, dict) for v in given.values()) else repr((op, given, raw_outs))
    hit = memo.get(key)
    if hit is None:
        hit = _checked(op, given, raw_outs, w)
        if key is not None:
            memo[key] = hit
    return Node(op, inputs, hit[0], hit[1], name)


def _checked(op, given, raw_outs, w):
    """(sorted normalized attrs, output Shapes) of one node's JSON fields."""
    outs = []
    for j, s in enumerate(raw_outs):
        if not isinstance(s, list) or len(s) != 2 or not isinstance(s[0], list) or not isinstance(s[1], str):
            raise SerializeError(f"{w}.outs[{j}]: expected [dims, dtype], got {brief(s)}")
        try:
            outs.append(Shape(tuple(s[0]), s[1]))
        except RlxError as e:
            raise SerializeError(f"{w}.outs[{j}]: {e}") from None
    given = {k: graph_from_dict(v["graph"], f"{w}.attrs.{k}") if isinstance(v, dict) and "graph" in v
             else v for k, v in given.items()}          # control-flow bodies, verified on load
    try:
        a = get_op(op).check_attrs(given)
    except RlxError as e:
        raise SerializeError(f"{w}.attrs: {e}") from None
    return tuple(sorted(a.items())), tuple(outs)


def _constant(c, w):
    dt = _need(c, "dtype", str, w)
    try:
        dt = DType.parse(dt)
    except RlxError as e:
        raise SerializeError(f"{w}.dtype: {e}") from None
    shape = _need(c, "shape", list, w)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape):
        raise SerializeError(f"{w}.shape: expected a list of ints >= 0, got {brief(shape)}")
    if isinstance(c.get("data"), bytes):           # the compile cache's blob, read as it is
        raw = c["data"]
    else:
        try:
            raw = base64.b64decode(_need(c, "data", str, w), validate=True)
        except ValueError as e:
            raise SerializeError(f"{w}.data: not base64: {e}") from None
    if len(raw) != math.prod(shape) * dt.itemsize:
        raise SerializeError(f"{w}.data: {len(raw)} bytes; shape {shape} of {dt.value} needs "
                             f"{math.prod(shape) * dt.itemsize}")
    try:
        return np.frombuffer(raw, dtype=dt.np).reshape(shape).copy()
    except ValueError as e:                        # a zero-size shape numpy cannot index
        raise SerializeError(f"{w}.shape: {e}") from None


def graph_from_dict(d: dict, source: str = "<json>"):

    if not isinstance(d, dict):
        raise SerializeError(f"{source}: top level must be an object, got {type(d).__name__}")
    if d.get("format") != FORMAT:
        raise SerializeError(f"{source}: format must be {FORMAT!r}, got {brief(d.get('format'))}")
    if d.get("version") != VERSION or isinstance(d.get("version"), bool):
        raise SerializeError(f"{source}: unsupported version {brief(d.get('version'))}; expected {VERSION}")
    memo: dict = {}
    nodes = tuple(_node(nd, f"{source}: nodes[{i}]", memo)
                  for i, nd in enumerate(_need(d, "nodes", list, source)))
    outputs = []
    for j, o in enumerate(_need(d, "outputs", list, source)):
        if not isinstance(o, list) or len(o) != 2 or not isinstance(o[0], str):
            raise SerializeError(f"{source}: outputs[{j}] must be [name, ref], got {brief(o)}")
        outputs.append((o[0], _ref(o[1], f"{source}: outputs[{j}] ({o[0]!r})")))
    consts = {k: _constant(c, f"{source}: constants[{k!r}]")
              for k, c in _need(d, "constants", dict, source).items()}
    g = Graph(_need(d, "name", str, source), _need(d, "level", str, source), nodes, tuple(outputs), consts)
    try:
        verify(g)
    except RlxError as e:
        raise SerializeError(f"{source}: {e}") from None
    return g


def graph_from_json(text, source: str = "<json>"):
    """Text or UTF-8 bytes of IR JSON -> a verified Graph (or LirModule); SerializeError otherwise."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise SerializeError(f"{source}: not UTF-8 text (binary file?): {e}") from None
    if not isinstance(text, str):
        raise SerializeError(f"{source}: IR JSON must be text, got {type(text).__name__}")
    try:
        d = json.loads(text)
    except (ValueError, RecursionError) as e:     # JSONDecodeError, over-long int literals
        raise SerializeError(f"{source}: not valid JSON (truncated?): {e}") from None
    try:
        if isinstance(d, dict) and d.get("level") == "lir":
            return lir_from_dict(d, source)
        return graph_from_dict(d, source)
    except RecursionError:
        raise SerializeError(f"{source}: IR JSON nested too deeply") from None


def load_json_file(path) -> object:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SerializeError(f"{path}: cannot read: {e}") from None
    return graph_from_json(data, str(path))


def lir_from_dict(d: dict, source: str) -> LirModule:
    """Load LIR JSON: the graph is verified and the plan is recomputed and compared."""
    g = graph_from_dict(dict(d, level="mir"), source)
    lir = plan(g)
    try:
        saved = {tuple(k): Slot(**{**s, "base": tuple(s["base"]) if s["base"] else None})
                 for k, s in d.get("plan", [])}
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise SerializeError(f"{source}: malformed plan: {type(e).__name__}: {e}") from None
    if saved != lir.slots:
        raise SerializeError(f"{source}: the saved buffer plan does not match the graph")
    return lir
