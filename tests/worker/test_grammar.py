"""Constrained decoding: the mask on the device, the checks, the engine's handling of
grammars that compile off its thread, and the schema corpus on the demo model (every output
validates; an unconstrained request beside them is unaffected)."""

from __future__ import annotations

import json
import re
import shutil
import time

import jsonschema
import pytest
import torch

from benchmarks.schema_corpus import SCHEMAS
from worker.config import EngineConfig
from worker.engine import Engine, EngineRequest
from worker.grammar import GrammarCompiler, MaskBuilder
from worker.guided import GuidedDecoding, check_guided
from worker.llm import LLM
from worker.model.demo import ensure_demo_model
from worker.model.random_model import Shape, hf_config
from worker.outputs import RequestDelta
from worker.sampling import SamplingParams, TokenMask
from worker.tokenizer import Tokenizer
from worker.validation import InvalidRequest, check_request

GREEDY = dict(temperature=0.0)
REGEX = r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}\."
GRAMMAR = 'root ::= "The answer is " ("yes" | "no") "."'  # GBNF, as llama.cpp writes it


# -- the mask ---------------------------------------------------------------------------


def _bitmask(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            words[row, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _bits() -> torch.Tensor:
    return torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32)


@pytest.mark.parametrize("rows", [None, [2, 0]])
def test_a_token_mask_blocks_exactly_what_its_bits_forbid(rows: list[int] | None) -> None:
    vocab, logits = 70, torch.randn(3, 70)
    allowed = [[0, 31, 32, 69], [5, 63]]  # bit 31 is the sign bit of its word
    targets = rows or [0, 1]
    n = len(allowed)
    mask = TokenMask(
        _bitmask(allowed, vocab), None if rows is None else torch.tensor(rows), _bits()
    )
    if rows is None:
        logits = logits[:n]
    out = mask.apply(logits)
    assert not torch.equal(out, logits) and out.data_ptr() != logits.data_ptr()
    for k, row in enumerate(targets):
        finite = torch.isfinite(out[row]).nonzero().view(-1).tolist()
        assert finite == allowed[k]
        assert torch.equal(out[row, allowed[k]], logits[row, allowed[k]])
    for row in set(range(out.shape[0])) - set(targets):
        assert torch.equal(out[row], logits[row])


# -- the checks -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guided", "message"),
    [
        (GuidedDecoding(kind="json_schema", spec="{not json"), "not JSON"),
        (GuidedDecoding.from_schema({"type": "strin"}), "Invalid type"),
        (GuidedDecoding.from_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (GuidedDecoding.from_schema({"type": "integer", "minimum": 5, "maximum": 1}), "minimum"),
        (GuidedDecoding.from_schema([1, 2]), "object"),  # type: ignore[arg-type]
        (GuidedDecoding.from_regex("(("), "regex"),
        (GuidedDecoding.from_grammar("root ::= ("), "GBNF"),
    ],
)
def test_a_spec_no_engine_could_compile_is_refused_naming_the_problem(
    guided: GuidedDecoding, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_guided(guided)
    params = SamplingParams(max_tokens=4, guided=guided)
    with pytest.raises(InvalidRequest) as caught:
        check_request(EngineRequest("r", [1, 2], params), vocab_size=100, max_seq_len=64)
    assert caught.value.param == "guided"


def test_specs_are_checked_by_kind_and_min_tokens_is_refused_beside_them() -> None:
    for name, schema in SCHEMAS.items():
        check_guided(GuidedDecoding.from_schema(schema)), name
    check_guided(GuidedDecoding.from_regex(REGEX))
    check_guided(GuidedDecoding.from_grammar(GRAMMAR))
    with pytest.raises(ValueError, match="needs a spec"):
        GuidedDecoding(kind="regex")
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, guided=GuidedDecoding.any_object())


# -- the engine, on random weights with the demo tokenizer ------------------------------

NEVER_DONE = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}  # EOS stays masked


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory: pytest.TempPathFactory):
    """A two-layer random model of the demo's vocabulary, holding the demo tokenizer."""
    path = tmp_path_factory.mktemp("grammar-model")
    shape = Shape(2, 64, 128, 4, 2, 16, 49152, False, 10000.0, 2048)
    (path / "config.json").write_text(json.dumps(hf_config(shape, "float32")))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_demo_model() / name, path / name)
    return path


def _engine(path, **overrides) -> Engine:
    config = dict(
        model=str(path), device="cpu", max_seq_len=128, max_running=8, num_pages=64,
        load_format="random", **overrides,
    )  # fmt: skip
    return Engine(EngineConfig.from_flat(**config))


