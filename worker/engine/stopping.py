"""Decides, after each appended token, whether a request is finished and why."""

from __future__ import annotations

from typing import Any

from shared.wire import RequestStatus, SamplingParams

# Extra tokens decoded before the stop-string window: a window that starts inside a multi-byte
# character decodes its first bytes as replacement characters (at most 3 continuation bytes).
_WINDOW_SLACK_TOKENS = 4


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

        A stop beats a length limit reached on the same token. Nothing stops a request before it
        has min_tokens output tokens (the sampler masks EOS and stop ids until then).
        """
        num_output = len(output_token_ids)
        may_stop = num_output > 0 and num_output >= params.min_tokens
        if may_stop and self._is_stop(output_token_ids, params):
            return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or prompt_len + num_output >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _is_stop(self, output_token_ids: list[int], params: SamplingParams) -> bool:
        last = output_token_ids[-1]
        if last in params.stop_token_ids:
            return True
        if not params.ignore_eos and last in self.eos_token_ids:
            return True
        return bool(params.stop) and self._ends_with_stop_string(output_token_ids, params.stop)

    def _ends_with_stop_string(self, output_token_ids: list[int], stops: list[str]) -> bool:
        """Whether a stop string occurs in the output text ending inside the last token's text.

        Occurrences wholly inside the text before the last token were seen by earlier checks, so
        only a tail window is decoded: O(longest stop string) per call, not O(output length).
        """
        if self.tokenizer is None:
            raise ValueError("stop strings need a StopChecker built with a tokenizer")
        longest = max(len(stop) for stop in stops)
        before, after = self._decode_tail(output_token_ids, longest)
        # Decoding is not always prefix-stable (a token can complete a multi-byte character), so
        # new text starts where `before` and `after` first differ, or where `before` ends.
        stable = _common_prefix_len(before, after)
        for stop in stops:
            if stop and after.find(stop, max(0, stable - len(stop) + 1)) != -1:
                return True
        return False

    def _decode_tail(self, output_token_ids: list[int], min_chars: int) -> tuple[str, str]:
        """Texts of a tail window without and with the last token; the window grows until the
        text before the last token holds `min_chars` characters beyond the slack, or is the whole
        output (tokens that decode to nothing, e.g. skipped special tokens, make it grow)."""
        num_tokens = min_chars + _WINDOW_SLACK_TOKENS
        while True:
            window = output_token_ids[-(num_tokens + 1) :]
            before = self._decode(window[:-1])
            enough = len(before) >= min_chars + _WINDOW_SLACK_TOKENS
            if enough or len(window) == len(output_token_ids):
                return before, self._decode(window)
            num_tokens *= 2

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
