"""Engine lifecycle: validation, abort, errors, resume, seeded sampling, logprobs, stop tokens —
and every block back in the pool afterwards."""

from __future__ import annotations

import pytest

from kvfleet.shared.wire import SamplingParams
from tests.engine.tiny_models import greedy, random_prompt, run_to_completion


def assert_no_leak(engine):
    stats = engine.stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    assert stats.num_running == 0 and stats.num_waiting == 0
    engine.block_manager.check_invariants()


def test_rejects_bad_requests_with_clear_messages(tiny_llama):
    engine = tiny_llama.engine(num_blocks=8)  # 32 tokens
    with pytest.raises(ValueError, match="exceeds the model context of 512"):
        engine.add_request("long", [5] * 500, greedy(20))
    with pytest.raises(ValueError, match="pool has only 8"):
        engine.add_request("big", [5] * 30, greedy(10))
    engine.add_request("ok", [5] * 10, greedy(3))
    with pytest.raises(ValueError, match="already"):
        engine.add_request("ok", [5] * 10, greedy(3))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], greedy(3))
    run_to_completion(engine)
    assert_no_leak(engine)


def test_abort_frees_blocks_at_once_in_any_state(tiny_llama):
    engine = tiny_llama.engine(max_batched_tokens=8)
    engine.add_request("running", random_prompt(20, 1), greedy(50))
    engine.add_request("waiting", random_prompt(20, 2), greedy(50))
    engine.step()
    assert engine.stats().num_blocks_free < engine.stats().num_blocks_total
    out = engine.abort("running")
    assert out.finish_reason == "abort" and out.new_token_ids == []
    assert engine.abort("waiting").finish_reason == "abort"
    assert engine.abort("never-seen") is None
    assert not engine.has_unfinished()
    assert_no_leak(engine)


def test_a_failing_request_errors_alone_and_leaks_nothing(tiny_llama, monkeypatch):
    engine = tiny_llama.engine()
    bad = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, seed=666)
    sample = engine.sampler.sample

    def failing_sample(logits, inputs, *rest):
        if any(inp.params.seed == 666 for inp in inputs):
            raise RuntimeError("poison")
        return sample(logits, inputs, *rest)

    monkeypatch.setattr(engine.sampler, "sample", failing_sample)
    good_prompt = random_prompt(9, 3)
    engine.add_request("good", good_prompt, greedy(6))
    engine.add_request("bad", random_prompt(9, 4), bad)
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    bad_out = [o for o in outputs if o.req_id == "bad"]
    assert [o.finish_reason for o in bad_out] == ["error"] and "poison" in bad_out[0].error
    good = [t for o in outputs if o.req_id == "good" for t in o.new_token_ids]
    assert good == tiny_llama.reference(good_prompt, 6)
    assert_no_leak(engine)


def test_a_failing_forward_errors_its_batch_and_the_engine_goes_on(tiny_llama, monkeypatch):
    engine = tiny_llama.engine()
    engine.add_request("a", random_prompt(9, 5), greedy(6))
    engine.add_request("b", random_prompt(5, 6), greedy(6))
    engine.step()
    execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda sched: 1 / 0)
    outputs = engine.step()
    assert sorted((o.req_id, o.finish_reason) for o in outputs) == [("a", "error"), ("b", "error")]
    assert_no_leak(engine)
    monkeypatch.setattr(engine.runner, "execute", execute)
    prompt = random_prompt(7, 7)
    engine.add_request("c", prompt, greedy(4))
    assert run_to_completion(engine)["c"] == tiny_llama.reference(prompt, 4)


def test_resume_continues_the_same_greedy_stream(tiny):
    prompt = random_prompt(21, 8)
    expected = tiny.reference(prompt, 24)
    engine = tiny.engine()
    engine.add_request("resumed", prompt, greedy(24), output_token_ids=expected[:10])
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    assert [t for o in outputs for t in o.new_token_ids] == expected[10:]
    assert outputs[-1].num_output_tokens == 24 and outputs[-1].finish_reason == "length"
    assert_no_leak(engine)


def test_resume_with_every_token_already_generated_finishes_at_once(tiny_llama):
    engine = tiny_llama.engine()
    engine.add_request("done", random_prompt(5, 9), greedy(3), output_token_ids=[7, 8, 9])
    outputs = engine.step()
    assert [(o.req_id, o.finish_reason, o.num_output_tokens) for o in outputs] == [("done", "length", 3)]
    assert not engine.has_unfinished()


