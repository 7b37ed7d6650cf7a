"""The demo model (SmolLM2-135M-Instruct) through kvray vs transformers on the converted directory."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.factories.logits import packed_logits
from worker import LLM, SamplingParams

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm():
    return LLM("demo", num_pages=256, max_seq_len=1024, max_running=8)


def test_chat_logits_match_transformers(llm):
    tok = llm.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": QUESTION}]),
        tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}]),
    ]
    ours = packed_logits(llm.engine.executor, prompts)
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].float()
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_greedy_chat_answer_names_paris(llm):
    out = llm.generate(QUESTION, SamplingParams(temperature=0, max_tokens=40), chat=True)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # it ends on <|im_end|> by itself
