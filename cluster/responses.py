"""OpenAI response bodies from choice deltas: whole responses, SSE chunks, logprobs, usage."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster import tools
from cluster.formats import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from cluster.generation import ChoiceDelta, Generation
from cluster.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    DeltaMessage,
    FinishReason,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
    Usage,
)
from cluster.reasoning import ReasoningParser, ReasoningParserName, split_reasoning
from worker.outputs import TokenLogprobs

TokenText = Callable[[int], str]


def usage_of(gen: Generation) -> Usage:
    prompt, completion = gen.num_prompt_tokens, gen.num_completion_tokens
    details = {"cached_tokens": gen.num_cached_tokens} if gen.num_cached_tokens else None
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
    )


def _top(token_text: TokenText, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def chat_logprobs(
    token_text: TokenText, logprobs: list[TokenLogprobs] | None
) -> ChatLogprobs | None:
    if logprobs is None:
        return None
    content = []
    for lp in logprobs:
        top = [_top(token_text, tid, v) for tid, v in lp.top.items()]
        text = token_text(lp.token_id)
        content.append(
            ChatTokenLogprob(
                token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    token_text: TokenText, logprobs: list[TokenLogprobs] | None, offset: int
) -> CompletionLogprobs | None:
    if logprobs is None:
        return None
    out = CompletionLogprobs()
    for lp in logprobs:
        text = token_text(lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({token_text(tid): v for tid, v in lp.top.items()})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _best(top: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely of a token's scored alternatives, which the engine keeps most likely
    first (it may have scored more, when two fields of one request asked for different counts)."""
    return list(itertools.islice(top.items(), k))


def echo_logprobs(
    token_text: TokenText, prompt_ids: list[int], scored: list[TokenLogprobs | None] | None, k: int
) -> CompletionLogprobs:
    """The logprobs of an echoed prompt's tokens, k alternatives each: null for the first,
    which nothing scores."""
    out, offset = CompletionLogprobs(), 0
    for j, token_id in enumerate(prompt_ids):
        text = token_text(token_id)
        lp = scored[j] if scored is not None and j < len(scored) else None
        out.tokens.append(text)
        out.token_logprobs.append(None if lp is None else lp.logprob)
        out.top_logprobs.append(
            None if lp is None else {token_text(tid): v for tid, v in _best(lp.top, k)}
        )
        out.text_offset.append(offset)
        offset += len(text)
    return out


