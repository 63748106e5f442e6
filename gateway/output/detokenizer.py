"""Incremental detokenisation for streaming: never emits a broken multi-byte character, holds back
text that may still become a stop string, and cuts the output where the worker stopped it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"  # what decode() yields for an incomplete UTF-8 sequence
CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces come out right


def _backend_decode(tokenizer, skip_special_tokens: bool = True
                    ) -> Callable[[list[int]], str] | None:
    """The `tokenizers` backend's decode when it returns exactly what
    `tokenizer.decode(ids, skip_special_tokens=True)` returns: transformers' fast tokenizers only
    add Python layers around it, plus the optional clean-up of tokenization spaces."""
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the generic path stays exact
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend) or not isinstance(backend, Tokenizer)
            or cls.decode is not PreTrainedTokenizerBase.decode
            or cls._decode is not TokenizersBackend._decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        return None
    return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)


class TextDecoder:
    """`tokenizer.decode(ids, skip_special_tokens=...)`, made cheap for streaming: the Rust
    backend is called directly where that is exact, and the text of each single token is cached
    (a one-token window is what the incremental detokeniser decodes most). One per tokenizer,
    shared by all requests."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self._decode = _backend_decode(tokenizer, skip_special_tokens) or (
            lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        self._single: dict[int, str] = {}  # token id -> its text alone (at most the vocabulary)

    def decode(self, ids: list[int]) -> str:
        if len(ids) == 1:
            text = self._single.get(ids[0])
            if text is None:
                text = self._single[ids[0]] = self._decode(ids)
            return text
        return self._decode(ids)


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text deltas.

    Works for any tokenizer (byte-level BPE, SentencePiece with byte fallback): each step decodes
    the window `ids[prefix_offset:]` and compares it with `ids[prefix_offset:read_offset]`; a window
    that ends in U+FFFD is an incomplete character and is held until the next token completes it.
    The prefix window's text is kept until the offsets move, so a step costs one decode (the
    prefix window is then usually one token, whose text the TextDecoder caches).
    """

    def __init__(self, tokenizer, context_token_ids: Sequence[int] = (),
                 decoder: TextDecoder | None = None):
        self._decoder = decoder or TextDecoder(tokenizer)
        self._ids: list[int] = list(context_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)  # ids before this are already turned into text
        self._prefix_text: str | None = None  # text of ids[prefix_offset:read_offset], if known

    def _window_texts(self) -> tuple[str, str]:
        """(text of the prefix window, text of the whole window)."""
        if self._prefix_text is None:
            self._prefix_text = self._decoder.decode(
                self._ids[self._prefix_offset:self._read_offset])
        return self._prefix_text, self._decoder.decode(self._ids[self._prefix_offset:])

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None

    def add(self, token_ids: Sequence[int]) -> str:
        """The text the new tokens complete (possibly empty)."""
        if not token_ids:
            return ""  # the windows' texts are what they were: nothing new completes
        self._ids.extend(token_ids)
        prefix_text, full_text = self._window_texts()
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance()
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """Whatever is still held at the end (an incomplete character becomes U+FFFD)."""
        prefix_text, full_text = self._window_texts()
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = ""
        return full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""


# what one token's text is taken to hold at most after a stop string it completes
_LAST_TOKEN_CHARS = 16


class StopStringRenderer:
    """Renders where the worker stopped the answer; it never decides it (the worker does, on the
    text as the client sees it, min_tokens included: see `shared.wire.TokenEvent`).

    While the answer streams, `feed` holds back the longest tail of the text that is a proper
    prefix of a stop string, and a complete stop string ending in the last few characters: the
    worker may yet stop (or have stopped) there, so no text past a stop is ever sent. A complete
    stop string followed by more text that did not end the answer is text (the worker did not
    stop there: min_tokens). `finish` cuts what is left where the worker's final event says.
    """

    def __init__(self, stop: Sequence[str], include_stop: bool = False):
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop  # include_stop_str_in_output
        self._held = ""

    def feed(self, text: str) -> str:
        """The part of `text` (plus what was held) that is safe to send before the answer ends."""
        if not self._stop:
            return text
        buffer = self._held + text
        hold = max(self._longest_partial_match(buffer), self._recent_complete_match(buffer))
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[:len(buffer) - hold]

    def finish(self, text: str, finish_reason: str | None, stop_reason: int | str | None = None,
               text_after_stop: int | None = None) -> str:
        """The rest of the answer, given its last text (what was held, then `text`) and how the
        final event says it ended."""
        buffer, self._held = self._held + text, ""
        if finish_reason != "stop":
            return buffer
        if text_after_stop is None:  # a worker older than the field: the compatibility rule
            return self._cut_at_first_stop(buffer)
        if not isinstance(stop_reason, str):  # a stop token (its text is the caller's to drop)
            return buffer
        end = len(buffer) - text_after_stop
        if not self._include_stop:
            end -= len(stop_reason)
        # below 0 only where the stop string began in text this renderer never held (a stream
        # resumed after a token inside it): what was sent before cannot be taken back
        return buffer[:max(0, end)]

    def _cut_at_first_stop(self, buffer: str) -> str:
        hits = [(i, i + len(s)) for s, i in ((s, buffer.find(s)) for s in self._stop) if i >= 0]
        if not hits:
            return buffer
        start, end = min(hits)
        return buffer[:end if self._include_stop else start]

    def _recent_complete_match(self, buffer: str) -> int:
        """The tail from a complete stop string that ends in the last few characters: the
        token that completed it may be the last one, its final event not read yet (a stream
        re-attached while the request ends reads those tokens from the checkpoint first). Held
        until later text shows the worker went on (min_tokens), or the final event cuts it."""
        tail_start = len(buffer)
        for stop in self._stop:
            start = buffer.find(stop, max(0, len(buffer) - len(stop) - _LAST_TOKEN_CHARS))
            if start != -1:
                tail_start = min(tail_start, start)
        return len(buffer) - tail_start

    def _longest_partial_match(self, buffer: str) -> int:
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
