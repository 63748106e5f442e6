"""Stale attempts and repeated tokens never reach the client."""

from __future__ import annotations

from kvfleet.gateway.output.sequencer import EventSequencer
from kvfleet.shared.wire import TokenEvent, TokenLogprob, Usage


def test_in_order_events_pass_through():
    sequencer = EventSequencer()
    assert sequencer.accept(TokenEvent(seq=0, attempt=0, token_ids=[1, 2])).token_ids == [1, 2]
    assert sequencer.accept(TokenEvent(seq=2, attempt=0, token_ids=[3])).token_ids == [3]
    assert sequencer.next_seq == 3


def test_repeated_tokens_of_a_resumed_attempt_are_dropped():
    sequencer = EventSequencer()
    sequencer.accept(TokenEvent(seq=0, attempt=0, token_ids=[1, 2, 3]))
    logprobs = [TokenLogprob(t, -1.0) for t in (2, 3, 4)]
    new = sequencer.accept(TokenEvent(seq=1, attempt=1, token_ids=[2, 3, 4], logprobs=logprobs))
    assert new.token_ids == [4] and [lp.token_id for lp in new.logprobs] == [4]
    assert sequencer.attempt_max == 1 and sequencer.next_seq == 4


def test_events_of_a_stale_attempt_are_dropped_even_final_ones():
    sequencer = EventSequencer()
    sequencer.accept(TokenEvent(seq=0, attempt=2, token_ids=[1]))
    assert sequencer.accept(TokenEvent(seq=1, attempt=1, token_ids=[9])) is None
    assert sequencer.accept(TokenEvent(seq=1, attempt=1, finish_reason="stop",
                                       usage=Usage(1, 1))) is None
    final = sequencer.accept(TokenEvent(seq=1, attempt=2, token_ids=[2], finish_reason="length",
                                        usage=Usage(1, 2)))
    assert final.token_ids == [2] and final.final.finish_reason == "length"


def test_a_fully_repeated_event_yields_no_tokens():
    sequencer = EventSequencer()
    sequencer.accept(TokenEvent(seq=0, attempt=0, token_ids=[1, 2]))
    assert sequencer.accept(TokenEvent(seq=0, attempt=0, token_ids=[1, 2])).token_ids == []
    assert sequencer.next_seq == 2
