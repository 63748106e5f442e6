"""Turns a batch of logits into next tokens: penalties, filters and seeded Gumbel-max sampling.

Determinism: the token sampled for a row is a pure function of (seed, position, logits row, params,
prompt/output tokens). The only randomness is Gumbel noise drawn from a CPU generator seeded with
a mix of (seed, position), so the result does not depend on the batch, the row index, the device
or on what was sampled before; a request resumed at position p continues the same stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from shared.messages import SamplingParams, TokenLogprob

# Below this temperature a row is sampled greedily (as vLLM does): dividing by ~0 only overflows.
GREEDY_TEMPERATURE_EPS = 1e-5

_MASK64 = (1 << 64) - 1


@dataclass
class SamplerInput:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far; the token sampled now is at this list's length

    @property
    def position(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature < GREEDY_TEMPERATURE_EPS


class Sampler:
    """Samples one token per row. Stateless apart from the EOS ids: safe to share and to reuse."""

    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = list(eos_token_ids)

    def sample(
        self, logits: torch.Tensor, inputs: list[SamplerInput]
    ) -> list[tuple[int, TokenLogprob | None]]:
        """One (token id, logprob or None) per row of `logits` [N, vocab]; row i is inputs[i]."""
        if logits.dim() != 2 or logits.shape[0] != len(inputs):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(inputs)} inputs")
        if not inputs:
            return []
        scores = logits.detach().to(torch.float32, copy=True)  # [N, vocab], modified in place
        raw_logprobs = _raw_logprobs(scores, inputs)  # before any penalty or temperature
        apply_penalties(scores, inputs)
        apply_min_tokens(scores, inputs, self.eos_token_ids)
        token_ids = _choose_tokens(scores, inputs)
        return list(zip(token_ids, _token_logprobs(raw_logprobs, token_ids, inputs)))


# --- penalties and masks (in place on float32 scores [N, vocab]) ----------------------------------


def apply_penalties(scores: torch.Tensor, inputs: list[SamplerInput]) -> None:
    """HF repetition penalty over prompt + output, then OpenAI presence/frequency over output."""
    rep_rows = [i for i, inp in enumerate(inputs) if inp.params.repetition_penalty != 1.0]
    if rep_rows:
        seen = token_counts(
            [inputs[i].prompt_token_ids + inputs[i].output_token_ids for i in rep_rows],
            scores.shape[1],
            scores.device,
        ) > 0  # [R, vocab]
        penalty = _row_values(scores, [inputs[i].params.repetition_penalty for i in rep_rows])
        sub = scores[rep_rows]
        penalised = torch.where(sub < 0, sub * penalty, sub / penalty)
        scores[rep_rows] = torch.where(seen, penalised, sub)

    out_rows = [
        i
        for i, inp in enumerate(inputs)
        if inp.params.presence_penalty != 0.0 or inp.params.frequency_penalty != 0.0
    ]
    if out_rows:
        counts = token_counts(
            [inputs[i].output_token_ids for i in out_rows], scores.shape[1], scores.device
        ).to(torch.float32)  # [R, vocab]
        frequency = _row_values(scores, [inputs[i].params.frequency_penalty for i in out_rows])
        presence = _row_values(scores, [inputs[i].params.presence_penalty for i in out_rows])
        scores[out_rows] -= counts * frequency + (counts > 0).to(torch.float32) * presence


def apply_min_tokens(
    scores: torch.Tensor, inputs: list[SamplerInput], eos_token_ids: list[int]
) -> None:
    """Mask the tokens that would stop a request until it has min_tokens output tokens.

    With ignore_eos, EOS does not stop the request, so it stays sampleable; stop_token_ids do.
    """
    vocab_size = scores.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, inp in enumerate(inputs):
        if inp.position >= inp.params.min_tokens:
            continue
        blocked = set(inp.params.stop_token_ids)
        if not inp.params.ignore_eos:
            blocked.update(eos_token_ids)
        blocked_in_vocab = [t for t in blocked if 0 <= t < vocab_size]
        rows.extend([i] * len(blocked_in_vocab))
        cols.extend(blocked_in_vocab)
    if rows:
        scores[_index(rows, scores.device), _index(cols, scores.device)] = float("-inf")


def token_counts(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """How often each token occurs in each list: int64 [len(token_lists), vocab_size].

    One bincount over (row * vocab + token) for the whole batch; ids outside the vocab are ignored.
    """
    num_rows = len(token_lists)
    lengths = torch.tensor([len(ids) for ids in token_lists], dtype=torch.int64)
    ids = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(num_rows), lengths)
    in_vocab = (ids >= 0) & (ids < vocab_size)
    flat = (rows * vocab_size + ids)[in_vocab].to(device)
    return torch.bincount(flat, minlength=num_rows * vocab_size).view(num_rows, vocab_size)


# --- choosing tokens ------------------------------------------------------------------------------


def _choose_tokens(scores: torch.Tensor, inputs: list[SamplerInput]) -> list[int]:
    token_ids = [0] * len(inputs)
    greedy_rows = [i for i, inp in enumerate(inputs) if inp.is_greedy]
    random_rows = [i for i, inp in enumerate(inputs) if not inp.is_greedy]
    if greedy_rows:
        chosen = scores[greedy_rows].argmax(dim=-1).tolist()
        for row, token_id in zip(greedy_rows, chosen):
            token_ids[row] = token_id
    if random_rows:
        sub = scores[random_rows]  # a copy: [R, vocab]
        chosen = _sample_random(sub, [inputs[i] for i in random_rows]).tolist()
        for row, token_id in zip(random_rows, chosen):
            token_ids[row] = token_id
    return token_ids


def _sample_random(scores: torch.Tensor, inputs: list[SamplerInput]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p (HF order), then Gumbel-max: argmax(scores + noise)."""
    scores /= _row_values(scores, [inp.params.temperature for inp in inputs])
    _apply_top_k(scores, inputs)
    _apply_top_p(scores, inputs)
    _apply_min_p(scores, inputs)
    keys = [noise_key(inp.params.seed, inp.position) for inp in inputs]
    noise = gumbel_noise(keys, scores.shape[1]).to(scores.device)
    return (scores + noise).argmax(dim=-1)


