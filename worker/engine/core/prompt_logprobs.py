"""Log-probabilities of prompt tokens (`SamplingParams.prompt_logprobs`, the completions API's
`echo` with `logprobs`), from the raw logits of the prefill: no temperature, penalty, bias or
grammar, as vLLM reports them. One read back to the host per step."""

from __future__ import annotations

import torch

from kvfleet.shared.wire import TokenLogprob
from kvfleet.worker.engine.core.model_runner import PromptSpan
from kvfleet.worker.engine.core.sequence import Sequence

# log_softmax over this many rows at a time: a float32 copy of [rows, vocab] is what it costs.
_ROWS_PER_SLICE = 64


def compute_prompt_logprobs(spans: list[PromptSpan], logits: torch.Tensor
                            ) -> list[tuple[Sequence, list[TokenLogprob]]]:
    """Per span, the logprobs of the prompt tokens its rows predict, in position order.

    `logits` [P, vocab]: row `span.row + i` is position `span.first_position + i` of the span's
    sequence, whose next prompt token it scores. Each entry has the token's logprob, its rank
    (1 = the most likely token) and the top-N alternatives (N = the request's prompt_logprobs).
    """
    if not spans:
        return []
    device = logits.device
    targets = torch.tensor([t for span in spans for t in _targets(span)], dtype=torch.int64
                           ).to(device, non_blocking=True)  # [P]
    width = max(span.seq.params.prompt_logprobs or 0 for span in spans)
    chosen, ranks, top_values, top_ids = [], [], [], []
    for start in range(0, logits.shape[0], _ROWS_PER_SLICE):
        rows = torch.log_softmax(logits[start:start + _ROWS_PER_SLICE].float(), dim=-1)
        picked = rows.gather(1, targets[start:start + rows.shape[0]].unsqueeze(1))  # [r, 1]
        chosen.append(picked.squeeze(1))
        ranks.append((rows > picked).sum(dim=1) + 1)
        if width:
            top = rows.topk(min(width, rows.shape[1]), dim=-1)
            top_values.append(top.values)
            top_ids.append(top.indices)
    # float64 holds token ids and ranks exactly: one tensor, one read
    parts = [torch.cat(chosen).double(), torch.cat(ranks).double()]
    if width:
        parts += [torch.cat(top_ids).double().flatten(), torch.cat(top_values).double().flatten()]
    packed = torch.cat(parts).tolist()
    num_rows = logits.shape[0]
    width = min(width, logits.shape[1])
    values, rank_values = packed[:num_rows], packed[num_rows:2 * num_rows]
    ids_flat = packed[2 * num_rows:2 * num_rows + num_rows * width]
    tops_flat = packed[2 * num_rows + num_rows * width:]
    results = []
    for span in spans:
        num_top = min(span.seq.params.prompt_logprobs or 0, width)
        entries = []
        for i, token_id in enumerate(_targets(span)):
            row = span.row + i
            base = row * width
            pairs = [(int(ids_flat[base + n]), tops_flat[base + n]) for n in range(num_top)]
            entries.append(TokenLogprob(token_id, values[row], pairs, int(rank_values[row])))
        results.append((span.seq, entries))
    return results


def _targets(span: PromptSpan) -> list[int]:
    """The prompt tokens the span's rows predict (position p predicts token p + 1)."""
    first = span.first_position + 1
    return span.seq.prompt_token_ids[first:first + span.num_rows]
