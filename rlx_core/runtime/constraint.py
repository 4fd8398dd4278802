"""The hook through which a grammar (rlx_core.runtime.grammar, or a test's hand-made one)
constrains generation: the sampler asks each row's constraint which tokens may come next,
masks the others to -inf before any other logits processing, and tells it the token chosen.
A finished constraint (the grammar is complete) forces EOS: the row ends with "stop" (before
min_new_tokens too: nothing else may follow)."""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Constraint(Protocol):
    """One sequence's grammar state."""

    def allowed(self) -> np.ndarray | None:
        """bool [vocab]: the tokens allowed next, EOS included where the output may end here
        (complete, though it may go on); None: any token."""
        ...

    def accept(self, token: int) -> None:
        """Advance by the chosen token."""
        ...

    def finished(self) -> bool:
        """Whether the grammar is complete: only EOS may follow (the sampler forces it)."""
        ...


ConstraintFactory = Callable[[], Constraint]     # a fresh constraint per sequence (row / choice)

__all__ = ["Constraint", "ConstraintFactory"]
