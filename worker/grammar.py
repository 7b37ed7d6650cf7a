"""Constrained decoding: compiled grammars (off the engine thread, cached by spec) and the
per-step token bitmasks the sampler applies on the device.

- `GrammarCompiler` compiles a `GuidedDecoding` into an llguidance matcher for one
  tokenizer, in a small thread pool, and keeps the result (or its error) per spec, most
  recently used first. `compile` returns a Future at once: the engine holds a request
  back until its grammar is ready, and never waits for one on its loop thread.
- `GrammarState` is one request's matcher (a copy of a compiled one, taken at its first use)
  and how many of its output tokens it has consumed.
- `MaskBuilder` fills, each step, one row of bits per constrained request into pinned host
  memory and copies the rows to the device in one copy, as a `worker.sampling.TokenMask`.
  The executor starts it after the step's forward is queued and takes the mask only when
  it must queue the step's sampling. On CUDA the rows are filled on a thread of the
  builder's, in parallel (llguidance's pool; it drops the GIL), while the engine's thread
  reads the step before and schedules the next one. On CPU they are filled one by one,
  at once: the cores that would fill them in parallel are the forward's.

llguidance builds a grammar's lexer lazily, during the first masks rather than at compile
time; copies of one compiled matcher share what it has built.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from worker.cores import usable_cores
from worker.guided import GuidedDecoding
from worker.sampling import TokenMask

log = logging.getLogger("kvray.grammar")

COMPILE_THREADS = 2
CACHE_SIZE = 256  # compiled grammars kept per engine


def fill_threads() -> int:
    """Threads that fill a step's masks on CUDA: llguidance's own default, 80 % of the cores
    (here the usable ones, under a container's CPU limit too), at most 32."""
    return max(1, min(32, int(0.8 * usable_cores())))


class GrammarError(ValueError):
    """A spec that passed the check but that the tokenizer-bound compile refused."""


class CompiledGrammar:
    """A spec's matchers in their initial state, one per compile of it, for requests'
    matchers to be copied from.

    Copies of one compile share the lexer states it builds lazily, behind a lock, so a step's
    rows copied from one compile are filled one after another even by llguidance's pool.
    So each request of a spec after its first asks `more` (the compile pool) for one more
    compile, up to `compiles`, and takes its copy only at its first mask, after its prompt,
    from the least copied compile: a burst of one schema spreads over the compiles made
    meanwhile, and a spec used once is compiled once.
    """

    def __init__(
        self,
        matcher: Any,
        seconds: float,
        compiles: int = 1,
        more: Callable[[CompiledGrammar], object] | None = None,
    ):
        self.seconds = seconds  # what one compile took
        self._matchers = [matcher]
        self._copies = [0]  # requests' copies of each
        self._lock = threading.Lock()
        self._requests = 0
        self._wanted = compiles - 1 if more is not None else 0
        self._more = more

    @property
    def compiles(self) -> int:
        return len(self._matchers)

    def state(self) -> GrammarState:
        """A new request's state; its matcher is copied at its first use (`copy`)."""
        with self._lock:
            self._requests += 1
            grow = self._requests > 1 and self._wanted > 0
            self._wanted -= grow
        if grow:
            assert self._more is not None
            self._more(self)
        return GrammarState(self)

    def copy(self) -> Any:
        """A copy of the compile fewest requests have copied so far."""
        with self._lock:
            i = min(range(len(self._copies)), key=self._copies.__getitem__)
            self._copies[i] += 1
            matcher = self._matchers[i]
        return matcher.deep_copy()

    def add(self, matcher: Any) -> None:
        """One more compile of the same spec (from the pool)."""
        with self._lock:
            self._matchers.append(matcher)
            self._copies.append(0)


class GrammarState:
    """One request's place in its grammar: it has consumed `consumed` output tokens."""

    def __init__(self, compiled: CompiledGrammar):
        self._compiled = compiled
        self.consumed = 0
        self.error: str | None = None  # set when a token was refused: the request fails

    @functools.cached_property
    def matcher(self) -> Any:
        return self._compiled.copy()

    def consume(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.consumed += 1
            if self.error is None and not self.matcher.consume_token(token):
                self.error = self.matcher.get_error() or f"the grammar refused token {token}"

    @property
    def done(self) -> bool:
        """The grammar admits nothing but the end of the output."""
        return bool(self.matcher.is_stopped())


class GrammarCompiler:
    """Compiles specs for one tokenizer; thread-safe. The tokenizer's llguidance tables are
    built on first use (about a second for a 50k vocabulary), in the pool, not at start."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        threads: int = COMPILE_THREADS,
        capacity: int = CACHE_SIZE,
        compiles: int = 1,
    ):
        """`compiles`: how many times a spec is compiled, at most, for its requests' matchers
        to come from (`CompiledGrammar`); as many as the masks are filled in parallel."""
        self._hf, self.vocab_size = hf_tokenizer, vocab_size
        self._compiles = compiles
        # a config's EOS id beyond the tokenizer's vocabulary is no token a grammar can allow
        self._eos = sorted(i for i in eos_token_ids if i < len(hf_tokenizer))
        self._capacity = capacity
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvray-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()

    def compile(self, guided: GuidedDecoding) -> Future[CompiledGrammar]:
        """The compiled grammar of `guided`, cached or on its way (a failed compile raises
        GrammarError from `result()`)."""
        key = (guided.kind, guided.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, guided)
            self._cache[key] = future
            if len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, guided: GuidedDecoding) -> CompiledGrammar:
        import llguidance

        tokenizer, text = self.tokenizer(), guided.grammar_text()
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        seconds = time.perf_counter() - start

        def more(compiled: CompiledGrammar) -> None:
            with contextlib.suppress(RuntimeError):  # a pool shut down: the engine stops
                self._pool.submit(
                    lambda: compiled.add(llguidance.LLMatcher(tokenizer, text, log_level=0))
                )

        return CompiledGrammar(matcher, seconds, self._compiles, more)

    def tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built once."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance.hf

                start = time.perf_counter()
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos
                )
                log.info("grammar tokenizer tables built in %.2fs", time.perf_counter() - start)
            return self._tokenizer


class MaskBuilder:
    """Fixed buffers for the masks of up to `max_rows` constrained requests a step: two
    pinned host buffers used in turn (a step's copy may still read the other one) and one
    device buffer. Each holds the rows' bits, then their batch row indices, so one copy
    moves both."""

    def __init__(
        self, vocab_size: int, max_rows: int, device: torch.device, threaded: bool | None = None
    ):
        """`threaded`: fill on the builder's thread (default: on CUDA, where a step's host
        work overlaps the device's)."""
        import llguidance

        self.vocab_size, self.width, self.max_rows = vocab_size, (vocab_size + 31) // 32, max_rows
        size = max_rows * (self.width + 1)
        cuda = device.type == "cuda"
        self._host = [torch.zeros(size, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._device = torch.zeros(size, dtype=torch.int32, device=device)
        # bit b of an int32 word, as int32 (bit 31 is the sign bit)
        bits = [1 << b for b in range(31)] + [-(1 << 31)]
        self._bits = torch.tensor(bits, dtype=torch.int32, device=device)
        self._executor = llguidance.LLExecutor(fill_threads()) if cuda else None
        threaded = cuda if threaded is None else threaded
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="kvray-mask") if threaded else None
        self._filling: Future[None] | None = None
        self._turn = 0

    def build(self, states: Sequence[GrammarState], rows: Sequence[int], batch: int) -> TokenMask:
        """The mask of batch rows `rows` (in order), state k constraining row rows[k]."""
        return self.start(states, rows, batch)()

    def start(
        self, states: Sequence[GrammarState], rows: Sequence[int], batch: int
    ) -> Callable[[], TokenMask]:
        """Begin the mask of `build`; the returned call waits for the rows, queues their copy
        to the device and gives the mask. The states must not be used until it is called."""
        self.settle()  # the last fill wrote the other buffer; it is done before this one starts
        k, width = len(states), self.width
        self._turn ^= 1
        host = self._host[self._turn]
        masks = host[: k * width].view(k, width)
        host[k * width : k * width + k] = torch.tensor(rows, dtype=torch.int32)
        if self._filler is not None:
            entered = threading.Event()

            def fill() -> None:
                entered.set()
                self._fill(states, masks)

            self._filling = self._filler.submit(fill)
            # Until llguidance drops the GIL, the filler needs it, and CPython hands it to a
            # waiting thread only after 5 ms of this one's Python: wait, so the filler starts now.
            entered.wait()
        else:  # filled now; a failure surfaces in `finish`, as one on the thread would
            self._filling = Future()
            try:
                self._fill(states, masks)
                self._filling.set_result(None)
            except Exception as e:
                self._filling.set_exception(e)

        def finish() -> TokenMask:
            self.settle(raise_error=True)
            for i, s in enumerate(states):
                if s.error is not None:  # a failed request samples freely until it is ended
                    masks[i].fill_(-1)
            device = self._device[: k * width + k]
            device.copy_(host[: k * width + k], non_blocking=True)
            all_rows = k == batch  # rows are 0..k-1 in order: no gather needed
            return TokenMask(
                device[: k * width].view(k, width),
                None if all_rows else device[k * width :].long(),
                self._bits,
            )

        return finish

    def settle(self, raise_error: bool = False) -> None:
        """Wait for the fill in flight, if any (its error raised only when asked)."""
        filling, self._filling = self._filling, None
        if filling is not None:
            error = filling.exception()
            if error is not None and raise_error:
                raise error

    def close(self) -> None:
        self.settle()
        if self._filler is not None:
            self._filler.shutdown(wait=False)

    def _fill(self, states: Sequence[GrammarState], masks: torch.Tensor) -> None:
        row_bytes, base = self.width * 4, masks.data_ptr()
        if self._executor is not None and len(states) > 1:
            pairs = [(s.matcher, k) for k, s in enumerate(states)]
            self._executor.unsafe_compute_mask_ptr(pairs, base, row_bytes, len(states))
        else:
            for k, s in enumerate(states):
                s.matcher.unsafe_compute_mask_ptr(base + k * row_bytes, row_bytes)
