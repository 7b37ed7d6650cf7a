"""A reasoning model's thinking split from its answer, as vLLM's `reasoning_content`.

Reasoning models write their thinking in a `<think> ... </think>` block before the answer.
`ClusterConfig.reasoning_parser` says how the block opens:
- `qwen3`: the model writes `<think>` itself, first (Qwen 3, QwQ); output that does not
  start with it (thinking turned off: `chat_template_kwargs: {"enable_thinking": false}`)
  is all answer.
- `deepseek_r1`: the chat template opens the block in the prompt (DeepSeek-R1 and its
  distills), so the output starts inside it; a `<think>` the model writes anyway is
  dropped, and output that never closes the block is all thinking.
The answer after `</think>` starts at its first non-blank character. Streams are split as
they arrive: text that may be the start of a tag is held back until it is known.

Structured output and required tools leave the block free: their grammar holds after it
(`thinking`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cluster.tools import partial_suffix
from worker.guided import Thinking
from worker.sampling import SamplingParams

OPEN, CLOSE = "<think>", "</think>"
ReasoningParserName = Literal["none", "qwen3", "deepseek_r1"]
_THINKING: dict[ReasoningParserName, Thinking] = {
    "none": "none",
    "qwen3": "optional",
    "deepseek_r1": "open",
}


def thinking(params: SamplingParams, name: ReasoningParserName) -> SamplingParams:
    """A chat request's parameters with its grammar (if any) holding only after the
    thinking block this parser reads."""
    if params.guided is None or name == "none":
        return params
    guided = params.guided.model_copy(update={"thinking": _THINKING[name]})
    return params.model_copy(update={"guided": guided})


@dataclass
class ReasoningParser:
    """One choice's text, as it arrives, split into reasoning and answer (`push`)."""

    opened: bool  # the prompt opened the block: the output starts inside it
    _state: Literal["start", "reasoning", "answer"] = "start"
    _buffer: str = ""
    _blank: bool = True  # the answer has no character yet but blanks (they are dropped)

    @classmethod
    def of(cls, name: ReasoningParserName) -> ReasoningParser | None:
        return None if name == "none" else cls(opened=name == "deepseek_r1")

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) known by now."""
        self._buffer += text
        reasoning, answer = [], []
        while self._buffer:
            if self._state == "start":
                head = self._buffer.lstrip()
                if head.startswith(OPEN):
                    self._state, self._buffer = "reasoning", head[len(OPEN) :]
                elif OPEN.startswith(head):  # blank, or the tag's start: not known yet
                    break
                else:
                    self._state = "reasoning" if self.opened else "answer"
            elif self._state == "reasoning":
                end = self._buffer.find(CLOSE)
                if end < 0:
                    keep = partial_suffix(self._buffer, CLOSE)
                    reasoning.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                reasoning.append(self._buffer[:end])
                self._state, self._buffer = "answer", self._buffer[end + len(CLOSE) :]
            else:
                answer.append(self._answer(self._buffer))
                self._buffer = ""
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """The end of the text: what was held back, where it belongs."""
        rest, self._buffer = self._buffer, ""
        if self._state == "start":
            self._state = "reasoning" if self.opened else "answer"
            rest = rest.lstrip()
        if self._state == "reasoning":
            return rest, ""
        return "", self._answer(rest)

    def _answer(self, text: str) -> str:
        if self._blank:
            text = text.lstrip()
            self._blank = not text
        return text


def split_reasoning(text: str, name: ReasoningParserName) -> tuple[str | None, str]:
    """A whole reply's reasoning (None without a parser, or when it has none) and answer."""
    parser = ReasoningParser.of(name)
    if parser is None:
        return None, text
    head = parser.push(text)
    tail = parser.finish()
    reasoning = head[0] + tail[0]
    return reasoning or None, head[1] + tail[1]