def _until_finished(engine: Engine, requests: list[EngineRequest]) -> dict[str, RequestDelta]:
    """Step until every request finished; the tokens of each, merged into its last delta."""
    stream = engine.submit(requests)
    tokens: dict[str, list[int]] = {}
    last: dict[str, RequestDelta] = {}
    while not stream.finished:
        engine.step()
        for frame in stream.poll():
            for d in frame:
                tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
                last[d.request_id] = d
    for rid, d in last.items():
        d.new_token_ids = tokens[rid]
    return last


def _constrained(n: int, max_tokens: int = 24) -> list[EngineRequest]:
    schemas = [NEVER_DONE, SCHEMAS["order"], SCHEMAS["nested_address"], SCHEMAS["tags"]]
    return [
        EngineRequest(
            f"g{i}",
            [10 + i, 20, 30 + i],
            SamplingParams(
                max_tokens=max_tokens,
                seed=i if i % 2 else None,
                **({"temperature": 0.8} if i % 2 else GREEDY),
                guided=GuidedDecoding.from_schema(schemas[i % len(schemas)]),
            ),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("threaded", [False, True], ids=["filled-at-once", "filled-on-a-thread"])
def test_overlapped_steps_read_the_token_in_flight_into_the_grammar(
    random_dir, threaded: bool
) -> None:
    """With overlap the next step is queued before this step's tokens are read: its mask
    must still follow them. Same tokens as the plain engine, each a valid prefix; also with
    the masks filled on the builder's thread (as on CUDA) while the engine reads the step
    before."""
    plain, overlapped = _engine(random_dir, overlap=False), _engine(random_dir, overlap=True)
    if threaded:
        overlapped.executor._masks = MaskBuilder(49152, 8, torch.device("cpu"), threaded=True)
    requests = _constrained(4) + [
        EngineRequest("free", [5, 6, 7], SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY))
    ]
    want = _until_finished(plain, requests)
    got = _until_finished(overlapped, requests)
    assert {r: d.new_token_ids for r, d in got.items()} == {
        r: d.new_token_ids for r, d in want.items()
    }
    assert overlapped.num_overlapped_steps > 10
    assert want["g0"].finish_reason == "length" and len(want["g0"].new_token_ids) == 24
    text = plain.tokenizer.decode(want["g0"].new_token_ids)
    assert re.fullmatch(r"\[(-?\d+, )*-?\d*", text), text  # the never-done array, so far
    for engine in (plain, overlapped):
        assert engine.executor.cache.num_free_pages == engine.executor.cache.num_total_pages
        engine.shutdown()


def test_the_step_log_shows_the_host_waiting_for_slow_masks(random_dir, monkeypatch) -> None:
    """Where a constrained step's host time goes: a mask that takes 100 ms to fill shows as
    mask wait on every step with a grammar, and never on a step without one."""
    engine = _engine(random_dir, overlap=True)
    builder = MaskBuilder(49152, 8, torch.device("cpu"), threaded=True)
    fill = builder._fill

    def slow_fill(states, masks) -> None:
        time.sleep(0.1)
        fill(states, masks)

    monkeypatch.setattr(builder, "_fill", slow_fill)
    engine.executor._masks = builder
    engine.step_log = []
    free = SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY)
    _until_finished(engine, [EngineRequest("free", [5, 6, 7], free)])
    unconstrained = list(engine.step_log)
    engine.step_log = []
    _until_finished(engine, _constrained(1, max_tokens=6))
    assert unconstrained and all(r.mask_wait_seconds == 0 for r in unconstrained)
    sampled = [r for r in engine.step_log if r.num_decodes or r.num_prompt_tokens]
    assert len(sampled) >= 5
    assert all(r.mask_wait_seconds > 0.02 for r in sampled), [r.mask_wait_seconds for r in sampled]
    assert all(r.device_wait_seconds == 0 for r in engine.step_log)  # no device events on CPU
    engine.shutdown()


