"""A running sequence with its KV cache, taken out of one engine to continue in another
(`Engine.export_sequence`, `Engine.import_sequence`), and its encoding for the wire.

What moves is everything its next steps read: its tokens, its sampling parameters (a token is a
pure function of seed, position and logits, so they and the output tokens are the sampler's
whole state), its adapter, and a host copy of the blocks holding the KV of positions
`[0, num_computed_tokens)` (with a draft model, the draft's blocks too). The receiving engine
takes it as a swapped-out preempted sequence and swaps it into fresh blocks when they fit:
nothing is computed again, and where rows are batch-invariant (`--deterministic`) its answer
continues bit for bit as it would have where it was. The copy means something only to an engine
of the same layout (`Engine.handoff_layout`): the same model, KV format and block size.

On the wire: a msgpack header (every field but the tensors, and each tensor's name, dtype and
shape) and the tensors' raw bytes back to back, in the header's order.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch

from kvfleet.shared.wire import SamplingParams
from kvfleet.shared.wire.messages import pack, unpack
from kvfleet.worker.engine.memory.kv_cache import HostBlocks, KVCachePool, tensor_bytes
from kvfleet.worker.engine.memory.kv_format import SCALE_DTYPE
from kvfleet.worker.engine.core.lora_request import LoraRequest


class HandoffError(ValueError):
    """A state this engine cannot take (another layout / kv format / block size / model, an
    adapter without --enable-lora, a request id already here), or an engine that cannot hand off
    (tensor parallelism)."""


_TENSORS = ("values", "scales", "draft_values", "draft_scales")
# what a pool stores (kv_format.py): plain floats, 8-bit codes, fp16 scales
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8)}


@dataclass
class SequenceState:
    """One sequence as it leaves an engine between two steps."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    num_computed_tokens: int  # KV rows present in `values`
    # prompt tokens its first admission found in the prefix cache (reported in usage)
    num_cached_tokens: int
    lora: LoraRequest | None
    layout: dict  # what the receiving engine must match: Engine.handoff_layout()
    values: torch.Tensor  # host copy of its blocks, as HostBlocks.values
    scales: torch.Tensor | None  # 8-bit KV formats
    draft_values: torch.Tensor | None = None  # the draft model's blocks, when they hold its KV
    draft_scales: torch.Tensor | None = None
    draft_num_computed_tokens: int = 0  # leading positions of valid KV in `draft_values`

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_bytes(self) -> int:
        """Bytes of KV it moves (a simulated engine's state: the size modelled, worker/sim/)."""
        return self.layout.get("modelled_bytes") or tensor_bytes(
            *(getattr(self, name) for name in _TENSORS))

    def encode(self) -> tuple[bytes, list[memoryview]]:
        """A header (msgpack: every field but the tensors, plus each tensor's dtype/shape) and the
        tensors' raw bytes as memoryviews (no copy), to be sent back to back."""
        header = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in _TENSORS}
        header["params"] = self.params.to_dict()
        header["lora"] = None if self.lora is None else dataclasses.asdict(self.lora)
        return pack_tensors(header, [(name, getattr(self, name)) for name in _TENSORS])

    @classmethod
    def decode(cls, header: bytes, payload) -> SequenceState:
        """From the header and the concatenated buffers (`payload`: bytes, bytearray or
        memoryview; the tensors are views of it, not copies). Raises HandoffError on a malformed
        header or a payload of the wrong length."""
        try:
            fields, tensors = unpack_tensors(header, payload, _TENSORS)
            fields["params"] = SamplingParams.from_dict(fields["params"])
            if fields["lora"] is not None:
                fields["lora"] = LoraRequest(**fields["lora"])
            known = {f.name for f in dataclasses.fields(cls)}  # a newer writer's others: left out
            state = cls(**{k: v for k, v in fields.items() if k in known},
                        **{name: tensors.get(name) for name in _TENSORS})
        except HandoffError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as exc:  # msgpack's: ValueError
            raise HandoffError(f"a malformed handoff state: {exc!r}") from exc
        _check_types(state)
        return state


def pack_tensors(header: dict, tensors: list[tuple[str, torch.Tensor | None]]
                 ) -> tuple[bytes, list[memoryview]]:
    """`header` (msgpack) with each present tensor's name, dtype and shape added, and the
    tensors' raw bytes as memoryviews (host copies are contiguous: no copy), back to back."""
    present = [(name, t) for name, t in tensors if t is not None]
    header = {**header, "tensors": [{"name": name, "dtype": str(t.dtype).removeprefix("torch."),
                                     "shape": list(t.shape)} for name, t in present]}
    return pack(header), [memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                          for _, t in present]


