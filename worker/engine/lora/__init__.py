"""PEFT LoRA adapters in the engine (`--enable-lora`): one step computes requests of several
adapters and of the base model together.

request.py (what a request names, the error, the counters), weights.py (an adapter's factors,
loaded and cut to this rank), cache.py (loaded adapters in host memory, LRU), slots.py (the
device's max_loras slots), sgmv.py (the Triton kernels of a mixed batch), layers.py (which
products of a prepared model get terms), manager.py (all of it for one engine). Only request.py
is imported here: the sequence and the scheduler need it without torch.
"""

from kvfleet.worker.engine.core.lora_request import LoraLoadError, LoraRequest, LoraStats

__all__ = ["LoraLoadError", "LoraRequest", "LoraStats"]
