"""What every module of the op parity suite shares (ops_suite and the modules it pulls in,
such as ops_suite_moe): the record of which ops have a parity case, the float-dtype
parametrization and the packed schemes tested. Its own module so those modules need not
import ops_suite, which imports them (an import circle)."""
from __future__ import annotations

import pytest

from .parity import FLOATS

COVERED: set = set()


def covers(*ops):
    COVERED.update(ops)
    return lambda f: f


FLOAT_IDS = [d.value for d in FLOATS]
fdtype = pytest.mark.parametrize("dt", FLOATS, ids=FLOAT_IDS)

SCHEMES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "int8_b32", "int4_b64"]

__all__ = ["COVERED", "covers", "FLOAT_IDS", "fdtype", "SCHEMES"]
