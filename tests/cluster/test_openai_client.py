"""The official `openai` client against the running app (real Serve, real engine, demo model)."""

from __future__ import annotations

import functools
import math

import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from tests.cluster.conftest import ENGINE, Served
from worker.llm import LLM
from worker.model.demo import resolve_model_path
from worker.sampling import SamplingParams
from worker.tokenizer import Tokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a short story about a robot learning to paint."}]


def test_models_lists_the_served_model(client: OpenAI) -> None:
    models = client.models.list().data  # the module's first request: its length is asked for
    assert [m.id for m in models] == ["demo"]
    assert models[0].model_extra == {"max_model_len": ENGINE["max_seq_len"]}
    assert client.models.retrieve("demo") == models[0]
    with pytest.raises(NotFoundError, match="org/other-model") as missing:
        client.models.retrieve("org/other-model")  # a name with a slash: one path parameter
    assert missing.value.code == "model_not_found"


def test_tokenize_counts_the_prompt_tokens_a_completion_is_billed(
    client: OpenAI, served: Served
) -> None:
    """vLLM's /tokenize over HTTP: its count for the messages is the usage's prompt_tokens."""
    import httpx

    post = functools.partial(httpx.post, headers=served.headers(), timeout=60)
    counted = post(f"{served.base_url}/tokenize", json={"model": "demo", "messages": QUESTION})
    assert counted.status_code == 200, counted.text
    reply = client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=1)
    assert counted.json()["count"] == reply.usage.prompt_tokens
    assert counted.json()["max_model_len"] == ENGINE["max_seq_len"]
    text = post(
        f"{served.base_url}/detokenize", json={"model": "demo", "tokens": counted.json()["tokens"]}
    )
    assert "What is the capital of France?" in text.json()["prompt"]
    assert (
        httpx.post(f"{served.base_url}/tokenize", json={"model": "demo", "prompt": "x"}).status_code
        == 401
    )


def test_chat_template_fields_continue_the_assistants_message(
    client: OpenAI, served: Served
) -> None:
    """vLLM's continue_final_message: the reply goes on from a started assistant message
    (the prompt is /tokenize's for the same fields); the fields that cannot go together, or
    a template variable that would stand in for an argument, are 400s naming the field."""
    import httpx

    started = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    reply = client.chat.completions.create(
        model="demo", messages=started, max_tokens=4, temperature=0, extra_body=fields
    )
    counted = httpx.post(
        f"{served.base_url}/tokenize",
        json={"model": "demo", "messages": started, **fields},
        headers=served.headers(),
        timeout=60,
    ).json()
    assert counted["count"] == reply.usage.prompt_tokens  # type: ignore[union-attr]
    prompt = Tokenizer.from_dir(str(resolve_model_path("demo"))).decode(counted["tokens"])
    assert prompt.endswith("assistant\nThe capital of France is")
    assert not (reply.choices[0].message.content or "").startswith("The capital")
    for extra, param in (
        ({"continue_final_message": True}, "continue_final_message"),  # with the generation prompt
        (
            {"add_generation_prompt": False, "continue_final_message": True},
            "continue_final_message",
        ),
    ):
        messages = QUESTION if len(extra) == 2 else started
        with pytest.raises(BadRequestError) as bad:
            client.chat.completions.create(
                model="demo", messages=messages, max_tokens=1, extra_body=extra
            )
        assert bad.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(BadRequestError, match="may not set tools"):
        client.chat.completions.create(
            model="demo", messages=QUESTION, max_tokens=1,
            extra_body={"chat_template_kwargs": {"tools": []}},
        )  # fmt: skip


def test_greedy_chat_over_http_equals_llm_generate(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model="demo", messages=QUESTION, temperature=0, max_tokens=24
    )
    llm = LLM(**ENGINE)
    try:
        [local] = llm.generate(
            QUESTION[0]["content"], SamplingParams(temperature=0, max_tokens=24), chat=True
        )
    finally:
        llm.engine.shutdown()
    choice = reply.choices[0]
    assert choice.message.content == local.text
    assert "Paris" in choice.message.content
    assert choice.finish_reason == local.finish_reason
    assert reply.usage.completion_tokens == len(local.token_ids)
    assert reply.usage.prompt_tokens == len(local.prompt_token_ids)


