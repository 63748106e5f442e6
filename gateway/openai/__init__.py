"""The OpenAI-compatible HTTP layer: request and response schemas, routes, the serving handlers
(completions, chat, re-attach, files and batches); prompt tokenisation is the model's
(gateway/models/tokenization.py)."""
