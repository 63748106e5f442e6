"""Turns a batch of logits into next tokens on the logits' device: penalties, per-row masks,
filters and seeded inverse-CDF sampling, with one host sync per call.

Determinism: the token sampled for a row is a pure function of (seed, position, logits row, params,
prompt/output tokens). The only randomness is one uniform number per row, u = hash(seed, position),
computed with exact integer arithmetic on the host (splitmix64), so it has the same bits on every
device and does not depend on the batch, the row index or on what was sampled before; a request
resumed at position p continues the same stream. The token is the first whose cumulative
probability (in vocabulary order) reaches u: exactly a draw from the filtered softmax.

Why not Gumbel-max over the vocabulary: it needs vocab-sized noise per row (tens of MB per step at
a 128k vocab) and costs more on a CPU than the softmax + cumsum used here; every operation below
is row-wise (elementwise, or a reduction/scan along the row), so a row's result is independent of
the other rows in the batch.

Host syncs: per-row parameters go to the device as small tensors (host -> device copies, which do
not wait); everything else stays on the device until `_to_host`, which packs tokens and logprobs
into one tensor and reads it once. On a CPU syncs cost nothing, so top-p there keeps a shortcut
that looks at the data (`_top_p_cutoff`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import torch

from kvfleet.shared.wire import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from kvfleet.worker.structured.logit_mask import LogitMask

# Below this temperature a row is sampled greedily (as vLLM does): dividing by ~0 only overflows.
GREEDY_TEMPERATURE_EPS = 1e-5

_MASK64 = (1 << 64) - 1
# u = (k + 0.5) / 2^23 for a 23-bit k: exact in float32 (24-bit mantissa), strictly inside (0, 1).
_UNIFORM_BITS = 23

# On a CPU, top_p looks for its cutoff among this many most likely tokens before sorting the whole
# vocab (the check needs a sync, which is free there); on an accelerator it always sorts.
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
        self, logits: torch.Tensor, inputs: list[SamplerInput], logit_mask: LogitMask | None = None
    ) -> list[tuple[int, TokenLogprob | None]]:
        """One (token id, logprob or None) per row of `logits` [N, vocab]; row i is inputs[i].

        `logit_mask`: the tokens each constrained row may take now (its grammar's next tokens)."""
        if logits.dim() != 2 or logits.shape[0] != len(inputs):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(inputs)} inputs")
        if not inputs:
            return []
        modifies = logit_mask is not None or any(
            _needs_penalties(inp) or _needs_min_tokens(inp) or inp.params.logit_bias
            for inp in inputs)
        # float32; a private copy only when rows are modified in place (the caller's stay intact)
        scores = logits.detach().to(torch.float32, copy=modifies)  # [N, vocab]
        raw_logprobs = _raw_logprobs(scores, inputs)  # before any penalty or temperature
        if modifies:
            apply_penalties(scores, inputs)
            apply_min_tokens(scores, inputs, self.eos_token_ids)
            apply_logit_bias(scores, inputs)
            if logit_mask is not None:
                logit_mask.apply(scores)  # last: nothing may re-allow a token the grammar refuses
        token_ids = _choose_tokens(scores, inputs)  # [N] int64, on the device
        return _to_host(token_ids, raw_logprobs, inputs)


def _needs_penalties(inp: SamplerInput) -> bool:
    p = inp.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _needs_min_tokens(inp: SamplerInput) -> bool:
    # A constrained row ends when its grammar does: masking EOS there could leave no token at all.
    return inp.position < inp.params.min_tokens and inp.params.constraint is None


# --- penalties (in place on float32 scores [N, vocab], counted on the device) ---------------------


