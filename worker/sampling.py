"""Sampling: per-request SamplingParams, the per-batch SamplingBatchInfo, and the sampler.

The engine builds a SamplingBatchInfo once per set of running requests (host data copied to
the device in one go), calls `sample` every step and `SamplingBatchInfo.record` after it.
A request's `logit_bias` is added to its row first, as OpenAI adds it to the logits before
sampling. Constrained requests (`SamplingParams.guided`) add a `TokenMask` of this step's grammar
bits, built by worker/grammar.py; rows without a grammar are left as they are.
Neither of those two touches the host: the engine's one copy of the sampled ids is the only
sync of a step. Work a batch does not need (penalties, sorting, log-softmax, noise) is left
out when the batch is built, by plain Python decisions on the host-side parameters.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from worker.guided import GuidedDecoding

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # tokens one request may bias (OpenAI documents no limit; 300 in practice)
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias lies in [-100, 100]
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # the range torch.Generator.manual_seed accepts
_NEG_INF = float("-inf")
# Floor for what divides logits (temperature, repetition penalty): smaller values underflow or
# overflow in float32, and at 1e-5 a draw already equals the argmax for any realistic logits.
_MIN_DIVISOR = 1e-5
_MIN_TOP_P = torch.finfo(torch.float32).tiny  # a smaller top_p rounds to 0 and masks every token


class SamplingParams(BaseModel):
    """How to pick the tokens of one request. Invalid values raise a ValidationError naming the field."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    n: int = Field(1, ge=1, le=16, description="independent samples of the same prompt")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = off")
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="nucleus: keep the smallest set with this mass"
    )
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top probability"
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="subtract x count of the token in the output"
    )
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="subtract once if the token is in the output"
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=10.0,
        description="HF-style: divide positive / multiply negative logits of seen tokens",
    )
    seed: int | None = Field(None, description="per-request seed: same seed, same output")
    max_tokens: int | None = Field(
        None,
        ge=0,
        description="most new tokens; None = up to the context limit; 0 = only score the prompt",
    )
    min_tokens: int = Field(
        0, ge=0, description="EOS and stop ids are suppressed until this many tokens"
    )
    stop: tuple[str, ...] = Field((), description="stop strings (applied on detokenized text)")
    stop_token_ids: tuple[int, ...] = Field((), description="extra token ids that end the request")
    ignore_eos: bool = Field(False, description="keep going past EOS")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="return the sampled token's logprob and this many top alternatives",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="return each prompt token's logprob (after the first) and this many top "
        "alternatives; the prompt is computed in full, not read from the prefix cache",
    )
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the text")
    include_stop_str_in_output: bool = Field(
        False, description="keep the matched stop string in the text"
    )
    guided: GuidedDecoding | None = Field(
        None, description="constrain the output to a JSON schema, a regex or a grammar"
    )
    logit_bias: tuple[tuple[int, float], ...] = Field(
        (),
        max_length=MAX_LOGIT_BIAS,
        description="(token id, bias) pairs added to the model's logits before anything else",
    )

    @field_validator("logit_bias")
    @classmethod
    def _bias_pairs(cls, pairs: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        tokens = [token for token, _ in pairs]
        if any(token < 0 for token in tokens):
            raise ValueError("logit_bias token ids must be >= 0")
        if len(set(tokens)) < len(tokens):
            raise ValueError("logit_bias names a token more than once")
        if any(not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE for _, bias in pairs):
            raise ValueError(
                f"logit_bias values lie in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"
            )
        return pairs

    @field_validator("seed")
    @classmethod
    def _seed_fits_generator(cls, seed: int | None) -> int | None:
        if seed is not None and not _SEED_MIN <= seed <= _SEED_MAX:
            raise ValueError(f"seed must lie in [{_SEED_MIN}, {_SEED_MAX}]")
        return seed

    @field_validator("min_tokens")
    @classmethod
    def _min_not_above_max(cls, min_tokens: int, info: ValidationInfo) -> int:
        max_tokens = info.data.get("max_tokens")  # declared before min_tokens, so already checked
        if max_tokens is not None and min_tokens > max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return min_tokens

    @field_validator("stop")
    @classmethod
    def _stops_non_empty(cls, stop: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_non_negative(cls, ids: tuple[int, ...]) -> tuple[int, ...]:
        if any(i < 0 for i in ids):
            raise ValueError("stop token ids must be >= 0")
        return ids

    @model_validator(mode="after")
    def _guided_without_min_tokens(self) -> SamplingParams:
        # a finished grammar allows only EOS, which min_tokens would forbid
        if self.guided is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with guided decoding")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(slots=True)
class SamplerOutput:
    """One step's result, all on the device; the engine copies `token_ids` to the host once."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: log_softmax(raw logits) at token_ids
    top_ids: torch.Tensor | None  # [B, K] int64, most likely first; K = largest `logprobs` asked
    top_logprobs: torch.Tensor | None  # [B, K] float32, matching top_ids


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor; on CUDA from pinned memory without waiting, so a build never syncs."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _token_counts(
    rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[B, V] float32 count of each token id in each row, filled on the device from one copy."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    flat = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    where = _to_device(torch.stack([row_of, flat]), device)
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    ones = torch.ones(flat.numel(), dtype=torch.float32, device=device)
    return counts.index_put_((where[0], where[1]), ones, accumulate=True)


@dataclass(eq=False)
class _Penalties:
    """Token-history penalties, each kept as the [B, V] tensor that one fused op per step needs.

    Built only when some row has a non-neutral penalty, and then only for the kinds in use.
    """

    repetition: torch.Tensor  # [B, 1]
    neg_frequency: torch.Tensor  # [B, 1] -frequency_penalty
    neg_presence: torch.Tensor  # [B, 1] -presence_penalty
    rep_scale: torch.Tensor | None  # [B, V] repetition penalty at prompt+output tokens, else 1
    counts: torch.Tensor | None  # [B, V] float32 times each token was generated
    present: torch.Tensor | None  # [B, V] float32 1.0 where the token was generated
    ones: torch.Tensor  # [B, 1] float32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Return penalized logits as a new tensor (the raw ones stay intact for logprobs)."""
        if self.rep_scale is not None:  # HF style: shrink positive logits, grow negative ones
            logits = torch.where(logits > 0, logits / self.rep_scale, logits * self.rep_scale)
        if self.counts is not None:
            logits = torch.addcmul(logits, self.counts, self.neg_frequency)
        if self.present is not None:
            logits = torch.addcmul(logits, self.present, self.neg_presence)
        return logits

    def record(self, token_ids: torch.Tensor) -> None:
        column = token_ids.view(-1, 1)
        if self.rep_scale is not None:
            self.rep_scale.scatter_(1, column, self.repetition)
        if self.counts is not None:
            self.counts.scatter_add_(1, column, self.ones)
        if self.present is not None:
            self.present.scatter_(1, column, self.ones)


@dataclass(eq=False)
class _LogitBias:
    """Every row's `logit_bias` as one sparse add (an index_add: atomics, no host sync)."""

    where: torch.Tensor  # [N] int64: row * V + token, into the flattened [B, V] logits
    values: torch.Tensor  # [N] float32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1)
        return flat.index_add(0, self.where, self.values).view_as(logits)


@dataclass(eq=False)
class _MinTokens:
    """Holds EOS and stop ids at -inf in rows that have produced fewer than min_tokens tokens."""

    stop_mask: torch.Tensor  # [B, V] bool: EOS and stop ids of rows short of min_tokens at build
    min_tokens: torch.Tensor  # [B, 1]
    out_len: torch.Tensor  # [B, 1] tokens produced so far, advanced by record()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(self.stop_mask & (self.out_len < self.min_tokens), _NEG_INF)


@dataclass(eq=False)
class _TopK:
    """Per-row top-k with its index arithmetic done at build, so a step spends no kernels on it."""

    keep: torch.Tensor  # [B, 1] int64: k, or V where off (compared with sorted ranks)
    kth_index: torch.Tensor  # [B, 1] int64: k - 1, or 0 where off (into a partial topk)
    off: torch.Tensor  # [B, 1] bool
    max_k: int
    ranks: torch.Tensor | None  # [V] 0..V-1 for the sorted (top-p) path; None without top-p

    def mask_(self, x: torch.Tensor) -> None:
        """One partial topk of the largest k, no full sort; ties at the k-th value stay."""
        kth = x.topk(self.max_k, dim=-1).values.gather(1, self.kth_index)
        x.masked_fill_(x < kth.masked_fill_(self.off, _NEG_INF), _NEG_INF)

    def mask_sorted_(self, sorted_x: torch.Tensor) -> None:
        assert self.ranks is not None
        sorted_x.masked_fill_(self.ranks >= self.keep, _NEG_INF)


@dataclass(eq=False)
class SamplingBatchInfo:
    """Per-row sampling state of one batch, on the device; rebuilt only when the batch changes.

    A field is None when no row of the batch needs it, and then `sample` skips that stage.
    """

    batch_size: int
    vocab_size: int
    device: torch.device
    all_greedy: bool
    greedy: torch.Tensor | None  # [B] bool; None when no row, or every row, is greedy
    temperature: torch.Tensor | None  # [B, 1]; 1.0 in greedy rows; None when all greedy
    top_k: _TopK | None  # None when no row uses it
    top_p: torch.Tensor | None  # [B, 1], inf = off; None when no row uses it
    log_min_p: torch.Tensor | None  # [B, 1], -inf = off; None when no row uses it
    penalties: _Penalties | None
    min_tokens: _MinTokens | None
    logit_bias: _LogitBias | None
    # sampling rows that draw their noise from their own generator
    seeded: tuple[tuple[int, torch.Generator], ...]
    any_unseeded: bool  # some sampling row draws from default_generator
    default_generator: torch.Generator | None  # None = torch's default generator of the device
    max_logprobs: int | None  # most top alternatives asked for; None = nobody wants logprobs
    grammar_rows: tuple[int, ...] = ()  # rows with a grammar: each step brings their TokenMask

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        *,
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Collection[int] = frozenset(),
        default_generator: torch.Generator | None = None,
    ) -> SamplingBatchInfo:
        """Gather the batch's parameters (row i = request i) and copy them to `device` once.

        `prompt_ids` / `output_ids` seed the penalty counts and min_tokens counters; after
        this, `record` keeps them current. A request's generator must live on `device`.
        """
        dev = torch.device(device)
        batch = len(params)
        _check_batch(batch, prompt_ids, output_ids, generators, dev, default_generator)
        floats, ints = _pack_scalars(params, output_ids, vocab_size, dev)
        sampling = [not p.greedy for p in params]
        sampled = [p for p in params if not p.greedy]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        top_p = floats[:, 1:2] if any(p.top_p < 1.0 for p in sampled) else None
        return cls(
            batch_size=batch,
            vocab_size=vocab_size,
            device=dev,
            all_greedy=not any(sampling),
            greedy=ints[:, 5].bool() if sampled and len(sampled) < batch else None,
            temperature=floats[:, 0:1] if sampled else None,
            top_k=_build_top_k(sampled, ints, vocab_size, with_ranks=top_p is not None),
            top_p=top_p,
            log_min_p=floats[:, 2:3] if any(p.min_p > 0.0 for p in sampled) else None,
            penalties=_build_penalties(params, prompt_ids, output_ids, floats, vocab_size, dev),
            min_tokens=_build_min_tokens(params, output_ids, ints, eos_token_ids, vocab_size, dev),
            logit_bias=_build_logit_bias(params, vocab_size, dev),
            seeded=tuple((i, g) for i, g in enumerate(generators) if g is not None and sampling[i]),
            any_unseeded=any(s and g is None for s, g in zip(sampling, generators, strict=True)),
            default_generator=default_generator,
            max_logprobs=min(max(logprobs), vocab_size) if logprobs else None,
            grammar_rows=tuple(i for i, p in enumerate(params) if p.guided is not None),
        )

    @property
    def plain_greedy(self) -> bool:
        """Every row takes the argmax of its (masked) logits and nothing else is asked."""
        return (
            self.all_greedy
            and self.penalties is None
            and self.min_tokens is None
            and self.logit_bias is None
            and self.max_logprobs is None
        )

    def record(self, token_ids: torch.Tensor) -> None:
        """Count this step's sampled ids ([B] int64, device) in place, for the next step."""
        if self.penalties is not None:
            self.penalties.record(token_ids)
        if self.min_tokens is not None:
            self.min_tokens.out_len.add_(1)


def _check_batch(
    batch: int,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
    device: torch.device,
    default_generator: torch.Generator | None,
) -> None:
    """Fail at build, with a plain message, on what would otherwise fail obscurely per step."""
    if batch == 0:
        raise ValueError("a sampling batch needs at least one request")
    if not batch == len(prompt_ids) == len(output_ids) == len(generators):
        raise ValueError(
            "params, prompt_ids, output_ids and generators must have one entry per row"
        )
    for g in [*generators, default_generator]:
        if g is not None and g.device.type != device.type:
            raise ValueError(f"generator on {g.device} cannot sample on {device}")


def _pack_scalars(
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every per-row scalar in two device tensors (two copies); the batch info keeps views.

    floats: temperature, top_p, log(min_p), repetition, -frequency, -presence.
    ints: top-k keep count, top-k kth index, top-k off flag, min_tokens, tokens produced
    so far, greedy flag.
    Greedy rows get neutral sampling values so they never divide by 0 or mask anything;
    divisors and top_p are floored where float32 would turn them into 0.
    """
    n = len(params)

    def column(values, dtype) -> np.ndarray:
        return np.fromiter(values, dtype=dtype, count=n)

    temperature = column((p.temperature for p in params), np.float64)
    top_p = column((p.top_p for p in params), np.float64)
    log_min_p = column(
        (math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params), np.float64
    )
    s = temperature != 0.0  # rows that sample
    floats = np.empty((n, 6), dtype=np.float32)
    floats[:, 0] = np.where(s, np.maximum(temperature, _MIN_DIVISOR), 1.0)
    floats[:, 1] = np.where(s & (top_p < 1.0), np.maximum(top_p, _MIN_TOP_P), math.inf)
    floats[:, 2] = np.where(s, log_min_p, -math.inf)
    floats[:, 3] = np.maximum(
        column((p.repetition_penalty for p in params), np.float64), _MIN_DIVISOR
    )
    floats[:, 4] = -column((p.frequency_penalty for p in params), np.float64)
    floats[:, 5] = -column((p.presence_penalty for p in params), np.float64)
    k = np.where(s, np.minimum(column((p.top_k for p in params), np.int64), vocab_size), 0)
    ints = np.empty((n, 6), dtype=np.int64)
    ints[:, 0] = np.where(k == 0, vocab_size, k)
    ints[:, 1] = np.maximum(k - 1, 0)
    ints[:, 2] = k == 0
    ints[:, 3] = column((p.min_tokens for p in params), np.int64)
    ints[:, 4] = column((len(out) for out in output_ids), np.int64)
    ints[:, 5] = ~s
    return _to_device(torch.from_numpy(floats), device), _to_device(torch.from_numpy(ints), device)


def _build_penalties(
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    floats: torch.Tensor,
    vocab_size: int,
    device: torch.device,
) -> _Penalties | None:
    """History tensors only for the penalties some row uses, and only that row's history."""
    use_rep = [p.repetition_penalty != 1.0 for p in params]
    use_freq = [p.frequency_penalty != 0.0 for p in params]
    use_pres = [p.presence_penalty != 0.0 for p in params]
    if not any(use_rep + use_freq + use_pres):
        return None
    repetition = floats[:, 3:4]
    rep_scale = None
    if any(use_rep):
        history = [
            [*pr, *out] if u else []
            for pr, out, u in zip(prompt_ids, output_ids, use_rep, strict=True)
        ]
        rep_scale = torch.where(_token_counts(history, vocab_size, device) > 0, repetition, 1.0)
    counts = present = None
    if any(use_freq + use_pres):
        use_out = [f or p for f, p in zip(use_freq, use_pres, strict=True)]
        outputs = [out if u else [] for out, u in zip(output_ids, use_out, strict=True)]
        generated = _token_counts(outputs, vocab_size, device)
        counts = generated if any(use_freq) else None
        present = (generated > 0).float() if any(use_pres) else None
    ones = torch.ones(len(params), 1, device=device)
    return _Penalties(repetition, floats[:, 4:5], floats[:, 5:6], rep_scale, counts, present, ones)


def _build_min_tokens(
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    ints: torch.Tensor,
    eos_token_ids: Collection[int],
    vocab_size: int,
    device: torch.device,
) -> _MinTokens | None:
    """Mask of EOS and stop ids, in the rows still short of min_tokens."""
    stops = [
        [t for t in {*eos_token_ids, *p.stop_token_ids} if t < vocab_size]
        if len(out) < p.min_tokens
        else []
        for p, out in zip(params, output_ids, strict=True)
    ]
    if not any(stops):
        return None
    stop_mask = _token_counts(stops, vocab_size, device) > 0
    return _MinTokens(stop_mask, ints[:, 3:4], ints[:, 4:5])


def _build_logit_bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> _LogitBias | None:
    pairs = [
        (row, token, bias)
        for row, p in enumerate(params)
        for token, bias in p.logit_bias
        if token < vocab_size  # the engine's checks refuse others; the LM head may be wider
    ]
    if not pairs:
        return None
    where = torch.tensor([row * vocab_size + token for row, token, _ in pairs], dtype=torch.int64)
    biases = torch.tensor([bias for _, _, bias in pairs], dtype=torch.float32)
    return _LogitBias(_to_device(where, device), _to_device(biases, device))


def _build_top_k(
    sampled: Sequence[SamplingParams], ints: torch.Tensor, vocab_size: int, *, with_ranks: bool
) -> _TopK | None:
    max_k = min(max((p.top_k for p in sampled), default=0), vocab_size)
    if max_k == 0:
        return None
    ranks = torch.arange(vocab_size, device=ints.device) if with_ranks else None
    return _TopK(ints[:, 0:1], ints[:, 1:2], ints[:, 2:3].bool(), max_k, ranks)


@dataclass(eq=False)
class TokenMask:
    """One step's grammar masks, on the device: bit t of `bitmask[k]` allows token t in batch
    row `rows[k]` (`rows` None: row k itself, every row constrained)."""

    bitmask: torch.Tensor  # [K, ceil(V / 32)] int32
    rows: torch.Tensor | None  # [K] int64 batch rows, or None
    bits: torch.Tensor  # [32] int32: 1 << b

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """`x` ([B, V]) with the tokens the grammars forbid at -inf, as a new tensor."""
        k, vocab = self.bitmask.shape[0], x.shape[1]
        blocked = (self.bitmask.unsqueeze(-1) & self.bits).eq(0).view(k, -1)[:, :vocab]
        if self.rows is None:
            return x.masked_fill(blocked, _NEG_INF)
        masked = x.index_select(0, self.rows).masked_fill_(blocked, _NEG_INF)
        return x.index_copy(0, self.rows, masked)


def penalized_logits(
    logits: torch.Tensor, info: SamplingBatchInfo, mask: TokenMask | None = None
) -> torch.Tensor:
    """`logits` after logit_bias, penalties, min_tokens and the grammars' mask: what greedy
    rows take the argmax of.

    Returns `logits` itself (as float32) when the batch has none of them; never modifies it.
    """
    if logits.shape != (info.batch_size, info.vocab_size):
        shape = tuple(logits.shape)
        raise ValueError(f"logits {shape} do not match batch {info.batch_size} x {info.vocab_size}")
    x = logits.float()
    x = x if info.logit_bias is None else info.logit_bias.apply(x)
    x = x if info.penalties is None else info.penalties.apply(x)
    x = x if info.min_tokens is None else info.min_tokens.apply(x)
    return x if mask is None else mask.apply(x)


def sample(
    logits: torch.Tensor, info: SamplingBatchInfo, mask: TokenMask | None = None
) -> SamplerOutput:
    """Pick one token per row of `logits` ([B, V], row i = request i); no host sync.

    Order: logit_bias, penalties, min_tokens, the grammars' mask, temperature, top-k,
    top-p, min-p, then a draw. Greedy rows take the argmax after the first four. `logits` is left
    unmodified, and logprobs are the model's own (before any of this).
    """
    x = penalized_logits(logits, info, mask)
    ids = x.argmax(dim=-1) if info.all_greedy else _sample_rows(x, info)
    return _with_logprobs(logits.float(), ids, info)


def _sample_rows(x: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    assert info.temperature is not None  # set whenever a row samples
    greedy_ids = x.argmax(dim=-1) if info.greedy is not None else None
    x = x / info.temperature  # a new tensor: the stages below work in place on it
    _top_k_top_p_(x, info)
    if info.log_min_p is not None:
        x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + info.log_min_p, _NEG_INF)
    ids = _exponential_race(x.softmax(dim=-1), info)
    if info.greedy is None or greedy_ids is None:
        return ids
    return torch.where(info.greedy, greedy_ids, ids)


def _top_k_top_p_(x: torch.Tensor, info: SamplingBatchInfo) -> None:
    """Mask, in place, what falls outside each row's top-k and nucleus; sorts only for top-p."""
    if info.top_p is None:
        if info.top_k is not None:
            info.top_k.mask_(x)
        return
    sorted_x, order = x.sort(dim=-1, descending=True)
    if info.top_k is not None:
        info.top_k.mask_sorted_(sorted_x)
    probs = sorted_x.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)  # the top token always has 0 before it
    sorted_x.masked_fill_(mass_before >= info.top_p, _NEG_INF)
    x.scatter_(1, order, sorted_x)


def _exponential_race(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """argmax(p / E), E ~ Exp(1) i.i.d., picks token i with probability p_i (no cumsum, no sync).

    Seeded rows draw their noise from their own generator, V values per step, so their
    draws do not depend on which other requests share the batch.
    """
    noise = torch.empty_like(probs)
    if info.any_unseeded:
        noise.exponential_(generator=info.default_generator)
    elif info.greedy is not None:
        noise.fill_(1.0)  # only greedy rows are left undrawn; their pick is replaced anyway
    for row, generator in info.seeded:
        noise[row].exponential_(generator=generator)
    # An exact 0 from the noise would turn a masked 0 probability into NaN, which argmax picks.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)


def _with_logprobs(raw: torch.Tensor, ids: torch.Tensor, info: SamplingBatchInfo) -> SamplerOutput:
    """Logprobs under the model's own distribution, computed only when some row asked."""
    if info.max_logprobs is None:
        return SamplerOutput(ids, None, None, None)
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, ids.view(-1, 1)).view(-1)
    if info.max_logprobs == 0:
        return SamplerOutput(ids, chosen, None, None)
    top = logprobs.topk(info.max_logprobs, dim=-1)
    return SamplerOutput(ids, chosen, top.indices, top.values)
