"""`kvray bench offline` on a tiny random model, and the random-model writer it relies on."""

import argparse
import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from benchmarks.offline import CpuWatch, _params, add_arguments, engine_options, make_workload, run
from worker.model.config import ModelConfig
from worker.model.loader import weight_files
from worker.model.random_model import (
    SHAPES,
    ensure_random_model,
    hf_config,
    tensor_specs,
    write_random_model,
)

N, IN_RANGE, OUT_RANGE = 5, (4, 40), (3, 20)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    args = _args(
        "--random-shape",
        "tiny",
        "--random-dir",
        str(tmp),
        "--num-requests",
        str(N),
        "--input-len-range",
        *map(str, IN_RANGE),
        "--output-len-range",
        *map(str, OUT_RANGE),
        "--warmup-requests",
        "2",
        "--compare-hf",
        "--result-json",
        str(tmp / "out.json"),
        "--max-running",
        "4",
        "--page-size",
        "4",
    )
    return run(args), tmp / "out.json"


def test_run_counts_every_requested_token(tiny_result):
    result, _ = tiny_result
    lens = make_workload(N, IN_RANGE, OUT_RANGE, SHAPES["tiny"].vocab_size, 0).output_lens
    expected = sum(lens)
    kv = result["kvray"]
    assert kv["output_tokens"] == result["workload"]["output_tokens"] == expected
    assert kv["seconds"] > 0 and kv["output_tok_s"] == pytest.approx(expected / kv["seconds"])
    assert kv["steps"] >= max(lens)  # the longest request needs one step per output token
    assert (
        result["engine_config"]["max_running"] == 4
        and result["engine_config"]["advanced"]["page_size"] == 4
    )


def test_run_compares_with_transformers_on_the_same_work(tiny_result):
    result, _ = tiny_result
    hf = result["hf"]
    assert hf["output_tokens"] == result["kvray"]["output_tokens"]
    assert hf["batch_size"] == 4 and hf["num_groups"] == 2  # the engine's max_running by default
    assert hf["generated_tokens"] >= hf["output_tokens"]  # padding waste counted apart
    assert 0 <= hf["same_tokens_as_kvray"] <= N
    assert result["ratio_vs_hf"] == pytest.approx(
        result["kvray"]["output_tok_s"] / hf["output_tok_s"]
    )


def test_run_writes_json_with_machine_and_params(tiny_result):
    result, path = tiny_result
    saved = json.loads(path.read_text())
    assert saved["kvray"]["output_tokens"] == result["kvray"]["output_tokens"]
    for key in ("date", "hostname", "hardware", "git_commit", "torch", "engine_config"):
        assert saved[key], key
    assert saved["hardware"]["cpu"] and saved["hardware"]["cpu_count"] >= 1
    assert saved["params"]["random_shape"] == "tiny" and saved["model"]["random_shape"] == "tiny"
    assert "token_ids" not in saved["kvray"] and "token_ids" not in saved["hf"]
    assert saved["kvray"]["others_cpu_cores"] >= 0 and saved["hf"]["others_cpu_cores"] >= 0
    profile = saved["kvray"]["step_profile"]
    assert sum(row["steps"] for row in profile) == saved["kvray"]["steps"]
    assert sum(row["seconds"] for row in profile) <= saved["kvray"]["seconds"]
    assert {row["kind"] for row in profile} >= {"prompt"}


def test_run_refuses_lengths_beyond_max_seq_len(tmp_path):
    args = _args(
        "--random-shape",
        "tiny",
        "--random-dir",
        str(tmp_path),
        "--num-requests",
        "1",
        "--input-len-range",
        "60",
        "60",
        "--output-len-range",
        "10",
        "10",
        "--max-seq-len",
        "64",
    )
    with pytest.raises(ValueError, match="max_seq_len"):
        run(args)


def test_engine_options_come_from_engine_config_fields():
    args = _args(
        "--max-running",
        "8",
        "--no-cuda-graphs",
        "--cache",
        "contiguous",
        "--num-pages",
        "100",
        "--dtype",
        "float32",
        "--no-overlap",
    )
    assert engine_options(args) == dict(
        max_running=8,
        cuda_graphs=False,
        cache="contiguous",
        num_pages=100,
        dtype="float32",
        overlap=False,
    )
    # an optional bool: a flag pair too
    assert engine_options(_args("--overlap")) == dict(overlap=True)
    assert engine_options(_args()) == {}
    with pytest.raises(SystemExit):
        _args("--cache", "ring")


def test_workload_lengths_are_uniform_in_closed_ranges_and_seeded():
    w = make_workload(400, (3, 6), (1, 4), vocab=50, seed=7)
    assert {len(p) for p in w.prompts} == {3, 4, 5, 6}
    assert set(w.output_lens) == {1, 2, 3, 4}
    assert all(0 <= t < 50 for p in w.prompts for t in p)
    assert make_workload(400, (3, 6), (1, 4), vocab=50, seed=7) == w
    assert make_workload(400, (3, 6), (1, 4), vocab=50, seed=8) != w