def test_a_mask_that_fails_ends_its_steps_requests_and_the_engine_goes_on(
    random_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sampling behind a grammar's mask is queued late (when the next step is launched):
    should the mask fail there, the step's requests and those of the step queued after it end
    with an error instead of reading ids never sampled, and the engine serves the next ones."""
    engine = _engine(random_dir, overlap=True)
    fills = 0
    fill = MaskBuilder._fill

    def failing_fill(self, states, masks) -> None:
        nonlocal fills
        fills += 1
        if fills == 5:
            raise RuntimeError("mask fill failed")
        fill(self, states, masks)

    monkeypatch.setattr(MaskBuilder, "_fill", failing_fill)
    free = EngineRequest(
        "free", [5, 6, 7], SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY)
    )
    got = _until_finished(engine, _constrained(2) + [free])
    assert {d.finish_reason for d in got.values()} == {"error"}, got
    assert "mask fill failed" in (got["g0"].error or "")
    again = _until_finished(engine, [_renamed(r, f"again-{r.request_id}") for r in _constrained(2)])
    assert {d.finish_reason for d in again.values()} == {"length"}
    assert engine.executor.cache.num_free_pages == engine.executor.cache.num_total_pages
    engine.shutdown()


def test_a_request_waits_for_its_grammar_off_the_loop_thread(random_dir) -> None:
    """An abort of a request whose grammar still compiles ends it at once. A grammar that
    takes a while to compile holds back only its own request: one submitted with it is
    served meanwhile."""
    engine = Engine.launched(_engine(random_dir).config)
    try:
        # the first grammar of an engine also builds the tokenizer's tables (~1 s)
        gone = engine.submit([_renamed(_constrained(3)[2], "gone")])
        engine.abort("gone")
        [delta] = [d for frame in _read_all(gone) for d in frame]
        assert delta.finish_reason == "abort"
        many = {
            f"k{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}x{i}$"}
            for i in range(1000)
        }
        slow = GuidedDecoding.from_schema(
            {"type": "object", "properties": many, "required": list(many)}
        )
        params = SamplingParams(max_tokens=2, guided=slow, **GREEDY)  # ~0.1 s to compile
        free = SamplingParams(max_tokens=3, ignore_eos=True, **GREEDY)
        stream = engine.submit(
            [EngineRequest("slow", [1, 2, 3], params), EngineRequest("free", [5, 6, 7], free)]
        )
        finished = {d.request_id: d for f in _read_all(stream) for d in f if d.finish_reason}
        assert {r: d.finish_reason for r, d in finished.items()} == {
            "slow": "length",
            "free": "length",
        }
        slow_metrics, free_metrics = finished["slow"].metrics, finished["free"].metrics
        assert slow_metrics is not None and free_metrics is not None
        assert free_metrics.e2e_latency < slow_metrics.queue_time
        assert not engine.has_work and engine.stats().num_waiting == 0
        cache = engine.executor.cache
        assert cache.num_free_pages == cache.num_total_pages
    finally:
        engine.shutdown()


def _renamed(request: EngineRequest, rid: str) -> EngineRequest:
    return EngineRequest(rid, request.prompt_token_ids, request.params)


def _read_all(stream) -> list[list[RequestDelta]]:
    frames = []
    deadline = time.monotonic() + 60
    while not stream.finished and time.monotonic() < deadline:
        frames += stream.poll()
        time.sleep(0.01)
    return frames + stream.poll()


def test_a_burst_of_one_spec_gets_compiles_of_its_own_and_a_lone_request_one(
    random_dir, monkeypatch
) -> None:
    """Copies of one compile fill one after another (they share its lazily built lexer), so
    each request of a spec after its first asks for one more compile, at most `compiles`, and
    takes its copy at its first use from the least copied compile: a burst spreads over them.
    Every copy masks the same tokens."""
    import llguidance

    tokenizer, vocab = Tokenizer.from_dir(random_dir), 49152
    grammars = GrammarCompiler(tokenizer.hf_tokenizer, vocab, tokenizer.eos_token_ids, compiles=3)
    lone = grammars.compile(GuidedDecoding.from_regex("abc")).result()
    lone.state().consume([])
    compiled = grammars.compile(GuidedDecoding.from_regex(REGEX)).result()
    states = [compiled.state() for _ in range(6)]  # a burst, before any is used
    deadline = time.monotonic() + 30
    while compiled.compiles < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # room for a compile too many, were one asked for
    assert (lone.compiles, compiled.compiles) == (1, 3)
    copied_from: list[int] = []
    deep_copy = llguidance.LLMatcher.deep_copy
    monkeypatch.setattr(
        llguidance.LLMatcher, "deep_copy", lambda m: copied_from.append(id(m)) or deep_copy(m)
    )
    builder = MaskBuilder(vocab, len(states), torch.device("cpu"))
    text = tokenizer.encode("Hello is 42.")
    for token in [None, *text]:
        if token is not None:
            for s in states:
                s.consume([token])
        bits = builder.build(states, list(range(len(states))), len(states)).bitmask
        assert all(torch.equal(bits[0], row) for row in bits), token
    assert sorted(copied_from.count(m) for m in set(copied_from)) == [2, 2, 2]
    assert all(s.error is None and s.done for s in states)
    grammars.shutdown()


def test_masks_are_filled_for_the_rows_given_and_copied_in_one_piece(random_dir) -> None:
    tokenizer, vocab = Tokenizer.from_dir(random_dir), 49152
    grammars = GrammarCompiler(tokenizer.hf_tokenizer, vocab, tokenizer.eos_token_ids)
    states = [grammars.compile(GuidedDecoding.from_regex(p)).result().state() for p in ("ab", "b")]
    builder = MaskBuilder(vocab, 4, torch.device("cpu"))
    mask = builder.build(states, [1, 3], batch=4)
    assert mask.rows is not None and mask.rows.tolist() == [1, 3]
    out = mask.apply(torch.zeros(4, vocab))
    for row, text in ((1, "ab"), (3, "b")):
        allowed = torch.isfinite(out[row]).nonzero().view(-1).tolist()
        assert allowed and all(text.startswith(tokenizer.decode([t])) for t in allowed)
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()
    assert grammars.compile(GuidedDecoding.from_regex("ab")) is grammars.compile(
        GuidedDecoding.from_regex("ab")
    )


def test_an_eos_id_past_the_tokenizer_is_left_out_of_the_grammar(random_dir) -> None:
    """A model whose config names an EOS id the tokenizer lacks (a random-weights 8B shape
    borrowing the demo's tokenizer) still compiles grammars, ending at the tokenizer's EOS."""
    tokenizer, vocab = Tokenizer.from_dir(random_dir), 128256  # logits wider than the tokenizer
    eos = {*tokenizer.eos_token_ids, 128001}
    grammars = GrammarCompiler(tokenizer.hf_tokenizer, vocab, eos)
    state = grammars.compile(GuidedDecoding.from_regex("ab")).result().state()
    assert state is not None


# -- the corpus on the demo model -------------------------------------------------------

MAX_TOKENS = 64
FREE_PROMPTS = ["What is the capital of France?", "Name a colour."]


@pytest.fixture(scope="module")
def corpus_run():
    """Every schema of the corpus, a regex, a grammar, JSON mode and two unconstrained
    requests in one batch; then the unconstrained ones alone, for comparison."""
    llm = LLM("demo", max_seq_len=384, max_running=48, num_pages=320)
    try:
        specs = {f"schema:{n}": GuidedDecoding.from_schema(s) for n, s in SCHEMAS.items()}
        specs |= {
            "regex": GuidedDecoding.from_regex(REGEX),
            "grammar": GuidedDecoding.from_grammar(GRAMMAR),
            "json_object": GuidedDecoding.any_object(),
        }
        prompts = [f"Reply with an example of {k.split(':')[-1]} in JSON." for k in specs]
        prompts[-1] = "What is 2+2? Reply as a JSON object."  # json_object: unbounded otherwise
        params = [SamplingParams(max_tokens=MAX_TOKENS, guided=g, **GREEDY) for g in specs.values()]
        free = SamplingParams(max_tokens=16, **GREEDY)
        outputs = llm.generate(
            prompts + FREE_PROMPTS, params + [free] * len(FREE_PROMPTS), chat=True
        )
        alone = llm.generate(FREE_PROMPTS, free, chat=True)
    finally:
        llm.engine.shutdown()
    return dict(zip(list(specs) + FREE_PROMPTS, outputs, strict=True)), alone


def test_every_output_of_the_schema_corpus_validates(corpus_run) -> None:
    outputs, _ = corpus_run
    assert len(SCHEMAS) >= 30
    for name, schema in SCHEMAS.items():
        out = outputs[f"schema:{name}"]
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert re.fullmatch(REGEX, outputs["regex"].text), outputs["regex"].text
    assert outputs["grammar"].text in ("The answer is yes.", "The answer is no.")
    assert isinstance(json.loads(outputs["json_object"].text), dict)


def test_unconstrained_requests_beside_constrained_ones_are_unaffected(corpus_run) -> None:
    outputs, alone = corpus_run
    for prompt, solo in zip(FREE_PROMPTS, alone, strict=True):
        assert outputs[prompt].token_ids == solo.token_ids
    assert "Paris" in outputs[FREE_PROMPTS[0]].text
