"""Model-free proposers: guess a decoding stream's next tokens from text it has already seen.

Both are called every step for every decoding stream, so each keeps an index per request that
grows with the tokens appended since its last call (never a scan of the whole context):
- `NgramProposer` (vLLM's "ngram", prompt lookup decoding): the tokens that followed the most
  recent earlier occurrence of the stream's last n tokens, longest n first.
- `SuffixProposer` (vLLM's "suffix", SuffixDecoding, arXiv 2411.04975): suffix tries with
  counts over the stream's own prompt and output and over the outputs of recent finished
  requests; it follows the most frequent continuation while its estimated probability holds.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any


class Proposer(ABC):
    """Guesses the tokens that follow a sequence; the engine verifies them (a wrong guess costs
    time, never a different answer)."""

    name: str  # "ngram", "suffix"

    @abstractmethod
    def propose(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                k: int) -> list[int]:
        """Up to k tokens expected to follow `token_ids` (the request's prompt + output so far;
        the list only grows between calls for one req_id, except after `forget`)."""

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The request left the engine (finished or aborted): drop its state (suffix: keep its
        output for others)."""
        self.forget(req_id)

    def forget(self, req_id: str) -> None:
        """Drop the request's per-request state (it may come back with the same token_ids)."""


# ---- ngram ------------------------------------------------------------------------------------


class _NgramIndex:
    """One request's n-grams -> the start of their latest occurrence, for every n-gram that ends
    before `next_end` (those ending at the last token would find themselves)."""

    def __init__(self) -> None:
        self.latest_start: dict[tuple[int, ...], int] = {}
        self.next_end = 0


class NgramProposer(Proposer):
    """Cheap and exact on text that quotes itself (code edits, summaries of the prompt)."""

    name = "ngram"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                k: int) -> list[int]:
        index = self._indexes.setdefault(req_id, _NgramIndex())
        self._catch_up(index, token_ids)
        if k < 1:
            return []
        num_tokens = len(token_ids)
        suffix = tuple(token_ids[max(0, num_tokens - self.max_n):])
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            start = index.latest_start.get(suffix[len(suffix) - n:])
            if start is not None:  # it ends before the last token, so a continuation exists
                return list(token_ids[start + n:start + n + k])
        return []

    def _catch_up(self, index: _NgramIndex, token_ids: Sequence[int]) -> None:
        """Index the n-grams ending at the positions appended since the last call, but not at
        the last token: a later occurrence overwrites an earlier one, so the latest start wins."""
        last_end = len(token_ids) - 1
        if index.next_end >= last_end:
            return
        offset = max(0, index.next_end - self.max_n + 1)
        window = tuple(token_ids[offset:last_end])  # positions offset .. last_end - 1
        for end in range(index.next_end, last_end):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                start = end - n + 1
                index.latest_start[window[start - offset:end + 1 - offset]] = start
        index.next_end = last_end

    def forget(self, req_id: str) -> None:
        self._indexes.pop(req_id, None)


# ---- suffix tries -----------------------------------------------------------------------------


class _Node:
    """A path: `count` occurrences, `continued` of them followed by a token (the denominator of
    a child's probability, so that the stream's own latest occurrence, whose next token is not
    known yet, and the ends of texts do not count against the continuations seen). `best`: the
    most frequent child's token (ties: the lowest), None until needed."""

    __slots__ = ("count", "continued", "children", "best")

    def __init__(self, count: int):
        self.count = count
        self.continued = 0
        self.children: dict[int, _Node | _Leaf] = {}
        self.best: int | None = None

    def gained(self, token: int) -> None:
        """Child `token` just gained an occurrence."""
        self.continued += 1
        best = self.best
        if best is None:
            if len(self.children) == 1:
                self.best = token
        elif best != token:
            count, best_count = self.children[token].count, self.children[best].count
            if count > best_count or (count == best_count and token < best):
                self.best = token

    def lost(self, token: int) -> None:
        """Child `token` is about to lose an occurrence (and may go)."""
        self.continued -= 1
        if token == self.best:
            self.best = None

    def most_frequent_child(self) -> int | None:
        if self.best is None and self.children:
            self.best = min(self.children, key=lambda token: (-self.children[token].count, token))
        return self.best


class _Leaf:
    """The one occurrence of every path below its parent: the chain `text[start:end]`, whose
    first token is its key in the parent. A live text's chains grow with it up to `stop` (the
    trie's depth), so extending a path seen once costs nothing."""

    __slots__ = ("text", "start", "stop")
    count = 1

    def __init__(self, text: list[int], start: int, stop: int):
        self.text = text
        self.start = start
        self.stop = stop

    @property
    def end(self) -> int:
        return min(self.stop, len(self.text))

    def split(self) -> _Node:
        """A second occurrence shares the first token: it becomes a node of count 2, and the
        rest of the chain (if any is left) hangs below it."""
        node = _Node(2)
        self.start += 1
        if self.start < self.end:
            token = self.text[self.start]
            node.children[token] = self
            node.gained(token)
        return node


