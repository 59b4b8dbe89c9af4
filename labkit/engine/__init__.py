"""The serving engine (`LLMEngine`) and the single-request parts it grew from."""

from labkit.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput, TokenEvent
from labkit.engine.scheduler import SchedulerConfig

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SchedulerConfig", "TokenEvent"]
