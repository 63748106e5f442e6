"""KV handoff between workers: a running stream's KV cache goes from one worker to another."""
