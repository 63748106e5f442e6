"""The serving engine: KV block pool, block manager, scheduler, model runner, sampler."""
