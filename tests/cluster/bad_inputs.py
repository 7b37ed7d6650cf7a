"""A corpus of malformed and hostile requests, as data: each must get a 4xx OpenAI error.

`build_corpus(target)` returns the cases; the families below each cover one kind of bad
input (bad JSON, wrong types, limits, encodings, HTTP-level mistakes, ...). Families are
generated where a table is clearer than repetition, but every case is a distinct input
and names what it sends. `param` is the field the error must name; ANY where the field
is not the point (HTTP-level errors, bad JSON, auth).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MODELS = "/v1/models"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
RESPONSES = "/v1/responses"
ANY = "<any>"  # the error's param is not checked
MIB = 1024 * 1024
NO_HEADER = ""  # a header value that means: leave the header out


@dataclass(frozen=True)
class Target:
    """What the corpus needs to know of the app under test."""

    model: str
    api_key: str
    max_seq_len: int
    vocab_size: int
    max_request_bytes: int = 4 * MIB
    max_stop: int = 16
    max_stop_chars: int = 1024
    max_stop_token_ids: int = 64
    max_prompts: int = 64
    max_n: int = 16
    max_waiting: int = 1024  # the engine's waiting queue: one request's sequences must fit it


@dataclass
class Case:
    """One request and the answer it must get."""

    family: str
    name: str
    method: str
    path: str
    body: bytes | None
    status: int
    param: str | None = ANY
    headers: dict[str, str] = field(default_factory=dict)
    chunked: bool = False  # send the body with Transfer-Encoding: chunked (no Content-Length)

    @property
    def id(self) -> str:
        return f"{self.family}/{self.name}"


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


class _Builder:
    """Makes cases against one target: base bodies, default headers, one family at a time."""

    def __init__(self, target: Target):
        self.t = target
        self.cases: list[Case] = []
        self.family = ""

    def chat(self, **fields: Any) -> dict[str, Any]:
        body = {
            "model": self.t.model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
        }
        return {**body, **fields}

    def completion(self, **fields: Any) -> dict[str, Any]:
        return {**{"model": self.t.model, "prompt": "Hi", "max_tokens": 2}, **fields}

    def add(
        self,
        name: str,
        body: bytes | dict[str, Any] | list[Any] | None,
        status: int = 400,
        param: str | None = ANY,
        *,
        path: str = CHAT,
        method: str = "POST",
        headers: dict[str, str] | None = None,
        chunked: bool = False,
    ) -> None:
        raw = body if isinstance(body, bytes) or body is None else dumps(body)
        merged = {
            "Authorization": f"Bearer {self.t.api_key}",
            "Content-Type": "application/json",
            **(headers or {}),
        }
        merged = {k: v for k, v in merged.items() if v != NO_HEADER}
        self.cases.append(
            Case(self.family, name, method, path, raw, status, param, merged, chunked)
        )


# ---- families ---------------------------------------------------------------------------


def bad_json(b: _Builder) -> None:
    ok = dumps(b.chat())
    texts = {
        "empty": b"",
        "whitespace": b" \n\t ",
        "truncated-object": ok[:-1],
        "truncated-mid-string": ok[: ok.index(b"Hi") + 1],
        "unclosed-array": b'{"model": "demo", "messages": [',
        "trailing-comma-object": ok[:-1] + b",}",
        "trailing-comma-array": b'{"model":"demo","messages":[{"role":"user","content":"Hi"},]}',
        "single-quotes": ok.replace(b'"', b"'"),
        "unquoted-keys": b'{model: "demo", messages: [{role: "user", content: "Hi"}]}',
        "line-comment": b"// hello\n" + ok,
        "block-comment": ok[:1] + b"/* c */" + ok[1:],
        "utf8-bom": b"\xef\xbb\xbf" + ok,
        "raw-nul-byte": ok[:-1] + b', "user": "a\x00b"}',
        "raw-newline-in-string": ok.replace(b'"Hi"', b'"H\ni"'),
        "invalid-escape": ok.replace(b'"Hi"', b'"\\x41"'),
        "short-unicode-escape": ok.replace(b'"Hi"', b'"\\u12"'),
        "lone-high-surrogate": ok.replace(b'"Hi"', b'"\\ud800"'),
        "lone-low-surrogate": ok.replace(b'"Hi"', b'"\\udc00 x"'),
        "reversed-surrogates": ok.replace(b'"Hi"', b'"\\udc00\\ud800"'),
        "two-objects": ok + ok,
        "trailing-garbage": ok + b"garbage",
        "hex-number": ok.replace(b'"max_tokens": 2', b'"max_tokens": 0x10'),
        "leading-zero": ok.replace(b'"max_tokens": 2', b'"max_tokens": 012'),
        "plus-sign": ok.replace(b'"max_tokens": 2', b'"max_tokens": +2'),
        "bare-decimal-point": ok.replace(b'"max_tokens": 2', b'"max_tokens": .5'),
        "js-undefined": ok.replace(b'"max_tokens": 2', b'"max_tokens": undefined'),
        "python-literals": b'{"model": "demo", "messages": [], "stream": True, "user": None}',
        "top-level-nan": b"NaN",
        "missing-colon": b'{"model" "demo"}',
        "missing-value": b'{"model": }',
    }
    for name, raw in texts.items():
        b.add(name, raw)
    b.add("truncated-completion", dumps(b.completion())[:-2], path=COMPLETIONS)


def not_an_object(b: _Builder) -> None:
    for name, raw in {
        "array": b"[]",
        "array-of-request": dumps([b.chat()]),
        "string": b'"hello"',
        "number": b"42",
        "null": b"null",
        "true": b"true",
    }.items():
        b.add(name, raw, param=None)
    b.add("completion-array", b"[1, 2]", param=None, path=COMPLETIONS)


def missing_fields(b: _Builder) -> None:
    b.add("empty-object", {}, param="model")
    b.add("no-model", {"messages": [{"role": "user", "content": "Hi"}]}, param="model")
    b.add("no-messages", {"model": b.t.model}, param="messages")
    b.add("no-prompt", {"model": b.t.model}, param="prompt", path=COMPLETIONS)
    b.add("message-without-role", b.chat(messages=[{"content": "Hi"}]), param="messages.0.role")
    b.add(
        "part-without-text",
        b.chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        param="messages.0.content.0.text",
    )
    b.add(
        "part-without-type",
        b.chat(messages=[{"role": "user", "content": [{"text": "Hi"}]}]),
        param="messages.0.content.0.type",
    )
    b.add("empty-message-object", b.chat(messages=[{}]), param="messages.0.role")


# field -> wrong values; strict types, so a string of digits or a bool is no number
_WRONG_TYPES: dict[str, list[Any]] = {
    "model": [5, None, ["demo"], {"id": "demo"}],
    "max_tokens": ["16", 1.5, True, [16], {}],
    "temperature": ["0.5", True, [], {}, None],
    "top_p": ["1", False],
    "n": ["2", True, 2.5, [2]],
    "stop": [5, True, {"a": 1}],
    "seed": ["42", 1.5, True],
    "stream": ["yes", 1, "true", None],
    "stream_options": ["yes", []],
    "presence_penalty": ["0"],
    "frequency_penalty": [[]],
    "user": [5, {}],
    "top_k": ["5", 1.5],
    "min_p": ["0.1"],
    "repetition_penalty": ["1"],
    "ignore_eos": ["false"],
    "min_tokens": ["1"],
    "stop_token_ids": ["1", 1],
    "skip_special_tokens": [0],
    "include_stop_str_in_output": ["no"],
    "logprobs": ["true", 1],
    "top_logprobs": ["5", 1.5],
    "max_completion_tokens": ["5"],
}


def wrong_types(b: _Builder) -> None:
    for name, values in _WRONG_TYPES.items():
        for value in values:
            b.add(f"{name}={json.dumps(value)}", b.chat(**{name: value}), param=name)
    for value in [[1, 2], [["x"]], [None]]:
        b.add(f"stop={json.dumps(value)}", b.chat(stop=value), param=ANY)
    b.add("stop_token_ids=['1']", b.chat(stop_token_ids=["1"]), param="stop_token_ids.0")
    b.add(
        "stream_options.include_usage='true'",
        b.chat(stream_options={"include_usage": "true"}),
        param="stream_options.include_usage",
    )
    for value in ["hi", {}, 5, ["hi"], [None], [[]]]:
        b.add(f"messages={json.dumps(value)}", b.chat(messages=value), param=ANY)
    for value in [5, None, {}, [1.5], [True], [[1, "a"]], [["a"]], [None], [1, [2]], ["a", 1]]:
        b.add(
            f"prompt={json.dumps(value)}", b.completion(prompt=value), param=ANY, path=COMPLETIONS
        )
    for name, value in [("logprobs", "5"), ("logprobs", True), ("logprobs", 1.5), ("echo", "yes")]:
        b.add(
            f"completion-{name}={json.dumps(value)}",
            b.completion(**{name: value}),
            param=name,
            path=COMPLETIONS,
        )


def token_limits(b: _Builder) -> None:
    ctx = b.t.max_seq_len
    for value in [0, -1, -(2**63), 2**63, 10**30]:
        b.add(f"max_tokens={value}", b.chat(max_tokens=value), param="max_tokens")
    b.add("max_tokens=context", b.chat(max_tokens=ctx), param="max_tokens")
    b.add("max_tokens=10^6", b.chat(max_tokens=10**6), param="max_tokens")
    for value in [0, -5, 10**9]:
        b.add(
            f"max_completion_tokens={value}",
            b.chat(max_tokens=None, max_completion_tokens=value),
            param="max_completion_tokens" if value < 1 else "max_tokens",
        )
    for value in [0, -1, 10**9, 10**30]:
        b.add(
            f"completion-max_tokens={value}",
            b.completion(max_tokens=value),
            param="max_tokens",
            path=COMPLETIONS,
        )
    b.add("min_tokens=-1", b.chat(min_tokens=-1), param="min_tokens")
    b.add("min_tokens>max_tokens", b.chat(min_tokens=10, max_tokens=2), param="min_tokens")
    b.add("min_tokens=2^31", b.chat(min_tokens=2**31), param="min_tokens")
    b.add("top_k=2^31", b.chat(top_k=2**31), param="top_k")
    b.add("top_k=-2", b.chat(top_k=-2), param="top_k")
    b.add("seed=2^63", b.chat(seed=2**63), param="seed")
    b.add("seed=-2^63-1", b.chat(seed=-(2**63) - 1), param="seed")


def n_range(b: _Builder) -> None:
    for value in [0, -1, b.t.max_n + 1, 1000, 10**20]:
        b.add(f"n={value}", b.chat(n=value), param="n")
    for value in [0, b.t.max_n + 1, 2**63]:
        b.add(f"completion-n={value}", b.completion(n=value), param="n", path=COMPLETIONS)


_FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]
_NON_FINITE = {
    "NaN": b"NaN",
    "-NaN": b"-NaN",
    "Infinity": b"Infinity",
    "-Infinity": b"-Infinity",
    "1e999": b"1e999",
    "-1e999": b"-1e999",
}


def non_finite(b: _Builder) -> None:
    """Raw JSON tokens that are no JSON numbers (NaN, Infinity) or overflow a double."""
    for name in _FLOAT_FIELDS:
        for label, token in _NON_FINITE.items():
            raw = dumps(b.chat(**{name: 0.5})).replace(b"0.5", token, 1)
            b.add(f"{name}={label}", raw, param=ANY if label == "-NaN" else name)
    for name in ["max_tokens", "n", "seed"]:
        raw = dumps(b.chat(**{name: 3})).replace(f'"{name}": 3'.encode(), f'"{name}": NaN'.encode())
        b.add(f"{name}=NaN", raw, param=name)
    b.add(
        "completion-temperature=Infinity",
        dumps(b.completion(temperature=0.5)).replace(b"0.5", b"Infinity"),
        param="temperature",
        path=COMPLETIONS,
    )


_OUT_OF_RANGE: list[tuple[str, float]] = [
    ("temperature", 2.01),
    ("temperature", -0.1),
    ("temperature", 1e308),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("min_p", 1.5),
    ("min_p", -0.01),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 11.0),
]


def out_of_range(b: _Builder) -> None:
    for name, value in _OUT_OF_RANGE:
        b.add(f"{name}={value}", b.chat(**{name: value}), param=name)


def stops(b: _Builder) -> None:
    t = b.t
    for count in [t.max_stop + 1, 100, 10_000]:
        b.add(f"{count}-stop-strings", b.chat(stop=[f"s{i}" for i in range(count)]), param="stop")
    b.add("stop-string-over-limit", b.chat(stop="x" * (t.max_stop_chars + 1)), param="stop")
    b.add("stop-list-one-huge", b.chat(stop=["ok", "y" * MIB]), param="stop")
    b.add("stop-empty-string", b.chat(stop=""), param="stop")
    b.add("stop-list-empty-string", b.chat(stop=["a", ""]), param="stop")
    for value in [-1, 2**31, 2**64, 10**30]:
        b.add(f"stop_token_ids=[{value}]", b.chat(stop_token_ids=[value]), param="stop_token_ids.0")
    for count in [t.max_stop_token_ids + 1, 10_000]:
        b.add(
            f"{count}-stop-token-ids",
            b.chat(stop_token_ids=list(range(count))),
            param="stop_token_ids",
        )
    b.add(
        "completion-17-stops",
        b.completion(stop=[str(i) for i in range(t.max_stop + 1)]),
        param="stop",
        path=COMPLETIONS,
    )


_BAD_UTF8 = {
    "ff": b"\xff",
    "fe": b"\xfe",
    "lone-continuation": b"\x80",
    "bad-2byte": b"\xc3\x28",
    "bad-3byte-2nd": b"\xe2\x28\xa1",
    "bad-3byte-3rd": b"\xe2\x82\x28",
    "bad-4byte": b"\xf0\x28\x8c\xbc",
    "5byte-form": b"\xf8\xa1\xa1\xa1\xa1",
    "overlong-slash": b"\xc0\xaf",
    "overlong-3byte": b"\xe0\x80\xaf",
    "utf8-surrogate": b"\xed\xa0\x80",
    "above-u10ffff": b"\xf4\x90\x80\x80",
    "truncated-3byte": b"\xe2\x82",
}


def invalid_utf8(b: _Builder) -> None:
    ok = dumps(b.chat())
    for name, raw in _BAD_UTF8.items():
        b.add(f"content-{name}", ok.replace(b'"Hi"', b'"H' + raw + b'i"'))
    b.add("in-key", ok.replace(b'"max_tokens"', b'"max_\xfftokens"'))
    b.add("in-model", ok.replace(b'"demo"', b'"de\xffmo"'))
    b.add("in-role", ok.replace(b'"user"', b'"us\xc3er"'))
    b.add("latin1-body", ok.replace(b'"Hi"', '"café"'.encode("latin-1")))
    b.add("utf16-body", json.dumps(b.chat()).encode("utf-16"))
    b.add("utf32-body", json.dumps(b.chat()).encode("utf-32"))
    b.add(
        "completion-prompt-ff", dumps(b.completion()).replace(b'"Hi"', b'"\xff"'), path=COMPLETIONS
    )


def context(b: _Builder) -> None:
    ctx, vocab = b.t.max_seq_len, b.t.vocab_size
    long_text = "word " * (ctx + 10)
    b.add(
        "chat-long-content",
        b.chat(messages=[{"role": "user", "content": long_text}]),
        param="messages",
    )
    many = [{"role": "user", "content": "hello there"}] * (ctx // 2)
    b.add("chat-many-messages", b.chat(messages=many), param="messages")
    b.add(
        "chat-many-empty-messages",
        b.chat(messages=[{"role": "user", "content": ""}] * 5000),
        param="messages",
    )
    b.add(
        "chat-1MB-content",
        b.chat(messages=[{"role": "user", "content": "a b " * (MIB // 4)}]),
        param="messages",
    )
    b.add(
        "chat-prompt-plus-max_tokens",
        b.chat(messages=[{"role": "user", "content": "word " * (ctx - 40)}], max_tokens=100),
        param="max_tokens",
    )
    for name, prompt, param in _completion_context_cases(ctx, vocab):
        b.add(name, b.completion(prompt=prompt), param=param, path=COMPLETIONS)
    b.add(
        "completion-ids-plus-max_tokens",
        b.completion(prompt=[1] * (ctx - 4), max_tokens=16),
        param="max_tokens",
        path=COMPLETIONS,
    )
    for count in [b.t.max_prompts + 1, 1000]:
        b.add(
            f"{count}-prompts",
            b.completion(prompt=["Hi"] * count),
            param="prompt",
            path=COMPLETIONS,
        )
    b.add(
        f"{b.t.max_prompts + 1}-id-prompts",
        b.completion(prompt=[[1, 2]] * (b.t.max_prompts + 1)),
        param="prompt",
        path=COMPLETIONS,
    )


def fan_out(b: _Builder) -> None:
    """More sequences (prompts x n) than a worker ever queues: 400, not a 429 forever."""
    t, w = b.t, b.t.max_waiting
    if w < t.max_n:
        b.add(f"chat-n={w + 1}", b.chat(n=w + 1), param="n")
        b.add(f"completion-n={w + 1}", b.completion(n=w + 1), param="n", path=COMPLETIONS)
    if w < t.max_prompts:
        b.add(
            f"{w + 1}-prompts",
            b.completion(prompt=["Hi"] * (w + 1)),
            param="prompt",
            path=COMPLETIONS,
        )
    n = w // 2 + 1
    if 2 <= n <= t.max_n and t.max_prompts >= 2:
        b.add(
            f"2-prompts-n={n}",
            b.completion(prompt=["Hi", "Yo"], n=n),
            param="prompt",
            path=COMPLETIONS,
        )


def _completion_context_cases(ctx: int, vocab: int) -> Iterator[tuple[str, Any, str | None]]:
    yield "string-over-context", "word " * (ctx + 10), "prompt"
    yield "ids-at-context", [1] * ctx, "prompt"
    yield "ids-over-context", [1] * (ctx + 88), "prompt"
    yield "ids-far-over-context", [1] * 50_000, "prompt"
    yield "second-prompt-too-long", ["Hi", "word " * (ctx + 10)], "prompt"
    yield "second-id-prompt-too-long", [[1, 2], [1] * (ctx + 1)], "prompt"
    for value in [vocab, vocab + 1, 10**7, 2**31, 2**63, 10**30, -1, -(2**63)]:
        yield f"token-id={value}", [1, 2, value], "prompt"
    yield "negative-id-in-second-prompt", [[1, 2], [3, -5]], "prompt"
    yield "empty-string", "", "prompt"
    yield "empty-list", [], "prompt"
    yield "empty-inner-list", [[]], "prompt"
    yield "empty-string-in-list", ["Hi", ""], "prompt"


def big_bodies(b: _Builder) -> None:
    limit = b.t.max_request_bytes
    junk = b"a" * (10 * MIB)
    b.add("10MB-junk-content-length", junk, 413)
    big_json = dumps(b.chat(messages=[{"role": "user", "content": "x" * (10 * MIB)}]))
    b.add("10MB-json-content-length", big_json, 413)
    b.add("10MB-json-chunked", big_json, 413, chunked=True)
    b.add("10MB-junk-chunked", junk, 413, chunked=True)
    b.add("limit-plus-one-content-length", b"{" + b" " * limit, 413)
    b.add("limit-plus-one-chunked", b"{" + b" " * limit, 413, chunked=True)
    b.add(
        "10MB-completion-chunked",
        dumps(b.completion(prompt="y" * (10 * MIB))),
        413,
        path=COMPLETIONS,
        chunked=True,
    )
    b.add("10MB-without-key", big_json, 401, headers={"Authorization": NO_HEADER})
    under = b.t.max_request_bytes - 1024  # inside the body limit, far past the context
    b.add(
        "body-limit-prompt",
        b.completion(prompt="word " * (under // 5)),
        param="prompt",
        path=COMPLETIONS,
    )
    b.add(
        "body-limit-chat-content",
        b.chat(messages=[{"role": "user", "content": "z" * under}]),
        param="messages",
    )


def streaming(b: _Builder) -> None:
    """A streaming request refused before it starts is a plain JSON error, not an SSE body."""
    over = "word " * (b.t.max_seq_len + 10)
    for name, body, status, param in [
        ("unknown-model", b.chat(model="nope"), 404, "model"),
        ("n-too-big", b.chat(n=b.t.max_n + 1), 400, "n"),
        ("context", b.chat(messages=[{"role": "user", "content": over}]), 400, "messages"),
        ("max_tokens-over-context", b.chat(max_tokens=b.t.max_seq_len), 400, "max_tokens"),
        ("guided-bad-regex", b.chat(guided_regex="(("), 400, "guided_regex"),
        ("stream-options-bad", b.chat(stream_options={"include_usage": 1}), 400, ANY),
    ]:
        b.add(name, {**body, "stream": True}, status, param)
    b.add(
        "completion-token-id",
        b.completion(prompt=[1, b.t.vocab_size], stream=True),
        param="prompt",
        path=COMPLETIONS,
    )


_BAD_ROLES: list[Any] = [
    "wizard",
    "",
    "USER",
    "User",
    None,
    5,
    "function",
    "system ",
    "assistant\u0000",
    "\uff55\uff53\uff45\uff52",
    "us\u0435r",
    ["user"],
]


def roles(b: _Builder) -> None:
    for role in _BAD_ROLES:
        b.add(
            f"role={json.dumps(role)}",
            b.chat(messages=[{"role": role, "content": "Hi"}]),
            param="messages.0.role",
        )
    b.add(
        "second-message-bad-role",
        b.chat(messages=[{"role": "user", "content": "Hi"}, {"role": "bot", "content": "x"}]),
        param="messages.1.role",
    )
    for role in ("system", "developer", "user", "tool"):  # each role's own required fields
        b.add(
            f"{role}-without-content", b.chat(messages=[{"role": role}]), param="messages.0.content"
        )
        b.add(
            f"{role}-null-content",
            b.chat(messages=[{"role": role, "content": None, "tool_call_id": "c"}]),
            param="messages.0.content",
        )
    b.add(
        "tool-without-tool_call_id",
        b.chat(messages=[{"role": "tool", "content": "42"}]),
        param="messages.0.tool_call_id",
    )


def unsupported(b: _Builder) -> None:
    function = {"name": "f", "parameters": {"type": "object"}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for name, value in {"functions": [function], "function_call": "auto"}.items():
        b.add(name, b.chat(**{name: value}), param=name)
    legacy = [{"role": "assistant", "content": None, "function_call": call["function"]}]
    b.add("history-function_call", b.chat(messages=legacy), param="messages.0.function_call")
    for name, value in {"suffix": "x", "best_of": 3}.items():
        b.add(f"completion-{name}", b.completion(**{name: value}), param=name, path=COMPLETIONS)
    vllm = {"use_beam_search": True, "allowed_token_ids": [1], "bad_words": ["x"],
            "truncate_prompt_tokens": 8}  # fmt: skip
    for name, value in vllm.items():
        b.add(f"vllm-{name}", b.chat(**{name: value}), param=name)
        b.add(
            f"completion-vllm-{name}", b.completion(**{name: value}), param=name, path=COMPLETIONS
        )


def logit_biases(b: _Builder) -> None:
    vocab = b.t.vocab_size
    for name, bias, param in [
        ("key-word", {"hello": 1}, "logit_bias"),
        ("key-negative", {"-1": 1}, "logit_bias"),
        ("key-float", {"1.5": 1}, "logit_bias"),
        ("key-huge", {str(10**30): 1}, "logit_bias"),
        ("key-vocab", {str(vocab): 1}, "logit_bias"),
        ("value-high", {"1": 100.5}, "logit_bias.1"),
        ("value-low", {"1": -101}, "logit_bias.1"),
        ("value-text", {"1": "5"}, "logit_bias.1"),
        ("value-bool", {"1": True}, "logit_bias.1"),
        ("not-a-map", [[1, 5]], "logit_bias"),
        ("too-many", {str(i): 1 for i in range(1025)}, "logit_bias"),
    ]:
        b.add(f"logit_bias-{name}", b.chat(logit_bias=bias), param=param)
        b.add(
            f"completion-logit_bias-{name}",
            b.completion(logit_bias=bias),
            param=param,
            path=COMPLETIONS,
        )


def structured_output(b: _Builder) -> None:
    """Schemas, regexes, grammars and tool choices that no engine could follow."""

    def schema_format(schema: Any, name: str = "x") -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}

    fmt = "response_format"
    schema = "response_format.json_schema.schema"
    for name, value, param in [
        ("format-type-bogus", {"type": "xml"}, "response_format.type"),
        ("format-no-type", {}, "response_format.type"),
        ("format-no-json_schema", {"type": "json_schema"}, "response_format.json_schema"),
        ("format-no-schema", {"type": "json_schema", "json_schema": {"name": "x"}}, schema),
        ("format-schema-number", schema_format(5), schema),
        ("format-bad-type", schema_format({"type": "strin"}), schema),
        ("format-unsupported-keyword", schema_format({"uniqueItems": True}), schema),
        (
            "format-unsatisfiable",
            schema_format({"type": "integer", "minimum": 2, "maximum": 1}),
            schema,
        ),
        ("format-bad-pattern", schema_format({"type": "string", "pattern": "(("}), schema),
        ("format-dangling-ref", schema_format({"$ref": "#/$defs/nope"}), schema),
        (
            "format-bad-name",
            schema_format({}, name="has space"),
            "response_format.json_schema.name",
        ),
    ]:
        b.add(name, b.chat(**{fmt: value}), param=param)
    b.add(
        "completion-format-bad-type",
        b.completion(**{fmt: schema_format({"type": 1})}),
        param=schema,
        path=COMPLETIONS,
    )
    b.add("guided_regex-unclosed", b.chat(guided_regex="(("), param="guided_regex")
    b.add("guided_grammar-unclosed", b.chat(guided_grammar="root ::= ("), param="guided_grammar")
    b.add("guided_json-not-json", b.chat(guided_json="{nope"), param="guided_json")
    b.add("guided_regex-number", b.chat(guided_regex=5), param="guided_regex")
    b.add("guided_choice-none", b.chat(guided_choice=[]), param="guided_choice")
    b.add("guided_choice-empty", b.chat(guided_choice=["yes", ""]), param="guided_choice.1")
    b.add("guided_choice-string", b.chat(guided_choice="yes"), param="guided_choice")
    so = "structured_outputs"
    b.add("so-two-kinds", b.chat(**{so: {"regex": "a+", "choice": ["a"]}}), param=so)
    b.add("so-structural_tag", b.chat(**{so: {"structural_tag": "{}"}}), param=so)
    b.add("so-no-choices", b.chat(**{so: {"choice": []}}), param=f"{so}.choice")
    b.add("so-regex-unclosed", b.chat(**{so: {"regex": "(("}}), param=f"{so}.regex")
    b.add("so-json-not-json", b.chat(**{so: {"json": "{nope"}}), param=f"{so}.json")
    b.add("so-and-guided", b.chat(guided_regex="a+", **{so: {"regex": "b+"}}), param=so)
    b.add(
        "two-guided-fields",
        b.chat(response_format={"type": "json_object"}, guided_regex="a+"),
        param="guided_regex",
    )
    b.add(
        "guided-with-min_tokens",
        b.chat(guided_regex="a+", min_tokens=1),
        param="min_tokens",
    )
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    b.add("tool_choice-without-tools", b.chat(tool_choice="required"), param="tool_choice")
    b.add("tool_choice-bogus", b.chat(tools=[tool], tool_choice="always"), param="tool_choice")
    b.add(
        "tool_choice-unknown-function",
        b.chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "g"}}),
        param="tool_choice.function.name",
    )
    b.add(
        "tool_choice-no-name",
        b.chat(tools=[tool], tool_choice={"type": "function", "function": {}}),
        param="tool_choice.function.name",
    )
    bad_params = {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
    b.add("tool-bad-parameters", b.chat(tools=[bad_params]), param="tools.0.function.parameters")
    b.add(
        "tool-bad-name",
        b.chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
        param="tools.0.function.name",
    )
    b.add("tool-no-function", b.chat(tools=[{"type": "function"}]), param="tools.0.function")
    b.add(
        "tool-and-format-required",
        b.chat(tools=[tool], tool_choice="required", response_format={"type": "json_object"}),
        param="response_format",
    )
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]},
    ]
    b.add(
        "history-call-no-function",
        b.chat(messages=history),
        param="messages.1.tool_calls.0.function",
    )
    history[1] = {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]}
    b.add(
        "history-call-no-arguments",
        b.chat(messages=history),
        param="messages.1.tool_calls.0.function.arguments",
    )


def content_types(b: _Builder) -> None:
    ok = dumps(b.chat())
    form = b"model=demo&messages=hi"
    for name, ctype, raw, status in [
        ("form-with-form-body", "application/x-www-form-urlencoded", form, 415),
        ("form-with-json-body", "application/x-www-form-urlencoded", ok, 415),
        ("text-plain-json-body", "text/plain", ok, 415),
        ("text-plain-text-body", "text/plain; charset=utf-8", b"Hello there", 415),
        ("multipart", "multipart/form-data; boundary=xyz", b"--xyz\r\n\r\nhi\r\n--xyz--", 415),
        ("xml", "application/xml", b"<request><model>demo</model></request>", 415),
        ("octet-stream", "application/octet-stream", ok, 415),
        ("jsonx", "application/jsonx", ok, 415),
        ("text-json", "text/json", ok, 415),
        ("bare-json", "json", ok, 415),
        ("no-media-type", "; charset=utf-8", ok, 415),
        ("missing-with-form-body", NO_HEADER, form, 400),
        ("missing-with-text-body", NO_HEADER, b"Hello there", 400),
        ("completion-form", "application/x-www-form-urlencoded", dumps(b.completion()), 415),
    ]:
        b.add(
            name,
            raw,
            status,
            param=None,
            headers={"Content-Type": ctype},
            path=COMPLETIONS if name.startswith("completion") else CHAT,
        )


def methods(b: _Builder) -> None:
    for path in [CHAT, COMPLETIONS]:
        for method in ["GET", "PUT", "DELETE", "PATCH", "OPTIONS"]:
            b.add(f"{method}-{path}", None, 405, path=path, method=method)
    for method in ["POST", "PUT", "DELETE"]:
        b.add(f"{method}-{MODELS}", dumps(b.chat()), 405, path=MODELS, method=method)
    for path, method in [("/health", "POST"), ("/health", "DELETE"), ("/metrics", "POST")]:
        b.add(f"{method}-{path}", b"{}", 405, path=path, method=method)


_UNKNOWN_PATHS = [
    "/",
    "/v1",
    "/v1/chat",
    "/v1/completion",
    "/v1/chat/completions/",
    "/v1/completions/",
    "/v2/chat/completions",
    "/v1/embeddings",
    "/v1/images/generations",
    "/v1/model/demo",
    "/v1/engines/demo/completions",
    "/admin",
    "/docs",
    "/redoc",
    "/v1/chat/completions%00",
    "/%2e%2e/%2e%2e/etc/passwd",
    "/v1/%C3%BCnicode",
    "/v1/chat/completions;jsessionid=1",
    "//v1//chat//completions",
    "/v1/" + "a" * 4000,
]


def unknown_paths(b: _Builder) -> None:
    for path in _UNKNOWN_PATHS:
        b.add(f"POST {path[:40]}", dumps(b.chat()), 404, path=path)
    b.add("GET /v1/nothing", None, 404, path="/v1/nothing", method="GET")


def auth(b: _Builder) -> None:
    key = b.t.api_key
    for name, value in {
        "missing": NO_HEADER,
        "wrong-key": "Bearer wrong",
        "quoted-empty-bearer": 'Bearer ""',
        "bearer-alone": "Bearer",
        "basic-scheme": "Basic dGVzdC1rZXk=",
        "no-scheme": key,
        "token-scheme": f"Token {key}",
        "key-with-suffix": f"Bearer {key}x",
        "key-prefix": f"Bearer {key[:-1]}",
        "key-uppercase": f"Bearer {key.upper()}",
        "latin1-key": f"Bearer {key}\u00e9",
        "long-key": "Bearer " + "k" * 8000,
    }.items():
        b.add(f"chat-{name}", dumps(b.chat()), 401, headers={"Authorization": value})
    b.add(
        "models-missing", None, 401, path=MODELS, method="GET", headers={"Authorization": NO_HEADER}
    )
    b.add(
        "models-wrong",
        None,
        401,
        path=MODELS,
        method="GET",
        headers={"Authorization": "Bearer nope"},
    )
    b.add(
        "completions-missing",
        dumps(b.completion()),
        401,
        path=COMPLETIONS,
        headers={"Authorization": NO_HEADER},
    )
    b.add("bad-key-and-bad-json", b"{nope", 401, headers={"Authorization": "Bearer nope"})


def messages_and_parts(b: _Builder) -> None:
    b.add("messages-empty", b.chat(messages=[]), param="messages")
    for name, content in {
        "text-is-number": [{"type": "text", "text": 5}],
        "text-is-null": [{"type": "text", "text": None}],
        "image-part": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
        "audio-part": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
        "uppercase-type": [{"type": "TEXT", "text": "x"}],
        "string-parts": ["Hi"],
        "number-parts": [5],
        "nested-part-list": [[{"type": "text", "text": "x"}]],
        "part-not-in-list": {"type": "text", "text": "x"},
        "content-number": 5,
        "content-bool": True,
        "content-object": {},
        "null-part": [None],
        "second-part-bad": [{"type": "text", "text": "ok"}, {"type": "text", "text": []}],
    }.items():
        b.add(name, b.chat(messages=[{"role": "user", "content": content}]), param=ANY)
    b.add(
        "name-is-number",
        b.chat(messages=[{"role": "user", "content": "Hi", "name": 5}]),
        param="messages.0.name",
    )


def logprobs(b: _Builder) -> None:
    for value in [21, -1, 1000, 2**63]:
        b.add(
            f"top_logprobs={value}", b.chat(logprobs=True, top_logprobs=value), param="top_logprobs"
        )
    for value in [21, -1, 10**6]:
        b.add(
            f"completion-logprobs={value}",
            b.completion(logprobs=value),
            param="logprobs",
            path=COMPLETIONS,
        )
    b.add("logprobs=5", b.chat(logprobs=5), param="logprobs")
    for value in [21, -1, "2", True]:
        b.add(f"prompt_logprobs={json.dumps(value)}", b.chat(prompt_logprobs=value),
              param="prompt_logprobs")  # fmt: skip
    b.add("prompt_logprobs-streamed", b.chat(prompt_logprobs=1, stream=True),
          param="prompt_logprobs")  # fmt: skip
    b.add("completion-prompt_logprobs-streamed", b.completion(prompt_logprobs=0, stream=True),
          param="prompt_logprobs", path=COMPLETIONS)  # fmt: skip


def deep_nesting(b: _Builder) -> None:
    ok = dumps(b.chat())[:-1]
    b.add("arrays-300-in-extra", ok + b', "x": ' + b"[" * 300 + b"]" * 300 + b"}")
    b.add("arrays-10000-in-user", ok + b', "user": ' + b"[" * 10_000 + b"]" * 10_000 + b"}")
    b.add("objects-300-in-extra", ok + b', "x": ' + b'{"a":' * 300 + b"1" + b"}" * 300 + b"}")
    b.add("unclosed-100000", ok + b', "x": ' + b"[" * 100_000)
    b.add(
        "nested-content",
        ok + b', "messages": [{"role": "user", "content": ' + b"[" * 500 + b"]" * 500 + b"}]}",
    )
    b.add("prompt-depth-4", b.completion(prompt=[[[[1]]]]), param="prompt.0.0", path=COMPLETIONS)
    b.add("stop-nested", b.chat(stop=[[["x"]]]), param="stop.0")


def unicode_edges(b: _Builder) -> None:
    for name, model in {
        "accented": "d\u00e9mo",
        "zero-width-space": "demo\u200b",
        "fullwidth": "\uff44\uff45\uff4d\uff4f",
        "empty": "",
        "leading-nul": "\u0000demo",
        "rtl-override": "\u202edemo",
        "emoji": "\U0001f916",
        "nfd-combining": "de\u0301mo",
    }.items():
        b.add(f"model-{name}", b.chat(model=model), 404, param="model")
    b.add(
        "cyrillic-model-key",
        {"m\u043edel": b.t.model, "messages": [{"role": "user", "content": "Hi"}]},
        param="model",
    )
    b.add("fullwidth-digits", b.chat(max_tokens="\uff11\uff16"), param="max_tokens")
    b.add(
        "emoji-prompt-over-context",
        b.chat(messages=[{"role": "user", "content": "\U0001f600" * b.t.max_seq_len}]),
        param="messages",
    )
    b.add(
        "combining-marks-over-context",
        b.completion(prompt="a" + "\u0301" * (b.t.max_seq_len * 2)),
        param="prompt",
        path=COMPLETIONS,
    )
    b.add("surrogate-pair-split-stop", dumps(b.chat()).replace(b'"Hi"', b'"Hi", "stop": "\\ud83d"'))


def tokenization(b: _Builder) -> None:
    """vLLM's /tokenize and /detokenize: one input of the right kind, ids in the vocabulary."""
    model, vocab = b.t.model, b.t.vocab_size
    hi = [{"role": "user", "content": "Hi"}]
    for name, body, param in [
        ("neither-prompt-nor-messages", {"model": model}, ANY),
        ("prompt-and-messages", {"model": model, "prompt": "Hi", "messages": hi}, ANY),
        ("no-model", {"prompt": "Hi"}, "model"),
        ("prompt=5", {"model": model, "prompt": 5}, "prompt"),
        ("prompt=[1, 2]", {"model": model, "prompt": [1, 2]}, "prompt"),
        ("messages=[]", {"model": model, "messages": []}, "messages"),
        ("messages='Hi'", {"model": model, "messages": "Hi"}, "messages"),
        ("message-without-role", {"model": model, "messages": [{"content": "Hi"}]}, ANY),
        ("add_generation_prompt='yes'", {"model": model, "messages": hi, "add_generation_prompt": "yes"},
         "add_generation_prompt"),
        ("return_token_strs=1", {"model": model, "prompt": "Hi", "return_token_strs": 1},
         "return_token_strs"),
    ]:  # fmt: skip
        b.add(f"tokenize-{name}", body, param=param, path=TOKENIZE)
    b.add("tokenize-unknown-model", {"model": "nope", "prompt": "Hi"}, 404, "model", path=TOKENIZE)
    b.add("tokenize-invalid-utf8", b'{"model": "' + model.encode() + b'", "prompt": "\xff"}',
          param=None, path=TOKENIZE)  # fmt: skip
    for name, tokens, param in [
        ("past-the-vocabulary", [1, vocab], "tokens.1"),
        ("negative", [-1], "tokens.0"),
        ("2**63", [2**63], "tokens.0"),
        ("fraction", [1.5], "tokens.0"),
        ("bool", [True], "tokens.0"),
        ("string", ["1"], "tokens.0"),
        ("not-a-list", "1 2", "tokens"),
        ("nested", [[1]], "tokens.0"),
    ]:
        b.add(
            f"detokenize-{name}", {"model": model, "tokens": tokens}, param=param, path=DETOKENIZE
        )
    b.add("detokenize-no-tokens", {"model": model}, param="tokens", path=DETOKENIZE)
    for path in (TOKENIZE, DETOKENIZE):
        b.add(f"{path[1:]}-no-key", {"model": model, "prompt": "Hi", "tokens": [1]}, 401,
              path=path, headers={"Authorization": NO_HEADER})  # fmt: skip
        b.add(f"{path[1:]}-get", None, 405, path=path, method="GET")
        b.add(f"{path[1:]}-array", b"[]", param=None, path=path)


