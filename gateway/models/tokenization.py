"""Prompts to token ids at the gateway (the worker sees token ids only): tokenising, the chat
template, the context-length check, and token texts for logprobs."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from kvfleet.gateway.http.errors import APIError, bad_request
from kvfleet.gateway.output.detokenizer import TextDecoder

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_LENGTH = 2048  # when neither the config nor the tokenizer says
# Prompts with at least this many characters are tokenised off the event loop: tokenising takes
# time in proportion to the text, and a long prompt on the loop is a pause every open stream
# would wait out; below this the hand-off to a thread costs more than it saves.
OFFLOAD_MIN_CHARS = 512


# apply_chat_template's own arguments: a request's chat_template_kwargs may not override them.
_RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                              "add_generation_prompt", "continue_final_message", "tokenize",
                              "padding", "truncation", "max_length", "return_tensors",
                              "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway knows about the served model."""

    served_id: str  # the `model` clients send, and the model name in the fleet's Redis keys
    context_length: int  # prompt + completion tokens the model can attend over
    vocab_size: int  # token ids must be below this
    # Temperature of a request that names none: the model's own generation default (see below).
    default_temperature: float = 1.0

    @classmethod
    def from_pretrained(cls, served_id: str, model_path: str, tokenizer) -> ModelInfo:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
        context = getattr(config, "max_position_embeddings", None)
        if not context:
            tokenizer_max = getattr(tokenizer, "model_max_length", 0) or 0
            context = tokenizer_max if 0 < tokenizer_max < 10**7 else DEFAULT_CONTEXT_LENGTH
        vocab = max(getattr(config, "vocab_size", 0) or 0, len(tokenizer))
        return cls(served_id, int(context), int(vocab), _generation_temperature(model_path))


def _generation_temperature(model_path: str) -> float:
    """What `model.generate()` would do by default: greedy (0) unless the model's generation
    config turns sampling on, then its temperature — as vLLM applies a model's generation config."""
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return 0.0
    return float(config.temperature or 1.0) if config.do_sample else 0.0


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


class PromptProcessor:
    """Turns API prompts into validated token ids for one model."""

    def __init__(self, tokenizer, model: ModelInfo, offload_min_chars: int = OFFLOAD_MIN_CHARS):
        self.tokenizer = tokenizer
        self.model = model
        self.decoder = TextDecoder(tokenizer)  # shared by every stream's detokeniser
        self.decoder_with_special = TextDecoder(tokenizer, skip_special_tokens=False)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else [])
        self.offload_min_chars = offload_min_chars
        self._token_texts: dict[int, str] = {}
        # One thread: long prompts queue behind each other. It tokenises with its own copy of
        # the tokenizer: a Rust tokenizer used from two threads at once can fail ("Already
        # borrowed") when a call changes its truncation or padding state.
        self._executor: ThreadPoolExecutor | None = None
        self._thread_processor: PromptProcessor | None = None

    async def completion_prompts_async(self, prompt: str | list) -> list[list[int]]:
        """`completion_prompts`, in a worker thread when the text is long (the Rust tokenizer
        releases the GIL, so the event loop keeps streaming meanwhile)."""
        size = len(prompt) if isinstance(prompt, str) else sum(
            len(p) for p in prompt if isinstance(p, str))
        return await self._maybe_offload(size, "completion_prompts", prompt)

    async def chat_prompt_async(self, messages: Sequence[Mapping[str, Any]],
                                add_generation_prompt: bool = True,
                                continue_final_message: bool = False,
                                tools: list[dict] | None = None,
                                template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """`chat_prompt`, in a worker thread when the conversation is long."""
        size = sum(len(m.get("content") or "") for m in messages)
        return await self._maybe_offload(size, "chat_prompt", messages, add_generation_prompt,
                                         continue_final_message, tools, template_kwargs)

    def prepare_offload(self) -> None:
        """Make the tokenising thread's copy of the tokenizer now (a noticeable pause), e.g.
        before the server takes requests; otherwise the first long prompt makes it on the event
        loop, holding up every stream meanwhile."""
        if self._executor is None:
            self._thread_processor = PromptProcessor(
                copy.deepcopy(self.tokenizer), self.model, offload_min_chars=self.offload_min_chars)
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvfleet-tokenize")

    async def _maybe_offload(self, size: int, method: str, *args):
        if size < self.offload_min_chars:
            return getattr(self, method)(*args)  # a thread hop costs more than a short prompt
        self.prepare_offload()
        work = getattr(self._thread_processor, method)
        return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)

    def completion_prompts(self, prompt: str | list) -> list[list[int]]:
        """Token ids of each prompt of /v1/completions (a string, strings, ids, or lists of ids)."""
        if isinstance(prompt, str):
            prompts: list = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise bad_request("`prompt` must not be empty.", param="prompt")
        token_ids = [self._encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for ids in token_ids:
            self._check_ids(ids, "prompt")
        return token_ids

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation, through the model's chat template (`template_kwargs`:
        the request's `chat_template_kwargs`, e.g. enable_thinking)."""
        if not messages:
            raise bad_request("`messages` must not be empty.", param="messages")
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED_KWARGS}
        try:
            rendered = self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools, tokenize=True,
                **kwargs)
        except Exception as exc:  # jinja raises for conversations the template refuses
            raise bad_request(f"The chat template refused the messages: {exc}",
                              param="messages") from exc
        # transformers 5 returns a BatchEncoding, 4.x a plain list.
        ids = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered
        ids = list(ids)
        self._check_ids(ids, "messages")
        return ids

    def resolve_max_tokens(self, prompt_len: int, requested: int | None,
                           default: int | None = None) -> int:
        """max_tokens for one prompt: the client's if it fits the context, else a 400; none
        asked: `default`, or (None) the rest of the context, as vLLM does."""
        context = self.model.context_length
        if requested is None:
            if prompt_len >= context:
                raise APIError(400, f"This model's maximum context length is {context} tokens. "
                               f"However, your prompt has {prompt_len} tokens. Please reduce the "
                               "length of the prompt.", param="prompt",
                               code="context_length_exceeded")
            return context - prompt_len if default is None else min(default, context - prompt_len)
        if prompt_len + requested > context:
            raise APIError(400, f"This model's maximum context length is {context} tokens. "
                           f"However, you requested {prompt_len + requested} tokens ({prompt_len} "
                           f"in the prompt, {requested} in the completion). Please reduce the "
                           "length of the prompt or of max_tokens.", param="max_tokens",
                           code="context_length_exceeded")
        return requested

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token on its own, as logprobs show it (an incomplete character shows as U+FFFD)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_texts[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's raw UTF-8 bytes (exact for byte-level BPE, else those of its text)."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        table = _byte_decoder()
        if isinstance(piece, str) and piece and all(ch in table for ch in piece):
            return [table[ch] for ch in piece]
        return list(self.token_text(token_id).encode("utf-8"))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def _check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request(f"`{param}` must not be empty.", param=param)
        bad = next((i for i in ids if not 0 <= i < self.model.vocab_size), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is out of range: the model's vocabulary has "
                              f"{self.model.vocab_size} tokens.", param=param)