def test_seeded_sampling_ignores_batch_composition_and_survives_resume(tiny_llama):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    prompt = random_prompt(13, 10)
    alone_engine = tiny_llama.engine()
    alone_engine.add_request("x", prompt, params)
    alone = run_to_completion(alone_engine)["x"]

    crowd = tiny_llama.engine(max_batched_tokens=9)
    for i in range(4):
        crowd.add_request(f"other{i}", random_prompt(11 + 5 * i, 20 + i),
                          SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True))
    crowd.step()
    crowd.add_request("x", prompt, params)
    assert run_to_completion(crowd)["x"] == alone

    resumed = tiny_llama.engine()
    resumed.add_request("x", prompt, params, output_token_ids=alone[:6])
    assert run_to_completion(resumed)["x"] == alone[6:]
    other_seed = tiny_llama.engine()
    other_seed.add_request("y", prompt, SamplingParams(max_tokens=16, temperature=0.9, seed=43,
                                                       ignore_eos=True))
    assert run_to_completion(other_seed)["y"] != alone


def test_logprobs_and_stop_token_ids(tiny_llama):
    prompt = random_prompt(9, 11)
    expected = tiny_llama.reference(prompt, 10)
    engine = tiny_llama.engine()
    engine.add_request("lp", prompt, greedy(10, logprobs=3, stop_token_ids=[expected[4]]))
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    stop_at = expected.index(expected[4]) + 1
    assert [t for o in outputs for t in o.new_token_ids] == expected[:stop_at]
    assert outputs[-1].finish_reason == "stop"
    for out in outputs:
        (lp,) = out.new_logprobs
        assert lp.token_id == out.new_token_ids[0] and len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id and lp.logprob <= 0.0


def test_eos_stops_unless_ignored(tiny_llama):
    prompt = random_prompt(9, 12)
    expected = tiny_llama.reference(prompt, 8)
    engine = tiny_llama.engine()
    engine.sampler.eos_token_ids = [expected[2]]  # pretend the 3rd token is EOS
    engine.scheduler.stop_checker.eos_token_ids = frozenset([expected[2]])
    engine.add_request("eos", prompt, SamplingParams(max_tokens=8, temperature=0.0))
    engine.add_request("ignore", prompt, greedy(8))
    produced = run_to_completion(engine)
    assert produced["eos"] == expected[:expected.index(expected[2]) + 1]
    assert produced["ignore"] == expected


def test_can_admit_counts_evictable_blocks_and_the_watermark(tiny_llama):
    engine = tiny_llama.engine(num_blocks=100, watermark=0.1)  # 10 blocks kept free
    assert engine.can_admit(90 * 4) and not engine.can_admit(90 * 4 + 1)
    prompt = random_prompt(40, 13)
    engine.add_request("a", prompt, greedy(2))
    run_to_completion(engine)
    assert engine.stats().num_cached_blocks > 0
    assert engine.can_admit(90 * 4)  # cached blocks are evictable, so they count as free


def test_stats_count_tokens(tiny_llama):
    engine = tiny_llama.engine(enable_prefix_caching=False)
    engine.generate([random_prompt(10, 14), random_prompt(6, 15)], greedy(5))
    stats = engine.stats()
    assert stats.num_generated_tokens == 10
    assert stats.num_prefill_tokens_computed == 16


def test_generate_keeps_prompt_order_and_per_request_params(tiny_llama):
    engine = tiny_llama.engine()
    prompts = [random_prompt(n, 30 + n) for n in (12, 3, 25)]
    params = [greedy(n) for n in (4, 9, 6)]
    outs = engine.generate(prompts, params)
    assert outs == [tiny_llama.reference(p, sp.max_tokens) for p, sp in zip(prompts, params)]


class LetterTokenizer:
    """Token i decodes to one letter: enough for stop strings."""

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


def test_stop_strings_use_the_engines_tokenizer(tiny_llama):
    prompt = random_prompt(9, 16)
    expected = tiny_llama.reference(prompt, 10)
    engine = tiny_llama.engine(tokenizer=LetterTokenizer())
    stop = LetterTokenizer().decode(expected[3:5])
    engine.add_request("s", prompt, greedy(10, stop=[stop]))
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    first = LetterTokenizer().decode(expected).index(stop)  # one letter per token
    assert [t for o in outputs for t in o.new_token_ids] == expected[:first + 2]
    assert outputs[-1].finish_reason == "stop"
