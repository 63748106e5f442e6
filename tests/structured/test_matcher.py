"""Grammar compilation (cached), matchers rebuilt from tokens, and the logit mask."""

from __future__ import annotations

import json

import pytest
import torch

from kvfleet.shared.structured import ConstraintError, OutputConstraint
from kvfleet.worker.structured.compiler import GrammarCompiler
from kvfleet.worker.structured.logit_mask import LogitMask

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def allowed_ids(matcher, vocab_size: int) -> set[int]:
    mask = LogitMask.of({0: matcher}, vocab_size)
    return set(mask.allowed(vocab_size, torch.device("cpu"))[0].nonzero().flatten().tolist())


def test_same_constraint_compiles_once(compiler):
    constraint = OutputConstraint.json_schema(SCHEMA)
    hits, misses = compiler.hits, compiler.misses
    compiler.matcher(constraint)
    compiler.matcher(OutputConstraint.json_schema(json.loads(json.dumps(SCHEMA))))
    assert compiler.misses == misses + 1 and compiler.hits == hits + 1


def test_mask_allows_exactly_the_grammar(compiler, tokenizer):
    matcher = compiler.matcher(OutputConstraint.choice(["yes", "no"]))
    allowed = allowed_ids(matcher, len(tokenizer))
    texts = {tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert tokenizer.encode("yes")[0] in allowed and tokenizer.encode("maybe")[0] not in allowed


def test_only_eos_once_complete(compiler, tokenizer):
    matcher = compiler.matcher(OutputConstraint("regex", "[0-9]{3}"))
    matcher.advance(tokenizer.encode("123"))
    assert allowed_ids(matcher, len(tokenizer)) == {tokenizer.eos_token_id}
    matcher.advance([tokenizer.eos_token_id])
    assert matcher.is_finished


def test_rebuilt_matcher_gives_the_same_masks(compiler, tokenizer):
    text = json.dumps({"name": "Ann", "age": 41})
    ids = tokenizer.encode(text)
    constraint = OutputConstraint.json_schema(SCHEMA)
    live = compiler.matcher(constraint)
    for k, token_id in enumerate(ids):
        resumed = compiler.matcher(constraint, ids[:k])  # a fresh worker replaying a checkpoint
        assert allowed_ids(resumed, len(tokenizer)) == allowed_ids(live, len(tokenizer)), k
        live.advance([token_id])


def test_replaying_foreign_tokens_is_refused(compiler, tokenizer):
    with pytest.raises(ConstraintError, match="violates"):
        compiler.matcher(OutputConstraint("regex", "[0-9]+"), tokenizer.encode("abc"))


def test_mask_only_touches_constrained_rows(compiler, tokenizer):
    vocab = len(tokenizer)
    scores = torch.randn(3, vocab + 64)  # an LM head padded beyond the tokenizer
    before = scores.clone()
    mask = LogitMask.of({1: compiler.matcher(OutputConstraint.choice(["yes"]))}, vocab)
    mask.apply(scores)
    assert torch.equal(scores[0], before[0]) and torch.equal(scores[2], before[2])
    finite = torch.isfinite(scores[1]).nonzero().flatten().tolist()
    assert finite and all("yes".startswith(tokenizer.decode([t])) for t in finite)
    assert max(finite) < vocab
