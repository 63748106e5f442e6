"""`tool_choice: "auto"` as a grammar on the default model's tokenizer: free text passes, a call
the model opens must follow a tool's schema, and `parallel_tool_calls: false` allows one call."""

from __future__ import annotations

import pytest
import torch

from kvfleet.gateway.tools.formats import HERMES, LLAMA3_JSON, MISTRAL
from kvfleet.gateway.tools.grammar import auto_tool_constraint
from kvfleet.shared.structured import ConstraintError, validate
from kvfleet.worker.structured.compiler import GrammarCompiler
from kvfleet.worker.structured.logit_mask import LogitMask

WEATHER = ("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]})
TIME = ("get_time", None)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SECOND = '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def accepts(compiler, tokenizer, constraint, text: str) -> bool:
    """Whether `text` then EOS is a complete answer under the constraint."""
    try:
        matcher = compiler.matcher(constraint, tokenizer.encode(text) + [tokenizer.eos_token_id])
    except ConstraintError:
        return False
    return matcher.is_finished


@pytest.mark.parametrize("text, parallel, ok", [
    ("Paris is sunny today, no need to look.", False, True),
    ("a < b, <tool and <tool_cal are not calls", False, True),
    (CALL, False, True),
    ("Let me check.\n" + CALL, False, True),
    (CALL.replace("get_weather", "get_wether"), False, False),  # no such tool
    (CALL.replace('"city"', '"town"'), False, False),  # not the tool's parameters
    (CALL + SECOND, False, False),  # parallel_tool_calls false: one call
    (CALL + SECOND, True, True),
    (CALL + "\nand some text after", True, False),  # nothing after the calls
])
def test_auto_allows_text_or_schema_calls(compiler, tokenizer, text, parallel, ok):
    constraint = auto_tool_constraint([WEATHER, TIME], HERMES, parallel)
    validate(constraint)
    assert accepts(compiler, tokenizer, constraint, text) is ok


def test_after_the_one_call_only_eos_may_come(compiler, tokenizer):
    matcher = compiler.matcher(auto_tool_constraint([WEATHER], HERMES, False),
                               tokenizer.encode(CALL))
    vocab = len(tokenizer)
    allowed = LogitMask.of({0: matcher}, vocab).allowed(vocab, torch.device("cpu"))[0]
    assert allowed.nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_formats_without_a_text_marker_stay_free():
    assert auto_tool_constraint([WEATHER], LLAMA3_JSON, True) is None
    assert auto_tool_constraint([WEATHER], MISTRAL, True) is None
