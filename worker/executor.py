"""One step on the device: bind -> forward -> sample. Tasks in, sampled ids out.

The executor owns the model, the workspace, the KV cache and the attention backend.
It never looks inside the scheduler; the scheduler never touches tensors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import torch

from worker.attention import BACKENDS, cuda_ops, decode_layout, mla_backend
from worker.attention.cuda import CudaBackend
from worker.batch import ForwardBatch
from worker.config import EngineConfig
from worker.grammar import GrammarState, MaskBuilder
from worker.graphs import DecodeGraphRunner, PromptGraphRunner, graph_buckets
from worker.kv_sizing import build_cache
from worker.model.config import ModelConfig
from worker.model.deepseek import DeepseekForCausalLM
from worker.model.loader import load_model
from worker.model.ops import OPS
from worker.outputs import TokenLogprobs
from worker.request import PENDING, ScheduledTask
from worker.sampling import SamplerOutput, SamplingBatchInfo, TokenMask, sample
from worker.workspace import InferenceWorkspace

log = logging.getLogger("kvray.executor")


@dataclass(slots=True)
class StepResult:
    """For each task that sampled (in task order): its token and, if asked, logprobs."""

    task_indices: list[int]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # (task index, index in its prompt of the first token scored, their logprobs) for the
    # tasks whose requests asked for prompt logprobs
    prompt_logprobs: list[tuple[int, int, list[TokenLogprobs]]] = field(default_factory=list)


@dataclass(slots=True)
class PromptScores:
    """Prompt logprobs a step queued on the device (`Executor._score_prompts`)."""

    spans: list[tuple[int, int, int, int]]  # (task index, first prompt index, count, top k)
    targets: list[int]  # the scored prompt tokens, spans in order
    chosen: torch.Tensor  # [T] float32: each scored token's logprob
    ranks: torch.Tensor  # [T] int64: its rank in the vocabulary (1 + tokens more likely)
    top_ids: torch.Tensor | None  # [T, K] int64, the K = most top alternatives asked for
    top_logprobs: torch.Tensor | None  # [T, K] float32

    def read(self) -> list[tuple[int, int, list[TokenLogprobs]]]:
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_lp = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        out, row = [], 0
        for task, first, count, k in self.spans:
            entries = [
                _token_logprobs(self.targets[i], chosen[i], top_ids, top_lp, i, k, ranks[i])
                for i in range(row, row + count)
            ]
            out.append((task, first, entries))
            row += count
        return out


@dataclass(slots=True)
class PendingStep:
    """A step queued on the device: `Executor.resolve` waits for it and reads its results."""

    tasks: list[ScheduledTask]
    rows: list[int]  # indices of the tasks that sample
    host_ids: torch.Tensor | None = None  # pinned buffer the sampled ids are copied into
    done: torch.cuda.Event | None = None  # recorded after that copy (CUDA only)
    sampled: SamplerOutput | None = None  # kept when logprobs were asked for (read at resolve)
    wants_logprobs: bool = False  # a request asked for logprobs: `sampled` will be kept
    overlapped: bool = False  # queued before the previous step's tokens were read
    advanced: bool = False  # its requests were advanced past it before its results were read
    started: torch.cuda.Event | None = None  # recorded before its first kernel (CUDA only)
    launch_seconds: float = 0.0  # host time of `Executor.launch` (bind, forward, sampling queued)
    schedule_seconds: float = 0.0  # host time the engine spent choosing its tasks (Engine.step)
    # of the host's time on this step, blocked: on the device (the previous step's ids, read
    # at launch for its grammars, and this step's at resolve), and on its grammars' masks
    device_wait_seconds: float = 0.0
    mask_wait_seconds: float = 0.0
    num_decodes: int = 0  # set at launch when the engine times its steps (worker/stats.py)
    num_prompt_tokens: int = 0
    decode_context_tokens: int = 0
    # the sampling still to queue, behind its grammars' masks (`Executor.finish_sampling`)
    unsampled: Callable[[], None] | None = None
    error: BaseException | None = None  # queueing that sampling failed: the step has no ids
    prompt_scores: PromptScores | None = None  # prompt logprobs it computed, read at resolve

    def device_seconds(self) -> float | None:
        """The step's span on the device stream, from its first queued work to the copy of its
        sampled ids (after `resolve`; None off CUDA). With overlapped scheduling this, not the
        wall time of `Engine.step`, is the step's own time."""
        if self.started is None or self.done is None:
            return None
        return self.started.elapsed_time(self.done) / 1e3