def apply_penalties(scores: torch.Tensor, inputs: list[SamplerInput]) -> None:
    """HF repetition penalty over prompt + output, then OpenAI presence/frequency over output.

    On the device, touching only the ids that occur: a gather and a scatter over a padded
    [R, longest list] id tensor per penalty, no [R, vocab] count table. Ids outside the vocabulary
    are ignored.
    """
    rows = [i for i, inp in enumerate(inputs) if inp.params.repetition_penalty != 1.0]
    if rows:
        sub = _rows(scores, rows)
        ids, real = _padded_ids(scores, [chain(inputs[i].prompt_token_ids,
                                               inputs[i].output_token_ids) for i in rows])
        penalty = _column(scores, [inputs[i].params.repetition_penalty for i in rows])
        values = sub.gather(1, ids)  # [R, W]
        penalised = torch.where(values < 0, values * penalty, values / penalty)
        # a repeated id writes the same value each time, so the scatter's order does not matter
        sub.scatter_(1, ids, torch.where(real[:, :1] > 0, penalised, values))
        _set_rows(scores, rows, sub)

    rows = [i for i, inp in enumerate(inputs)
            if inp.params.presence_penalty != 0.0 or inp.params.frequency_penalty != 0.0]
    if rows:
        sub = _rows(scores, rows)
        ids, real = _padded_ids(scores, [inputs[i].output_token_ids for i in rows])
        presence = _column(scores, [inputs[i].params.presence_penalty for i in rows])
        frequency = _column(scores, [inputs[i].params.frequency_penalty for i in rows])
        values = sub.gather(1, ids)
        sub.scatter_(1, ids, torch.where(real[:, :1] > 0, values - presence, values))  # once per id
        # once per occurrence: every addend of a column is the same, so any order gives one sum
        sub.scatter_add_(1, ids, -frequency * real)
        _set_rows(scores, rows, sub)


def _padded_ids(scores: torch.Tensor, token_lists) -> tuple[torch.Tensor, torch.Tensor]:
    """In-vocab ids of each list as int64 [R, W] on the device, padded with the row's first id (so
    padding repeats a real entry; 0 for an empty row), and float32 [R, W]: 1 for a real entry."""
    vocab_size = scores.shape[1]
    lists = [[t for t in tokens if 0 <= t < vocab_size] for tokens in token_lists]
    width = max(1, max(len(ids) for ids in lists))
    padded = [ids + [ids[0] if ids else 0] * (width - len(ids)) for ids in lists]
    real = [[1.0] * len(ids) + [0.0] * (width - len(ids)) for ids in lists]
    return (_index(padded, scores.device),
            torch.tensor(real, dtype=torch.float32).to(scores.device, non_blocking=True))


# --- per-row logit masks: tokens a row may not sample now -----------------------------------------
# min_tokens, logit_bias (row, col) pairs and the grammar masks of constrained rows
# (worker/structured/logit_mask.py), applied after the penalties and before temperature and the
# filters.


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


def apply_logit_bias(scores: torch.Tensor, inputs: list[SamplerInput]) -> None:
    """OpenAI's logit_bias: a per-request value added to the logits of the given token ids."""
    vocab_size = scores.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for i, inp in enumerate(inputs):
        for token_id, bias in inp.params.logit_bias.items():
            if 0 <= token_id < vocab_size:
                rows.append(i)
                cols.append(token_id)
                biases.append(bias)
    if rows:
        values = torch.tensor(biases, dtype=torch.float32).to(scores.device, non_blocking=True)
        scores.index_put_((_index(rows, scores.device), _index(cols, scores.device)), values,
                          accumulate=True)


# --- choosing tokens ------------------------------------------------------------------------------


def _argmax(scores: torch.Tensor) -> torch.Tensor:
    """[N, vocab] -> [N]: the first index of each row's maximum, as argmax; `max`'s indices are
    the same (documented: first maximal value) and markedly faster on the CPU at a batch of
    vocabulary-wide rows."""
    return scores.max(dim=-1).indices


def _choose_tokens(scores: torch.Tensor, inputs: list[SamplerInput]) -> torch.Tensor:
    """[N] int64 on the device: argmax for greedy rows, a seeded draw for the others."""
    random_rows = [i for i, inp in enumerate(inputs) if not inp.is_greedy]
    if not random_rows:
        return _argmax(scores)
    if len(random_rows) == len(inputs):
        return _sample_random(scores, inputs)
    greedy_rows = [i for i, inp in enumerate(inputs) if inp.is_greedy]
    token_ids = torch.empty(len(inputs), dtype=torch.int64, device=scores.device)
    greedy_index = _index(greedy_rows, scores.device)
    token_ids[greedy_index] = _argmax(scores.index_select(0, greedy_index))
    random_index = _index(random_rows, scores.device)
    token_ids[random_index] = _sample_random(
        scores.index_select(0, random_index), [inputs[i] for i in random_rows])
    return token_ids