def unpack_tensors(header: bytes, payload, names: tuple[str, ...]
                   ) -> tuple[dict, dict[str, torch.Tensor]]:
    """`pack_tensors`' header fields and its tensors, views of `payload` (only `names` taken).
    HandoffError for a payload of another length than the header says; ValueError, KeyError or
    TypeError for a malformed header."""
    fields = unpack(header)
    buffer = memoryview(payload).cast("B")
    tensors, offset = {}, 0
    for spec in fields.pop("tensors"):
        name, dtype, shape = spec["name"], _DTYPES[spec["dtype"]], spec["shape"]
        if (name not in names or name in tensors
                or not all(isinstance(n, int) and n > 0 for n in shape)):
            raise ValueError(f"tensor {name!r} of shape {shape}")
        num_bytes = math.prod(shape) * dtype.itemsize
        if offset + num_bytes > buffer.nbytes:
            raise HandoffError(f"handoff of {fields.get('req_id')!r}: the payload "
                               f"({buffer.nbytes} bytes) ends inside tensor {name!r}")
        tensors[name] = _view(buffer, offset, num_bytes, dtype, shape)
        offset += num_bytes
    if offset != buffer.nbytes:
        raise HandoffError(f"handoff of {fields.get('req_id')!r}: {buffer.nbytes} payload "
                           f"bytes where the header describes {offset}")
    return fields, tensors


def _view(buffer: memoryview, offset: int, num_bytes: int, dtype: torch.dtype,
          shape: list[int]) -> torch.Tensor:
    with warnings.catch_warnings():
        # a bytes payload is read-only; the host copy is only ever read (copied into a pool)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=num_bytes, offset=offset)
    return raw.view(dtype).view(shape)


def _check_types(state: SequenceState) -> None:
    tokens = state.prompt_token_ids, state.output_token_ids
    counts = state.num_computed_tokens, state.num_cached_tokens, state.draft_num_computed_tokens
    if not (isinstance(state.req_id, str) and isinstance(state.layout, dict)
            and state.values is not None
            and all(isinstance(ids, list) and all(isinstance(t, int) for t in ids)
                    for ids in tokens)
            and all(isinstance(n, int) for n in counts)):
        raise HandoffError(f"a malformed handoff state of {state.req_id!r}")


# ---- what the engines check --------------------------------------------------------------------

def pool_layout(pool: KVCachePool) -> dict:
    """The geometry and format of one pool's blocks (a handoff layout's part)."""
    layout = pool.layout
    return {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim, "kv_format": layout.kv_format.name,
            "kv_storage": str(layout.kv_format.storage).removeprefix("torch.")}


def check_layout(state: SequenceState, layout: dict) -> None:
    if state.layout != layout:
        differing = sorted(key for key in state.layout.keys() | layout.keys()
                           if state.layout.get(key) != layout.get(key))
        theirs = {key: state.layout.get(key) for key in differing}
        ours = {key: layout.get(key) for key in differing}
        raise HandoffError(f"handoff of {state.req_id!r}: another layout ({theirs}; this "
                           f"engine's: {ours})")


def host_blocks(state: SequenceState, pool: KVCachePool) -> HostBlocks:
    """The state's host copy of its blocks, checked against the pool it goes into: the blocks of
    exactly its computed positions, in the pool's format (a draft model's: speculation/)."""
    num_tokens = state.num_tokens
    if not 0 < state.num_computed_tokens < num_tokens:
        raise HandoffError(f"handoff of {state.req_id!r}: {state.num_computed_tokens} computed "
                           f"of {num_tokens} tokens (a sequence with KV and a token to compute)")
    if state.layout.get("draft") is None and not (state.draft_values is None
                                                  and state.draft_scales is None):
        raise HandoffError(f"handoff of {state.req_id!r}: draft KV of "
                           f"{state.draft_num_computed_tokens} positions does not fit here")
    return state_blocks(state, "values", "scales", state.num_computed_tokens, pool)


def state_blocks(state: SequenceState, values_name: str, scales_name: str, num_tokens: int,
                 pool: KVCachePool) -> HostBlocks:
    values, scales = getattr(state, values_name), getattr(state, scales_name)
    layout, block_size = pool.layout, pool.block_size
    shape = (layout.num_layers, 2, layout.num_kv_heads, -(-num_tokens // block_size), block_size,
             layout.head_dim)
    quantized = pool.kv_format.is_quantized
    if (values is None or tuple(values.shape) != shape or values.dtype != pool.kv_format.storage
            or (scales is not None) != quantized
            or (quantized and (tuple(scales.shape) != shape[:-1] or scales.dtype != SCALE_DTYPE))):
        raise HandoffError(f"handoff of {state.req_id!r}: {values_name} / {scales_name} are not "
                           f"the blocks of {num_tokens} positions in this pool's format")
    return HostBlocks(values, scales)
