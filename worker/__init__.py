"""kvray worker: one inference engine on one device. Never imports ray."""

from worker.config import EngineConfig
from worker.llm import LLM
from worker.outputs import RequestOutput
from worker.sampling import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]
