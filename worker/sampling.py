"""Sampling: per-request SamplingParams, the per-batch SamplingBatchInfo, and the sampler."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_LOGPROBS = 20


class SamplingParams(BaseModel):
    """How to pick the tokens of one request. Invalid values raise a ValidationError naming the field."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    n: int = Field(1, ge=1, le=16, description="independent samples of the same prompt")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus: keep the smallest set with this mass")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top probability")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtract x count of the token in the output")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtract once if the token is in the output")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="HF-style: divide positive / multiply negative logits of seen tokens")
    seed: int | None = Field(None, description="per-request seed: same seed, same output")
    max_tokens: int | None = Field(None, ge=1, description="most new tokens; None = up to the context limit")
    min_tokens: int = Field(0, ge=0, description="EOS and stop ids are suppressed until this many tokens")
    stop: tuple[str, ...] = Field((), description="stop strings (applied on detokenized text)")
    stop_token_ids: tuple[int, ...] = Field((), description="extra token ids that end the request")
    ignore_eos: bool = Field(False, description="keep going past EOS")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="return the sampled token's logprob and this many top alternatives")
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the text")
    include_stop_str_in_output: bool = Field(False, description="keep the matched stop string in the text")

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0
