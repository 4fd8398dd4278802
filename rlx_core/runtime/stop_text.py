"""A request's new tokens as text while it generates, with stop strings: the text shown so
far never contains a stop string nor the start of one still forming (that part is held back
until the next token settles it), nor half a multi-byte character."""
from __future__ import annotations


class StopText:
    """Feed tokens with `push`; each returns (text to show now, whether a stop string ended
    it). `finish()` gives what is still held back. `text` is the whole output: every token's
    text up to (not including) the first stop string."""

    def __init__(self, tokenizer, stops=()):
        self.tok, self.stops = tokenizer, tuple(s for s in stops if s)
        self.ids: list = []
        self.shown = ""
        self.text = ""
        self.stopped = False

    def _held(self, text: str) -> int:
        """How many trailing characters of `text` could begin a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if s.startswith(text[-k:]):
                    best = k
                    break
        return best

    def _show(self, upto: str) -> str:
        delta = upto[len(self.shown):]
        if delta:
            self.shown = upto
        return delta

    def push(self, token: int) -> tuple:
        self.ids.append(int(token))
        text = self.tok.decode(self.ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = text[:min(hits)], True
            return self._show(self.text), True
        self.text = text
        if text.endswith("\ufffd"):                # a character still incomplete
            return "", False
        return self._show(text[:len(text) - self._held(text)]), False

    def finish(self) -> str:
        return self._show(self.text)


__all__ = ["StopText"]
