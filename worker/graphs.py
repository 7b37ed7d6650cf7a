"""Decode CUDA graphs: captured once at engine start, replayed for every pure-decode step.

Batch buckets 1, 2, 4, 8, then steps of 8 up to max_running, captured largest first into
one shared memory pool, each after a live forward. Every input and output address comes
from the InferenceWorkspace. Replay pads the batch to its bucket with dummy requests whose
KV reads and writes land on the scratch page (page 0, through the pool's scratch row).
"""

from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from worker.attention.base import AttentionBackend
from worker.batch import ForwardBatch
from worker.cache import KVCache
from worker.model.llama import LlamaForCausalLM
from worker.workspace import InferenceWorkspace

log = logging.getLogger("kvray.graphs")


def graph_buckets(max_running: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_running]
    sizes += list(range(16, max_running + 1, 8))
    if sizes[-1] != max_running:
        sizes.append(max_running)
    return sizes


class DecodeGraphRunner:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, cache: KVCache, workspace: InferenceWorkspace):
        self.model, self.backend, self.cache, self.ws = model, backend, cache, workspace
        self.buckets = graph_buckets(workspace.max_running)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._padded: tuple[int, int] | None = None

    def bucket(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        for bs in tqdm(sorted(self.buckets, reverse=True), desc="capturing decode graphs", leave=False):
            self._pad(0, bs)
            batch = self._dummy_batch(bs)
            self._forward(batch)  # live forward: warms kernels and allocator before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._forward(batch)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self._padded = None
        log.info("captured decode CUDA graphs for batch sizes %s in %.1fs", self.buckets, time.perf_counter() - start)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[B, vocab]` of a pure-decode batch, by replaying its bucket's graph."""
        b = batch.batch_size
        bs = self.bucket(b)
        assert bs is not None and batch.is_decode
        if batch.steady is None or self._padded != (b, bs):
            self._pad(b, bs)
        self.graphs[bs].replay()
        return self.logits[bs][:b]

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.backend.prepare(batch, self.cache)
        hidden = self.model(batch.input_ids, batch.positions, self.cache, self.backend)
        return self.model.compute_logits(hidden)

    def _pad(self, b: int, bs: int) -> None:
        """Rows b..bs become dummy requests: one token at position 0 on the scratch page."""
        ws = self.ws
        if bs > b:
            ws.input_ids[b:bs].zero_()
            ws.positions[b:bs].zero_()
            ws.out_cache_loc[b:bs].zero_()
            ws.req_pool_indices[b:bs].fill_(self.cache.req_pool.scratch_row)
            ws.seq_lens[b:bs].fill_(1)
        self._padded = (b, bs)

    def _dummy_batch(self, bs: int) -> ForwardBatch:
        ws = self.ws
        return ForwardBatch(
            input_ids=ws.input_ids[:bs], positions=ws.positions[:bs], out_cache_loc=ws.out_cache_loc[:bs],
            req_pool_indices=ws.req_pool_indices[:bs], seq_lens=ws.seq_lens[:bs], qo_indptr=ws.qo_indptr[: bs + 1],
            kv_indptr=ws.kv_indptr[: bs + 1], logits_indices=ws.logits_indices[:bs], q_lens=[1] * bs,
            seq_lens_host=[1] * bs,
        )  # fmt: skip