def _apply_top_k(scores: torch.Tensor, inputs: list[SamplerInput]) -> None:
    """Keep the k highest scores (and any tied with the k-th: device-independent, like vLLM)."""
    vocab_size = scores.shape[1]
    rows = [i for i, inp in enumerate(inputs) if 0 < inp.params.top_k < vocab_size]
    if not rows:
        return
    ks = [inputs[i].params.top_k for i in rows]
    sub = scores[rows]
    top_values = sub.topk(max(ks), dim=-1).values  # [R, max_k], descending
    kth = top_values.gather(1, _index(ks, scores.device).unsqueeze(1) - 1)  # [R, 1]
    scores[rows] = sub.masked_fill(sub < kth, float("-inf"))


def _apply_top_p(scores: torch.Tensor, inputs: list[SamplerInput]) -> None:
    """Keep the smallest set of highest scores whose probability mass reaches top_p."""
    rows = [i for i, inp in enumerate(inputs) if inp.params.top_p < 1.0]
    if not rows:
        return
    sub = scores[rows]
    sorted_scores = sub.sort(dim=-1, descending=True).values  # [R, vocab]
    probs = sorted_scores.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    top_p = _row_values(scores, [inputs[i].params.top_p for i in rows])
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)  # [R, 1]
    # Threshold by value, not by sorted position, so ties do not depend on the sort's order.
    cutoff = sorted_scores.gather(1, num_kept - 1)
    scores[rows] = sub.masked_fill(sub < cutoff, float("-inf"))


def _apply_min_p(scores: torch.Tensor, inputs: list[SamplerInput]) -> None:
    """Drop tokens with probability < min_p * the top probability, i.e. score < max + log(min_p)."""
    rows = [i for i, inp in enumerate(inputs) if inp.params.min_p > 0.0]
    if not rows:
        return
    sub = scores[rows]
    log_min_p = _row_values(scores, [inputs[i].params.min_p for i in rows]).log()
    threshold = sub.max(dim=-1, keepdim=True).values + log_min_p
    scores[rows] = sub.masked_fill(sub < threshold, float("-inf"))


# --- counter-based noise --------------------------------------------------------------------------


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_key(seed: int | None, position: int) -> int:
    """The generator seed for one (request seed, output position); seed None counts as 0.

    32 bits, because torch's CPU generator (mt19937) only uses the low 32 bits of its seed.
    """
    mixed = _splitmix64(_splitmix64((seed or 0) & _MASK64) ^ (position & _MASK64))
    return (mixed ^ (mixed >> 32)) & 0xFFFFFFFF


def gumbel_noise(keys: list[int], vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise, float32 [len(keys), vocab_size] on CPU, row i a function of keys[i].

    Always drawn on CPU, so CPU and GPU workers produce the same stream for the same request.
    """
    noise = torch.empty(len(keys), vocab_size, dtype=torch.float32)
    for row, key in enumerate(keys):
        generator = torch.Generator().manual_seed(key)
        torch.rand(vocab_size, generator=generator, out=noise[row])
    # Gumbel = -log(-log(U)); U == 0 gives -inf (that token cannot win), U < 1 always.
    return noise.log_().neg_().log_().neg_()


# --- logprobs -------------------------------------------------------------------------------------


def _raw_logprobs(
    scores: torch.Tensor, inputs: list[SamplerInput]
) -> tuple[list[int], torch.Tensor] | None:
    """Rows that asked for logprobs and the log_softmax of their unmodified logits [R, vocab]."""
    rows = [i for i, inp in enumerate(inputs) if inp.params.logprobs is not None]
    if not rows:
        return None
    return rows, torch.log_softmax(scores[rows], dim=-1)


def _token_logprobs(
    raw_logprobs: tuple[list[int], torch.Tensor] | None,
    token_ids: list[int],
    inputs: list[SamplerInput],
) -> list[TokenLogprob | None]:
    results: list[TokenLogprob | None] = [None] * len(inputs)
    if raw_logprobs is None:
        return results
    rows, logprobs = raw_logprobs
    chosen = _index([token_ids[i] for i in rows], logprobs.device).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen).squeeze(1).tolist()
    num_tops = [min(max(inputs[i].params.logprobs or 0, 0), logprobs.shape[1]) for i in rows]
    top = logprobs.topk(max(num_tops), dim=-1)  # [R, max_n], descending; a single sync below
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    for j, row in enumerate(rows):
        pairs = list(zip(top_ids[j][: num_tops[j]], top_values[j][: num_tops[j]]))
        results[row] = TokenLogprob(token_ids[row], chosen_logprobs[j], pairs)
    return results


# --- small helpers --------------------------------------------------------------------------------


def _row_values(like: torch.Tensor, values: list[float]) -> torch.Tensor:
    """Per-row parameters as a float32 column [R, 1] on `like`'s device."""
    return torch.tensor(values, dtype=torch.float32, device=like.device).unsqueeze(1)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
