"""The IR: dtypes, shapes, the op table, graphs at three levels, lowering, planning."""
from .dtype import DType, promote
from .errors import RlxError
from .graph import HIR, LIR, MIR, Builder, Emit, Graph, Node, Value
from .lir import BindingManifest, LirModule, plan
from .lower import FusionPolicy, legalize, lower
from .ops import OPS, MaskKind, OpDef
from .serialize import graph_from_json, graph_to_json
from .shape import Shape
from .verify import verify
from . import contract  # noqa: F401,E402  (registers dot_general in the op table)
from . import control  # noqa: F401,E402  (registers if_, while_, scan)
from . import fft  # noqa: F401,E402  (registers fft, ifft, rfft, irfft)
from . import linalg  # noqa: F401,E402  (registers dense_solve)
from . import moe  # noqa: F401,E402  (registers moe_route, moe_experts)
from . import deltanet  # noqa: F401,E402  (registers gated_delta_rule, causal_conv1d)

__all__ = ["DType", "promote", "RlxError", "HIR", "MIR", "LIR", "Builder", "Emit", "Graph", "Node",
           "Value", "BindingManifest", "LirModule", "plan", "FusionPolicy", "legalize", "lower",
           "OPS", "MaskKind", "OpDef", "graph_from_json", "graph_to_json", "Shape", "verify"]
