"""Tokenizer of a model directory: HF fast tokenizer, chat template, EOS ids, and streaming
text (incremental detokenizer + stop strings).

Tokenization runs on the ingress (CPU); GPU replicas only ever see token ids. Text leaves
the system through `TextStream`, which turns the ids of one request into text as they
arrive and applies that request's stop strings.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"  # what a byte sequence that is not (yet) valid UTF-8 decodes to
_CONTEXT_TOKENS = 4  # tokens kept before new ones so decoders see word boundaries
_MAX_WINDOW = 64  # beyond this, a trailing U+FFFD is invalid output, not a char in progress


# apply_chat_template's own arguments: template variables may not stand in for them
_TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


class Tokenizer:
    """The HF fast tokenizer of a model directory plus the ids that end a generation."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int]) -> None:
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"{type(hf_tokenizer).__name__} is not a fast tokenizer (no tokenizer.json)"
            )
        self._hf = hf_tokenizer
        self._backend = backend
        self.vocab_size: int = len(hf_tokenizer)
        self.eos_token_ids: frozenset[int] = frozenset(int(i) for i in eos_token_ids)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer files and EOS ids from an HF model directory."""
        from transformers import AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {path} does not exist")
        hf = AutoTokenizer.from_pretrained(path)
        eos = read_eos_token_ids(path)
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        if not eos:
            log.warning("no EOS token id in %s: generations end only at max_tokens or stop", path)
        return cls(hf, eos)

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer underneath (the grammar compiler reads its vocabulary)."""
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    @property
    def template_takes_tools(self) -> bool:
        """Does the chat template render a `tools` list (and calls in the history)?"""
        template = self._hf.chat_template
        return isinstance(template, str) and "tools" in template

    def chat_prompt_text(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render messages (and `tools`, OpenAI's tool dicts) with the model's chat template;
        `continue_final_message`: the last message left open, for the reply to go on with it;
        `template_kwargs`: more variables for the template (e.g. Qwen 3's `enable_thinking`)."""
        if not self._hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use a plain prompt")
        taken = sorted(set(template_kwargs or {}) & _TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}")
        text = self._hf.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
        return str(text)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; the template itself places any BOS, so none is added."""
        text = self.chat_prompt_text(
            messages, add_generation_prompt, tools, continue_final_message, template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. No clean-up of spaces before punctuation: that rewrite reaches
        across token boundaries, and streamed text must equal this decode exactly."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


def read_eos_token_ids(path: Path) -> set[int]:
    """EOS ids of generation_config.json (int or list), else of config.json.

    Read with plain json: the HF loaders drop fields silently when a file does not match
    the class they expect, and a missing EOS means a generation that never stops.
    """
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if not file.is_file():
            continue
        value = json.loads(file.read_text()).get("eos_token_id")
        ids = {value} if isinstance(value, int) else set(value or ())
        if ids:
            return {int(i) for i in ids}
    return set()


class IncrementalDetokenizer:
    """Turns token ids into text as they arrive.

    Each push decodes only a short window: a few context tokens already emitted plus the
    new ones; the text the context decodes to was emitted before, the rest is new. Text
    ending in U+FFFD may be a multi-byte character whose remaining bytes are still to come,
    so it is held back until a later token completes it (or until the window grows past
    `_MAX_WINDOW` tokens, which only output that is not valid UTF-8 reaches).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._start = 0  # first id of the window
        self._emitted = 0  # chars of the window's text already returned

    def push(self, token_ids: Sequence[int]) -> str:
        """New text since the last push; never ends inside a multi-byte character."""
        self._ids.extend(token_ids)
        text = self._window_text()
        end = len(text)
        if len(self._ids) - self._start <= _MAX_WINDOW:
            while end > self._emitted and text[end - 1] == _REPLACEMENT:
                end -= 1
        return self._take(text, end)

    def flush(self) -> str:
        """Whatever is still held back (the stream ended)."""
        text = self._window_text()
        return self._take(text, len(text))

    def _window_text(self) -> str:
        return self._tokenizer.decode(self._ids[self._start :], self._skip)

    def _take(self, text: str, end: int) -> str:
        new = text[self._emitted : end]
        self._emitted = end
        start = len(self._ids) - _CONTEXT_TOKENS
        if end == len(text) and start > self._start:  # all of it is out: keep only context
            self._start = start
            self._emitted = len(self._window_text())
        return new


class TextStream:
    """Detokenizer + stop strings for one request; used by the offline LLM API and by the HTTP ingress."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._detok = tokenizer.detokenizer(skip_special_tokens)
        self._stops = tuple(s for s in stop if s)  # an empty stop string would match everywhere
        self._include_stop = include_stop_str_in_output
        self._held = ""  # a suffix that may be the start of a stop string
        self.stopped = False
        self._pieces: list[str] = []  # appended per push, joined on demand (no O(n^2) +=)

    @property
    def text(self) -> str:
        """All visible text so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def push(self, token_ids: Sequence[int]) -> str:
        """New visible text. Text that could still begin a stop string is held back."""
        if self.stopped:
            return ""
        return self._feed(self._detok.push(token_ids), final=False)

    def finish(self) -> str:
        """The end of the request: release held-back text (unless a stop string matched)."""
        if self.stopped:
            return ""
        return self._feed(self._detok.flush(), final=True)

    def _feed(self, new: str, final: bool) -> str:
        buf = self._held + new
        match = self._first_match(buf)
        if match is not None:
            start, end = match
            out = buf[: end if self._include_stop else start]
            self.stopped = True
            self._held = ""
        else:
            keep = 0 if final else self._partial_stop_len(buf)
            out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        if out:
            self._pieces.append(out)
        return out

    def _first_match(self, buf: str) -> tuple[int, int] | None:
        """(start, end) of the stop string that completes first in `buf`; on a tie the one
        that starts first. This is what streaming char by char would find, however the text
        arrives in chunks."""
        best: tuple[int, int] | None = None
        for stop in self._stops:
            start = buf.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or (end, start) < (best[1], best[0]):
                best = (start, end)
        return best

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:size]):
                    longest = size
                    break
        return longest
