"""CUDA graphs, captured once at engine start.

Decode graphs replay every pure-decode step whole. Batch buckets 1, 2, 4, 8, then steps of
8 up to max_running, captured largest first into one shared memory pool, each after a live
forward. Every input and output address comes from the InferenceWorkspace. Replay pads the
batch to its bucket with dummy requests whose KV reads and writes land on the scratch page
(page 0, through the pool's scratch row).

Prompt graphs serve the steps that carry prompt tokens, piecewise: attention's launch
depends on the batch's shape, so it runs eagerly, and the graphs hold everything between
one layer's attention and the next (see PromptGraphRunner).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.cuda import _POOL_HANDLE
from tqdm import tqdm

from worker.attention import cuda_ops
from worker.attention.base import AttentionBackend
from worker.attention.cuda import CudaBackend
from worker.batch import ForwardBatch
from worker.cache import KVCache
from worker.cache_view import CacheView
from worker.model.base import CausalLM
from worker.model.ops import RopeInputs
from worker.workspace import InferenceWorkspace

log = logging.getLogger("kvray.graphs")


def graph_buckets(max_running: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_running]
    sizes += list(range(16, max_running + 1, 8))
    if sizes[-1] != max_running:
        sizes.append(max_running)
    return sizes


class DecodeGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        cache: KVCache,
        workspace: InferenceWorkspace,
    ):
        self.model, self.backend, self.cache, self.ws = model, backend, cache, workspace
        self.buckets = graph_buckets(workspace.max_running)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._padded: tuple[int, int] | None = None

    def bucket(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def capture(self) -> None:
        with _no_collection():
            self._capture()

    def _capture(self) -> None:
        start = time.perf_counter()
        pool = None
        for bs in tqdm(
            sorted(self.buckets, reverse=True), desc="capturing decode graphs", leave=False
        ):
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
        log.info(
            "captured decode CUDA graphs for batch sizes %s in %.1fs",
            self.buckets,
            time.perf_counter() - start,
        )

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
        self.cache.batch = batch  # backends that store K/V through the view read its slots
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
        # fmt: skip
        return ForwardBatch(
            input_ids=ws.input_ids[:bs],
            positions=ws.positions[:bs],
            out_cache_loc=ws.out_cache_loc[:bs],
            req_pool_indices=ws.req_pool_indices[:bs],
            seq_lens=ws.seq_lens[:bs],
            qo_indptr=ws.qo_indptr[: bs + 1],
            kv_indptr=ws.kv_indptr[: bs + 1],
            logits_indices=ws.logits_indices[:bs],
            q_lens=[1] * bs,
            seq_lens_host=[1] * bs,
            rows_host=[self.cache.req_pool.scratch_row] * bs,
        )


def prompt_graph_buckets(max_tokens: int) -> list[int]:
    """Token counts of the prompt graphs: 8, 16, steps of 32 up to 512, then of 128. A step
    runs in the smallest that holds it; padding costs at most 31 (then 127) tokens' work."""
    sizes = [
        s for s in (8, 16, *range(32, 513, 32), *range(640, max_tokens + 1, 128)) if s <= max_tokens
    ]
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


class _PieceBoundary(AttentionBackend):
    """Stands in for attention while a forward is captured piece by piece: each layer's call
    ends the current graph and begins the next one, and hands back the fixed buffer that the
    real attention will fill at replay. With `pool` None it only hands back the buffer (the
    live forward before a capture). It takes q and k unrotated, as the CUDA backend does:
    at replay RoPE and the KV write are one kernel beside attention."""

    applies_rope = True

    def __init__(self, out: torch.Tensor, pool: _POOL_HANDLE | None):
        self.out, self.pool = out, pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.rope: RopeInputs | None = None  # every layer's: the workspace's positions

    def begin(self) -> None:
        if self.pool is not None:
            self.graphs.append(torch.cuda.CUDAGraph())
            self.graphs[-1].capture_begin(pool=self.pool)

    def end(self) -> None:
        if self.pool is not None:
            self.graphs[-1].capture_end()

    def prepare(self, batch: ForwardBatch, view: CacheView) -> None:
        pass

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        view: CacheView,
        rope: RopeInputs | None = None,
    ) -> torch.Tensor:
        if self.pool is not None:
            self.end()
            # Non-owning: the pool may reuse this memory later in the capture, as an eager
            # forward would once attention has read it; replay keeps that order.
            self.inputs.append((cuda_ops.alias(q), cuda_ops.alias(k), cuda_ops.alias(v)))
            self.rope = rope
            self.begin()
        return self.out[: q.shape[0]]

    def fwd_decode(self, layer: int, q: torch.Tensor, view: CacheView) -> torch.Tensor:
        raise AssertionError("a piece boundary never attends")

    fwd_prefill = fwd_decode


