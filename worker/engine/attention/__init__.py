"""Paged attention over the KV block pool, plugged into transformers through AttentionInterface:
one interface (backend.py), its backends (gather + SDPA, the CPU's C++ kernels, Triton's paged
kernel) and the registry that picks one at start-up."""

from kvfleet.worker.engine.attention.backend import (
    ATTENTION_NAME, CONTEXT_KWARG, AttentionBackend, AttentionMetadata, StepGeometry,
    fused_layer_attention, paged_attention_forward, register_paged_attention)
from kvfleet.worker.engine.attention.registry import (
    ATTENTION_BACKENDS, resolve_attention_backend, resolve_backend_name)

__all__ = [
    "ATTENTION_BACKENDS", "ATTENTION_NAME", "CONTEXT_KWARG", "AttentionBackend",
    "AttentionMetadata", "StepGeometry", "fused_layer_attention", "paged_attention_forward",
    "register_paged_attention", "resolve_attention_backend", "resolve_backend_name"]
