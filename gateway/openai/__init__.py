"""The OpenAI-compatible HTTP layer: request and response schemas, routes, the serving handlers
(completions, chat, re-attach, files and batches) and prompt tokenisation."""