@dataclass(frozen=True, slots=True)
class _Pieces:
    """One token bucket's graphs (before layer 0's attention, between each pair of layers,
    after the last one), each attention call's q, k, v (unrotated), their RoPE inputs, and
    the final hidden states."""

    graphs: list[torch.cuda.CUDAGraph]
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    rope: RopeInputs
    hidden: torch.Tensor
    last_rows: bool  # `hidden` holds only `InferenceWorkspace.last_rows`, each request's last token


class PromptGraphRunner:
    """Piecewise CUDA graphs for steps that carry prompt tokens (prompt chunks, with or
    without decodes beside them), up to `max_tokens` tokens.

    Eagerly such a step launches a few hundred small kernels from Python, and on a GPU that
    finishes them faster than Python launches them the step takes the launches' time. Here the step's tokens are
    padded to a bucket and each layer costs one graph launch plus its attention kernels,
    which run eagerly on the real tokens only, writing into a fixed buffer that the next
    piece reads. Padded rows hold stale but finite tokens and positions; every op is
    row-wise, so they touch nothing but themselves, and they never reach the KV cache.
    Buckets past max_running tokens carry only the workspace's `last_rows` past the last
    attention, so their graphs give each request's last hidden state, not every token's.
    """

    def __init__(
        self,
        model: CausalLM,
        backend: CudaBackend,
        cache: KVCache,
        workspace: InferenceWorkspace,
        max_tokens: int,
    ):
        self.model, self.backend, self.cache, self.ws = model, backend, cache, workspace
        self.buckets = prompt_graph_buckets(min(max_tokens, workspace.max_tokens))
        cfg = model.config
        dtype = model.model.embed_tokens.weight.dtype
        self.attn_out = torch.zeros(
            (self.buckets[-1], cfg.num_heads, cfg.head_dim), dtype=dtype, device=workspace.device
        )
        self.pieces: dict[int, _Pieces] = {}

    def bucket(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def capture(self) -> None:
        with _no_collection():
            self._capture()

    def _capture(self) -> None:
        start, before = time.perf_counter(), torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        with torch.inference_mode():
            stream.wait_stream(torch.cuda.current_stream())
            for t in tqdm(
                sorted(self.buckets, reverse=True), desc="capturing prompt graphs", leave=False
            ):
                ids, positions = self.ws.input_ids[:t], self.ws.positions[:t]
                keep = self.ws.last_rows(t)
                if keep is not None:
                    keep.zero_()  # rows the live forward may read
                boundary = _PieceBoundary(self.attn_out, pool)
                with torch.cuda.stream(stream):  # the live forward warms up the capture's stream
                    live = _PieceBoundary(self.attn_out, None)
                    self.model(ids, positions, self.cache, live, keep)
                    stream.synchronize()
                    boundary.begin()
                    hidden = self.model(ids, positions, self.cache, boundary, keep)
                    boundary.end()
                assert boundary.rope is not None, "a Llama-family forward hands RoPE on"
                self.pieces[t] = _Pieces(
                    boundary.graphs,
                    boundary.inputs,
                    boundary.rope,
                    cuda_ops.alias(hidden),
                    keep is not None,
                )
                del hidden
            torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # fmt: skip
        log.info(
            "captured prompt CUDA graphs for %d token counts up to %d (%d pieces each) in %.1fs, %.0f MiB",
            len(self.buckets),
            self.buckets[-1],
            self.model.config.num_layers + 1,
            time.perf_counter() - start,
            (torch.cuda.memory_reserved() - before) / 2**20,
        )

    def keeps_last_rows(self, bucket: int) -> bool:
        """Whether `bucket`'s graphs give only each request's last hidden state."""
        return self.pieces[bucket].last_rows

    def run(self, batch: ForwardBatch, bucket: int) -> torch.Tensor:
        """Hidden states after the final norm, as the model's forward gives them, from the
        pieces of `bucket` (`self.bucket(T)`): `[T, hidden]`, or `[B, hidden]` at each
        request's last token where the bucket `keeps_last_rows`."""
        n = batch.num_tokens
        pieces = self.pieces[bucket]
        out = self.attn_out[:n]
        rope = RopeInputs(pieces.rope.positions[:n], pieces.rope.cos, pieces.rope.sin)
        # the first piece (embedding to the first q/k/v) reads no attention metadata: the
        # device runs it while the host plans attention
        pieces.graphs[0].replay()
        self.backend.prepare(batch, self.cache)
        for layer, (q, k, v) in enumerate(pieces.inputs):
            if layer:
                pieces.graphs[layer].replay()
            self.backend.forward(layer, q[:n], k[:n], v[:n], self.cache, rope, out=out)
        pieces.graphs[-1].replay()
        return pieces.hidden[: batch.batch_size if pieces.last_rows else n]


@contextmanager
def _no_collection() -> Iterator[None]:
    """Python's cycle collector off while graphs are captured (after one collection): a
    CUDA graph it destroys mid-capture (an engine dropped earlier in this process) is an
    operation a capture forbids, and fails that capture."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
