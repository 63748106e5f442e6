"""The engine's configuration: defined with the settings it is built from (shared/engine_config.py),
so that the worker's flags and the engine's fields are one definition."""

from kvfleet.shared.engine_config import (CacheConfig, EngineConfig, LoraConfig, ModelConfig,
                                          PaceConfig, ParallelConfig, SchedulerConfig,
                                          SpeculativeConfig)

__all__ = ["CacheConfig", "EngineConfig", "LoraConfig", "ModelConfig", "PaceConfig",
           "ParallelConfig", "SchedulerConfig", "SpeculativeConfig"]