def prompt_logprobs(
    token_text: TokenText, prompt_ids: list[int], scored: list[TokenLogprobs | None] | None, k: int
) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt token (null for the first) its own logprob and its
    k most likely alternatives', keyed by token id, ranked 1..k; the token's own rank is
    among the whole vocabulary (1 + the tokens more likely), whether or not it is one of them."""
    out: PromptLogprobs = []
    for j, token_id in enumerate(prompt_ids):
        lp = scored[j] if scored is not None and j < len(scored) else None
        if lp is None:
            out.append(None)
            continue
        best = _best(lp.top, k)
        ranks = {tid: r for r, (tid, _) in enumerate(best, start=1)}
        row = {
            str(tid): PromptLogprob(logprob=v, rank=ranks[tid], decoded_token=token_text(tid))
            for tid, v in best
        }
        assert lp.rank is not None, "the engine ranks every prompt token it scores"
        own = PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=token_text(token_id))
        out.append({str(token_id): own, **row})
    return out


@dataclass(frozen=True)
class Echo:
    """A completion choice's prompt, returned before its text (`echo`), with its tokens'
    logprobs (that many alternatives each) when the request asked for logprobs."""

    text: str
    token_ids: list[int]
    logprobs: int | None


def echoed(
    token_text: TokenText,
    prompt: Echo,
    text: str,
    scored: list[TokenLogprobs | None] | None,
    logprobs: CompletionLogprobs | None,
) -> tuple[str, CompletionLogprobs | None]:
    """A choice's text and logprobs (the first chunk's, or the whole choice's) with its
    prompt before them: `scored` are the prompt's logprobs, `logprobs` the text's own (at
    offsets from the prompt's end)."""
    text = prompt.text + text
    if prompt.logprobs is None:
        return text, logprobs
    head = echo_logprobs(token_text, prompt.token_ids, scored, prompt.logprobs)
    tail = logprobs or CompletionLogprobs()
    return text, CompletionLogprobs(
        tokens=head.tokens + tail.tokens,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
        text_offset=head.text_offset + tail.text_offset,
    )


@dataclass
class _Collected:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


def _finish(reason: FinishReason | None, called: bool) -> FinishReason | None:
    """A choice that ended by itself after calling tools finished with `tool_calls`."""
    return "tool_calls" if called and reason == "stop" else reason


@dataclass
class Collector:
    """Gathers every delta of a non-streaming request; a chat reply's text is split into
    reasoning and answer with a `reasoning` parser, and its answer into content and calls
    with `tool_calls`."""

    num_choices: int
    wants_logprobs: bool
    choices: dict[int, _Collected] = field(default_factory=dict)
    tool_calls: bool = False
    reasoning: ReasoningParserName = "none"
    echo: list[Echo] | None = None  # each choice's prompt, for a completion with `echo`
    # `prompt_logprobs`: each choice's prompt ids and the alternatives to show
    scored_prompts: list[list[int]] | None = None
    prompt_alternatives: int = 0

    def __post_init__(self) -> None:
        self.choices = {
            i: _Collected(logprobs=[] if self.wants_logprobs else None)
            for i in range(self.num_choices)
        }

    def add(self, delta: ChoiceDelta) -> None:
        c = self.choices[delta.index]
        c.text.append(delta.text)
        if c.logprobs is not None and delta.logprobs:
            c.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            c.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason:
            c.finish_reason = delta.finish_reason

    def chat(
        self, rid: str, created: int, model: str, usage: Usage, token_text: TokenText
    ) -> ChatCompletion:
        choices = []
        for i, c in sorted(self.choices.items()):
            reasoning, content = split_reasoning("".join(c.text), self.reasoning)
            answer: str | None = content
            calls: list[tools.ParsedCall] = []
            if self.tool_calls:
                answer, calls = tools.split_calls(content)
            message = AssistantMessage(
                content=None if reasoning and not answer else answer,
                reasoning_content=reasoning,
                tool_calls=[
                    ToolCall(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments))
                    for t in calls
                ]
                or None,
            )
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=chat_logprobs(token_text, c.logprobs),
                    finish_reason=_finish(c.finish_reason, bool(calls)),
                )
            )
        return ChatCompletion(
            id=rid,
            created=created,
            model=model,
            choices=choices,
            usage=usage,
            prompt_logprobs=self._prompt_logprobs(0, token_text),  # the choices share one prompt
        )

    def completion(
        self, rid: str, created: int, model: str, usage: Usage, token_text: TokenText
    ) -> Completion:
        choices = []
        for i, c in sorted(self.choices.items()):
            text = "".join(c.text)
            start = len(self.echo[i].text) if self.echo is not None else 0
            logprobs = completion_logprobs(token_text, c.logprobs, start)
            if self.echo is not None:
                text, logprobs = echoed(token_text, self.echo[i], text, c.prompt_logprobs, logprobs)
            choices.append(
                CompletionChoice(
                    index=i,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    prompt_logprobs=self._prompt_logprobs(i, token_text),
                )
            )
        return Completion(id=rid, created=created, model=model, choices=choices, usage=usage)

    def _prompt_logprobs(self, choice: int, token_text: TokenText) -> PromptLogprobs | None:
        if self.scored_prompts is None:
            return None
        scored = self.choices[choice].prompt_logprobs
        ids = self.scored_prompts[choice]
        return prompt_logprobs(token_text, ids, scored, self.prompt_alternatives)


def _says_nothing(choice: ChatChunkChoice) -> bool:
    d = choice.delta
    said = d.content or d.reasoning_content or d.tool_calls or choice.finish_reason
    return not said and choice.logprobs is None


