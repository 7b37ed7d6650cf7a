"""EngineConfig: validation, and what `resolve()` makes of "auto"."""

import pytest
from pydantic import ValidationError

from worker.config import EngineConfig


def test_prompt_graphs_are_a_cuda_option_capped_by_the_token_budget():
    on_cpu = EngineConfig(device="cpu", advanced={"prompt_graph_tokens": 2048}).resolve()
    assert on_cpu.advanced.prompt_graph_tokens == 0 and not on_cpu.advanced.cuda_graphs
    assert EngineConfig(device="cpu").resolve().advanced.prompt_graph_tokens == 0
    # on by default on CUDA
    assert EngineConfig(device="cuda").resolve().advanced.prompt_graph_tokens == 2048
    cuda = EngineConfig(
        device="cuda", token_budget=1024, advanced={"prompt_graph_tokens": 4096}
    ).resolve()
    assert cuda.advanced.prompt_graph_tokens == 1024


@pytest.mark.parametrize("field", ["cpu_prompt_lane", "cpu_small_step_tokens"])
def test_the_cpu_only_step_modes_are_gone(field):
    """An old config that still sets them is refused, not silently ignored."""
    with pytest.raises(ValidationError, match=field):
        EngineConfig(**{field: None})


def test_cuda_backend_needs_the_paged_cache():
    with pytest.raises(ValidationError, match="paged"):
        EngineConfig(advanced={"backend": "cuda", "cache": "contiguous"})


def test_from_flat_sorts_keyword_settings_into_the_advanced_section():
    flat = EngineConfig.from_flat(model="m", page_size=4, max_running=8, backend="torch")
    nested = EngineConfig(model="m", max_running=8, advanced={"page_size": 4, "backend": "torch"})
    assert flat == nested
    with pytest.raises(ValidationError, match="no_such_setting"):
        EngineConfig.from_flat(no_such_setting=1)


def test_few_settings_are_user_facing_and_fault_injection_is_not_one():
    """#37: at most ~25 fields a user meets across EngineConfig and ClusterConfig; the rest
    under one `advanced:` each; the test-only fault hook is no config field at all."""
    from cluster.config import AutoscalingSettings, ClusterConfig

    engine = [f for f in EngineConfig.model_fields if f != "advanced"]
    cluster = [
        f for f in ClusterConfig.model_fields if f not in ("engine", "advanced", "autoscaling")
    ]
    user_facing = engine + cluster + list(AutoscalingSettings.model_fields)
    assert len(user_facing) <= 25, user_facing
    schema = str(ClusterConfig.model_json_schema())
    assert "fault_injection" not in schema
