"""Streaming a model's new tokens as text while it generates (`rlx generate`, `rlx chat`)."""
from __future__ import annotations

import sys


def _stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


class TextStream:
    """A `stream=` callback for `CausalLM.generate` (batch of one): decodes everything
    generated so far and writes the part not yet shown, so multi-token characters come out
    whole; stop tokens are not shown."""

    def __init__(self, tokenizer, stop_ids, write=_stdout):
        self.tok, self.stop, self.write, self.ids, self.shown = tokenizer, set(stop_ids), write, [], ""

    def __call__(self, row_ids: list) -> None:
        if row_ids[0] in self.stop:
            return
        self.ids.append(row_ids[0])
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):          # a character still incomplete
            return
        self.write(text[len(self.shown):])
        self.shown = text


__all__ = ["TextStream"]