def test_streaming_equals_non_streaming_and_reports_usage(client: OpenAI) -> None:
    whole = client.chat.completions.create(
        model="demo", messages=STORY, temperature=0, max_tokens=20
    )
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=STORY,
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert text == whole.choices[0].message.content
    assert finishes == ["length"] == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20 == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n2_gives_two_indexed_choices(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model="demo", messages=STORY, n=2, temperature=1.0, seed=3, max_tokens=12
    )
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert all(c.message.content for c in reply.choices)
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
    assert 2 <= reply.usage.completion_tokens <= 24
    assert reply.choices[0].message.content != reply.choices[1].message.content


def test_stop_string_cuts_the_text_and_finishes_with_stop(client: OpenAI) -> None:
    full = client.chat.completions.create(
        model="demo", messages=STORY, temperature=0, max_tokens=40
    )
    text = full.choices[0].message.content
    stop = text[20:26]
    assert stop.strip(), "the greedy story should have text to cut"
    cut = client.chat.completions.create(
        model="demo", messages=STORY, temperature=0, max_tokens=40, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
    streamed = client.chat.completions.create(
        model="demo", messages=STORY, temperature=0, max_tokens=40, stop=stop, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == text[: text.index(stop)]
    )


def test_logprobs_and_top_logprobs(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model="demo", messages=QUESTION, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)
        assert math.isclose(entry.logprob, max(t.logprob for t in entry.top_logprobs), abs_tol=1e-4)
    assert "".join(e.token for e in content) == reply.choices[0].message.content


def test_echo_returns_the_prompt_and_its_logprobs_as_the_engine_scores_them(
    client: OpenAI,
) -> None:
    """lm-evaluation-harness's loglikelihood request: echo, max_tokens 0, logprobs."""
    prompt = "The capital of France is Paris"
    scored = client.completions.create(
        model="demo", prompt=prompt, echo=True, max_tokens=0, logprobs=1, temperature=0
    )
    choice = scored.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    llm = LLM(**ENGINE)
    try:
        [local] = llm.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))
    finally:
        llm.engine.shutdown()
    lp = choice.logprobs
    assert len(lp.tokens) == len(local.prompt_token_ids) == scored.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(
        [e.logprob for e in local.prompt_logprobs[1:]], abs=1e-3
    )
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])

    more = client.completions.create(
        model="demo", prompt=prompt, echo=True, max_tokens=4, logprobs=1, temperature=0
    )
    plain = client.completions.create(model="demo", prompt=prompt, max_tokens=4, temperature=0)
    text, n = more.choices[0].text, len(lp.tokens)
    assert text == prompt + plain.choices[0].text
    assert len(more.choices[0].logprobs.tokens) == n + more.usage.completion_tokens
    assert more.choices[0].logprobs.token_logprobs[1:n] == pytest.approx(
        lp.token_logprobs[1:], abs=1e-3
    )
    assert more.choices[0].logprobs.text_offset[n] == len(prompt)

    chunks = list(
        client.completions.create(
            model="demo",
            prompt=prompt,
            echo=True,
            max_tokens=4,
            logprobs=1,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[0].choices[0].text.startswith(prompt)  # the prompt comes first, whole
    assert "".join(c.choices[0].text for c in chunks) == text
    streamed = [t for c in chunks for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and len(streamed) == len(more.choices[0].logprobs.tokens)
    assert streamed[1:] == pytest.approx(more.choices[0].logprobs.token_logprobs[1:], abs=1e-3)

    ids = local.prompt_token_ids  # token-id prompts, two at once, as lm-eval sends them
    batch = client.completions.create(
        model="demo", prompt=[ids, ids[:4]], echo=True, max_tokens=0, logprobs=1, temperature=0
    )
    assert [len(c.logprobs.tokens) for c in batch.choices] == [len(ids), 4]
    assert batch.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1:], abs=1e-3
    )
    assert batch.choices[0].text == choice.text  # token ids echo as their text


def test_prompt_logprobs_as_vllm_returns_them(client: OpenAI, served: Served) -> None:
    """vLLM's `prompt_logprobs`: on each completion choice, once at the top of a chat reply;
    the scores echo gives, keyed by token id; refused with stream."""
    import openai

    prompt = "The capital of France is Paris"
    ids = Tokenizer.from_dir(str(resolve_model_path(served.config.engine.model))).encode(prompt)
    echo = client.completions.create(
        model="demo", prompt=prompt, echo=True, max_tokens=0, logprobs=0, temperature=0
    )
    plain = client.completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None
    reply = client.completions.create(
        model="demo", prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    assert reply.choices[0].text == plain.choices[0].text  # the text is not echoed
    rows = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(rows) == len(ids) == reply.usage.prompt_tokens and rows[0] is None
    echoed = echo.choices[0].logprobs.token_logprobs
    for row, token_id, want in zip(rows[1:], ids[1:], echoed[1:], strict=True):
        own = row[str(token_id)]
        assert own["logprob"] == pytest.approx(want, abs=1e-3)
        alternatives = sorted(
            (e["rank"], e["logprob"]) for t, e in row.items() if t != str(token_id)
        )
        if own["rank"] > 2:  # not among the top two: less likely than both
            assert [r for r, _ in alternatives] == [1, 2] and own["logprob"] <= alternatives[1][1]
        else:  # one of them, at its own rank
            ranked = sorted([*alternatives, (own["rank"], own["logprob"])])
            assert len(row) == 2 and [r for r, _ in ranked] == [1, 2]
            assert ranked[own["rank"] - 1][1] == own["logprob"] and ranked[0][1] >= ranked[1][1]
    chat = client.chat.completions.create(
        model="demo", messages=QUESTION, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    scored = chat.model_extra["prompt_logprobs"]
    assert len(scored) == chat.usage.prompt_tokens and scored[0] is None
    assert all(len(row) == 1 for row in scored[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(
            model="demo", messages=QUESTION, stream=True, extra_body={"prompt_logprobs": 1}
        )


def test_logit_bias_bans_and_forces_tokens(client: OpenAI, served: Served) -> None:
    tokenizer = Tokenizer.from_dir(str(resolve_model_path(served.config.engine.model)))

    def greedy(**kw: object) -> str:
        reply = client.chat.completions.create(
            model="demo", messages=QUESTION, temperature=0, max_tokens=12, **kw
        )
        return reply.choices[0].message.content or ""

    plain = greedy()
    assert "Paris" in plain
    paris = [
        *tokenizer.encode(" Paris", add_special_tokens=False),
        *tokenizer.encode("Paris", add_special_tokens=False),
    ]
    banned = greedy(logit_bias={str(t): -100 for t in paris})
    assert "Paris" not in banned
    [star] = tokenizer.encode("*", add_special_tokens=False)
    assert greedy(logit_bias={str(star): 100}) == "*" * 12
    # completions take it too, and a bias of 0 changes nothing
    reply = client.completions.create(
        model="demo",
        prompt="The quick brown fox",
        max_tokens=6,
        temperature=0,
        logit_bias={str(star): 100},
    )
    assert reply.choices[0].text == "*" * 6
    assert greedy(logit_bias={str(star): 0}) == plain


def test_seed_reproduces_sampled_text(client: OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = client.chat.completions.create(
            model="demo", messages=STORY, temperature=1.0, top_p=0.95, seed=seed, max_tokens=16
        )
        return reply.choices[0].message.content or ""

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_completions_endpoint_plain_and_streaming(client: OpenAI) -> None:
    reply = client.completions.create(
        model="demo", prompt="The quick brown fox", max_tokens=8, temperature=0
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 8
    streamed = client.completions.create(
        model="demo", prompt="The quick brown fox", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reply.choices[0].text
