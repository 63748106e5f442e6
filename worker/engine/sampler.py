"""Turns a batch of logits into next tokens: penalties, filters and seeded Gumbel-max sampling.

Determinism: the token sampled for a row is a pure function of (seed, position, logits row, params,
prompt/output tokens). The only randomness is Gumbel noise drawn from a CPU generator seeded with
a mix of (seed, position), so the result does not depend on the batch, the row index, the device
or on what was sampled before; a request resumed at position p continues the same stream.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import chain

import torch

from shared.messages import SamplingParams, TokenLogprob

# Below this temperature a row is sampled greedily (as vLLM does): dividing by ~0 only overflows.
GREEDY_TEMPERATURE_EPS = 1e-5

_MASK64 = (1 << 64) - 1

# top_p looks for its cutoff among this many most likely tokens before sorting the whole vocab.
_TOP_P_CANDIDATES = 256


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
        modifies = any(_needs_penalties(inp) or _needs_min_tokens(inp) for inp in inputs)
        # float32; a private copy only when rows are modified in place (the caller's stay intact)
        scores = logits.detach().to(torch.float32, copy=modifies)  # [N, vocab]
        raw_logprobs = _raw_logprobs(scores, inputs)  # before any penalty or temperature
        if modifies:
            apply_penalties(scores, inputs)
            apply_min_tokens(scores, inputs, self.eos_token_ids)
        token_ids = _choose_tokens(scores, inputs)
        return list(zip(token_ids, _token_logprobs(raw_logprobs, token_ids, inputs)))


def _needs_penalties(inp: SamplerInput) -> bool:
    p = inp.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _needs_min_tokens(inp: SamplerInput) -> bool:
    return inp.position < inp.params.min_tokens


# --- penalties and masks (in place on float32 scores [N, vocab]) ----------------------------------


def apply_penalties(scores: torch.Tensor, inputs: list[SamplerInput]) -> None:
    """HF repetition penalty over prompt + output, then OpenAI presence/frequency over output.

    Only the (row, token) pairs that occur are touched: one gather and one index_put per penalty.
    """
    vocab_size = scores.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    penalties: list[float] = []
    for i, inp in enumerate(inputs):
        if inp.params.repetition_penalty == 1.0:
            continue
        seen = {t for t in chain(inp.prompt_token_ids, inp.output_token_ids) if 0 <= t < vocab_size}
        rows.extend([i] * len(seen))
        cols.extend(seen)
        penalties.extend([inp.params.repetition_penalty] * len(seen))
    if rows:
        index = (_index(rows, scores.device), _index(cols, scores.device))
        values = scores[index]
        penalty = torch.tensor(penalties, dtype=torch.float32, device=scores.device)
        scores[index] = torch.where(values < 0, values * penalty, values / penalty)

    rows, cols, amounts = [], [], []
    for i, inp in enumerate(inputs):
        presence, frequency = inp.params.presence_penalty, inp.params.frequency_penalty
        if presence == 0.0 and frequency == 0.0:
            continue
        for token_id, count in Counter(inp.output_token_ids).items():
            if 0 <= token_id < vocab_size:
                rows.append(i)
                cols.append(token_id)
                amounts.append(count * frequency + presence)
    if rows:
        index = (_index(rows, scores.device), _index(cols, scores.device))
        scores[index] -= torch.tensor(amounts, dtype=torch.float32, device=scores.device)


def apply_min_tokens(
    scores: torch.Tensor, inputs: list[SamplerInput], eos_token_ids: list[int]
) -> None:
    """Mask the tokens that would stop a request until it has min_tokens output tokens.

    With ignore_eos, EOS does not stop the request, so it stays sampleable; stop_token_ids do not.
    """
    vocab_size = scores.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, inp in enumerate(inputs):
        if not _needs_min_tokens(inp):
            continue
        blocked = set(inp.params.stop_token_ids)
        if not inp.params.ignore_eos:
            blocked.update(eos_token_ids)
        blocked_in_vocab = [t for t in blocked if 0 <= t < vocab_size]
        rows.extend([i] * len(blocked_in_vocab))
        cols.extend(blocked_in_vocab)
    if rows:
        scores[_index(rows, scores.device), _index(cols, scores.device)] = float("-inf")


# --- choosing tokens ------------------------------------------------------------------------------


def _choose_tokens(scores: torch.Tensor, inputs: list[SamplerInput]) -> list[int]:
    greedy_rows = [i for i, inp in enumerate(inputs) if inp.is_greedy]
    random_rows = [i for i, inp in enumerate(inputs) if not inp.is_greedy]
    if not random_rows:
        return scores.argmax(dim=-1).tolist()
    token_ids = [0] * len(inputs)
    if greedy_rows:
        for row, token_id in zip(greedy_rows, scores[greedy_rows].argmax(dim=-1).tolist()):
            token_ids[row] = token_id
    sub = scores if not greedy_rows else scores[random_rows]  # [R, vocab]
    chosen = _sample_random(sub, [inputs[i] for i in random_rows]).tolist()
    for row, token_id in zip(random_rows, chosen):
        token_ids[row] = token_id
    return token_ids


def _sample_random(scores: torch.Tensor, inputs: list[SamplerInput]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p (HF order), then Gumbel-max: argmax(scores + noise)."""
    scores = scores / _column(scores, [inp.params.temperature for inp in inputs])  # new tensor
    _apply_top_k(scores, [inp.params.top_k for inp in inputs])
    _apply_top_p(scores, [inp.params.top_p for inp in inputs])
    _apply_min_p(scores, [inp.params.min_p for inp in inputs])
    keys = [noise_key(inp.params.seed, inp.position) for inp in inputs]
    return (scores + gumbel_noise(keys, scores.shape[1]).to(scores.device)).argmax(dim=-1)


