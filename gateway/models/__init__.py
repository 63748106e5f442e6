"""The models one gateway serves: what the fleet serves (catalog), each model's tokenizer loaded
on first use (loader), and the fleet's LoRA adapters (adapters)."""
