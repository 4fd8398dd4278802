"""Graph passes: generic (DCE, CSE, constant folding), fusion rules, hoisting, precision."""
from .fusion import RULES, TARGETS, fuse, groups_for, unfused
from .generic import const_fold, cse, dce
from .transform import hoist_params, to_precision

__all__ = ["RULES", "TARGETS", "fuse", "groups_for", "unfused", "const_fold", "cse", "dce",
           "hoist_params", "to_precision"]
