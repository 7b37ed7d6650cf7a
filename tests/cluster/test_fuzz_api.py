"""Schemathesis against the running app's own OpenAPI document (/openapi.json).

Two runs, bounded by a fixed number of examples per operation:
- positive: requests valid by the schema, on a copy narrowed so the CPU engine is not
  flooded (max_tokens required and at most 4, n at most 2, short texts, the served model
  name). No 5xx; statuses, content types and bodies as the document declares them
  (responses are validated against the pydantic response models' schemas).
- negative: requests that break the schema as served. Each must be refused with a 4xx
  OpenAI error body; a 2xx means the schema and the validation disagree.
"""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.cluster.conftest import Served

MAX_EXAMPLES = 50  # per operation and run; nine operations
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,  # one request may wait on a busy 2-core engine; the client timeout bounds it
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
REQUEST_TIMEOUT_S = 60
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def served_spec(served: Served) -> dict[str, Any]:
    response = httpx.get(f"{served.base_url}/openapi.json", timeout=60)
    response.raise_for_status()
    spec: dict[str, Any] = response.json()
    return spec


def narrowed(spec: dict[str, Any], model: str) -> dict[str, Any]:
    """A copy whose valid requests the server must accept, and cheaply: the served model, a
    few new tokens, prompts well inside the 512-token context, no refused extra fields."""
    spec = copy.deepcopy(spec)
    schemas = spec["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        body = schemas[name]
        props = body["properties"]
        props["model"] = {"type": "string", "enum": [model]}
        props["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 4}
        props["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
        # min_tokens is refused beside a json_object format, a rule the schema cannot say
        props["min_tokens"] = {"type": "integer", "minimum": 0, "maximum": 0}
        props["stop"]["anyOf"][1]["maxItems"] = 4
        props["stop_token_ids"]["anyOf"][0]["maxItems"] = 4
        body["required"] = sorted({*body.get("required", []), "max_tokens"})
        body["additionalProperties"] = False  # extra fields are refused functions, suffix, ...
        props.pop("logit_bias")  # its keys must be token ids of the vocabulary: test_logit_bias
        # a schema, regex or grammar valid JSON may still not compile (400): test_structured
        for name in ("guided_json", "guided_regex", "guided_grammar", "guided_choice",
                     "structured_outputs", "tools", "tool_choice"):  # fmt: skip
            props.pop(name, None)
        props.pop("prompt_logprobs")  # refused with stream: test_prompt_logprobs_as_vllm_*
        formats = ("TextFormat", "JsonObjectFormat")
        props["response_format"] = {
            "anyOf": [{"$ref": f"#/components/schemas/{f}"} for f in formats] + [{"type": "null"}]
        }
    chat = schemas["ChatCompletionRequest"]["properties"]
    chat["max_completion_tokens"] = {"type": "integer", "minimum": 1, "maximum": 4}
    # continuing needs the assistant's message last, a rule the schema cannot say
    for name in ("continue_final_message", "chat_template_kwargs"):  # test_chat_template_*
        chat.pop(name)
    chat["messages"]["maxItems"] = 2
    for role in ("System", "Developer", "User", "Assistant", "Tool"):
        message = schemas[f"{role}MessageParam"]
        message["properties"]["content"] = {"type": "string", "maxLength": 50}
        message["additionalProperties"] = False
    # past calls are written into the prompt at any length (one ran past the 512-token
    # context): the tool round trips test them (test_structured, test_responses_api)
    schemas["AssistantMessageParam"]["properties"].pop("tool_calls")
    completion = schemas["CompletionRequest"]["properties"]
    completion["prompt"] = {"type": "string", "minLength": 1, "maxLength": 100}
    responses = schemas["ResponsesRequest"]
    props = responses["properties"]
    props["model"] = {"type": "string", "enum": [model]}
    props["input"] = {"type": "string", "maxLength": 100}
    props["instructions"] = {"type": "string", "maxLength": 50}
    props["max_output_tokens"] = {"type": "integer", "minimum": 1, "maximum": 4}
    for name in ("tools", "tool_choice", "text"):  # compiled grammars: test_responses_api
        props.pop(name)
    responses["required"] = ["input", "max_output_tokens", "model"]
    responses["additionalProperties"] = False  # extra fields are refused previous_response_id, ...
    # /tokenize takes a prompt or messages, not both (a rule the schema cannot say): prompts
    tokenize = schemas["TokenizeRequest"]
    for name in ("messages", "tools"):
        tokenize["properties"].pop(name)
    tokenize["properties"]["model"] = {"type": "string", "enum": [model]}
    for param in spec["paths"]["/v1/models/{model}"]["get"]["parameters"]:
        param["schema"] = {"type": "string", "enum": [model]}
    tokenize["properties"]["prompt"] = {"type": "string", "maxLength": 100}
    tokenize["required"], tokenize["additionalProperties"] = ["model", "prompt"], False
    detokenize = schemas["DetokenizeRequest"]
    detokenize["properties"]["model"] = {"type": "string", "enum": [model]}
    ids = {"type": "integer", "minimum": 0, "maximum": 49151}  # the demo's vocabulary
    detokenize["properties"]["tokens"] = {"type": "array", "items": ids, "maxItems": 50}
    detokenize["additionalProperties"] = False
    return spec


OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
]
BODIES = [op for op in OPERATIONS if op[0] == "POST"]


def load(spec: dict[str, Any], served: Served) -> Any:
    schema = schemathesis.openapi.from_dict(spec)
    schema.config.update(base_url=served.base_url)
    return schema


@pytest.fixture(scope="module")
def positive_schema(served: Served) -> Any:
    return load(narrowed(served_spec(served), served.config.model_name), served)


@pytest.fixture(scope="module")
def negative_schema(served: Served) -> Any:
    return load(served_spec(served), served)


def assert_openai_error(response: Any) -> None:
    if response.status_code < 400:
        return
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]


def fuzz(
    schema: Any, op: tuple[str, str], mode: GenerationMode, checks: list[Any], served: Served
) -> None:
    """Up to MAX_EXAMPLES generated requests to one operation; hypothesis shrinks a failure."""
    method, path = op
    operation = schema[path][method]

    @FUZZ_SETTINGS
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call_and_validate(
            headers=served.headers(), checks=checks, timeout=REQUEST_TIMEOUT_S
        )
        assert_openai_error(response)
        import sys

        print(
            mode.name,
            path,
            response.status_code,
            response.text[:150].replace("\n", " "),
            file=sys.stderr,
        )  # noqa

    run()


def test_served_spec_describes_the_request_bodies(served: Served) -> None:
    spec = served_spec(served)
    routes = {(m.upper(), p) for p, item in spec["paths"].items() for m in item}
    assert routes == set(OPERATIONS), "fuzz every route: add new ones to OPERATIONS"
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ChatCompletionRequest"
    assert "messages" in spec["components"]["schemas"]["ChatCompletionRequest"]["required"]
    assert "ErrorResponse" in spec["components"]["schemas"]


@pytest.mark.parametrize("op", OPERATIONS, ids=" ".join)
def test_valid_requests_by_the_schema(
    op: tuple[str, str], positive_schema: Any, served: Served
) -> None:
    fuzz(positive_schema, op, GenerationMode.POSITIVE, [*CHECKS, positive_data_acceptance], served)


@pytest.mark.parametrize("op", BODIES, ids=" ".join)
def test_invalid_requests_by_the_schema(
    op: tuple[str, str], negative_schema: Any, served: Served
) -> None:
    fuzz(negative_schema, op, GenerationMode.NEGATIVE, [*CHECKS, negative_data_rejection], served)
