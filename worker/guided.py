"""What a constrained request's output must match: a JSON schema, any JSON object, a regular
expression or a grammar (`GuidedDecoding`), and the check both the ingress and the worker
run on it before anything is queued.

The spec is plain text (a schema travels as its JSON), so it crosses the wire in a request's
msgpack row as it is and is the key of the worker's cache of compiled grammars
(worker/grammar.py). llguidance turns it into a grammar; the check compiles that grammar
without a tokenizer, which catches what the engine would refuse (bad JSON, an unsupported
keyword, an unsatisfiable schema, a regex or grammar that does not parse) in well under a
millisecond for the usual schema, and remembers its answer per spec.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GuidedKind = Literal["json_object", "json_schema", "regex", "grammar"]
Thinking = Literal["none", "optional", "open"]
MAX_SPEC_CHARS = 262_144
# Compact separators as json.dumps writes them, and no free whitespace: a small model that
# may emit spaces or newlines at will can spend its whole budget on them.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuidedDecoding(BaseModel):
    """The output of a request must match this: `json_schema` (spec: the schema's JSON),
    `json_object` (any JSON object; no spec), `regex` (the whole output matches it) or
    `grammar` (Lark, or GBNF / EBNF as llama.cpp writes it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: GuidedKind
    spec: str = Field("", max_length=MAX_SPEC_CHARS, description="schema JSON, regex or grammar")
    thinking: Thinking = Field(
        "none",
        description="a reasoning model's <think> ... </think> block before the output: "
        "'optional' (the model may open one first), 'open' (the prompt opened it)",
    )

    @model_validator(mode="after")
    def _spec_matches_kind(self) -> GuidedDecoding:
        if self.kind == "json_object" and self.spec:
            raise ValueError("json_object takes no spec")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"a {self.kind} needs a spec")
        return self

    @classmethod
    def from_schema(cls, schema: dict[str, Any] | str) -> GuidedDecoding:
        """Output valid under this JSON schema (a dict, or its JSON text)."""
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        return cls(kind="json_schema", spec=text)

    @classmethod
    def any_object(cls) -> GuidedDecoding:
        return cls(kind="json_object")

    @classmethod
    def from_regex(cls, pattern: str) -> GuidedDecoding:
        return cls(kind="regex", spec=pattern)

    @classmethod
    def from_grammar(cls, text: str) -> GuidedDecoding:
        return cls(kind="grammar", spec=text)

    @classmethod
    def from_choices(cls, choices: list[str]) -> GuidedDecoding:
        """Output that is exactly one of these strings: a Lark grammar of their literals
        (JSON's string escapes are Lark's)."""
        if not choices or "" in choices:
            raise ValueError("choices are one or more non-empty strings")
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return cls.from_grammar(f"start: {literals}\n")

    def grammar_text(self) -> str:
        """llguidance's grammar for this spec; ValueError when the spec cannot be read."""
        body = self._body_text()
        if self.thinking == "none":
            return body
        lark = self.kind == "grammar"  # Lark text; the others are llguidance's JSON
        grammars = [{"lark_grammar": body}] if lark else json.loads(body)["grammars"]
        think = _THINK_OPTIONAL if self.thinking == "optional" else _THINK_OPEN
        body_grammar = {**grammars[0], "name": "body"}
        return json.dumps({"grammars": [{"lark_grammar": think}, body_grammar, *grammars[1:]]})

    def _body_text(self) -> str:
        from llguidance import LLMatcher, grammar_from

        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "grammar":
            return grammar_from("grammar", self.spec)  # Lark, or GBNF converted to Lark
        schema = '{"type": "object"}' if self.kind == "json_object" else self.spec
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the schema is not JSON: {exc}") from None
        if not isinstance(parsed, dict | bool):
            raise ValueError("a JSON schema is an object (or true / false)")
        if isinstance(parsed, bool):
            schema = "{}" if parsed else '{"not": {}}'
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]


# The thinking block ends at its first </think> (the complement rules out a second one);
# up to 4 blanks may follow it, and then the output's own grammar (@body) holds.
_THINK_END = r"<\/think>[ \n]{0,4}/ & ~/(?s:.*<\/think>.*<\/think>.*)/"
_THINK_OPTIONAL = f"start: THINK? @body\nTHINK: /<think>(?s:.*){_THINK_END}\n"
_THINK_OPEN = f"start: THINK @body\nTHINK: /(?s:.*){_THINK_END}\n"

_CACHED_SPEC_CHARS = 16_384  # longer specs are checked every time: the memo stays small


def check_guided(guided: GuidedDecoding) -> None:
    """Raise ValueError naming the problem when no engine could compile `guided`."""
    check = _memo_error if len(guided.spec) <= _CACHED_SPEC_CHARS else _grammar_error
    error = check(guided.kind, guided.spec, guided.thinking)
    if error:
        raise ValueError(error)


def _grammar_error(kind: GuidedKind, spec: str, thinking: Thinking = "none") -> str:
    from llguidance import LLMatcher

    try:
        text = GuidedDecoding(kind=kind, spec=spec, thinking=thinking).grammar_text()
    except ValueError as exc:
        return str(exc)
    return LLMatcher.validate_grammar(text).strip()


_memo_error = functools.lru_cache(maxsize=512)(_grammar_error)
