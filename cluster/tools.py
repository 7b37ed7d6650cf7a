"""Tool calling in the ingress: the tools a chat template sees, the grammar that makes a
`required` or named `tool_choice` always parse, and the parser that turns the model's text
into OpenAI `tool_calls` (whole, or delta by delta while streaming).

Calls are written the Hermes way, which Qwen 2.5 / 3, Hermes and SmolLM3 templates teach
their models:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that takes no `tools` (the demo model's) gets them in a system message that
asks for that format. Text outside the tags is the message's content; a block that does not
parse as a call stays content too.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from worker.guided import JSON_OPTIONS, GuidedDecoding

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class Function:
    """One tool: a function the model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates (and OpenAI) write it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """A tool call the model wrote: `arguments` is JSON text, as OpenAI returns it."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def calls_grammar(functions: list[Function], one_call: bool) -> GuidedDecoding:
    """A grammar whose every output is one call (`one_call`) or several, of these functions
    with arguments valid under each one's parameters schema."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f.name},
                "arguments": f.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    body = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    calls = "call" if one_call else r'call ("\n" call)*'
    lark = f'start: {calls}\ncall: "{OPEN}\\n" %json {body} "\\n{CLOSE}"\n'
    return GuidedDecoding.from_grammar(lark)


def system_prompt(functions: list[Function]) -> str:
    """The tools, for a template that does not take them, and how to call one."""
    tools = "\n".join(json.dumps(f.template_dict()) for f in functions)
    return (
        "You may call one or more functions to answer the user. The functions are listed "
        f"within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n"
        "To call a function, reply with a JSON object of its name and arguments within "
        f'{OPEN}{CLOSE} XML tags:\n{OPEN}\n{{"name": <function-name>, "arguments": '
        f"<args-json-object>}}\n{CLOSE}"
    )


def template_inputs(
    messages: list[dict[str, Any]], functions: list[Function], takes_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and `tools` to render: the tools go to a template that takes them, or
    else into the system message (the first one, or a new one ahead of the others)."""
    if not functions:
        return messages, None
    if takes_tools:
        return messages, [f.template_dict() for f in functions]
    prompt = system_prompt(functions)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        return [first, *messages[1:]], None
    return [{"role": "system", "content": prompt}, *messages], None


def call_text(name: str, arguments: str) -> str:
    """A past call, as the model would have written it (for templates without tools)."""
    try:
        args: Any = json.loads(arguments)
    except json.JSONDecodeError:
        args = arguments
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{CLOSE}"


def parse_call(body: str) -> ParsedCall | None:
    """The call inside one pair of tags, or None when it is not `{"name", "arguments"}`."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ParsedCall(new_call_id(), data["name"], text)


@dataclass
class CallParser:
    """Splits one choice's text, as it arrives, into content and tool calls.

    `push` returns the content that is certain by now (text that may be the start of a tag
    is held back) and the calls completed by now. Content made only of whitespace is held
    until more content follows, so the newlines around calls never become content.
    """

    calls: list[ParsedCall] = field(default_factory=list)
    _buffer: str = ""
    _inside: bool = False
    _blank: str = ""  # whitespace content held back

    def push(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        content, calls = [], []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._inside = False
                call = parse_call(body)
                if call is None:
                    content.append(f"{OPEN}{body}{CLOSE}")
                else:
                    calls.append(call)
                continue
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = partial_suffix(self._buffer, OPEN)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            content.append(self._buffer[:start])
            self._buffer, self._inside = self._buffer[start + len(OPEN) :], True
        self.calls += calls
        return self._content("".join(content)), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The end of the text: an unclosed call that parses counts, anything else is content.
        A call cut off inside its closing tag (by `max_tokens`) is whole, so it counts too."""
        rest, self._buffer = self._buffer, ""
        calls = []
        if self._inside:
            call = parse_call(rest[: len(rest) - partial_suffix(rest, CLOSE)])
            if call is None:
                rest = OPEN + rest
            else:
                calls, rest = [call], ""
        self._inside = False
        self.calls += calls
        content = self._content(rest)
        if not self.calls:
            content, self._blank = self._blank + content, ""
        return content, calls

    def _content(self, text: str) -> str:
        if not text:
            return ""
        if text.isspace():
            self._blank += text
            return ""
        out, self._blank = self._blank + text, ""
        return out


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def split_calls(text: str) -> tuple[str | None, list[ParsedCall]]:
    """A whole reply's content (None when it holds nothing but calls) and its calls."""
    parser = CallParser()
    head, _ = parser.push(text)
    tail, _ = parser.finish()
    content = head + tail
    if parser.calls:
        content = content.strip()
    return (content if content or not parser.calls else None), parser.calls