def _sample_random(scores: torch.Tensor, inputs: list[SamplerInput]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p (HF order), then the inverse CDF at each row's uniform."""
    scores = scores / _column(scores, [inp.params.temperature for inp in inputs])  # new tensor
    _apply_top_k(scores, [inp.params.top_k for inp in inputs])
    _apply_top_p(scores, [inp.params.top_p for inp in inputs])
    _apply_min_p(scores, [inp.params.min_p for inp in inputs])
    uniforms = _column(scores, [uniform_noise(inp.params.seed, inp.position) for inp in inputs])
    return inverse_cdf(scores, uniforms)


def inverse_cdf(scores: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative softmax probability reaches u ([R, 1] in (0, 1)).

    A token with probability 0 (score -inf) never qualifies: its cumulative value equals its
    predecessor's, which was already below the target.
    """
    cdf = torch.softmax(scores, dim=-1).cumsum_(dim=-1)  # [R, vocab], ends at ~1
    target = uniforms * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=scores.shape[1] - 1)


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
    """Keep the smallest set of highest-probability tokens whose mass reaches top_p."""
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return
    probs = _rows(scores, rows).softmax(dim=-1)  # [R, vocab]
    top_p = _column(scores, [top_ps[i] for i in rows])
    _mask_rows(scores, rows, probs < _top_p_cutoff(probs, top_p))


def _top_p_cutoff(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest kept probability of each row [R, 1].

    On an accelerator: from a full sort (no sync). On a CPU: from the top _TOP_P_CANDIDATES first;
    only rows whose candidates hold too little mass sort the whole vocab. Either way a row's cutoff
    depends on that row alone and both give the same value.
    """
    num_candidates = min(_TOP_P_CANDIDATES, probs.shape[1])
    if not probs.is_cpu or num_candidates == probs.shape[1]:
        return _sorted_cutoff(probs.sort(dim=-1, descending=True).values, top_p)
    candidates = probs.topk(num_candidates, dim=-1).values  # [R, C], descending
    cutoff = _sorted_cutoff(candidates, top_p)
    short = candidates.sum(dim=-1) < top_p.squeeze(1)  # mass beyond the candidates is needed
    if short.any():
        full = probs[short].sort(dim=-1, descending=True).values
        cutoff[short] = _sorted_cutoff(full, top_p[short])
    return cutoff


def _sorted_cutoff(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Token j (in descending order) is kept iff the mass before it is < top_p."""
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
    if len(rows) == scores.shape[0]:
        return scores
    return scores.index_select(0, _index(rows, scores.device))


def _set_rows(scores: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    """In place: scores[rows] = values ([len(rows), vocab])."""
    if values is scores:
        return
    if len(rows) == scores.shape[0]:
        scores.copy_(values)
    else:
        scores.index_copy_(0, _index(rows, scores.device), values)


def _mask_rows(scores: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
    """In place: scores[rows[j], t] = -inf where mask[j, t]; mask is [len(rows), vocab]."""
    if len(rows) == scores.shape[0]:
        scores.masked_fill_(mask, float("-inf"))
    else:
        _set_rows(scores, rows, _rows(scores, rows).masked_fill(mask, float("-inf")))


# --- counter-based noise --------------------------------------------------------------------------


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_key(seed: int | None, position: int) -> int:
    """64 well-mixed bits for one (request seed, output position); seed None counts as 0."""
    return _splitmix64(_splitmix64((seed or 0) & _MASK64) ^ (position & _MASK64))


def uniform_noise(seed: int | None, position: int) -> float:
    """The row's uniform in (0, 1): the key's top 23 bits, centred; exact in float32."""
    k = noise_key(seed, position) >> (64 - _UNIFORM_BITS)
    return (k + 0.5) / (1 << _UNIFORM_BITS)


# --- logprobs and the one read back ---------------------------------------------------------------


def _raw_logprobs(
    scores: torch.Tensor, inputs: list[SamplerInput]
) -> tuple[list[int], torch.Tensor] | None:
    """Rows that asked for logprobs and the log_softmax of their unmodified logits [R, vocab]."""
    rows = [i for i, inp in enumerate(inputs) if inp.params.logprobs is not None]
    if not rows:
        return None
    return rows, torch.log_softmax(_rows(scores, rows), dim=-1)


def _to_host(
    token_ids: torch.Tensor,
    raw_logprobs: tuple[list[int], torch.Tensor] | None,
    inputs: list[SamplerInput],
) -> list[tuple[int, TokenLogprob | None]]:
    """Read tokens (and the logprobs asked for) back in one transfer: the call's only sync."""
    num_rows = len(inputs)
    if raw_logprobs is None:
        return [(t, None) for t in token_ids.tolist()]
    rows, logprobs = raw_logprobs
    chosen = logprobs.gather(1, token_ids.index_select(0, _index(rows, token_ids.device)).unsqueeze(1))
    num_tops = [min(max(inputs[i].params.logprobs or 0, 0), logprobs.shape[1]) for i in rows]
    width = max(num_tops)
    top = top_logprobs(logprobs, width)  # [R, width], descending, ties by token id
    # float64 holds every token id exactly; one tensor, one read
    packed = torch.cat([token_ids.double(), chosen.squeeze(1).double(),
                        top.indices.double().flatten(), top.values.double().flatten()]).tolist()
    ids = [int(t) for t in packed[:num_rows]]
    chosen_values = packed[num_rows:num_rows + len(rows)]
    offset = num_rows + len(rows)
    top_ids = packed[offset:offset + len(rows) * width]
    top_values = packed[offset + len(rows) * width:]
    results: list[TokenLogprob | None] = [None] * num_rows
    for j, row in enumerate(rows):
        base = j * width
        pairs = [(int(top_ids[base + n]), top_values[base + n]) for n in range(num_tops[j])]
        results[row] = TokenLogprob(ids[row], chosen_values[j], pairs)
    return list(zip(ids, results))


# Candidates beyond the requested alternatives that `top_logprobs` looks at for ties (bf16 logits
# tie often); a row whose ties reach past them is sorted whole.
_TIE_WINDOW = 16


def top_logprobs(logprobs: torch.Tensor, width: int) -> torch.return_types.topk:
    """The `width` highest entries of each row, ordered by value, then by token id: the same
    list whatever the other rows (topk's order among equal values depends on the batch's shape,
    so an alternative could change places with a tied one when a row is verified beside others)."""
    vocab_size = logprobs.shape[1]
    window = min(width + _TIE_WINDOW, vocab_size)
    candidates = logprobs.topk(window, dim=-1)
    values, indices = candidates.values, candidates.indices
    if window < vocab_size:
        kth = values[:, width - 1:width]
        spill = (values[:, -1:] == kth).squeeze(1)  # ties may go on past the window
        if spill.any():
            full = logprobs[spill].sort(dim=-1, descending=True, stable=True)
            values, indices = values.clone(), indices.clone()
            values[spill], indices[spill] = full.values[:, :window], full.indices[:, :window]
    by_id = indices.sort(dim=-1, stable=True).indices  # ids ascending, then values descending
    values, indices = values.gather(1, by_id), indices.gather(1, by_id)
    order = values.sort(dim=-1, descending=True, stable=True).indices[:, :width]
    return torch.return_types.topk((values.gather(1, order), indices.gather(1, order)))


# --- small helpers --------------------------------------------------------------------------------


def _column(like: torch.Tensor, values: list[float]) -> torch.Tensor:
    """Per-row parameters as a float32 column [R, 1] on `like`'s device (a copy, not a sync)."""
    return torch.tensor(values, dtype=torch.float32).to(like.device, non_blocking=True).unsqueeze(1)


def _index(values, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