class Executor:
    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        model_config: ModelConfig,
        eos_token_ids: frozenset[int],
    ):
        assert config.max_seq_len is not None
        self.config, self.model_config, self.eos_token_ids = config, model_config, eos_token_ids
        self.device = torch.device(config.device)
        mla = model_config.mla is not None
        if mla and config.kv_cache_dtype == "fp8":
            raise ValueError(
                f"kv_cache_dtype 'fp8' is not supported for {model_config.architecture}: its MLA "
                "latent cache is kept in the activation dtype (use kv_cache_dtype 'auto')"
            )
        # MLA models run torch's layer ops everywhere: csrc's kernels assume the Llama shapes.
        ops = OPS["torch" if mla else config.advanced.backend]()
        # fmt: skip
        self.model = load_model(
            model_path,
            config.torch_dtype,
            self.device,
            config.max_seq_len,
            random=config.advanced.load_format == "random",
            ops=ops,
        )
        self.workspace = InferenceWorkspace(
            max_tokens=config.token_budget,
            max_running=config.max_running,
            max_seq_len=config.max_seq_len,
            num_heads=model_config.num_heads,
            head_dim=model_config.head_dim,
            dtype=config.torch_dtype,
            device=self.device,
            split_kv=config.advanced.backend == "cuda" and not mla,
        )
        self.cache = build_cache(config, model_config, self.workspace)
        if isinstance(self.model, DeepseekForCausalLM):
            self.backend = mla_backend(
                config.advanced.backend,
                model_config,
                self.model.kv_b_weights(),
                config.max_running,
                self.device,
                config.torch_dtype,
            )
        else:
            self.backend = BACKENDS[config.advanced.backend](
                model_config.num_heads,
                model_config.head_dim,
                self.workspace,
                config.advanced.prefill_kernel,
            )
        self.decode_layout: decode_layout.Choice | None = None  # CudaBackend's, measured
        if isinstance(self.backend, CudaBackend):
            self.decode_layout = decode_layout.choose(
                self.cache, self.workspace, graph_buckets(config.max_running)
            )
            self.backend.decode_variants = self.decode_layout.table(config.max_running)
        log.info(
            "attention backend: %s, layer ops: %s",
            type(self.backend).__name__,
            type(self.model.ops).__name__,
        )
        self.generator = torch.Generator(self.device).manual_seed(config.advanced.seed)
        self._sampling: SamplingBatchInfo | None = None
        cuda = self.device.type == "cuda"
        self._host_ids = [
            torch.zeros(config.max_running, dtype=torch.int64, pin_memory=cuda) for _ in range(2)
        ]
        # Greedy rows' argmax: csrc's kernel spreads a row over several blocks where torch's
        # takes one (29 µs for a 128k vocabulary on an H100, 0.6 % of an 8B step).
        self._argmax_scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        if cuda and config.advanced.backend == "cuda":
            rows = config.max_running
            self._argmax_scratch = (
                torch.zeros(
                    rows * cuda_ops.ARGMAX_MAX_BLOCKS, dtype=torch.int64, device=self.device
                ),
                torch.zeros(rows, dtype=torch.int32, device=self.device),
            )
        # Timing events cost a little on every step, so only the prompt pacer, which needs each
        # step's device span (PendingStep.device_seconds), gets them.
        timed = cuda and config.advanced.prefill_slowdown is not None
        self._started = [torch.cuda.Event(enable_timing=True) if timed else None for _ in range(2)]
        self._done = [torch.cuda.Event(enable_timing=timed) if cuda else None for _ in range(2)]
        self._flip = 0
        self._previous: PendingStep | None = None  # the last step launched
        self._masks: MaskBuilder | None = None  # built at the first step with a grammar
        self.graphs: DecodeGraphRunner | None = None
        self.prompt_graphs: PromptGraphRunner | None = None
        if config.advanced.cuda_graphs and self.backend.supports_graph:
            self.graphs = DecodeGraphRunner(self.model, self.backend, self.cache, self.workspace)
            self.graphs.capture()
            if config.advanced.prompt_graph_tokens and isinstance(self.backend, CudaBackend):
                self.prompt_graphs = PromptGraphRunner(
                    self.model,
                    self.backend,
                    self.cache,
                    self.workspace,
                    config.advanced.prompt_graph_tokens,
                )
                self.prompt_graphs.capture()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        """Logits (float32) at each request's last new token, or at every token."""
        if (
            self.graphs is not None
            and batch.is_decode
            and not all_logits
            and self.graphs.bucket(batch.batch_size)
        ):
            return self.graphs.run(batch)
        return self.model.compute_logits(self._hidden(batch, last_rows=not all_logits))

    def _hidden(self, batch: ForwardBatch, last_rows: bool) -> torch.Tensor:
        """The last hidden state of every token of the batch, or (`last_rows`) of each
        request's last new token only, `[B, hidden]` (no decode graph)."""
        runner = self.prompt_graphs
        if (
            runner is not None
            and (bucket := runner.bucket(batch.num_tokens))
            and (last_rows or not runner.keeps_last_rows(bucket))
        ):
            hidden, kept = runner.run(batch, bucket), runner.keeps_last_rows(bucket)
        else:  # eagerly; a step that reads every token's state where the bucket's graphs do not
            self.backend.prepare(batch, self.cache)
            keep = self.workspace.last_rows(batch.num_tokens) if last_rows else None
            hidden = self.model(batch.input_ids, batch.positions, self.cache, self.backend, keep)
            kept = keep is not None
        if not last_rows:
            return hidden
        return hidden[: batch.batch_size] if kept else hidden[batch.logits_indices]

    @torch.inference_mode()
    def launch(
        self, tasks: list[ScheduledTask], carried: Sequence[tuple[int, int]] = ()
    ) -> PendingStep:
        """Queue one step on the device without waiting for it: bind, forward, sample, and the
        copy of the sampled ids to the host. The engine schedules the next step meanwhile.

        `carried`: (packed input index, row of the previous step's sampled ids) for input
        tokens the previous step sampled and the host has not read yet."""
        start = time.perf_counter()
        try:
            pending = self._launch(tasks, carried)
        except BaseException:
            self.discard()
            raise
        pending.launch_seconds = time.perf_counter() - start
        return pending

    def resolve(self, pending: PendingStep) -> StepResult:
        """Wait for a launched step; its sampled ids (and logprobs) on the host."""
        try:
            self.finish_sampling(pending)
            if pending.error is not None:
                raise pending.error
            pending.device_wait_seconds += _wait(pending.done)
            n = len(pending.rows)
            token_ids = pending.host_ids[:n].tolist() if pending.host_ids is not None else []
            logprobs: list[TokenLogprobs | None] = [None] * n
            if pending.sampled is not None:
                logprobs = self._logprobs(pending.tasks, pending.rows, pending.sampled)
            prompt = pending.prompt_scores.read() if pending.prompt_scores is not None else []
            return StepResult(pending.rows, token_ids, logprobs, prompt)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """After a failed step: the next bind rebuilds all metadata and the sampling batch."""
        self.cache.invalidate_bind()
        self._sampling = None
        self._previous = None
        if self._masks is not None:
            self._masks.settle()

    def close(self) -> None:
        """Stop the mask builder's thread (the model and cache go with the executor)."""
        if self._masks is not None:
            self._masks.close()

    @torch.inference_mode()
    def finish_sampling(self, pending: PendingStep) -> None:
        """Queue a step's sampling, if its grammars' masks held it back (once; a failure is
        kept on the step, for `resolve`)."""
        unsampled, pending.unsampled = pending.unsampled, None
        if unsampled is not None:
            try:
                unsampled()
            except BaseException as e:
                pending.error = e
                raise

    def _launch(
        self, tasks: list[ScheduledTask], carried: Sequence[tuple[int, int]]
    ) -> PendingStep:
        ws = self.workspace
        if self._previous is not None:  # this step's input ids are the previous step's samples
            self.finish_sampling(self._previous)
        slot = self._flip ^ 1  # the buffers of the step before this one may still be in use
        started = self._started[slot]
        if started is not None:
            started.record()
        batch = self.cache.bind_tasks(tasks, carried)
        if batch.steady is not None:
            ws.input_ids[: batch.steady.batch_size].copy_(
                ws.next_token_ids[: batch.steady.batch_size]
            )
        scored = _prompt_spans(tasks, batch) if batch.steady is None else []  # no prompt in it
        prompt_scores = None
        if scored:
            hidden = self._hidden(batch, last_rows=False)
            prompt_scores = self._score_prompts(tasks, batch, scored, hidden)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
        else:
            logits = self.forward(batch)
        rows = [i for i, t in enumerate(tasks) if t.samples]
        if not rows:
            self._sampling = None
            self._previous = PendingStep(tasks, rows, prompt_scores=prompt_scores)
            return self._previous
        if len(rows) < len(tasks):
            assert batch.sample_rows is not None and len(batch.sample_rows) == len(rows)
            logits = logits.index_select(0, batch.sample_rows)
        info = self._sampling_info(tasks, rows, batch.steady is not None)
        # The grammars' masks are filled while the device runs the forward queued above, and
        # (CUDA) while the engine reads the step before: the sampling is queued at the latest,
        # when the next step is launched or this one resolved.
        mask, waited = self._grammar_mask(tasks, rows, info) if info.grammar_rows else (None, 0.0)
        self._flip = slot
        pending = PendingStep(
            tasks,
            rows,
            self._host_ids[slot],
            self._done[slot],
            wants_logprobs=info.max_logprobs is not None,
            started=started,
            prompt_scores=prompt_scores,
            device_wait_seconds=waited,
        )
        self._previous = pending
        if mask is None:
            self._sample(pending, logits, info, None)
            return pending

        def sample_when_masked() -> None:
            start = time.perf_counter()
            ready = mask()
            pending.mask_wait_seconds = time.perf_counter() - start
            self._sample(pending, logits, info, ready)

        pending.unsampled = sample_when_masked
        return pending

    def _sample(
        self,
        pending: PendingStep,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        mask: TokenMask | None,
    ) -> None:
        next_ids = self.workspace.next_token_ids[: len(pending.rows)]
        if info.plain_greedy:  # no sampler, and no allocation without a grammar
            x = logits if mask is None else mask.apply(logits)
            if self._argmax_scratch is None:
                torch.argmax(x, dim=-1, out=next_ids)
            else:
                cuda_ops.argmax(x, next_ids, *self._argmax_scratch)
        else:
            out = sample(logits, info, mask)
            info.record(out.token_ids)
            next_ids.copy_(out.token_ids)
            pending.sampled = out if pending.wants_logprobs else None
        # The one device-to-host copy of a step, into pinned memory, two buffers in turn: it
        # is queued behind the step and waited for only when the step is resolved.
        assert pending.host_ids is not None
        pending.host_ids[: len(pending.rows)].copy_(next_ids, non_blocking=True)
        if pending.done is not None:
            pending.done.record()

    def _grammar_mask(
        self, tasks: list[ScheduledTask], rows: list[int], info: SamplingBatchInfo
    ) -> tuple[Callable[[], TokenMask], float]:
        """This step's masks of the rows with a grammar, each grammar first brought up to date
        with its request's output, and the seconds spent waiting for that output. A token the
        step in flight sampled is not on the host yet (PENDING, overlapped scheduling): it is
        read from that step's copy, which the device finishes before the forward just queued."""
        if self._masks is None:
            vocab, rows_max = self.model_config.vocab_size, self.config.max_running
            self._masks = MaskBuilder(vocab, rows_max, self.device)
        states: list[GrammarState] = []
        pending: dict[int, int] | None = None
        waited = 0.0
        for row in info.grammar_rows:
            request = tasks[rows[row]].request
            state = request.grammar
            assert state is not None, "a constrained request reached a step before its grammar"
            new = request.output_ids[state.consumed :]
            if new and new[-1] == PENDING:
                if pending is None:
                    pending, waited = self._previous_ids()
                new[-1] = pending[id(request)]
            state.consume(new)
            states.append(state)
        return self._masks.start(states, info.grammar_rows, len(rows)), waited

    def _previous_ids(self) -> tuple[dict[int, int], float]:
        """The sampled ids of the step launched before this one, by id() of their request,
        once the device has them on the host; and the seconds spent waiting for that."""
        prev = self._previous
        assert prev is not None and prev.host_ids is not None
        waited = _wait(prev.done)
        ids = prev.host_ids[: len(prev.rows)].tolist()
        return {id(prev.tasks[i].request): ids[j] for j, i in enumerate(prev.rows)}, waited

    def _sampling_info(
        self, tasks: list[ScheduledTask], rows: list[int], steady: bool
    ) -> SamplingBatchInfo:
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

    def _score_prompts(
        self,
        tasks: list[ScheduledTask],
        batch: ForwardBatch,
        spans: list[tuple[int, int, int, int]],
        hidden: torch.Tensor,
    ) -> PromptScores:
        """Each span's prompt tokens scored by the model's logits at the token before each:
        their logprobs and the top alternatives, the model's own (no sampling settings),
        queued on the device in slices so that the float32 logits stay small."""
        rows: list[int] = []
        targets: list[int] = []
        packed = [0, *accumulate(batch.q_lens)]  # where each task's tokens start in the batch
        for task, first, count, _ in spans:
            start = batch.seq_lens_host[task] - batch.q_lens[task]  # its first position
            row = packed[task] + first - 1 - start  # token j is scored at position j - 1
            rows += range(row, row + count)
            targets += tasks[task].request.prompt_ids[first : first + count]
        k = max(s[3] for s in spans)
        # from host tensors without a blocking copy, which would wait for the forward
        idx = torch.tensor(rows, dtype=torch.long).to(hidden.device, non_blocking=True)
        tgt = torch.tensor(targets, dtype=torch.long).to(hidden.device, non_blocking=True)
        chosen, ranks, top_ids, top_lp = [], [], [], []
        for lo in range(0, len(rows), _SCORE_SLICE):
            logits = self.model.compute_logits(hidden[idx[lo : lo + _SCORE_SLICE]]).float()
            lp = torch.log_softmax(logits, dim=-1)
            own = lp.gather(1, tgt[lo : lo + _SCORE_SLICE, None])
            chosen.append(own.view(-1))
            ranks.append((lp > own).sum(-1) + 1)
            if k:
                top = lp.topk(min(k, lp.shape[-1]), dim=-1)
                top_ids.append(top.indices)
                top_lp.append(top.values)
        return PromptScores(
            spans,
            targets,
            torch.cat(chosen),
            torch.cat(ranks),
            torch.cat(top_ids) if k else None,
            torch.cat(top_lp) if k else None,
        )

    def _logprobs(
        self, tasks: list[ScheduledTask], rows: list[int], out: SamplerOutput
    ) -> list[TokenLogprobs | None]:
        wanted = [tasks[i].request.params.logprobs for i in rows]
        if out.logprobs is None or all(w is None for w in wanted):
            return [None] * len(rows)
        chosen = out.logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        ids = out.token_ids.tolist()
        result: list[TokenLogprobs | None] = []
        for j, k in enumerate(wanted):
            entry = None if k is None else _token_logprobs(ids[j], chosen[j], top_ids, top_lp, j, k)
            result.append(entry)
        return result


