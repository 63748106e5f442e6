"""Unit tests of the model-free proposers (ngram, suffix): what they propose, that their
incremental indexes agree with a fresh build, and that a call's work does not grow with the
context (no model, no Redis)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

import pytest

from kvfleet.worker.engine.speculation.proposers import (
    NgramProposer,
    SuffixProposer,
    SuffixTrie,
    TrieText,
    make_proposer,
)


class GrowingTokens(Sequence):
    """The first `end` tokens of a list, counting the elements read (a slice counts its
    length): a stream that grows by one token per step, as the engine shows it."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.end = 0
        self.reads = 0

    def __len__(self) -> int:
        return self.end

    def __getitem__(self, index):
        if isinstance(index, slice):
            item = self.tokens[slice(*index.indices(self.end))]
            self.reads += len(item)
            return item
        if not -self.end <= index < self.end:
            raise IndexError(index)
        self.reads += 1
        return self.tokens[index % self.end]


def repetitive_tokens(rng: random.Random, n: int, alphabet: int) -> list[int]:
    """Random tokens with copied stretches, so that matches of every length occur."""
    tokens: list[int] = []
    while len(tokens) < n:
        if tokens and rng.random() < 0.4:
            start = rng.randrange(len(tokens))
            tokens += tokens[start:start + rng.randint(1, 8)]
        else:
            tokens.append(rng.randrange(alphabet))
    return tokens[:n]


def grow(proposer, req_id: str, tokens: list[int], rng: random.Random, k: int):
    """Propose after every prefix reached by appending random chunks; yield (prefix, proposal)."""
    end = 0
    while end < len(tokens):
        end = min(len(tokens), end + rng.randint(1, 3))
        yield tokens[:end], proposer.propose(req_id, tokens[:end], 0, k)


# ---- ngram ------------------------------------------------------------------------------------


def naive_ngram(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposes_what_followed_the_most_recent_earlier_match():
    tokens = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2]
    assert NgramProposer().propose("a", tokens, 4, 3) == [4, 8, 1]


def test_ngram_longest_match_wins_over_a_more_recent_shorter_one():
    tokens = [5, 6, 7, 1, 6, 7, 2, 9, 7, 3, 5, 6, 7]  # [7] last followed 3; [5, 6, 7] followed 1
    assert NgramProposer().propose("a", tokens, 0, 2) == [1, 6]
    assert NgramProposer(prompt_lookup_max=1).propose("a", tokens, 0, 2) == [3, 5]


def test_ngram_nothing_without_an_earlier_match():
    proposer = NgramProposer()
    assert proposer.propose("a", [1, 2, 3, 4, 5], 2, 4) == []
    assert proposer.propose("b", [7], 1, 4) == []
    assert proposer.propose("c", [1, 2, 1], 1, 0) == []
    assert NgramProposer(prompt_lookup_min=3).propose("d", [1, 2, 9, 1, 2], 0, 4) == []


def test_ngram_proposes_only_known_tokens():
    assert NgramProposer().propose("a", [7, 8, 9, 7, 8], 0, 5) == [9, 7, 8]
    # The final n-gram is not its own earlier match: [4, 4, 4] last occurred at 0, then one 4.
    assert NgramProposer().propose("b", [4, 4, 4, 4], 0, 5) == [4]


def test_ngram_incremental_matches_a_fresh_build_and_a_naive_scan():
    rng = random.Random(1)
    for case in range(300):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 6)
        tokens = repetitive_tokens(rng, rng.randint(1, 50), rng.randint(2, 6))
        incremental = NgramProposer(lo, hi)
        for prefix, proposal in grow(incremental, "r", tokens, rng, k):
            assert proposal == naive_ngram(prefix, lo, hi, k), (case, prefix)
            assert proposal == NgramProposer(lo, hi).propose("r", prefix, 0, k)


@pytest.mark.parametrize("drop", ["forget", "finish"])
def test_ngram_forget_and_finish_drop_the_request_index(drop):
    proposer = NgramProposer()
    first = [1, 2, 3, 1, 2]
    assert proposer.propose("a", first, 0, 2) == [3, 1]
    if drop == "forget":
        proposer.forget("a")
    else:
        proposer.finish("a", first, 0)
    assert proposer.propose("a", [5, 6, 7, 5, 6], 0, 2) == [7, 5]  # a stale index finds nothing


def test_ngram_work_per_call_does_not_grow_with_the_context():
    tokens = GrowingTokens(repetitive_tokens(random.Random(2), 4000, 50))
    proposer, k = NgramProposer(1, 4), 5
    proposed = 0
    for tokens.end in range(1, len(tokens.tokens) + 1):
        proposed += len(proposer.propose("a", tokens, 0, k))
    assert proposed > 1000  # it did propose
    # Per call: the new token with the 3 before it, the final 4-gram, the proposal.
    assert tokens.reads <= len(tokens) * (4 + 4 + k)


# ---- suffix tries -----------------------------------------------------------------------------


