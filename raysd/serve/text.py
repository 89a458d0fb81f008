"""Incremental detokenization for streaming, with stop strings."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns token bursts into text deltas.

    Decodes the whole output each time and emits what is new, holding back a trailing replacement
    character (an incomplete UTF-8 sequence under byte-level BPE) and any tail that could still become a
    stop string. ``push`` returns ``(delta, stopped)``; text from a stop string on is never emitted.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.token_ids: list[int] = []
        self.sent = 0  # characters of the decoded text already emitted

    def _visible(self, text: str) -> tuple[str, bool]:
        for stop in self.stops:
            index = text.find(stop)
            if index != -1:
                return text[:index], True
        hold = 0
        for stop in self.stops:  # keep back a suffix that is a prefix of a stop string
            for length in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:length]):
                    hold = max(hold, length)
                    break
        while text[: len(text) - hold].endswith("\ufffd"):
            hold += 1
        return text[: len(text) - hold], False

    def push(self, new_token_ids: list[int]) -> tuple[str, bool]:
        self.token_ids.extend(new_token_ids)
        visible, stopped = self._visible(self.tokenizer.decode(self.token_ids))
        delta, self.sent = visible[self.sent:], max(self.sent, len(visible))
        return delta, stopped

    def flush(self) -> str:
        text = self.tokenizer.decode(self.token_ids)
        for stop in self.stops:
            if stop in text:
                text = text[: text.index(stop)]
        delta, self.sent = text[self.sent:], len(text)
        return delta
