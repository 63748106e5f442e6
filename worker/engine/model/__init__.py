"""The model as the engine runs it: prepared (sharded, fused, packed), its CPU layers, the KV budget from a memory profile, and the numerics fingerprint and invariance check."""
