"""What crosses the engine's boundary per request: the checks a new request passes, and the
`RequestOutput`s it gets back."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.shared.wire import RequestStatus, SamplingParams, TokenLogprob
from kvfleet.worker.engine.memory.block_manager import BlockManager
from kvfleet.worker.engine.core.scheduler import TokenEmission
from kvfleet.worker.engine.core.sequence import Sequence
from kvfleet.worker.engine.core.stopping import Stop, StopChecker


@dataclass
class RequestOutput:
    req_id: str
    new_token_ids: list[int]  # tokens produced this step (0, 1, or more where speculation hit)
    new_logprobs: list[TokenLogprob] | None
    num_output_tokens: int  # total generated, including resumed ones
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    finish_reason: str | None  # RequestStatus.finish_reason when finished
    error: str | None = None  # what went wrong, when finish_reason == "error"
    # prompt token i + 1's logprob at i; in the request's first output only (prompt_logprobs)
    prompt_logprobs: list[TokenLogprob] | None = None
    stop: Stop | None = None  # what stopped it, when finish_reason == "stop"


def check_request(req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  max_model_len: int, block_manager: BlockManager) -> None:
    """ValueError when the request can never run here: empty, too long, more blocks than the pool."""
    if not prompt_token_ids:
        raise ValueError(f"request {req_id!r}: the prompt is empty")
    if params.max_tokens < 0:
        raise ValueError(f"request {req_id!r}: max_tokens must be >= 0")
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"request {req_id!r}: prompt ({len(prompt_token_ids)} tokens) + max_tokens "
            f"({params.max_tokens}) = {total} exceeds the model context of {max_model_len}")
    # the last sampled token's KV is never computed (max_tokens 0: the prompt's all is)
    blocks = block_manager.blocks_for_tokens(max(total - 1, len(prompt_token_ids)))
    if blocks > block_manager.num_blocks:
        raise ValueError(
            f"request {req_id!r}: needs {blocks} KV blocks but the pool has only "
            f"{block_manager.num_blocks}")


def request_output(seq: Sequence, new_token_ids: list[int], logprobs,
                   stop_checker: StopChecker) -> RequestOutput:
    stop = None
    if seq.status is RequestStatus.FINISHED_STOPPED:  # described again from the same tokens
        stop = stop_checker.find_stop(seq.output_token_ids, seq.params)
    return RequestOutput(
        req_id=seq.req_id, new_token_ids=new_token_ids, new_logprobs=logprobs,
        num_output_tokens=seq.num_output_tokens, num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens, finish_reason=seq.status.finish_reason,
        error=seq.error, stop=stop)


def emission_output(emission: TokenEmission, stop_checker: StopChecker) -> RequestOutput:
    """A step's tokens as an output; the request's first carries its prompt logprobs."""
    seq = emission.seq
    logprobs = None if None in emission.logprobs else emission.logprobs
    output = request_output(seq, emission.token_ids, logprobs or None, stop_checker)
    if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
        seq.prompt_logprobs_sent = True  # once, with the first output
        output.prompt_logprobs = list(seq.prompt_logprobs)
    return output
