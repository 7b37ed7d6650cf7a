"""Tokenizer, incremental detokenizer and stop strings, on the demo model's tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.model.demo import ensure_demo_model
from worker.tokenizer import IncrementalDetokenizer, TextStream, Tokenizer

MIXED_TEXTS = [
    "Hello 😀👍🏽 world",
    "你好，世界！这是一个测试。",
    "日本語のテキストと한국어 텍스트",
    "family 👨‍👩‍👧‍👦 flag 🇫🇷 café naïve — ok",
    "🙂🙃😉😊😇🥰😍🤩😘😗",
    "mix: abc 世界 😀 def 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 end",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model())


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> list[str]:
    pieces = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*pieces, detok.flush()]


@pytest.mark.parametrize("text", MIXED_TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_detokenizer_streams_exactly_the_full_decode(tok: Tokenizer, text: str, chunk: int):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 4  # byte-level pieces: multi-byte chars span tokens
    pieces = stream(tok.detokenizer(), ids, chunk)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert pieces[-1] == ""  # nothing was left behind for flush on valid UTF-8


def test_detokenizer_emits_as_soon_as_a_char_is_complete(tok: Tokenizer):
    ids = tok.encode("a😀b", add_special_tokens=False)
    detok = tok.detokenizer()
    pieces = [detok.push([i]) for i in ids]
    emitted_before_last = "".join(pieces[:-1])
    assert emitted_before_last == "a😀"  # the emoji came out with its last byte, not later
    assert pieces[-1] == "b"


def test_detokenizer_special_tokens(tok: Tokenizer):
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi 😀"}])
    kept = "".join(stream(tok.detokenizer(skip_special_tokens=False), ids, 1))
    assert kept == tok.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user" in kept
    skipped = "".join(stream(tok.detokenizer(), ids, 1))
    assert skipped == tok.decode(ids) and "<|im_start|>" not in skipped


# The SmolLM2 vocabulary has no byte token for some control characters and for the UTF-8
# lead bytes of planes 4-16 (the original tokenizer lacks them too): such text is dropped
# by encode, so the round trip to the same text is checked on the characters it covers.
_ROUND_TRIP_CHARS = st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cc", "Cs"))


@settings(max_examples=60, deadline=None)
@given(text=st.text(_ROUND_TRIP_CHARS, min_size=1, max_size=40), chunk=st.integers(1, 5))
def test_detokenizer_any_text(tok: Tokenizer, text: str, chunk: int):
    # Hypothesis also draws string literals from the source tree, such as "<|im_end|>":
    # encode turns those into special tokens, so they are kept for the round trip.
    ids = tok.encode(text, add_special_tokens=False)
    pieces = stream(tok.detokenizer(skip_special_tokens=False), ids, chunk)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=False) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in piece for piece in pieces)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=80), chunk=st.integers(1, 4))
def test_detokenizer_arbitrary_ids_concatenate_to_decode(tok: Tokenizer, ids, chunk):
    """Random ids are often not valid UTF-8; the stream must still add up to the decode."""
    for skip in (True, False):
        pieces = stream(tok.detokenizer(skip_special_tokens=skip), ids, chunk)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def run_stream(tok: Tokenizer, text: str, chunk: int = 1, **kwargs) -> tuple[TextStream, list[str]]:
    ids = tok.encode(text, add_special_tokens=False)
    ts = TextStream(tok, **kwargs)
    pieces = [ts.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return ts, [*pieces, ts.finish()]


def test_stop_string_across_token_boundaries(tok: Tokenizer):
    text = "The answer is 42. ENDOFANSWER and more text"
    assert len(tok.encode("ENDOFANSWER", add_special_tokens=False)) > 1
    ts, pieces = run_stream(tok, text, stop=["ENDOFANSWER"])
    assert ts.stopped
    assert "".join(pieces) == ts.text == "The answer is 42. "
    assert ts.push(tok.encode(" again", add_special_tokens=False)) == ""
    assert ts.finish() == "" and ts.text == "The answer is 42. "


def test_stop_string_at_the_very_start(tok: Tokenizer):
    ts, pieces = run_stream(tok, "STOP right now", stop=["STOP"])
    assert ts.stopped and ts.text == "" and all(p == "" for p in pieces)


def test_include_stop_str_in_output(tok: Tokenizer):
    ts, pieces = run_stream(tok, "abc 世界 def", stop=["世界"], include_stop_str_in_output=True)
    assert ts.stopped and "".join(pieces) == ts.text == "abc 世界"


def test_several_stop_strings_first_completed_wins(tok: Tokenizer):
    text = "one two three four"
    ts, _ = run_stream(tok, text, stop=["four", "two", "nothing"])
    assert ts.stopped and ts.text == "one "
    # both start at the same place; the shorter one completes first
    ts, _ = run_stream(tok, text, stop=["two three", "two"], include_stop_str_in_output=True)
    assert ts.text == "one two"
    # completes first even though it starts later
    ts, _ = run_stream(tok, text, stop=["two three four", "three"])
    assert ts.text == "one two "


def test_held_back_prefix_is_flushed_at_finish(tok: Tokenizer):
    text = "the stream ends with ST"
    ts, pieces = run_stream(tok, text, stop=["STOP"])
    assert not ts.stopped
    assert "".join(pieces[:-1]) == "the stream ends with "  # "ST" might have become "STOP"
    assert pieces[-1] == "ST"
    assert ts.text == text


def test_no_stop_strings_passes_text_through(tok: Tokenizer):
    ts, pieces = run_stream(tok, MIXED_TEXTS[0], chunk=2)
    assert not ts.stopped and "".join(pieces) == ts.text == MIXED_TEXTS[0]


@settings(max_examples=80, deadline=None)
@given(
    text=st.text(alphabet="ab c世", min_size=1, max_size=30),
    stops=st.lists(st.text(alphabet="ab c世", min_size=1, max_size=4), max_size=3),
    chunk=st.integers(1, 4),
    include=st.booleans(),
)
def test_stop_strings_do_not_depend_on_chunking(tok: Tokenizer, text, stops, chunk, include):
    """Streaming in any chunks gives what one pass over the full text gives."""
    ts, pieces = run_stream(tok, text, chunk, stop=stops, include_stop_str_in_output=include)
    matches = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    if matches:
        end, start = min(matches)
        expected = text[: end if include else start]
    else:
        expected = text
    assert ts.stopped == bool(matches)
    assert "".join(pieces) == ts.text == expected


def test_demo_eos_and_bos_ids(tok: Tokenizer):
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1 and im_end[0] in tok.eos_token_ids
    assert tok.bos_token_id == tok.encode("<|im_start|>", add_special_tokens=False)[0]
    assert tok.vocab_size == 49152


def test_eos_ids_union_generation_config_and_tokenizer(tok: Tokenizer, tmp_path):
    src = ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, tmp_path / name)
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == {2}  # from the tokenizer alone
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == {0, 2, 7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == {2, 5}


def test_chat_template_structure(tok: Tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.chat_prompt_text(messages)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 3  # system, user, assistant turns
    assert tok.decode(ids, skip_special_tokens=False) == text
    closed = tok.chat_prompt_text(messages, add_generation_prompt=False)
    assert closed.endswith("<|im_end|>\n") and "<|im_start|>assistant" not in closed


def test_continue_final_message_leaves_the_assistants_turn_open(tok: Tokenizer):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    text = tok.chat_prompt_text(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe capital of France is")


def test_template_kwargs_reach_the_template_but_not_its_arguments(tok: Tokenizer, tmp_path):
    src = ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!{% endif %}"
    (tmp_path / "chat_template.jinja").write_text(template)
    custom, messages = Tokenizer.from_dir(tmp_path), [{"role": "user", "content": "hi"}]
    assert custom.chat_prompt_text(messages) == "hi"
    assert custom.chat_prompt_text(messages, template_kwargs={"shout": True}) == "hi!"
    with pytest.raises(ValueError, match="may not set add_generation_prompt, tools"):
        custom.chat_prompt_text(messages, template_kwargs={"tools": [], "add_generation_prompt": 1})


def test_from_dir_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