def responses_api(b: _Builder) -> None:
    """OpenAI's Responses API: its own fields named in the error (not the chat request's it
    becomes), items of the right kinds, and nothing that needs a stored response."""
    model, ctx = b.t.model, b.t.max_seq_len
    weather = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}

    def body(**fields: Any) -> dict[str, Any]:
        return {"model": model, "input": "Hi", "max_output_tokens": 2, **fields}

    for name, sent, param in [
        ("no-input", {"model": model}, "input"),
        ("no-model", {"input": "Hi"}, "model"),
        ("input=5", body(input=5), "input"),
        ("input=[]", body(input=[]), "input"),
        ("input-item-unknown-type", body(input=[{"type": "web_search_call"}]), "input.0.type"),
        ("input-message-without-role", body(input=[{"type": "message", "content": "Hi"}]),
         "input.0.role"),
        ("input-message-role=tool", body(input=[{"role": "tool", "content": "Hi"}]),
         "input.0.role"),
        ("input-image-part", body(input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}]), "input.0.content.0.type"),
        ("function_call-without-call_id", body(input=[{"type": "function_call", "name": "f",
                                                       "arguments": "{}"}]), "input.0.call_id"),
        ("function_call_output-output=1", body(input=[{"type": "function_call_output",
                                                       "call_id": "c", "output": 1}]), "input.0.output"),
        ("max_output_tokens=0", body(max_output_tokens=0), "max_output_tokens"),
        ("max_output_tokens='2'", body(max_output_tokens="2"), "max_output_tokens"),
        ("max_output_tokens=context", body(max_output_tokens=ctx), "max_output_tokens"),
        ("temperature=3", body(temperature=3), "temperature"),
        ("top_p=0", body(top_p=0), "top_p"),
        ("instructions=1", body(instructions=1), "instructions"),
        ("tools-web_search", body(tools=[{"type": "web_search"}]), "tools.0.type"),
        ("tools-bad-name", body(tools=[{**weather, "name": "a b"}]), "tools.0.name"),
        ("tools-bad-parameters", body(tools=[{**weather, "parameters": {"type": "nope"}}]),
         "tools.0.parameters"),
        ("tool_choice-unknown", body(tools=[weather], tool_choice={"type": "function",
                                                                   "name": "nope"}),
         "tool_choice.name"),
        ("tool_choice=required-without-tools", body(tool_choice="required"), "tool_choice"),
        ("tool_choice='sometimes'", body(tool_choice="sometimes"), "tool_choice"),
        ("text.format-unknown", body(text={"format": {"type": "yaml"}}), "text.format.type"),
        ("text.format-schema-not-a-schema", body(text={"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "nope"}}}), "text.format.schema"),
        ("previous_response_id", body(previous_response_id="resp_1"), "previous_response_id"),
        ("conversation", body(conversation="conv_1"), "conversation"),
        ("background", body(background=True), "background"),
        ("include", body(include=["message.output_text.logprobs"]), "include"),
        ("stream='yes'", body(stream="yes"), "stream"),
    ]:  # fmt: skip
        b.add(f"responses-{name}", sent, param=param, path=RESPONSES)
    b.add("responses-unknown-model", body(model="nope"), 404, "model", path=RESPONSES)
    b.add("responses-no-key", body(), 401, path=RESPONSES, headers={"Authorization": NO_HEADER})
    b.add("responses-get", None, 405, path=RESPONSES, method="GET")
    b.add("responses-array", b"[]", param=None, path=RESPONSES)


FAMILIES: list[Callable[[_Builder], None]] = [
    bad_json,
    not_an_object,
    missing_fields,
    wrong_types,
    token_limits,
    n_range,
    non_finite,
    out_of_range,
    stops,
    invalid_utf8,
    context,
    fan_out,
    big_bodies,
    streaming,
    roles,
    unsupported,
    logit_biases,
    structured_output,
    content_types,
    methods,
    unknown_paths,
    auth,
    messages_and_parts,
    logprobs,
    deep_nesting,
    tokenization,
    responses_api,
    unicode_edges,
]


def build_corpus(target: Target) -> list[Case]:
    """Every case of every family; ids are unique."""
    builder = _Builder(target)
    for family in FAMILIES:
        builder.family = family.__name__
        family(builder)
    ids = [c.id for c in builder.cases]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    return builder.cases
