"""One step on the device: bind -> forward -> sample. Tasks in, sampled ids out.

The executor owns the model, the workspace, the KV cache and the attention backend.
It never looks inside the scheduler; the scheduler never touches tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.attention import BACKENDS
from worker.batch import ForwardBatch
from worker.config import EngineConfig
from worker.graphs import DecodeGraphRunner
from worker.kv_sizing import build_cache
from worker.model.config import ModelConfig
from worker.model.loader import load_model
from worker.model.ops import OPS
from worker.outputs import TokenLogprobs
from worker.request import ScheduledTask
from worker.sampling import SamplerOutput, SamplingBatchInfo, sample
from worker.workspace import InferenceWorkspace

log = logging.getLogger("kvray.executor")


@dataclass(slots=True)
class StepResult:
    """For each task that sampled (in task order): its token and, if asked, logprobs."""

    task_indices: list[int]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Executor:
    def __init__(self, config: EngineConfig, model_path: Path, model_config: ModelConfig, eos_token_ids: frozenset[int]):
        assert config.max_seq_len is not None
        self.config, self.model_config, self.eos_token_ids = config, model_config, eos_token_ids
        self.device = torch.device(config.device)
        self.model = load_model(
            model_path, config.torch_dtype, self.device, config.max_seq_len,
            random=config.load_format == "random", ops=OPS[config.backend](),
        )  # fmt: skip
        self.workspace = InferenceWorkspace(
            max_tokens=config.token_budget,
            max_running=config.max_running,
            max_seq_len=config.max_seq_len,
            num_heads=model_config.num_heads,
            head_dim=model_config.head_dim,
            dtype=config.torch_dtype,
            device=self.device,
            split_kv=config.backend == "cuda",
        )
        self.cache = build_cache(config, model_config, self.workspace)
        self.backend = BACKENDS[config.backend](model_config.num_heads, model_config.head_dim, self.workspace)
        log.info("attention backend: %s, layer ops: %s", type(self.backend).__name__, type(self.model.ops).__name__)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self._sampling: SamplingBatchInfo | None = None
        self.graphs: DecodeGraphRunner | None = None
        if config.cuda_graphs and self.backend.supports_graph:
            self.graphs = DecodeGraphRunner(self.model, self.backend, self.cache, self.workspace)
            self.graphs.capture()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        """Logits (float32) at each request's last new token, or at every token."""
        if self.graphs is not None and batch.is_decode and not all_logits and self.graphs.bucket(batch.batch_size):
            return self.graphs.run(batch)
        self.backend.prepare(batch, self.cache)
        hidden = self.model(batch.input_ids, batch.positions, self.cache, self.backend)
        return self.model.compute_logits(hidden if all_logits else hidden[batch.logits_indices])

    @torch.inference_mode()
    def step(self, tasks: list[ScheduledTask]) -> StepResult:
        try:
            return self._step(tasks)
        except BaseException:
            self.cache.invalidate_bind()
            self._sampling = None
            raise

    def _step(self, tasks: list[ScheduledTask]) -> StepResult:
        ws = self.workspace
        batch = self.cache.bind_tasks(tasks)
        if batch.steady is not None:
            ws.input_ids[: batch.steady.batch_size].copy_(ws.next_token_ids[: batch.steady.batch_size])
        logits = self.forward(batch)
        rows = [i for i, t in enumerate(tasks) if t.samples]
        if not rows:
            self._sampling = None
            return StepResult([], [], [])
        if len(rows) < len(tasks):
            logits = logits[rows]
        info = self._sampling_info(tasks, rows, batch.steady is not None)
        next_ids = ws.next_token_ids[: len(rows)]
        if info.all_greedy and info.penalties is None and info.min_tokens is None and info.max_logprobs is None:
            torch.argmax(logits, dim=-1, out=next_ids)  # plain greedy: no sampler, no allocation
            return StepResult(rows, next_ids.tolist(), [None] * len(rows))
        out = sample(logits, info)
        info.record(out.token_ids)
        next_ids.copy_(out.token_ids)
        token_ids = next_ids.tolist()  # the one host sync of a step
        return StepResult(rows, token_ids, self._logprobs(tasks, rows, out))

    def _sampling_info(self, tasks: list[ScheduledTask], rows: list[int], steady: bool) -> SamplingBatchInfo:
        """Built once per task set; reused while the batch is steady (its counters advance on device)."""
        if steady and self._sampling is not None:
            return self._sampling
        reqs = [tasks[i].request for i in rows]
        self._sampling = SamplingBatchInfo.build(
            [r.params for r in reqs],
            [r.prompt_ids for r in reqs],
            [r.output_ids for r in reqs],
            [r.generator for r in reqs],
            vocab_size=self.model_config.vocab_size,
            device=self.device,
            eos_token_ids=self.eos_token_ids,
            default_generator=self.generator,
        )
        return self._sampling

    def _logprobs(self, tasks: list[ScheduledTask], rows: list[int], out: SamplerOutput) -> list[TokenLogprobs | None]:
        wanted = [tasks[i].request.params.logprobs for i in rows]
        if out.logprobs is None or all(w is None for w in wanted):
            return [None] * len(rows)
        chosen = out.logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        ids = out.token_ids.tolist()
        result: list[TokenLogprobs | None] = []
        for j, k in enumerate(wanted):
            if k is None:
                result.append(None)
                continue
            top = dict(zip(top_ids[j][:k], top_lp[j][:k], strict=True)) if (k and top_ids and top_lp) else {}
            result.append(TokenLogprobs(ids[j], chosen[j], top))
        return result
