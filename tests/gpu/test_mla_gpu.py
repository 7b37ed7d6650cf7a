"""DeepSeek MLA and MoE on a GPU (random weights of small DeepSeek-V2 shapes): absorbed
decode equals the naive form on CUDA, the grouped-GEMM experts equal one GEMM per expert,
and decode CUDA graphs (MoE layers inside them too) give the eager engine's greedy tokens
bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from tests.factories.tiny_models import random_prompts
from tests.gpu.test_engine_gpu import _greedy
from worker import SamplingParams
from worker.attention.mla import MlaTorchBackend
from worker.config import EngineConfig
from worker.engine import Engine
from worker.graphs import graph_buckets
from worker.model.moe import MoE
from worker.model.random_model import DeepseekShape, hf_config
from worker.request import Request, ScheduledTask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 4096


def _shape(dense: bool) -> DeepseekShape:
    """DeepSeek-V2-Lite's attention dims (512 + 64 latent, 192 / 128 heads) at 4 layers."""
    return DeepseekShape(
        num_layers=4, hidden_size=1024, intermediate_size=2816, num_heads=8, num_kv_heads=8,
        head_dim=192, vocab_size=VOCAB, tie_word_embeddings=False, rope_theta=10000.0,
        max_position_embeddings=4096, n_routed_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=256, first_k_dense_replace=4 if dense else 1,
    )  # fmt: skip


def _dir(tmp_path_factory, dense: bool):
    path = tmp_path_factory.mktemp("mla-dense" if dense else "mla-moe")
    (path / "config.json").write_text(json.dumps(hf_config(_shape(dense), "bfloat16")))
    return path


def _engine(path, **overrides) -> Engine:
    cfg = dict(model=str(path), load_format="random", dtype="bfloat16", device="cuda",
               max_running=16, max_seq_len=1024, num_pages=1024, page_size=16)  # fmt: skip
    return Engine(EngineConfig.from_flat(**{**cfg, **overrides}))


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_absorbed_decode_equals_naive_on_cuda(tmp_path_factory, dtype, tol):
    engine = _engine(_dir(tmp_path_factory, dense=False), dtype=dtype, cuda_graphs=False)
    ex, cache = engine.executor, engine.executor.cache
    assert isinstance(ex.backend, MlaTorchBackend) and ex.backend.absorb and ex.graphs is None
    reqs = [Request(f"r{i}", p, SamplingParams()) for i, p in enumerate(
        random_prompts([9, 300, 2, 77], vocab=VOCAB))]  # fmt: skip
    for r in reqs:
        assert cache.admit(r) and cache.reserve(r, len(r.prompt_ids))
    with torch.inference_mode():
        ex.forward(cache.bind_tasks([ScheduledTask(r, len(r.prompt_ids) - 1) for r in reqs]))
        batch = cache.bind_tasks([ScheduledTask(r, 1) for r in reqs])
        absorbed = ex.forward(batch)
        cfg = ex.model_config
        ex.backend = MlaTorchBackend(
            cfg.mla, cfg.num_heads, ex.model.kv_b_weights(), absorb=False, fixed_width=True
        )
        naive = ex.forward(batch)
    assert (absorbed - naive).abs().max().item() <= tol * naive.abs().max().item()


def test_grouped_experts_equal_one_gemm_per_expert(tmp_path_factory):
    engine = _engine(_dir(tmp_path_factory, dense=False), cuda_graphs=False)
    moe = engine.executor.model.model.layers[-1].mlp
    assert isinstance(moe, MoE)
    ops = engine.executor.model.ops
    x = torch.randn(300, moe.gate.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        got = moe(x, ops)
        ids, weights = moe.gate(x)
        want = torch.zeros_like(x, dtype=torch.float32)
        for slot in range(ids.shape[1]):
            for e in ids[:, slot].unique().tolist():
                rows = (ids[:, slot] == e).nonzero().squeeze(1)
                out = moe.experts[e](x[rows], ops).float()
                want[rows] += out * weights[rows, slot, None]
        want = (want.to(x.dtype) + moe.shared_experts(x, ops)).float()
    assert (got.float() - want).abs().max().item() <= 2e-2 * want.abs().max().item()


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "moe"])
def test_mla_decode_graphs_are_bit_identical_to_eager(tmp_path_factory, dense):
    path = _dir(tmp_path_factory, dense=dense)
    graphs, eager = _engine(path), _engine(path, cuda_graphs=False)
    assert graphs.executor.graphs is not None and eager.executor.graphs is None
    # bucket sizes only: a padded batch's GEMMs may pick other kernels than the eager one's
    for batch in graph_buckets(16):
        prompts = random_prompts(
            [5 + (29 * i) % 200 for i in range(batch)], vocab=VOCAB, seed=batch
        )
        assert _greedy(graphs, prompts, 24) == _greedy(eager, prompts, 24), batch


@pytest.mark.parametrize("heads", [16, 8, 20])
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_mla_decode_kernel_matches_attention_over_the_latent_rows(heads, splits):
    """csrc's absorbed MLA kernel against float32 attention over the same rows: scattered
    slots, lengths around its 32-token tiles, heads not a multiple of its 16 per block."""
    from worker.attention import cuda_ops

    g = torch.Generator(device="cuda").manual_seed(heads * 10 + splits)
    lens = [1, 31, 33, 200, 1000]
    slots_total, width = 8192, 1024
    cache = torch.randn(slots_total, 1, 576, device="cuda", generator=g).to(torch.bfloat16)
    table = torch.randperm(slots_total, device="cuda", generator=g)[: len(lens) * width]
    req_to_token = table.view(len(lens), width).to(torch.int32).contiguous()
    rows = torch.arange(len(lens), device="cuda", dtype=torch.int32).flip(0).contiguous()
    seq_lens = torch.tensor(lens[::-1], device="cuda", dtype=torch.int32)
    q = torch.randn(len(lens), heads, 576, device="cuda", generator=g).to(torch.bfloat16)
    scale = 192**-0.5
    out = torch.full((len(lens), heads, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
    o_part = torch.empty(len(lens) * heads * splits * 512, device="cuda")
    ml_part = torch.empty(len(lens) * heads * splits * 2, device="cuda")
    cuda_ops.mla_decode(q, cache, req_to_token, rows, seq_lens, scale, out, o_part, ml_part, splits)
    for b in range(len(lens)):
        n = int(seq_lens[b])
        latent = cache[req_to_token[rows[b], :n].long(), 0].float()  # [n, 576]
        p = torch.softmax(q[b].float() @ latent.T * scale, dim=-1)
        want = p @ latent[:, :512]
        got = out[b].float()
        assert torch.isfinite(got).all(), (b, n)
        assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item() + 1e-3, (b, n)


def test_mla_engine_decodes_through_the_kernel(tmp_path_factory):
    from worker.attention.mla_cuda import MlaCudaBackend

    engine = _engine(_dir(tmp_path_factory, dense=True))
    assert isinstance(engine.executor.backend, MlaCudaBackend)
