"""JSON round trip of every level. Loading validates everything and raises SerializeError."""
from __future__ import annotations

import base64
import json

import numpy as np

from .dtype import DType
from .errors import RlxError, SerializeError
from .ops import freeze
from .shape import Shape

FORMAT, VERSION = "rlx-ir", 1


def _shape_json(s: Shape) -> list:
    return [list(s.dims), s.dtype.value]


def _attr_json(v):
    return [_attr_json(x) for x in v] if isinstance(v, tuple) else v


def graph_dict(g) -> dict:
    return {
        "format": FORMAT, "version": VERSION, "name": g.name, "level": g.level,
        "nodes": [{"op": n.op, "name": n.name, "inputs": [list(r) for r in n.inputs],
                   "attrs": {k: _attr_json(v) for k, v in n.attrs},
                   "outs": [_shape_json(s) for s in n.outs]} for n in g.nodes],
        "outputs": [[name, list(r)] for name, r in g.outputs],
        "constants": {k: {"dtype": DType.parse(a.dtype).value, "shape": list(a.shape),
                          "data": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()}
                      for k, a in sorted(g.constants.items())},
    }


def graph_to_json(g) -> str:
    return json.dumps(graph_dict(g), sort_keys=True, separators=(",", ":"))


def _need(d, key, typ, where):
    if not isinstance(d, dict) or key not in d:
        raise SerializeError(f"{where}: missing key {key!r}")
    v = d[key]
    if not isinstance(v, typ):
        raise SerializeError(f"{where}.{key}: expected {getattr(typ, '__name__', typ)}, "
                             f"got {type(v).__name__}")
    return v


def _ref(r, where):
    if (not isinstance(r, list) or len(r) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                           for x in r)):
        raise SerializeError(f"{where}: a value reference must be [node, output], got {r!r}")
    return (r[0], r[1])


def graph_from_dict(d: dict, source: str = "<json>"):
    from .graph import Graph, Node
    from .verify import verify

    if not isinstance(d, dict):
        raise SerializeError(f"{source}: top level must be an object")
    if d.get("format") != FORMAT:
        raise SerializeError(f"{source}: format must be {FORMAT!r}, got {d.get('format')!r}")
    if d.get("version") != VERSION:
        raise SerializeError(f"{source}: unsupported version {d.get('version')!r}; expected {VERSION}")
    try:
        nodes = []
        for i, nd in enumerate(_need(d, "nodes", list, source)):
            w = f"{source}: nodes[{i}]"
            outs = []
            for s in _need(nd, "outs", list, w):
                if not isinstance(s, list) or len(s) != 2 or not isinstance(s[0], list):
                    raise SerializeError(f"{w}.outs: expected [dims, dtype], got {s!r}")
                outs.append(Shape(tuple(s[0]), s[1]))
            attrs_ = _need(nd, "attrs", dict, w)
            nodes.append(Node(_need(nd, "op", str, w),
                              tuple(_ref(r, w + ".inputs") for r in _need(nd, "inputs", list, w)),
                              tuple(sorted((k, freeze(v)) for k, v in attrs_.items())),
                              tuple(outs), _need(nd, "name", str, w)))
        outputs = []
        for o in _need(d, "outputs", list, source):
            if not isinstance(o, list) or len(o) != 2 or not isinstance(o[0], str):
                raise SerializeError(f"{source}: outputs entry must be [name, ref], got {o!r}")
            outputs.append((o[0], _ref(o[1], f"{source}: output {o[0]!r}")))
        consts = {}
        for k, c in _need(d, "constants", dict, source).items():
            w = f"{source}: constants[{k!r}]"
            dt = DType.parse(_need(c, "dtype", str, w))
            shape = tuple(_need(c, "shape", list, w))
            raw = base64.b64decode(_need(c, "data", str, w), validate=True)
            arr = np.frombuffer(raw, dtype=dt.np)
            if arr.size != int(np.prod(shape)):
                raise SerializeError(f"{w}: {arr.size} elements for shape {shape}")
            consts[k] = arr.reshape(shape).copy()
        level = _need(d, "level", str, source)
        g = Graph(_need(d, "name", str, source), level, tuple(nodes), tuple(outputs), consts)
    except SerializeError:
        raise
    except RlxError as e:
        raise SerializeError(f"{source}: {e}") from None
    except (ValueError, TypeError) as e:
        raise SerializeError(f"{source}: malformed IR JSON: {e}") from None
    try:
        verify(g)
    except RlxError as e:
        raise SerializeError(f"{source}: {e}") from None
    return g


def graph_from_json(text: str, source: str = "<json>"):
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise SerializeError(f"{source}: not valid JSON (truncated?): {e}") from None
    if isinstance(d, dict) and d.get("level") == "lir":
        from .lir import lir_from_dict

        return lir_from_dict(d, source)
    return graph_from_dict(d, source)


def load_json_file(path) -> object:
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise SerializeError(f"{path}: cannot read: {e}") from None
    return graph_from_json(text, str(path))