@dataclass
class ChunkWriter:
    """Turns deltas into SSE `data:` lines for a streaming request; with `tool_calls`, each
    chat choice's text goes through a `tools.CallParser`, and each call is one delta."""

    rid: str
    created: int
    model: str
    chat: bool
    token_text: TokenText
    include_usage: bool
    tool_calls: bool = False
    echo: list[Echo] | None = None  # each choice's prompt, before its first chunk's text
    reasoning: ReasoningParserName = "none"  # a chat choice's thinking -> reasoning_content
    _offsets: dict[int, int] = field(default_factory=dict)
    _parsers: dict[int, tools.CallParser] = field(default_factory=dict)
    _thinking: dict[int, ReasoningParser | None] = field(default_factory=dict)

    def start(self, num_choices: int) -> list[str]:
        """Chat streams open each choice with the assistant role."""
        if not self.chat:
            return []
        choices = [
            ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(num_choices)
        ]
        return [
            self._sse(
                ChatCompletionChunk(
                    id=self.rid, created=self.created, model=self.model, choices=choices
                )
            )
        ]

    def deltas(self, deltas: list[ChoiceDelta]) -> list[str]:
        """The step's chunk, leaving out choices that say nothing yet (text held back while
        it may start a tag or a stop string), and no chunk when none says anything."""
        if self.chat:
            chat_choices = [c for c in map(self._chat_choice, deltas) if not _says_nothing(c)]
            if not chat_choices:
                return []
            return [
                self._sse(
                    ChatCompletionChunk(
                        id=self.rid, created=self.created, model=self.model, choices=chat_choices
                    )
                )
            ]
        choices = []
        for d in deltas:
            prompt = self.echo[d.index] if self.echo and d.index not in self._offsets else None
            offset = len(prompt.text) if prompt else self._offsets.get(d.index, 0)
            text, logprobs = d.text, completion_logprobs(self.token_text, d.logprobs, offset)
            if prompt is not None:  # the choice's first chunk
                text, logprobs = echoed(self.token_text, prompt, text, d.prompt_logprobs, logprobs)
            choices.append(
                CompletionChoice(
                    index=d.index, text=text, logprobs=logprobs, finish_reason=d.finish_reason
                )
            )
            self._offsets[d.index] = offset + len(d.text)
        choices = [c for c in choices if c.text or c.finish_reason or c.logprobs is not None]
        if not choices:
            return []
        return [
            self._sse(
                Completion(id=self.rid, created=self.created, model=self.model, choices=choices)
            )
        ]

    def _chat_choice(self, d: ChoiceDelta) -> ChatChunkChoice:
        logprobs = chat_logprobs(self.token_text, d.logprobs)
        reasoning, text = self._split_reasoning(d)
        if not self.tool_calls:
            delta = DeltaMessage(
                content=None if reasoning and not text else text, reasoning_content=reasoning
            )
            return ChatChunkChoice(
                index=d.index, delta=delta, logprobs=logprobs, finish_reason=d.finish_reason
            )
        parser = self._parsers.setdefault(d.index, tools.CallParser())
        before = len(parser.calls)
        content, calls = parser.push(text)
        if d.finish_reason is not None:
            more, last = parser.finish()
            content, calls = content + more, calls + last
        delta = DeltaMessage(
            content=None if reasoning and not content else content,
            reasoning_content=reasoning,
            tool_calls=[
                DeltaToolCall(
                    index=before + k,
                    id=c.id,
                    type="function",
                    function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
                )
                for k, c in enumerate(calls)
            ]
            or None,
        )
        finish = _finish(d.finish_reason, bool(parser.calls))
        return ChatChunkChoice(index=d.index, delta=delta, logprobs=logprobs, finish_reason=finish)

    def _split_reasoning(self, d: ChoiceDelta) -> tuple[str | None, str]:
        """A chat delta's reasoning (None when there is none) and answer text."""
        if d.index not in self._thinking:
            self._thinking[d.index] = ReasoningParser.of(self.reasoning)
        parser = self._thinking[d.index]
        if parser is None:
            return None, d.text
        reasoning, answer = parser.push(d.text)
        if d.finish_reason is not None:
            more, rest = parser.finish()
            reasoning, answer = reasoning + more, answer + rest
        return reasoning or None, answer

    def usage(self, usage: Usage) -> list[str]:
        if not self.include_usage:
            return []
        if self.chat:
            return [
                self._sse(
                    ChatCompletionChunk(
                        id=self.rid, created=self.created, model=self.model, choices=[], usage=usage
                    )
                )
            ]
        return [
            self._sse(
                Completion(
                    id=self.rid, created=self.created, model=self.model, choices=[], usage=usage
                )
            )
        ]

    @staticmethod
    def _sse(body: ChatCompletionChunk | Completion) -> str:
        return f"data: {body.model_dump_json()}\n\n"
