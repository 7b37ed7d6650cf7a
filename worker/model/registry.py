"""HF architecture name -> the model class that serves it."""

from __future__ import annotations

from collections.abc import Callable

from worker.model.base import CausalLM
from worker.model.config import V2, V3, ModelConfig
from worker.model.deepseek import DeepseekForCausalLM
from worker.model.llama import LlamaForCausalLM
from worker.model.ops import ModelOps

# (config, max_len, ops) -> model
MODEL_CLASSES: dict[str, Callable[[ModelConfig, int, ModelOps | None], CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    V2: DeepseekForCausalLM,
    V3: DeepseekForCausalLM,
}
