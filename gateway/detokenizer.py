"""Incremental detokenisation for streaming: never emits a broken multi-byte character, holds back
text that may still become a stop string, and truncates the output at a stop string."""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"  # what decode() yields for an incomplete UTF-8 sequence
CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces come out right


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text deltas.

    Works for any tokenizer (byte-level BPE, SentencePiece with byte fallback): each step decodes
    the window `ids[prefix_offset:]` and compares it with `ids[prefix_offset:read_offset]`; a window
    that ends in U+FFFD is an incomplete character and is held until the next token completes it.
    """

    def __init__(self, tokenizer, context_token_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._ids: list[int] = list(context_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)  # ids before this are already turned into text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: Sequence[int]) -> str:
        """The text the new tokens complete (possibly empty)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """Whatever is still held at the end (an incomplete character becomes U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""


class StopStringFilter:
    """Passes text through until a stop string appears; holds back any tail that may still become
    one.

    Invariant: the held tail is the longest suffix of the text seen that is a proper prefix of a
    stop string, so a stop string can never start inside text already released.
    """

    def __init__(self, stop: Sequence[str]):
        self._stop = [s for s in stop if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of `text` (plus what was held) that is safe to send."""
        if self.stopped:
            return ""
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buffer[:min(hits)]
        hold = self._longest_partial_match(buffer)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[:len(buffer) - hold]

    def flush(self) -> str:
        """The held tail, once no more text can come."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_partial_match(self, buffer: str) -> int:
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