def naive_path_counts(texts: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: Counter[tuple[int, ...]] = Counter()
    for text in texts:
        for start in range(len(text)):
            for end in range(start + 1, min(start + depth, len(text)) + 1):
                counts[tuple(text[start:end])] += 1
    return dict(counts)


def build(texts: list[list[int]], depth: int, rng: random.Random) -> SuffixTrie:
    """A trie over `texts`, one after another, each in random chunks."""
    trie = SuffixTrie(depth)
    for text in texts:
        state = TrieText()
        while len(state.tokens) < len(text):
            done = len(state.tokens)
            trie.extend(state, text[done:done + rng.randint(1, 4)])
    return trie


def test_suffix_trie_counts_every_substring_up_to_the_depth():
    rng = random.Random(3)
    for _ in range(200):
        depth = rng.randint(1, 6)
        texts = [repetitive_tokens(rng, rng.randint(0, 30), rng.randint(1, 4))
                 for _ in range(rng.randint(1, 3))]
        trie = build(texts, depth, rng)
        assert trie.path_counts() == naive_path_counts(texts, depth)
        assert trie.root.count == sum(map(len, texts))
        trie.check_invariants()


def test_suffix_trie_remove_restores_the_counts_without_the_text():
    rng = random.Random(4)
    for _ in range(200):
        depth = rng.randint(1, 6)
        texts = [repetitive_tokens(rng, rng.randint(0, 30), rng.randint(1, 4))
                 for _ in range(rng.randint(2, 4))]
        trie = build(texts, depth, rng)
        gone = rng.sample(range(len(texts)), rng.randint(1, len(texts)))
        for i in gone:
            trie.remove(texts[i])
        kept = [text for i, text in enumerate(texts) if i not in gone]
        assert trie.path_counts() == naive_path_counts(kept, depth)
        assert trie.root.count == sum(map(len, kept))
        trie.check_invariants()
        if not kept:
            assert trie.root.children == {}


# ---- suffix proposer --------------------------------------------------------------------------


def test_suffix_proposes_a_phrase_the_request_repeats():
    tokens = list(range(10, 20)) + [50, 51] + [10, 11, 12, 13]
    assert SuffixProposer().propose("a", tokens, 12, 4) == [14, 15, 16, 17]


def test_suffix_learns_the_outputs_of_finished_requests():
    proposer = SuffixProposer()
    prompt, output = [1, 2, 3], list(range(20, 30))
    assert proposer.propose("new", [7, 8, 20, 21, 22], 5, 5) == []
    proposer.finish("old", prompt + output, len(prompt))
    assert proposer.propose("new2", [7, 8, 20, 21, 22], 5, 5) == [23, 24, 25]  # 3 matched
    assert proposer.propose("new3", [9, 1, 2], 3, 5) == []  # prompts are not learned


def test_suffix_evicts_the_oldest_output_and_restores_the_counts():
    outputs = [[1, 2, 3, 4, 5], [3, 4, 5, 6], [8, 9, 3, 4]]
    proposer = SuffixProposer(max_tree_depth=4, max_cached_requests=2)
    for i, output in enumerate(outputs):
        proposer.finish(f"r{i}", [0] + output, 1)
    expected = SuffixProposer(max_tree_depth=4, max_cached_requests=2)
    for i, output in enumerate(outputs[1:]):
        expected.finish(f"e{i}", output, 0)
    assert proposer.global_trie.path_counts() == expected.global_trie.path_counts()
    assert proposer.global_trie.path_counts() == naive_path_counts(outputs[1:], 4)
    assert proposer.propose("q", [1, 2], 2, 2) == []  # r0's text is gone
    assert proposer.propose("q2", [8, 9], 2, 2) == [3, 4]


def test_suffix_min_token_prob_stops_at_a_branch():
    outputs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7]]
    probs = {}
    for min_token_prob in (0.6, 0.4):
        proposer = SuffixProposer(max_spec_factor=1.0, min_token_prob=min_token_prob)
        for i, output in enumerate(outputs):
            proposer.finish(f"r{i}", output, 0)
        probs[min_token_prob] = proposer.propose("q", [9, 2, 3, 4], 4, 8)
    assert probs[0.6] == [5]  # 5 (2/2), then 6 or 7 (1/2 each) falls below 0.6
    assert probs[0.4] == [5, 6]  # 6 and 7 tie: the lower token


def test_suffix_max_spec_factor_caps_the_length():
    proposals = {}
    for factor in (0.1, 1.0, 2.0):
        proposer = SuffixProposer(max_spec_factor=factor)
        proposer.finish("old", list(range(1, 11)), 0)
        proposals[factor] = proposer.propose("q", [1, 2], 2, 8)
    assert proposals == {0.1: [3], 1.0: [3, 4], 2.0: [3, 4, 5, 6]}


def test_suffix_depth_bounds_match_and_proposal():
    tokens = list(range(100, 110)) + [1] + list(range(100, 104))
    assert SuffixProposer(max_tree_depth=6).propose("a", tokens, 0, 8) == [104, 105, 106]
    assert SuffixProposer(max_tree_depth=1).propose("b", tokens, 0, 8) == []


