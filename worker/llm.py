"""The offline API: `LLM(model).generate(prompts, params)`, driving the engine in this thread."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, cast

from worker.config import EngineConfig
from worker.engine import Engine, EngineRequest
from worker.outputs import RequestOutput, TokenLogprobs
from worker.sampling import SamplingParams
from worker.tokenizer import TextStream

Prompt = str | list[int]


class LLM:
    """`LLM("demo")` or `LLM("/path/to/hf-dir", dtype="bfloat16", cache="paged", ...)` (EngineConfig fields)."""

    def __init__(self, model: str = "demo", **config: Any):
        self.engine = Engine(EngineConfig.from_flat(model=model, **config))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """One output per prompt and sample (n > 1 gives n outputs per prompt, in order)."""
        single = isinstance(prompts, str) or _is_token_ids(prompts)
        prompts_list = [cast(Prompt, prompts)] if single else list(cast(Sequence[Prompt], prompts))
        params_list = _per_prompt(params, len(prompts_list))
        jobs = []
        for prompt, p in zip(prompts_list, params_list, strict=True):
            ids = self._encode(prompt, chat)
            for i in range(p.n):
                seeded = (
                    p if p.seed is None or i == 0 else p.model_copy(update={"seed": p.seed + i})
                )
                jobs.append(_Job(f"gen-{next(self._ids)}", ids, seeded, self._text_stream(seeded)))
        stream = self.engine.submit(
            [EngineRequest(j.request_id, j.prompt_ids, j.params) for j in jobs]
        )
        by_id = {j.request_id: j for j in jobs}
        while not stream.finished:
            self.engine.step()
            for frame in stream.poll():
                for delta in frame:
                    by_id[delta.request_id].add(delta, self.engine)
        for frame in stream.poll():
            for delta in frame:
                by_id[delta.request_id].add(delta, self.engine)
        return [j.output() for j in jobs]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = False
    ) -> Iterator[str]:
        """Text pieces of one generation as they are produced (for terminals)."""
        params = params or SamplingParams()
        job = _Job(
            f"gen-{next(self._ids)}", self._encode(prompt, chat), params, self._text_stream(params)
        )
        stream = self.engine.submit([EngineRequest(job.request_id, job.prompt_ids, params)])
        try:
            while not job.done:
                self.engine.step()
                for frame in stream.poll():
                    for delta in frame:
                        piece = job.add(delta, self.engine)
                        if piece:
                            yield piece
        finally:
            if not job.done:
                self.engine.abort(job.request_id)
                self.engine.step()

    def _encode(self, prompt: Prompt, chat: bool) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer: pass token ids")
        if chat:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def _text_stream(self, params: SamplingParams) -> TextStream | None:
        if self.tokenizer is None:
            return None
        return TextStream(
            self.tokenizer,
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
        )


class _Job:
    """One request's accumulating output, with detokenization and stop strings."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        text: TextStream | None,
    ):
        self.request_id, self.prompt_ids, self.params, self.text = (
            request_id,
            prompt_ids,
            params,
            text,
        )
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_cached = 0
        self.metrics = None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta, engine: Engine) -> str:
        self.metrics = delta.metrics or self.metrics
        if self.done:
            return ""  # the abort after a stop-string hit
        self.token_ids.extend(delta.new_token_ids)
        if self.logprobs is not None and delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        self.num_cached = delta.num_cached_tokens
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs
        piece = self.text.push(delta.new_token_ids) if self.text else ""
        if self.text is not None and self.text.stopped:
            self.finish_reason = "stop"
            engine.abort(self.request_id)
        elif delta.finish_reason is not None:
            self.finish_reason, self.error = delta.finish_reason, delta.error
            if self.text is not None:
                piece += self.text.finish()
        return piece

    def output(self) -> RequestOutput:
        assert self.finish_reason is not None
        return RequestOutput(
            self.request_id,
            self.prompt_ids,
            self.token_ids,
            self.text.text if self.text else "",
            self.finish_reason,  # type: ignore[arg-type]
            self.logprobs,
            self.error,
            self.num_cached,
            self.metrics,
            self.prompt_logprobs,
        )


def _is_token_ids(x: object) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
    return list(params)
