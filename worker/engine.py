"""Engine: one model on one device — request lifecycle and the engine-loop thread.

`step()` is schedule -> execute -> postprocess. The offline LLM calls it directly; a
server calls `start()` (or builds it with `launched`) and the loop thread runs it whenever
there is work, publishing each step's deltas to the streams that wait for them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from worker.config import EngineConfig
from worker.executor import Executor, PendingStep, StepResult
from worker.grammar import CompiledGrammar, GrammarCompiler, fill_threads
from worker.model.config import ModelConfig
from worker.model.demo import resolve_model_path
from worker.outputs import FinishReason, RequestDelta, TokenLogprobs
from worker.request import PENDING, Request, ScheduledTask, Status
from worker.scheduler import Scheduler
from worker.stats import EngineStats, StepObserver, StepRecord, request_metrics
from worker.streams import OutputStream
from worker.tokenizer import Tokenizer, read_eos_token_ids
from worker.validation import EngineRequest, check_request

log = logging.getLogger("kvray.engine")

SUMMARY_REFRESH_S = 0.05


class EngineFull(RuntimeError):
    """The waiting queue is at `max_waiting`: try again later (HTTP 429)."""


class Engine:
    def __init__(self, config: EngineConfig):
        start = time.perf_counter()
        path = resolve_model_path(config.model)
        model_config = ModelConfig.from_dir(path)
        self.config = config.resolve(model_max_len=model_config.max_len)
        if self.config.token_budget < self.config.max_running:
            log.info(
                "max_running capped to token_budget=%d (every running request decodes every step)",
                self.config.token_budget,
            )
            self.config = self.config.model_copy(update={"max_running": self.config.token_budget})
        self.model_config = model_config
        self.tokenizer = Tokenizer.from_dir(path) if _has_tokenizer(path) else None
        eos = (
            self.tokenizer.eos_token_ids if self.tokenizer else frozenset(read_eos_token_ids(path))
        )
        self.eos_token_ids = eos
        self.executor = Executor(self.config, path, model_config, eos)
        self.scheduler = Scheduler(self.config, self.executor.cache)
        self.model_path = path
        self._requests: dict[str, Request] = {}
        self._streams: dict[str, OutputStream] = {}
        self._inbox: list[Request] = []
        self._compiling: set[Request] = set()  # held back until their grammar is compiled
        self._grammars: GrammarCompiler | None = None  # made for the first constrained request
        self._inflight: PendingStep | None = None  # launched on the device, results not yet read
        self._aborts: list[str] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.observer = StepObserver(self.scheduler.pacer)
        self.stats_snapshot = EngineStats()
        self._num_penalized = 0  # live requests with penalties (they keep steps from overlapping)
        self._summary: list[int] = []
        self._summary_time = 0.0
        self.work_since = 0.0  # when work last arrived at an idle engine (monotonic)
        self.fault_hook: object | None = (
            None  # test hook: callable(tasks) run before each step's forward
        )
        self._snapshot()  # stats are complete before the first step
        log.info(
            "engine ready in %.1fs: %s, dtype %s, device %s, backend %s, cache %s, max_running %d, max_seq_len %d, token_budget %d",
            time.perf_counter() - start,
            path.name,
            self.config.dtype,
            self.config.device,
            self.config.advanced.backend,
            self.config.advanced.cache,
            self.config.max_running,
            self.config.max_seq_len,
            self.config.token_budget,
        )

    # -- submitting ----------------------------------------------------------------------
    def submit(
        self, requests: list[EngineRequest], into: OutputStream | None = None
    ) -> OutputStream:
        """Queue requests (thread-safe). Validates all first: bad input raises ValueError, nothing queued.

        Their deltas go to a new stream, or to `into`, a stream that earlier submits made. A
        request with a grammar waits (outside the scheduler) until a compile thread has it."""
        new = [self._validate(r) for r in requests]
        ids = [r.request_id for r in new]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate request_id in one submit")
        guided = [r for r in new if r.params.guided is not None]
        grammars = self._grammar_compiler() if guided else None
        with self._cv:
            if any(rid in self._requests for rid in ids):
                raise ValueError("request_id already in use")
            # the scheduler's queue read live, as `stats` does: the last step's snapshot would
            # miss what this step took from the inbox, and let a burst in past the limit
            queued = len(self.scheduler.waiting) + len(self._inbox) + len(self._compiling)
            if queued + len(new) > self.config.max_waiting:
                raise EngineFull(
                    f"more than max_waiting={self.config.max_waiting} requests are waiting"
                )
            # idle until now: a stall counts from here, not from the last step
            if not self._requests:
                self.work_since = time.monotonic()
            if into is None:
                stream = OutputStream(ids, self.abort)
            else:
                stream = into
                stream.add(ids)
            for r in new:
                self._requests[r.request_id] = r
                self._streams[r.request_id] = stream
            self._inbox.extend(r for r in new if r.params.guided is None)
            for r in guided:
                r.status = Status.COMPILING
            self._compiling.update(guided)
            self._cv.notify_all()
        for r in guided:  # a cached grammar calls back at once, on this thread
            assert grammars is not None and r.params.guided is not None
            grammars.compile(r.params.guided).add_done_callback(
                functools.partial(self._grammar_ready, r)
            )
        return stream

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise ValueError("guided decoding needs the model's tokenizer, and this model has none")
        with self._cv:
            if self._grammars is None:
                hf = self.tokenizer.hf_tokenizer
                vocab = self.model_config.vocab_size
                # on CUDA the masks are filled in parallel: rows need matchers of their own compiles
                compiles = fill_threads() if self.executor.device.type == "cuda" else 1
                self._grammars = GrammarCompiler(hf, vocab, self.eos_token_ids, compiles=compiles)
            return self._grammars

    def _grammar_ready(self, request: Request, compiled: Future[CompiledGrammar]) -> None:
        """A compile thread's callback: the request joins the inbox, with its grammar or the
        reason it has none (it then fails at the next step)."""
        try:
            request.grammar = compiled.result().state()
        except Exception as exc:
            request.error = f"the grammar did not compile: {exc}"
        with self._cv:
            self._compiling.discard(request)
            self._inbox.append(request)
            self._cv.notify_all()

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's pages are free after the next step."""
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify_all()

    def _validate(self, r: EngineRequest) -> Request:
        assert self.config.max_seq_len is not None
        check_request(r, self.model_config.vocab_size, self.config.max_seq_len)
        n = len(r.prompt_token_ids)
        page = self.executor.cache.page_size
        if -(-(n + 1) // page) > self.executor.cache.num_total_pages:
            raise ValueError(f"prompt of {n} tokens does not fit the KV cache")
        gen = None
        if r.params.seed is not None:
            gen = torch.Generator(self.executor.device).manual_seed(r.params.seed)
        scored: list[TokenLogprobs | None] | None = None
        if r.params.prompt_logprobs is not None:
            scored = [None]  # the first prompt token: nothing before it scores it
        return Request(
            r.request_id, list(r.prompt_token_ids), r.params, generator=gen, prompt_logprobs=scored
        )

    # -- stepping ------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._compiling) or self._has_steps

    @property
    def _has_steps(self) -> bool:
        """Work a step can do now (requests whose grammar compiles are not that)."""
        return bool(
            self._inbox or self._aborts or self.scheduler.has_work or self._inflight is not None
        )

    def step(self) -> list[RequestDelta]:
        """One engine iteration; returns (and publishes) every delta it produced."""
        self._await_grammars()
        started = time.perf_counter()
        deltas = self._drain()
        if self.config.advanced.overlap:
            stepped = self._overlap_step(deltas, started)
        else:
            stepped = self._normal_step(deltas, started)
        if stepped:
            self.observer.step_seconds += time.perf_counter() - started
        # the tokens go out first: the snapshot's prefix summary copies every cached key,
        # milliseconds with a full cache (docs/performance.md), which no token should wait for
        self._publish(deltas)
        self._snapshot()
        return deltas

    def _normal_step(self, deltas: list[RequestDelta], started: float) -> bool:
        """Schedule, launch, wait for the sampled ids, postprocess."""
        step = self._schedule(deltas, started)
        if step is None:
            return False
        self._resolve(step, deltas, started)
        return True

    def _overlap_step(self, deltas: list[RequestDelta], started: float) -> bool:
        """Resolve the step in flight after queueing the next one behind it on the device, so
        the host's bookkeeping runs while the device computes."""
        current = self._inflight or self._schedule(deltas, started)
        self._inflight = None
        if current is None:
            return False
        scheduled_at = time.perf_counter()
        following = self._continuation(current, deltas)
        if following is not None:
            carried = _carried(current, following)
            self._inflight = self._launch(following, deltas, scheduled_at, carried, overlapped=True)
        self._resolve(current, deltas, started)
        return True

    def _schedule(self, deltas: list[RequestDelta], since: float) -> PendingStep | None:
        tasks, too_long = self.scheduler.schedule()
        for request in too_long:
            deltas.append(self._finish(request, "length"))
        return self._launch(tasks, deltas, since) if tasks else None

    def _launch(
        self,
        tasks: list[ScheduledTask],
        deltas: list[RequestDelta],
        since: float,
        carried: Sequence[tuple[int, int]] = (),
        overlapped: bool = False,
    ) -> PendingStep | None:
        """Queue a step on the device; `since`: when choosing its tasks began."""
        now = time.monotonic()
        for t in tasks:  # queue time ends when a request's first step is queued, not when it ends
            if t.request.first_scheduled_time is None:
                t.request.first_scheduled_time = now
        try:
            if callable(self.fault_hook):
                self.fault_hook(tasks)
            step = self.executor.launch(tasks, carried)
        except Exception as e:
            deltas.extend(self._fail(tasks, e))
            return None
        step.overlapped = overlapped
        step.schedule_seconds = time.perf_counter() - since - step.launch_seconds
        self.observer.launched(step)
        self.executor.cache.hash_ahead(tasks)
        return step

    def _resolve(self, step: PendingStep, deltas: list[RequestDelta], started: float) -> None:
        """Wait for a launched step's sampled ids and apply them to its requests."""
        try:
            result = self.executor.resolve(step)
        except Exception as e:
            queued = self._inflight.tasks if self._inflight is not None else []
            self._inflight = None  # it ran on the failed step's state
            deltas.extend(self._fail(step.tasks + queued, e))
        else:
            deltas.extend(self._apply(step, result))
        self.observer.resolved(step, started)

    def _apply(self, step: PendingStep, result: StepResult) -> list[RequestDelta]:
        """`_postprocess`; should it raise (a bug in the bookkeeping, not in the device's
        step), the step's requests end with an error rather than stay half-advanced, their
        clients waiting for ever."""
        live = [t.request for t in step.tasks if t.request.status is not Status.FINISHED]
        try:
            return self._postprocess(step, result)
        except Exception as e:
            log.exception("applying a step's results failed; failing its %d requests", len(live))
            error = f"{type(e).__name__}: {e}"
            deltas = []
            for request in dict.fromkeys(live):
                # finished in there: its delta is lost, send one
                if request.status is Status.FINISHED:
                    request.finish_reason, request.error = "error", error
                    deltas.append(self._delta(request, [], None))
                else:
                    deltas.append(self._finish(request, "error", error))
            return deltas

    def _fail(self, tasks: list[ScheduledTask], e: Exception) -> list[RequestDelta]:
        """Isolate a failed step to its requests."""
        log.error("step failed; failing its %d requests", len(tasks), exc_info=e)
        live = dict.fromkeys(t.request for t in tasks if t.request.status is not Status.FINISHED)
        return [self._finish(r, "error", f"{type(e).__name__}: {e}") for r in live]

    def _continuation(
        self, current: PendingStep, deltas: list[RequestDelta]
    ) -> list[ScheduledTask] | None:
        """Schedule the step after `current` before `current`'s tokens are read; None when
        that could change what the plain engine would do.

        `current`'s requests are advanced as if its results were in: each token it samples is
        a PENDING placeholder in `output_ids` until `_postprocess` writes the real one over it,
        and the next step reads it as input on the device (`_carried`). A request that reaches
        its length limit with this token is left out; one that stops on it (EOS, a stop id)
        costs one wasted token in the next step. Not done when this step's logprobs must be
        read, when a request has penalties (their counts need the token on the host), or when
        free pages are too few to rule out a preemption.
        """
        sched, cache = self.scheduler, self.executor.cache
        if current.wants_logprobs:
            return None
        deltas.extend(self._drain())  # requests that arrived during this step join the next one
        if self._num_penalized:
            return None
        growth = min(self.config.token_budget, sum(r.num_pending for r in sched.running))
        if not cache.can_grow(len(sched.running), growth):
            return None
        limit = self.config.max_seq_len or 0
        finishing: set[Request] = set()
        for t in current.tasks:
            if t.request.status is not Status.FINISHED:  # not aborted while in flight
                t.request.num_computed += t.num_new
        for i in current.rows:
            r = current.tasks[i].request
            if r.status is Status.FINISHED:
                continue
            r.output_ids.append(PENDING)
            if (
                r.params.max_tokens is not None and len(r.output_ids) >= r.params.max_tokens
            ) or r.num_tokens >= limit:
                finishing.add(r)
        current.advanced = True
        tasks, too_long = sched.schedule(skip=finishing)
        for request in too_long:
            deltas.append(self._finish(request, "length"))
        return tasks or None

    def _await_grammars(self) -> None:
        """While the only work is requests whose grammars compile, wait (at most a second, so
        the stats stay fresh and no compile looks like a stalled step) instead of spinning."""
        if not self._compiling:  # the usual case, without the lock (a set's size is atomic)
            return
        with self._cv:
            if self._compiling and not self._has_steps:
                self._cv.wait_for(lambda: self._stopped or self._has_steps, timeout=1.0)

    def _drain(self) -> list[RequestDelta]:
        """New requests into the scheduler; aborted ones finished (their pages freed)."""
        with self._cv:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        deltas = []
        for r in inbox:
            if r.status is Status.FINISHED:  # aborted while its grammar compiled
                continue
            if r.params.guided is not None and r.grammar is None:
                deltas.append(self._finish(r, "error", r.error))
                continue
            r.status = Status.WAITING
            self.scheduler.add(r)
            self._num_penalized += r.params.has_penalties
        for rid in aborts:
            request = self._requests.get(rid)
            if request is not None and request.status is not Status.FINISHED:
                deltas.append(self._finish(request, "abort"))
        return deltas

    def _postprocess(self, step: PendingStep, result: StepResult) -> list[RequestDelta]:
        now = time.monotonic()
        cache, tasks = self.executor.cache, step.tasks
        # not aborted or failed while in flight
        live = [t.request.status is not Status.FINISHED for t in tasks]
        for t, alive in zip(tasks, live, strict=True):
            if not alive:
                continue
            if not step.advanced:
                t.request.num_computed += t.num_new
            if t.request.row >= 0:
                cache.commit(t.request)
        for i, first, entries in result.prompt_logprobs:
            scored = tasks[i].request.prompt_logprobs
            if live[i] and scored is not None and first <= len(scored):
                scored[first:] = entries
        deltas = []
        for i, token, lp in zip(
            result.task_indices, result.token_ids, result.logprobs, strict=True
        ):
            if not live[i]:
                continue
            request = tasks[i].request
            if request.params.max_tokens == 0:  # it only scored its prompt: no token
                if step.advanced:
                    request.output_ids.pop()  # its PENDING placeholder
                request.first_token_time = now
                self.observer.prompt_tokens += len(request.prompt_ids)
                deltas.append(self._finish(request, "length"))
                continue
            if step.advanced:
                request.output_ids[-1] = token  # over its PENDING placeholder
            else:
                request.output_ids.append(token)
            self.observer.generation_tokens += 1
            if len(request.output_ids) == 1:
                request.first_token_time = now
                self.observer.prompt_tokens += len(request.prompt_ids)
            if lp is not None:
                request.logprobs = (request.logprobs or []) + [lp]
            grammar = request.grammar
            if grammar is not None and grammar.error is not None:
                deltas.append(self._finish(request, "error", grammar.error, [token], lp))
                continue
            reason = self._stop_reason(request, token)
            if reason is None:
                deltas.append(self._delta(request, [token], lp))
            else:
                deltas.append(self._finish(request, reason, new_tokens=[token], lp=lp))
        return deltas

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        p, n_out = request.params, len(request.output_ids)
        if n_out >= p.min_tokens and (
            (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        ):
            return "stop"
        if (p.max_tokens is not None and n_out >= p.max_tokens) or request.num_tokens >= (
            self.config.max_seq_len or 0
        ):
            return "length"
        return None

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        error: str | None = None,
        new_tokens: list[int] | None = None,
        lp=None,
    ) -> RequestDelta:
        if request.status in (Status.WAITING, Status.RUNNING):  # in the scheduler
            self.scheduler.remove(request)
            self._num_penalized -= request.params.has_penalties
        request.status, request.finish_reason, request.error = Status.FINISHED, reason, error
        request.finish_time = time.monotonic()
        return self._delta(request, new_tokens or [], lp)

    def _delta(self, request: Request, tokens: list[int], lp) -> RequestDelta:
        scored = request.prompt_logprobs
        prompt_logprobs = None  # on the first delta after the whole prompt was scored
        sent = request.prompt_logprobs_sent
        if scored is not None and len(scored) == len(request.prompt_ids) and not sent:
            prompt_logprobs, request.prompt_logprobs_sent = list(scored), True
        return RequestDelta(
            request.request_id,
            tokens,
            [lp] if lp is not None else None,
            request.finish_reason,
            request.error,
            num_prompt_tokens=len(request.prompt_ids),
            num_cached_tokens=request.num_cached,
            metrics=request_metrics(request) if request.finish_time is not None else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _publish(self, deltas: list[RequestDelta]) -> None:
        frames: dict[int, tuple[OutputStream, list[RequestDelta]]] = {}
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is None:
                continue
            frames.setdefault(id(stream), (stream, []))[1].append(d)
            if d.finish_reason is not None:
                with self._cv:
                    self._streams.pop(d.request_id, None)
                    self._requests.pop(d.request_id, None)
        for stream, frame in frames.values():
            stream.push(frame)

    # -- the loop thread -----------------------------------------------------------------
    @classmethod
    def launched(cls, config: EngineConfig) -> Engine:
        """An engine built on the loop thread that then steps it, as a server's should be: GNU
        OpenMP gives each thread that runs torch CPU work a team of its own, and more team
        threads than cores make every parallel op's barrier sleep."""
        handoff: queue.SimpleQueue[Engine | BaseException] = queue.SimpleQueue()

        def main() -> None:
            try:
                engine = cls(config)
            except BaseException as exc:  # the caller raises it
                handoff.put(exc)
                return
            engine._thread = threading.current_thread()
            handoff.put(engine)
            engine._loop()

        threading.Thread(target=main, name="kvray-engine", daemon=True).start()
        built = handoff.get()
        if isinstance(built, BaseException):
            raise built
        return built

    def start(self) -> None:
        """Step on a loop thread from now on; see `launched`."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="kvray-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._grammars is not None:
            self._grammars.shutdown()
        self.executor.close()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopped or self.has_work)
                if self._stopped:
                    return
            try:
                self.step()
            except Exception:  # the loop never dies silently: log and keep serving
                log.exception("engine step raised outside the executor")

    # -- observability -------------------------------------------------------------------
    @property
    def num_overlapped_steps(self) -> int:
        return self.observer.num_overlapped_steps

    @property
    def step_log(self) -> list[StepRecord] | None:
        """Set to a list to record every resolved step (profiling)."""
        return self.observer.step_log

    @step_log.setter
    def step_log(self, log: list[StepRecord] | None) -> None:
        self.observer.step_log = log

    def _snapshot(self) -> None:
        cache, sched = self.executor.cache, self.scheduler
        now = time.monotonic()
        # refreshed at most every SUMMARY_REFRESH_S while steps come, and always at the last
        # one: an idle engine has no next step to refresh it
        settled = not sched.has_work and self._inflight is None
        if settled or now - self._summary_time > SUMMARY_REFRESH_S:
            self._summary, self._summary_time = cache.prefix_summary(), now
        self.stats_snapshot = self.observer.snapshot(cache, sched)

    def stats(self) -> EngineStats:
        """The last step's snapshot, with the request counts read live: a step that hangs
        must not make a busy replica look idle (a `len` is atomic; the rest needs the step)."""
        with self._cv:
            pending = len(self._inbox) + len(self._compiling)
        alive = self._thread is not None and self._thread.is_alive()
        sched = self.scheduler
        return dataclasses.replace(
            self.stats_snapshot,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + pending,
            loop_alive=alive,
        )

    def prefix_summary(self) -> list[int]:
        """Keys of cached pages, most recent first, as of the last refresh (at most
        SUMMARY_REFRESH_S old while the engine steps, current once it has nothing to step)."""
        return self._summary


def _carried(current: PendingStep, following: list[ScheduledTask]) -> list[tuple[int, int]]:
    """(index in `following`'s packed input, row of `current`'s sampled ids) for each input token
    that `current` samples: the PENDING placeholders, filled on the device."""
    row_of = {id(current.tasks[i].request): j for j, i in enumerate(current.rows)}
    carried, at = [], 0
    for t in following:
        j = row_of.get(id(t.request))
        if j is not None:
            carried.append((at, j))
        at += t.num_new
    return carried


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
