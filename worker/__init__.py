"""kvray worker: one inference engine on one device. Never imports ray."""

from worker.config import EngineConfig
from worker.sampling import SamplingParams

__all__ = ["EngineConfig", "SamplingParams"]
