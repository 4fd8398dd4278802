"""Backends: the interface every device implements. The NumPy backend ships in core and
registers through the same plugin hook as any other."""
from .base import Backend, Runner

__all__ = ["Backend", "Runner"]