def test_random_model_is_an_hf_directory_with_every_tensor(tmp_path):
    path = write_random_model(
        tmp_path / "m", "tiny", dtype="bfloat16", seed=3, max_shard_bytes=100_000
    )
    files = weight_files(path)
    assert len(files) > 1 and (path / "model.safetensors.index.json").is_file()
    assert not (path / "tokenizer.json").exists()
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    assert {k: tuple(t.shape) for k, t in tensors.items()} == dict(tensor_specs(SHAPES["tiny"]))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    q = tensors["model.layers.0.self_attn.q_proj.weight"].float()
    assert 0.015 < q.std() < 0.025 and abs(q.mean()) < 0.005
    assert torch.all(tensors["model.norm.weight"] == 1)
    cfg = ModelConfig.from_dir(path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.vocab_size) == (2, 64, 2, 512)
    assert cfg.rope_scaling["rope_type"] == "llama3" and not cfg.tie_word_embeddings


def test_random_model_is_seeded_and_cached(tmp_path):
    a = write_random_model(tmp_path / "a", "tiny", seed=1)
    b = write_random_model(tmp_path / "b", "tiny", seed=1)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    cached = ensure_random_model(tmp_path, "tiny", seed=1)
    stamp = (cached / "model.safetensors").stat().st_mtime_ns
    assert ensure_random_model(tmp_path, "tiny", seed=1) == cached
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob("*.tmp-*"))


def test_big_shapes_match_their_published_configs():
    llama = ModelConfig.from_dict(hf_config(SHAPES["llama3-8b"], "bfloat16"))
    assert (llama.num_layers, llama.hidden_size, llama.intermediate_size) == (32, 4096, 14336)
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim, llama.vocab_size) == (
        32,
        8,
        128,
        128256,
    )
    assert llama.rope_theta == 500000.0 and llama.rope_scaling["rope_type"] == "llama3"
    assert not llama.tie_word_embeddings
    assert 8.02e9 < SHAPES["llama3-8b"].num_params < 8.04e9  # Llama-3.1-8B: 8.03B
    smol = ModelConfig.from_dict(hf_config(SHAPES["smollm2-135m"], "bfloat16"))
    assert (
        smol.num_layers,
        smol.hidden_size,
        smol.num_heads,
        smol.num_kv_heads,
        smol.vocab_size,
    ) == (30, 576, 9, 3, 49152)
    assert smol.tie_word_embeddings and 134e6 < SHAPES["smollm2-135m"].num_params < 135e6


def test_cpu_watch_counts_other_processes_not_this_one():
    spin = "import time\nend = time.time() + 0.6\nwhile time.time() < end: pass"
    with CpuWatch() as watch:
        child = subprocess.Popen([sys.executable, "-c", spin])
        child.wait()
    assert watch.seconds >= 0.6
    # the spinning child is another process
    assert watch.others_cores is not None and watch.others_cores >= 0.5


def test_random_load_format_needs_only_a_config(tmp_path):
    args = _args(
        "--random-shape",
        "tiny",
        "--random-dir",
        str(tmp_path),
        "--load-format",
        "random",
        "--num-requests",
        "3",
        "--input-len-range",
        "5",
        "9",
        "--output-len-range",
        "2",
        "6",
        "--warmup-requests",
        "0",
    )
    result = run(args)
    assert result["kvray"]["output_tokens"] == result["workload"]["output_tokens"]
    (path,) = tmp_path.iterdir()
    assert path.name.endswith("-config") and not list(path.glob("*.safetensors"))
    with pytest.raises(ValueError, match="compare-hf"):
        run(
            _args(
                "--random-shape",
                "tiny",
                "--random-dir",
                str(tmp_path),
                "--load-format",
                "random",
                "--compare-hf",
            )
        )


def test_greedy_agreement_counts_identical_requests_and_matching_prefixes():
    from benchmarks.offline import greedy_agreement

    got = greedy_agreement(
        [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]], [[1, 2, 3, 4], [5, 0, 7, 8], [1, 9]]
    )
    assert got["identical_requests"] == 1 and got["identical_share"] == pytest.approx(1 / 3)
    assert got["mean_matching_prefix"] == pytest.approx(5 / 3)
    assert got["matching_prefix_share"] == pytest.approx(5 / 10)


def test_compare_bf16_runs_the_unquantized_cache_on_the_same_work(tmp_path):
    argv = ["--random-shape", "tiny", "--random-dir", str(tmp_path), "--num-requests", "3"]
    argv += ["--input-len-range", "5", "20", "--output-len-range", "4", "12"]
    argv += ["--warmup-requests", "0", "--kv-cache-dtype", "fp8", "--compare-bf16"]
    result = run(_args(*argv))
    unquantized = result["unquantized_kv"]
    assert result["engine_config"]["kv_cache_dtype"] == "fp8"
    assert unquantized["output_tokens"] == result["kvray"]["output_tokens"]
    assert unquantized["agreement"]["requests"] == 3
    assert 0 <= unquantized["agreement"]["matching_prefix_share"] <= 1
    with pytest.raises(ValueError, match="compare-bf16"):
        run(_args(*argv[:-3], "--compare-bf16"))