_Position = tuple[_Node | _Leaf, int]  # a matched path: where it ends, tokens of a leaf consumed


class TrieText:
    """A text being added to a trie token by token: its tokens (leaves point into them) and the
    nodes of its paths still being extended, as (start, node) for the paths `tokens[start:]`
    that occurred before and are shorter than the depth, oldest start (longest path) first."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.walking: list[tuple[int, _Node]] = []


class SuffixTrie:
    """Every substring of at most `max_depth` tokens of the texts added, with a count: how many
    start positions it occurs at. A path with count >= 2 is a `_Node` (a node left with count 1
    by `remove` stays one, which is fine); below it, a path that occurred once is one `_Leaf`
    however long, so text that does not repeat costs O(1) objects a token, not O(depth).
    Appending a token touches only the paths of the text that occurred before: O(depth) at most.

    Texts are added one after another: only the last text added may still grow (a leaf of an
    earlier text is cut where that text ended when it was split)."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node(0)  # count: start positions of all texts

    def extend(self, text: TrieText, tokens: Iterable[int]) -> None:
        for token in tokens:
            text.tokens.append(token)
            text.walking = self._count_last_token(text.tokens, text.walking)

    def _count_last_token(self, tokens: list[int],
                          walking: list[tuple[int, _Node]]) -> list[tuple[int, _Node]]:
        """Count the paths ending at the last token, one per start position still in depth."""
        end = len(tokens) - 1
        token = tokens[end]
        self.root.count += 1
        still_walking = []
        for start, node in [*walking, (end, self.root)]:
            child = node.children.get(token)
            if child is None:  # a new path: the chain of this occurrence from here on
                child = node.children[token] = _Leaf(tokens, end, start + self.max_depth)
            elif isinstance(child, _Leaf):
                child = node.children[token] = child.split()
            else:
                child.count += 1
            node.gained(token)
            if isinstance(child, _Node) and end + 1 - start < self.max_depth:
                still_walking.append((start, child))
        return still_walking

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back a text added with `extend`: every path of it loses one count, and a path
        whose count was 1 goes with everything below it (only this occurrence was there)."""
        for start in range(len(tokens)):
            self.root.count -= 1
            node = self.root
            for token in tokens[start:start + self.max_depth]:
                child = node.children[token]
                node.lost(token)
                if child.count == 1:
                    del node.children[token]
                    break
                child.count -= 1
                node = child

    def suffix_matches(self, tokens: Sequence[int]) -> Iterator[tuple[int, _Position]]:
        """(m, position of the last m tokens) for every m whose path exists, longest first.
        Every suffix of a path is a path, so the longest is found by bisection."""
        longest, shortest_missing = 0, len(tokens) + 1
        while shortest_missing - longest > 1:
            length = (longest + shortest_missing) // 2
            if self._find(tokens[len(tokens) - length:]) is None:
                shortest_missing = length
            else:
                longest = length
        for length in range(longest, 0, -1):
            yield length, self._find(tokens[len(tokens) - length:])

    def _find(self, path: Sequence[int]) -> _Position | None:
        node = self.root
        for depth, token in enumerate(path):
            child = node.children.get(token)
            if child is None:
                return None
            if isinstance(child, _Leaf):  # the rest of the path must be the rest of its chain
                rest = list(path[depth + 1:])
                start = child.start + 1
                if start + len(rest) > child.end or child.text[start:start + len(rest)] != rest:
                    return None
                return child, 1 + len(rest)
            node = child
        return node, 0

    def path_counts(self) -> dict[tuple[int, ...], int]:
        """Every path with its count, leaves expanded (walks the whole trie: for tests)."""
        counts: dict[tuple[int, ...], int] = {}
        for path, node in self._nodes():
            for token, child in node.children.items():
                if isinstance(child, _Leaf):
                    chain = tuple(child.text[child.start:child.end])
                    counts.update((path + chain[:n], 1) for n in range(1, len(chain) + 1))
                else:
                    counts[path + (token,)] = child.count
        return counts

    def check_invariants(self) -> None:
        """Each node's `continued` and `best` agree with its children (for tests)."""
        for path, node in self._nodes():
            assert node.continued == sum(child.count for child in node.children.values()), path
            if node.best is not None:
                assert node.best == min(node.children,
                                        key=lambda t: (-node.children[t].count, t)), path

    def _nodes(self) -> Iterator[tuple[tuple[int, ...], _Node]]:
        stack: list[tuple[tuple[int, ...], _Node]] = [((), self.root)]
        while stack:
            path, node = stack.pop()
            yield path, node
            stack += ((path + (token,), child) for token, child in node.children.items()
                      if isinstance(child, _Node))


