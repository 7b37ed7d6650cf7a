"""The FlashAttention-2 prefill path's gather plan on real engine batches (CPU): K/V gathered
by the plan, attended with a plain torch stand-in for the flash call, give what the torch
backend gives; chunked prompts and prefix-cache hits included."""

import pytest
import torch

from tests.factories.tiny_models import random_prompts
from worker.attention import flash
from worker.config import EngineConfig
from worker.engine import Engine, EngineRequest
from worker.sampling import SamplingParams


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """Plain torch: each sequence's queries over its keys, causal from the bottom right."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = q[qs].float(), k[ks].float(), v[ks].float()
        kb, vb = kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1)
        s = torch.einsum("nhd,lhd->hnl", qb, kb) * scale
        pos = torch.arange(kb.shape[0] - qb.shape[0], kb.shape[0])
        s = s.masked_fill(torch.arange(kb.shape[0])[None, None, :] > pos[None, :, None], -torch.inf)
        out[qs] = torch.einsum("hnl,lhd->nhd", s.softmax(-1), vb).to(q.dtype)
    return out


@pytest.fixture
def engine(tiny_model, monkeypatch):
    path, _ = tiny_model("llama")
    config = EngineConfig.from_flat(
        model=str(path), device="cpu", max_seq_len=128, max_running=8, page_size=4,
        num_pages=128, token_budget=40,
    )  # fmt: skip
    engine = Engine(config)
    backend = engine.executor.backend
    checked = []

    def fwd_prefill(layer, q, view):
        ours = backend_fwd(layer, q, view)
        b = backend.batch
        d = next((i for i, n in enumerate(b.q_lens) if n != 1), len(b.q_lens))
        cu_q, cu_k = b.qo_indptr[d:] - b.qo_indptr[d], b.kv_indptr[d:] - b.kv_indptr[d]
        plan = flash.GatherPlan.build(
            view.req_to_token_host, b.rows_host[d:], cu_q, cu_k, b.q_lens[d:], b.seq_lens_host[d:]
        )
        start = int(b.qo_indptr[d])
        theirs = flash.prefill(
            q[start:], view.k_cache[layer], view.v_cache[layer], plan, backend.scale
        )
        torch.testing.assert_close(theirs, ours[start:], atol=1e-5, rtol=1e-5)
        checked.append(sum(b.q_lens[d:]))
        return ours

    monkeypatch.setattr(flash, "_forward", _varlen)
    backend_fwd = backend.fwd_prefill
    original_prepare = backend.prepare

    def prepare(batch, view):
        backend.batch = batch
        original_prepare(batch, view)

    monkeypatch.setattr(backend, "prepare", prepare)
    monkeypatch.setattr(backend, "fwd_prefill", fwd_prefill)
    return engine, checked


def test_gathered_kv_attends_like_the_torch_backend(engine):
    engine, checked = engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = random_prompts([30, 7, 55, 12], seed=3)
    shared = [prompts[0] + p for p in random_prompts([9, 21], seed=4)]  # prefix-cache hits
    for batch in (prompts, shared):
        stream = engine.submit(
            [EngineRequest(f"r{len(checked)}-{i}", p, params) for i, p in enumerate(batch)]
        )
        while not stream.finished:
            engine.step()
    assert engine.stats().prefix_hits > 0
    assert sum(checked) >= sum(map(len, prompts)) and len(checked) > 3  # chunks of 40 tokens
