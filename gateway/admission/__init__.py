"""What a request passes before it is enqueued: body size, API keys, per-key rate limits,
backpressure."""