def _draft(position: _Position, max_tokens: int, min_token_prob: float) -> tuple[float, list[int]]:
    """The greedy continuation of a matched path: its most frequent child while the product of
    child.count / node.continued stays >= min_token_prob; (sum of those products, tokens)."""
    node, consumed = position
    tokens: list[int] = []
    score, prob = 0.0, 1.0
    while len(tokens) < max_tokens:
        if isinstance(node, _Leaf):  # one occurrence: every further token has probability 1
            start = node.start + consumed
            rest = node.text[start:min(node.end, start + max_tokens - len(tokens))]
            return score + prob * len(rest), tokens + rest
        token = node.most_frequent_child()
        if token is None:
            break
        child = node.children[token]
        prob *= child.count / node.continued
        if prob < min_token_prob:
            break
        tokens.append(token)
        score += prob
        node, consumed = child, 1
    return score, tokens


# ---- suffix -----------------------------------------------------------------------------------


class _RequestTrie:
    """One request's trie over its prompt and output as far as seen."""

    def __init__(self, max_depth: int):
        self.trie = SuffixTrie(max_depth)
        self.text = TrieText()


class SuffixProposer(Proposer):
    """Matches: every suffix of the stream (shorter than the depth) that occurred before, in the
    stream itself or in a cached output; each gives its greedy draft of at most
    max(1, floor(max_spec_factor x m)) tokens, and the best score wins (ties: the longer match,
    then the stream's own trie). Every matched length competes, not only the longest (as in
    ArcticInference): the longest leaves the least depth to continue in."""

    name = "suffix"

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 100,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1):
        if max_tree_depth < 1 or max_cached_requests < 0:
            raise ValueError("need max_tree_depth >= 1 and max_cached_requests >= 0")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_trie = SuffixTrie(max_tree_depth)  # outputs of recent finished requests
        self._cached_outputs: deque[list[int]] = deque()  # in global_trie, oldest first
        self._requests: dict[str, _RequestTrie] = {}

    def propose(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                k: int) -> list[int]:
        own = self._requests.get(req_id)
        if own is None:
            own = self._requests[req_id] = _RequestTrie(self.max_tree_depth)
        own.trie.extend(own.text, token_ids[len(own.text.tokens):])
        if k < 1:
            return []
        num_tokens = len(token_ids)
        # The stream's own suffixes that occurred before are exactly the paths still walking.
        own_matches = [(num_tokens - start, (node, 0)) for start, node in own.text.walking]
        own_score, own_tokens = self._best_draft(own_matches, k)
        window = token_ids[max(0, num_tokens - self.max_tree_depth + 1):]
        cached_matches = self.global_trie.suffix_matches(window)
        cached_score, cached_tokens = self._best_draft(cached_matches, k)
        return cached_tokens if cached_score > own_score else own_tokens

    def _best_draft(self, matches: Iterable[tuple[int, _Position]],
                    k: int) -> tuple[float, list[int]]:
        """The best-scoring draft over `matches`, longest first: a shorter match wins only with
        a higher score, and none can once it may not propose more tokens than that score (every
        token's probability is at most 1)."""
        best: tuple[float, list[int]] = (0.0, [])
        for length, position in matches:
            # + 1e-6: 0.29 x 100 is 28.999... in floating point
            max_tokens = min(k, max(1, math.floor(self.max_spec_factor * length + 1e-6)))
            if max_tokens <= best[0]:
                break
            draft = _draft(position, max_tokens, self.min_token_prob)
            if draft[0] > best[0]:
                best = draft
        return best

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.forget(req_id)
        if self.max_cached_requests == 0:
            return
        output = TrieText()
        self.global_trie.extend(output, token_ids[num_prompt_tokens:])
        self._cached_outputs.append(output.tokens)
        if len(self._cached_outputs) > self.max_cached_requests:
            self.global_trie.remove(self._cached_outputs.popleft())

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)


# ---- construction -----------------------------------------------------------------------------

_OPTIONS = {  # method -> {vLLM option name: constructor argument}
    "ngram": {"prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max"},
    "suffix": {
        "suffix_decoding_max_tree_depth": "max_tree_depth",
        "suffix_decoding_max_cached_requests": "max_cached_requests",
        "suffix_decoding_max_spec_factor": "max_spec_factor",
        "suffix_decoding_min_token_prob": "min_token_prob",
    },
}
_PROPOSERS: dict[str, type[Proposer]] = {"ngram": NgramProposer, "suffix": SuffixProposer}


def make_proposer(method: str, **options: Any) -> Proposer:
    """The proposer of `method` from options in vLLM's spelling; options of other methods (or
    of the speculative config at large) are ignored."""
    if method not in _PROPOSERS:
        raise ValueError(f"unknown proposer method {method!r}: expected {sorted(_PROPOSERS)}")
    names = _OPTIONS[method]
    return _PROPOSERS[method](**{names[o]: v for o, v in options.items() if o in names})