def _apply_top_k(scores: torch.Tensor, top_ks: list[int]) -> None:
    """Keep the k highest scores (and any tied with the k-th: device-independent, like vLLM)."""
    vocab_size = scores.shape[1]
    rows = [i for i, k in enumerate(top_ks) if 0 < k < vocab_size]
    if not rows:
        return
    ks = [top_ks[i] for i in rows]
    sub = _rows(scores, rows)
    top_values = sub.topk(max(ks), dim=-1).values  # [R, max_k], descending
    kth = top_values.gather(1, _index(ks, scores.device).unsqueeze(1) - 1)  # [R, 1]
    _mask_rows(scores, rows, sub < kth)


def _apply_top_p(scores: torch.Tensor, top_ps: list[float]) -> None:
    """Keep the smallest set of highest-probability tokens whose mass reaches top_p.

    The set is looked for among the top _TOP_P_CANDIDATES first; only rows whose candidates hold
    too little mass sort the whole vocab. Either way a row's cutoff depends on that row alone.
    """
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return
    probs = _rows(scores, rows).softmax(dim=-1)  # [R, vocab]
    top_p = _column(scores, [top_ps[i] for i in rows])
    num_candidates = min(_TOP_P_CANDIDATES, scores.shape[1])
    candidates = probs.topk(num_candidates, dim=-1).values  # [R, C], descending
    cutoff = _top_p_cutoff(candidates, top_p)
    short = candidates.sum(dim=-1) < top_p.squeeze(1)  # mass beyond the candidates is needed
    if short.any():
        full = probs[short].sort(dim=-1, descending=True).values
        cutoff[short] = _top_p_cutoff(full, top_p[short])
    _mask_rows(scores, rows, probs < cutoff)


def _top_p_cutoff(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest kept probability [R, 1]: token j is kept iff the mass before it is < top_p."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)
    # by value, not by sorted position, so ties do not depend on the sort's order
    return sorted_probs.gather(1, num_kept - 1)


def _apply_min_p(scores: torch.Tensor, min_ps: list[float]) -> None:
    """Drop tokens with probability < min_p * the top probability, i.e. score < max + log(min_p)."""
    rows = [i for i, p in enumerate(min_ps) if p > 0.0]
    if not rows:
        return
    sub = _rows(scores, rows)
    log_min_p = _column(scores, [min_ps[i] for i in rows]).log()
    threshold = sub.max(dim=-1, keepdim=True).values + log_min_p
    _mask_rows(scores, rows, sub < threshold)


def _rows(scores: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """scores[rows]: the tensor itself when that is every row, else a copy."""
    return scores if len(rows) == scores.shape[0] else scores[rows]


def _mask_rows(scores: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
    """In place: scores[rows[j], t] = -inf where mask[j, t]; mask is [len(rows), vocab]."""
    if len(rows) == scores.shape[0]:
        scores.masked_fill_(mask, float("-inf"))
    else:
        scores[rows] = scores[rows].masked_fill(mask, float("-inf"))


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


def _column(like: torch.Tensor, values: list[float]) -> torch.Tensor:
    """Per-row parameters as a float32 column [R, 1] on `like`'s device."""
    return torch.tensor(values, dtype=torch.float32, device=like.device).unsqueeze(1)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
