"""`kvray bench <name>`: every benchmark of the suite answers --help, and the cluster
benchmark's shared-prompt load shares what it should."""

from __future__ import annotations

import argparse
import importlib

import numpy as np
import pytest

from benchmarks.cluster import _hit_rate, _prefix_samples
from cluster.cli import BENCH_MODULES, main


@pytest.mark.parametrize("name", sorted(BENCH_MODULES))
def test_every_benchmark_answers_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", name, "--help"])
    assert exit_.value.code == 0
    assert f"kvray bench {name}" in capsys.readouterr().out
    module = importlib.import_module(BENCH_MODULES[name])
    assert callable(module.add_arguments) and callable(module.run)


def test_the_suite_is_the_seven_lasting_benchmarks() -> None:
    assert sorted(BENCH_MODULES) == [
        "cluster",
        "grammar",
        "kernels",
        "offline",
        "serve",
        "soak",
        "step",
    ]


def test_shared_prompt_requests_open_with_one_of_the_groups_system_prompts() -> None:
    args = argparse.Namespace(
        prefix_groups=3, prefix_len=64, prefix_prompts=30, prefix_suffix_len=8, prefix_output_len=4
    )
    samples = _prefix_samples(args, vocab=49152, seed=0)
    assert len(samples) == 30 and all(len(s.prompt) == 72 for s in samples)
    assert len({tuple(s.prompt[:64]) for s in samples}) == 3  # three system prompts, shared
    assert len({tuple(s.prompt[64:]) for s in samples}) == 30  # each its own suffix
    other = _prefix_samples(args, vocab=49152, seed=1)
    assert not {tuple(s.prompt[:64]) for s in samples} & {tuple(s.prompt[:64]) for s in other}
    assert np.all([s.output_len == 4 for s in samples])


def test_hit_rate_is_the_replicas_new_hits_over_their_new_queries() -> None:
    def stats(hits: int, queries: int, tokens: int) -> dict[str, int]:
        return {
            "prefix_hits": hits,
            "prefix_queries": queries,
            "num_preemptions": 0,
            "generation_tokens_total": tokens,
        }

    before = [stats(10, 20, 100), stats(0, 0, 0)]
    after = [stats(40, 60, 400), stats(5, 20, 50)]
    rate = _hit_rate(before, after)
    assert rate["prefix_hit_rate"] == pytest.approx(35 / 60)
    assert rate["per_replica_hit_rate"] == [pytest.approx(0.75), pytest.approx(0.25)]
    assert rate["per_replica_generated_tokens"] == [300, 50]


def test_the_router_scenario_times_the_routing_decision_without_ray() -> None:
    from benchmarks.cluster import router_cost

    result = router_cost(replicas=8, keys=64, prompt_pages=16, calls=50, seed=1)
    assert (result["replicas"], result["keys_per_replica"], result["calls"]) == (8, 64, 50)
    assert 0 < result["decision_us_p50"] <= result["decision_us_p99"]


def test_the_tenant_workload_shares_each_context_and_the_control_shares_nothing() -> None:
    from benchmarks.cluster_prefix import control_samples, kv_tokens_per_replica, tenant_samples

    args = argparse.Namespace(
        tenants=3,
        tenant_context_len=32,
        tenant_questions=4,
        question_len=8,
        answer_len=5,
        tenant_kv_tokens=None,
        replicas=2,
        control_requests=None,  # as many as the tenants' requests
        tenant_warmup=True,
    )
    warmup, samples = tenant_samples(args, vocab=49152, seed=0)
    assert len(samples) == 12 and all(len(s.prompt) == 40 and s.output_len == 5 for s in samples)
    contexts = [tuple(s.prompt[:32]) for s in samples]
    assert sorted(contexts.count(c) for c in set(contexts)) == [4, 4, 4]
    assert contexts != sorted(contexts, key=contexts.index)  # tenants interleaved, not in runs
    # the warm-up asks each tenant one question of its own, not one of the measured ones
    assert sorted(tuple(s.prompt[:32]) for s in warmup) == sorted(set(contexts))
    assert not {tuple(s.prompt) for s in warmup} & {tuple(s.prompt) for s in samples}
    args.tenant_warmup = False
    assert tenant_samples(args, vocab=49152, seed=0) == ([], samples)
    control = control_samples(args, vocab=49152, seed=0)
    assert [len(s.prompt) for s in control] == [len(s.prompt) for s in samples]
    assert len({tuple(s.prompt[:16]) for s in control}) == 12  # no page in common
    args.control_requests = 5
    assert [len(s.prompt) for s in control_samples(args, vocab=49152, seed=0)] == [40] * 5
    # the replicas together hold every context 1.5 times over, one alone cannot
    assert kv_tokens_per_replica(args) == 72 < 3 * 32