def test_the_constrained_share_is_spread_over_the_workload() -> None:
    workload = make_workload(8, IN_RANGE, OUT_RANGE, 512, 0)
    flags = [p.guided is not None for p in _params(workload, 0.0, 0.5)]
    assert flags == [False, True] * 4
    assert not any(p.guided for p in _params(workload, 0.0, 0.0))
    assert all(p.guided and p.ignore_eos for p in _params(workload, 0.0, 1.0))
    assert [p.max_tokens for p in _params(workload, 0.0, 0.5)] == workload.output_lens


def test_the_workload_floor_reads_weights_and_live_kv_each_step_and_counts_prompt_flops():
    """A 3-token request decodes twice after its prompt step (KV of 11, then 12 tokens); a
    1-token one only has its prompt step; the prompts' 30 tokens cost 2 x params FLOPs each."""
    from benchmarks.common import BF16_TFLOPS, COPY_TBPS
    from benchmarks.offline import FloorCosts, Workload, workload_floor

    workload = Workload(prompts=[[7] * 10, [7] * 20], output_lens=[3, 1])
    batches: list[int] = []

    def weights(batch: int) -> float:
        batches.append(batch)
        return 1e6 * batch

    floor = workload_floor(
        workload, FloorCosts(weights, kv_bytes_per_token=100, params_per_token=5)
    )
    assert batches == [1, 1]
    assert floor["decode_s"] == pytest.approx((1e6 + 1100 + 1e6 + 1200) / (COPY_TBPS * 1e12))
    assert floor["prefill_s"] == pytest.approx(2 * 5 * 30 / (BF16_TFLOPS * 1e12))
    assert floor["output_tok_s"] == pytest.approx(4 / (floor["decode_s"] + floor["prefill_s"]))
    # memory-bound steps: overlapping changes nothing
    assert floor["overlapped_decode_s"] == pytest.approx(floor["decode_s"])


def test_a_decode_step_of_the_floor_is_compute_bound_where_its_flops_outlast_the_weights():
    """Weights of 1 byte: the step's linear layers take their FLOPs' time instead."""
    from benchmarks.common import BF16_TFLOPS, COPY_TBPS
    from benchmarks.offline import FloorCosts, Workload, workload_floor

    workload = Workload(prompts=[[7] * 10, [7] * 20], output_lens=[2, 2])
    costs = FloorCosts(lambda b: 1.0, kv_bytes_per_token=100, params_per_token=5e9)
    floor = workload_floor(workload, costs)
    flops_s = 2 * 5e9 * 2 / (BF16_TFLOPS * 1e12)
    kv_s = (11 + 21) * 100 / (COPY_TBPS * 1e12)
    assert floor["decode_s"] == pytest.approx(flops_s + kv_s)
    # overlapped, the KV reads hide under the FLOPs
    assert floor["overlapped_decode_s"] == pytest.approx(
        max(flops_s, kv_s + 1 / (COPY_TBPS * 1e12))
    )
    prefill_s = floor["prefill_s"]
    assert floor["overlapped_output_tok_s"] == pytest.approx(
        4 / (floor["overlapped_decode_s"] + prefill_s)
    )


def test_each_profile_group_has_its_steps_floor_beside_its_time():
    """A decode band's floor is its weights (or FLOPs) and its decodes' KV, step by step; a
    prompt step's linear layers count every row, decodes and prompt tokens alike."""
    from benchmarks.common import BF16_TFLOPS, COPY_TBPS
    from benchmarks.offline import FloorCosts, step_profile
    from worker.engine import StepRecord

    costs = FloorCosts(lambda rows: 1e9, kv_bytes_per_token=1000, params_per_token=5e9)
    steps = [
        StepRecord(0.004, 2, 0, True, 0.001, 0.0005, decode_context_tokens=3000),
        StepRecord(0.006, 4, 0, True, 0.001, 0.0005, decode_context_tokens=5000),
        StepRecord(0.050, 2, 1000, False, 0.002, 0.001, decode_context_tokens=700),
    ]
    decode, prompt = step_profile(steps, costs)
    bandwidth, token_s = COPY_TBPS * 1e12, 2 * 5e9 / (BF16_TFLOPS * 1e12)
    floors = [1e9 / bandwidth + 3e6 / bandwidth, 1e9 / bandwidth + 5e6 / bandwidth]
    assert decode["kind"] == "decode, overlapped" and decode["batch_up_to"] == 8
    assert decode["floor_ms"] == pytest.approx(1e3 * sum(floors) / 2)
    assert decode["of_floor"] == pytest.approx(sum(floors) / 0.010)
    assert decode["mean_decode_context"] == 4000 and decode["mean_host_ms"] == pytest.approx(1.5)
    # 1,002 rows of FLOPs outlast the weights
    assert prompt["floor_ms"] == pytest.approx(1e3 * (1002 * token_s + 7e5 / bandwidth))
    # no costs (a CPU run): no floor columns
    assert "floor_ms" not in step_profile(steps)[0]