def naive_suffix(tokens: list[int], cached: list[list[int]], depth: int, factor: float,
                 min_token_prob: float, k: int) -> list[int]:
    """The suffix proposal by brute force over substring counts (no trie)."""

    def best_draft(counts: dict[tuple[int, ...], int], min_count: int) -> tuple[float, list[int]]:
        children: dict[tuple[int, ...], dict[int, int]] = {}
        for path, count in counts.items():
            children.setdefault(path[:-1], {})[path[-1]] = count
        best: tuple[float, list[int]] = (0.0, [])
        for m in range(min(depth - 1, len(tokens)), 0, -1):
            path = tuple(tokens[-m:])
            if counts.get(path, 0) >= min_count:
                draft = draft_from(children, path, min(k, max(1, math.floor(factor * m + 1e-6))))
                best = draft if draft[0] > best[0] else best
        return best

    def draft_from(children, path, max_tokens) -> tuple[float, list[int]]:
        proposal, score, prob = [], 0.0, 1.0
        while len(proposal) < max_tokens and path in children:
            after = children[path]
            token = min(after, key=lambda t: (-after[t], t))
            prob *= after[token] / sum(after.values())
            if prob < min_token_prob:
                break
            proposal.append(token)
            score += prob
            path += (token,)
        return score, proposal

    own = best_draft(naive_path_counts([tokens], depth), 2)  # 2: it occurred before the end
    shared = best_draft(naive_path_counts(cached, depth), 1)
    return shared[1] if shared[0] > own[0] else own[1]


def test_suffix_incremental_matches_a_brute_force_reference():
    rng = random.Random(5)
    for case in range(200):
        depth = rng.randint(2, 8)
        factor, min_token_prob = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.5])
        k = rng.randint(1, 6)
        cached = [repetitive_tokens(rng, rng.randint(0, 20), 4) for _ in range(rng.randint(0, 2))]
        tokens = repetitive_tokens(rng, rng.randint(1, 40), rng.randint(2, 5))
        proposer = SuffixProposer(depth, max_spec_factor=factor, min_token_prob=min_token_prob)
        for i, output in enumerate(cached):
            proposer.finish(f"done{i}", output, 0)
        for prefix, proposal in grow(proposer, "r", tokens, rng, k):
            expected = naive_suffix(prefix, cached, depth, factor, min_token_prob, k)
            assert proposal == expected, (case, prefix)


def test_suffix_forget_and_finish_drop_the_request_trie():
    proposer = SuffixProposer(max_cached_requests=0)
    first, other = [1, 2, 3, 9, 1, 2], [5, 6, 7, 8, 5, 6]
    proposer.propose("a", first, 0, 2)
    proposer.forget("a")
    assert proposer.propose("a", other, 0, 2) == [7, 8]
    proposer.finish("a", other, 0)
    assert proposer.propose("a", first, 0, 2) == [3, 9]
    assert proposer.global_trie.root.count == 0  # cache disabled


def test_suffix_work_per_call_does_not_grow_with_the_context():
    tokens = GrowingTokens(repetitive_tokens(random.Random(6), 4000, 50))
    proposer = SuffixProposer(max_tree_depth=24)
    proposer.finish("old", tokens.tokens[:500], 0)
    proposed = 0
    for tokens.end in range(1, len(tokens.tokens) + 1):
        proposed += len(proposer.propose("a", tokens, 0, 5))
    assert proposed > 1000
    assert tokens.reads <= len(tokens) * 24  # per call: the new token, the last 23 tokens
    # A path seen once is one leaf, not a chain of nodes: O(n) objects, not O(n x depth).
    assert num_trie_objects(proposer._requests["a"].trie) < 3 * len(tokens)


def num_trie_objects(trie: SuffixTrie) -> int:
    count, stack = 0, [trie.root]
    while stack:
        node = stack.pop()
        count += len(node.children)
        stack += (child for child in node.children.values() if isinstance(child, type(node)))
    return count


# ---- construction -----------------------------------------------------------------------------


def test_make_proposer_reads_vllm_options_and_ignores_other_methods():
    options = dict(prompt_lookup_min=2, prompt_lookup_max=3, suffix_decoding_max_tree_depth=8,
                   suffix_decoding_max_cached_requests=5, suffix_decoding_max_spec_factor=2.0,
                   suffix_decoding_min_token_prob=0.2, num_speculative_tokens=5)
    ngram = make_proposer("ngram", **options)
    assert isinstance(ngram, NgramProposer) and (ngram.min_n, ngram.max_n) == (2, 3)
    suffix = make_proposer("suffix", **options)
    assert isinstance(suffix, SuffixProposer) and suffix.name == "suffix"
    assert (suffix.max_tree_depth, suffix.max_cached_requests) == (8, 5)
    assert (suffix.max_spec_factor, suffix.min_token_prob) == (2.0, 0.2)
    assert make_proposer("ngram").max_n == 4
    with pytest.raises(ValueError):
        make_proposer("eagle")
    with pytest.raises(ValueError):
        make_proposer("ngram", prompt_lookup_min=3, prompt_lookup_max=2)
