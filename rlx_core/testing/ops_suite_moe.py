"""The op parity suite's cases for rlx_core.ir.moe's ops (pulled into ops_suite): each op
against an independent float64 reference on the kit's backends."""
from __future__ import annotations
