"""One real fleet (a gateway and two worker processes on the default model) shared by the e2e
tests, on a Redis of its own: the session's Redis is flushed around every test that asks for an
empty database, and a live fleet writes into its Redis all the time (heartbeats, block
announcements, streams made again after a flush), so the two do not share one. And the default
model in transformers (`hf_reference`), the reference of the tests that compare the fleet's
answers with it, loaded once and each chat's greedy answer generated once."""

from __future__ import annotations

import json

import pytest

from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path
from kvfleet.shared.redis_server import EmbeddedRedis
from tests.helpers.processes import ProcessFleet


@pytest.fixture(scope="session")
def fleet(tmp_path_factory):
    with EmbeddedRedis() as server:
        fleet = ProcessFleet(server.url, tmp_path_factory.mktemp("fleet-logs"))
        try:
            fleet.start("w0", "w-second")  # both load while the gateway starts
            yield fleet
        finally:
            fleet.kill()


class HfReference:
    """The default model in transformers, float32: the reference of the tests that compare the
    fleet with it, loaded once a session."""

    def __init__(self):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = resolve_model_path(DEFAULT_MODEL)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # chat -> (the greedy answer's ids, the max_new_tokens it was generated with)
        self._generated: dict[str, tuple[list[int], int]] = {}

    def greedy(self, messages: list[dict], max_new_tokens: int) -> tuple[str, int]:
        """`generate`'s greedy answer to a chat: its text and number of tokens. A chat is
        generated again only for more tokens than it was, unless it ended sooner: the answer to
        fewer is the first ones (greedy tokens do not depend on how many follow)."""
        import torch

        key = json.dumps(messages, sort_keys=True)
        known, asked = self._generated.get(key, ([], 0))
        if asked < max_new_tokens and len(known) == asked:  # not yet, or cut at its limit
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt",
                return_dict=True)["input_ids"]
            with torch.inference_mode():
                out = self.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            known = out[0, ids.shape[1]:].tolist()
            self._generated[key] = known, max_new_tokens
        answer = known[:max_new_tokens]
        return self.tokenizer.decode(answer, skip_special_tokens=True), len(answer)


@pytest.fixture(scope="session")
def hf_reference() -> HfReference:
    return HfReference()
