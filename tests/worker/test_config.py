"""EngineConfig: validation, and what `resolve()` makes of "auto"."""

import pytest
from pydantic import ValidationError

from worker.config import EngineConfig


def test_prompt_graphs_are_a_cuda_option_capped_by_the_token_budget():
    on_cpu = EngineConfig(device="cpu", prompt_graph_tokens=2048).resolve()
    assert on_cpu.prompt_graph_tokens == 0 and not on_cpu.cuda_graphs
    assert EngineConfig(device="cpu").resolve().prompt_graph_tokens == 0
    # on by default on CUDA
    assert EngineConfig(device="cuda").resolve().prompt_graph_tokens == 2048
    cuda = EngineConfig(device="cuda", prompt_graph_tokens=4096, token_budget=1024).resolve()
    assert cuda.prompt_graph_tokens == 1024


@pytest.mark.parametrize("field", ["cpu_prompt_lane", "cpu_small_step_tokens"])
def test_the_cpu_only_step_modes_are_gone(field):
    """An old config that still sets them is refused, not silently ignored."""
    with pytest.raises(ValidationError, match=field):
        EngineConfig(**{field: None})


def test_cuda_backend_needs_the_paged_cache():
    with pytest.raises(ValidationError, match="paged"):
        EngineConfig(backend="cuda", cache="contiguous")
