"""Decides, after each appended token, whether a request is finished and why.

The one stop decision of the fleet: the gateway renders what the worker decided (the final
event's `stop_reason` and `text_after_stop`, see `shared.wire.TokenEvent`) and never searches for
stop strings itself, so the two cannot disagree on where an answer ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfleet.shared.wire import RequestStatus, SamplingParams

# Extra tokens decoded before the stop-string window: a window that starts inside a multi-byte
# character decodes its first bytes as replacement characters (at most 3 continuation bytes).
_WINDOW_SLACK_TOKENS = 4


@dataclass(frozen=True)
class Stop:
    """What stopped a request: `reason` is the stop string that matched, the stop token id, or
    None for EOS; `text_after` is how many characters of the output text follow the end of the
    stop string (0 for a token)."""

    reason: int | str | None
    text_after: int = 0


_EOS = Stop(None)


class StopChecker:
    """Stateless: the verdict depends only on the arguments, so it survives preemption/resume."""

    def __init__(self, eos_token_ids: list[int], max_model_len: int, tokenizer: Any = None):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer  # only needed for stop strings: anything with .decode(ids)

    def check(
        self, prompt_len: int, output_token_ids: list[int], params: SamplingParams
    ) -> RequestStatus | None:
        """FINISHED_STOPPED, FINISHED_LENGTH or None, for the output as it is after the last append.

        A stop beats a length limit reached on the same token.
        """
        if self.find_stop(output_token_ids, params) is not None:
            return RequestStatus.FINISHED_STOPPED
        num_output = len(output_token_ids)
        if num_output >= params.max_tokens or prompt_len + num_output >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def find_stop(self, output_token_ids: list[int], params: SamplingParams) -> Stop | None:
        """What stops the output as it is after the last append, or None. The same tokens give
        the same answer, so a finished request's stop can be described again when it is reported.

        Nothing stops a request before it has min_tokens output tokens (the sampler masks EOS and
        stop ids until then; a stop string inside the first min_tokens tokens is text). EOS beats
        a stop token id (as vLLM V1: an EOS id among the stop ids reports None), which beats a
        stop string, on the same token.
        """
        num_output = len(output_token_ids)
        if num_output == 0 or num_output < params.min_tokens:
            return None
        last = output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return _EOS
        if last in params.stop_token_ids:
            return Stop(last)
        if params.stop:
            return self._stop_string(output_token_ids, params)
        return None

    def _stop_string(self, output_token_ids: list[int], params: SamplingParams) -> Stop | None:
        """The stop string that occurs in the output text ending inside the last token's text
        (the earliest-starting one, the shorter on a tie), with the text after it.

        Occurrences wholly inside the text before the last token were seen by earlier checks, so
        only a tail window is decoded: O(longest stop string) per call, not O(output length).
        The text is decoded as the client will see it (`skip_special_tokens`), so a stop string
        next to or across a special token matches exactly where the rendered text has it.
        """
        if self.tokenizer is None:
            raise ValueError("stop strings need a StopChecker built with a tokenizer")
        stops = params.stop
        longest = max(len(stop) for stop in stops)
        before, after = self._decode_tail(output_token_ids, longest, params.skip_special_tokens)
        # Decoding is not always prefix-stable (a token can complete a multi-byte character), so
        # new text starts where `before` and `after` first differ, or where `before` ends.
        stable = _common_prefix_len(before, after)
        best: tuple[int, int, str] | None = None
        for stop in stops:
            start = after.find(stop, max(0, stable - len(stop) + 1)) if stop else -1
            if start != -1 and (best is None or (start, start + len(stop)) < best[:2]):
                best = (start, start + len(stop), stop)
        if best is None:
            return None
        return Stop(best[2], len(after) - best[1])

    def _decode_tail(self, output_token_ids: list[int], min_chars: int,
                     skip_special_tokens: bool) -> tuple[str, str]:
        """Texts of a tail window without and with the last token; the window grows until the
        text before the last token holds `min_chars` characters beyond the slack, or is the whole
        output (tokens that decode to nothing, e.g. skipped special tokens, make it grow)."""
        num_tokens = min_chars + _WINDOW_SLACK_TOKENS
        while True:
            window = output_token_ids[-(num_tokens + 1) :]
            before = self._decode(window[:-1], skip_special_tokens)
            enough = len(before) >= min_chars + _WINDOW_SLACK_TOKENS
            if enough or len(window) == len(output_token_ids):
                return before, self._decode(window, skip_special_tokens)
            num_tokens *= 2

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        if not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
