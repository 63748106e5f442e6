"""EventCoalescer: which token events a worker publishes now, and what it merges, on a fake clock."""

from __future__ import annotations

import pytest

from kvfleet.shared.wire import RequestStatus, TokenEvent, TokenLogprob, Usage
from kvfleet.worker.coalescing import EventCoalescer, merge_events
from kvfleet.worker.protocol import Publication


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def publication(req_id: str, seq: int, tokens: list[int], *, final: bool = False,
                logprobs: bool = False, prompt_logprobs=None) -> Publication:
    event = TokenEvent(seq=seq, attempt=1, token_ids=tokens,
                       logprobs=[TokenLogprob(t, -0.5) for t in tokens] if logprobs else None,
                       finish_reason="length" if final else None,
                       usage=Usage(5, seq + len(tokens)) if final else None,
                       prompt_logprobs=prompt_logprobs)
    return Publication(req_id, 1, event, RequestStatus.FINISHED_LENGTH if final else None,
                       "stream", f"entry-{req_id}")


def test_no_interval_publishes_every_event_as_it_came():
    coalescer = EventCoalescer(0)
    items = [publication("a", 0, [1]), publication("b", 3, [7])]
    assert coalescer.step(items) == items
    assert coalescer.step([publication("a", 1, [2])])[0].event.token_ids == [2]
    assert coalescer.num_held == 0


def test_tokens_wait_for_the_interval_then_go_out_in_one_event():
    clock = Clock()
    coalescer = EventCoalescer(0.1, clock)
    [first] = coalescer.step([publication("a", 0, [10], logprobs=True,
                                          prompt_logprobs=[TokenLogprob(4, -1.0)])])
    assert first.event.token_ids == [10]  # the first token is not held back
    for seq, token in ((1, 11), (2, 12)):
        clock.now += 0.03
        assert coalescer.step([publication("a", seq, [token], logprobs=True)]) == []
    clock.now += 0.04  # 0.1 s after the first event
    [sent] = coalescer.step([publication("a", 3, [13], logprobs=True)])
    assert (sent.event.seq, sent.event.token_ids) == (1, [11, 12, 13])
    assert [lp.token_id for lp in sent.event.logprobs] == [11, 12, 13]
    assert sent.event.prompt_logprobs is None and sent.final_status is None
    clock.now += 0.05
    assert coalescer.step([publication("a", 4, [14], logprobs=True)]) == []  # 0.05 s since


def test_the_final_event_goes_out_at_once_with_what_was_held():
    clock = Clock()
    coalescer = EventCoalescer(1.0, clock)
    coalescer.step([publication("a", 0, [1])])
    assert coalescer.step([publication("a", 1, [2])]) == []
    [final] = coalescer.step([publication("a", 2, [3], final=True)])
    assert (final.event.seq, final.event.token_ids) == (1, [2, 3])
    assert final.event.finish_reason == "length" and final.event.usage == Usage(5, 3)
    assert final.final_status is RequestStatus.FINISHED_LENGTH
    assert coalescer.num_held == 0
    # the id may come back (a later attempt on this worker): its first event is not held
    assert len(coalescer.step([publication("a", 0, [1])])) == 1


def test_a_merged_final_event_keeps_what_stopped_it():
    """text_after_stop counts back from the end of the text, so merging tokens in front of the
    final event leaves it right."""
    first = TokenEvent(seq=0, attempt=1, token_ids=[1, 2])
    final = TokenEvent(seq=2, attempt=1, token_ids=[3], finish_reason="stop", usage=Usage(5, 3),
                       stop_reason="END", text_after_stop=2)
    merged = merge_events(first, final)
    assert merged.token_ids == [1, 2, 3]
    assert (merged.stop_reason, merged.text_after_stop) == ("END", 2)


def test_a_request_with_no_new_tokens_still_gets_what_it_held_when_due():
    clock = Clock()
    coalescer = EventCoalescer(0.1, clock)
    coalescer.step([publication("a", 0, [1]), publication("b", 0, [5])])
    clock.now += 0.05
    assert coalescer.step([publication("a", 1, [2]), publication("b", 1, [6])]) == []
    clock.now += 0.06  # "a" was preempted: only "b" stepped
    sent = coalescer.step([publication("b", 2, [7])])
    assert {(p.req_id, p.event.seq, tuple(p.event.token_ids)) for p in sent} == \
        {("a", 1, (2,)), ("b", 1, (6, 7))}


def test_a_fenced_request_drops_what_it_held():
    clock = Clock()
    coalescer = EventCoalescer(0.1, clock)
    coalescer.step([publication("a", 0, [1])])
    coalescer.step([publication("a", 1, [2])])
    coalescer.forget("a")
    assert coalescer.num_held == 0
    clock.now += 1
    assert coalescer.step([]) == []


def test_only_consecutive_events_of_one_attempt_merge():
    first = publication("a", 0, [1, 2]).event
    with pytest.raises(ValueError, match="does not follow"):
        merge_events(first, publication("a", 3, [4]).event)
    later = publication("a", 2, [3]).event
    later.attempt = 2
    with pytest.raises(ValueError, match="does not follow"):
        merge_events(first, later)
    with pytest.raises(ValueError, match="logprobs"):
        merge_events(first, publication("a", 2, [3], logprobs=True).event)
    with pytest.raises(ValueError, match="negative"):
        EventCoalescer(-1)
