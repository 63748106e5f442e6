"""Speculative decoding: proposers guess a stream's next tokens, the engine verifies them."""