def _token_logprobs(
    token_id: int,
    logprob: float,
    top_ids: list[list[int]] | None,
    top_logprobs: list[list[float]] | None,
    row: int,
    k: int,
    rank: int | None = None,
) -> TokenLogprobs:
    """A token's logprob and the first k of its row's top alternatives (host lists)."""
    top = {}
    if k and top_ids is not None and top_logprobs is not None:
        top = dict(zip(top_ids[row][:k], top_logprobs[row][:k], strict=True))
    return TokenLogprobs(token_id, logprob, top, rank)


_SCORE_SLICE = 512  # prompt tokens scored at once: float32 logits of 512 x 128k vocab = 256 MiB


def _prompt_spans(
    tasks: list[ScheduledTask], batch: ForwardBatch
) -> list[tuple[int, int, int, int]]:
    """(task index, first prompt index, count, top k) of the prompt tokens this step scores
    for requests that asked for prompt logprobs: token j > 0 needs the logits at position
    j - 1; tokens scored before a preemption are not scored again."""
    spans = []
    for i, t in enumerate(tasks):
        request = t.request
        scored = request.prompt_logprobs
        if scored is None or len(scored) >= len(request.prompt_ids):
            continue
        start = batch.seq_lens_host[i] - t.num_new
        first = max(start + 1, len(scored))  # the first prompt token this step can score
        last = min(start + t.num_new, len(request.prompt_ids) - 1)  # and the last
        if last >= first:
            spans.append((i, first, last + 1 - first, request.params.prompt_logprobs or 0))
    return spans


def _wait(event: torch.cuda.Event | None) -> float:
    """Block until `event` (a step's ids copied to the host) has happened; the seconds that took."""
    if event is None:
        return 0.0
    start = time.perf_counter()
    event.synchronize()
    return time.perf_counter() - start
