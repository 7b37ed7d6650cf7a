"""The Llama attention's path for a projection kernel that rotates q and k and writes K/V
itself (CudaOps' skinny GEMM on a GPU): on CPU, with that kernel played by torch
ops, an engine must give the tokens and logprobs of the usual path, prompts and decodes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.factories.tiny_models import random_prompts
from worker import LLM, SamplingParams
from worker.attention.base import KVDestination
from worker.attention.torch_native import TorchNativeBackend
from worker.model.ops import RopeInputs, TorchOps


def _kv_destination(self, layer: int, view) -> KVDestination:
    return KVDestination(view.k_cache[layer], view.v_cache[layer], view.batch.out_cache_loc)


def _qkv_rope_store(
    self, x, weight, bias, rope: RopeInputs, dest: KVDestination, num_q_heads: int
) -> torch.Tensor:
    """What the fused kernel does, in the torch ops the usual path runs."""
    n, (hk, d) = x.shape[0], dest.k_cache.shape[1:]
    q, k, v = F.linear(x, weight, bias).split([num_q_heads * d, hk * d, hk * d], dim=-1)
    q, k = self.rope(q.reshape(n, num_q_heads, d), k.reshape(n, hk, d), rope)
    dest.k_cache.index_copy_(0, dest.slots, k)
    dest.v_cache.index_copy_(0, dest.slots, v.reshape(n, hk, d))
    return torch.cat([q.reshape(n, -1), k.reshape(n, -1), v], dim=-1)


def test_attention_over_a_cache_the_projection_wrote_gives_the_usual_tokens(
    tiny_model, monkeypatch
):
    path, _ = tiny_model("llama")
    prompts = random_prompts([9, 14, 5, 21])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)

    def run() -> list:
        llm = LLM(str(path), device="cpu", max_seq_len=128, max_running=8, page_size=4)
        return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]

    want = run()
    calls: list[int] = []
    monkeypatch.setattr(TorchNativeBackend, "kv_destination", _kv_destination)

    def counted(self, *args) -> torch.Tensor:
        calls.append(1)
        return _qkv_rope_store(self, *args)

    monkeypatch.setattr(TorchOps, "qkv_rope_store", counted)
    assert run() == want
    assert calls  # the fused path ran
