"""kvray worker: one inference engine on one device. Never imports ray.

The public names load on first use (PEP 562), so that `import worker.tokenizer` in the
ingress does not import the engine, torch's CUDA path or the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.config import EngineConfig
    from worker.guided import GuidedDecoding
    from worker.llm import LLM
    from worker.outputs import RequestOutput
    from worker.sampling import SamplingParams

__all__ = ["LLM", "EngineConfig", "GuidedDecoding", "RequestOutput", "SamplingParams"]

_HOMES = {
    "LLM": "worker.llm",
    "EngineConfig": "worker.config",
    "GuidedDecoding": "worker.guided",
    "RequestOutput": "worker.outputs",
    "SamplingParams": "worker.sampling",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
