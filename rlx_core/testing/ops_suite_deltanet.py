"""The op parity suite's cases for rlx_core.ir.deltanet's ops (pulled into ops_suite): each op
against an independent float64 reference on the kit's backends."""
from __future__ import annotations
