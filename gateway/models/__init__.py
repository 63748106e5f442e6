"""The models one gateway serves: what the fleet serves (catalog), each model's tokenizer, chat
template and limits (tokenization) loaded on first use (loader), and the fleet's LoRA adapters
(adapters). Below the request path (gateway/openai): nothing here imports it."""
