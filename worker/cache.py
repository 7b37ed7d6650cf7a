"""The KV cache: storage, the (request row, position) -> slot table, and two layouts.

- ContiguousCache: each admitted request owns a whole row of `max_seq_len` slots. Simple.
- PageCache: slots come in pages of `page_size`; full pages are shared through the prefix
  cache. The GPU default.

Both fill the same InferenceWorkspace in `bind_tasks`, once per step; when a step is the
last one plus one token for the same requests, the metadata is advanced in place.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from worker.attention.kv_quant import FP8, store_rows
from worker.batch import DecodeSteadyState, ForwardBatch
from worker.cache_view import CacheView
from worker.page_hash import extend_page_hashes
from worker.prefix_cache import PrefixCache
from worker.request import Request, ScheduledTask
from worker.workspace import InferenceWorkspace


class KVStorage:
    """One K and one V tensor `[n_layers, n_slots, n_kv_heads, head_dim]`, zeroed (masked reads stay finite).

    With an FP8 dtype, float32 scales `[n_layers, n_slots, n_kv_heads]` for K and for V sit
    beside them (worker/attention/kv_quant.py); otherwise `k_scale` and `v_scale` are None.

    `latent`: one row per token and layer that is both K and V (MLA's compressed kv and
    k_pe, `n_kv_heads` 1): `v` is the same tensor as `k`, stored once."""

    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        latent: bool = False,
    ):
        if latent and (n_kv_heads != 1 or dtype == FP8):
            raise ValueError("a latent KV cache has one row per token, not FP8")
        shape = (n_layers, n_slots, n_kv_heads, head_dim)
        self.latent = latent
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = self.k if latent else torch.zeros(shape, dtype=dtype, device=device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if dtype == FP8:
            self.k_scale = torch.zeros(shape[:3], dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(shape[:3], dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        scales = self.k_scale.numel() * 4 if self.k_scale is not None else 0
        return (1 if self.latent else 2) * (self.k.numel() * self.k.element_size() + scales)

    @staticmethod
    def bytes_per_token(
        n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, *, latent: bool = False
    ) -> int:
        row = head_dim * torch.empty((), dtype=dtype).element_size() + (4 if dtype == FP8 else 0)
        return (1 if latent else 2) * n_layers * n_kv_heads * row


class ReqToTokenPool:
    """int32 `[max_running + 1, max_seq_len]`: (row, position) -> slot, with a host mirror.

    The last row is the scratch row (all slot 0, the scratch page) that CUDA-graph padding
    uses. Writes go to the mirror and reach the device in one batched scatter per step,
    through preallocated staging buffers, so a steady step allocates nothing.
    """

    def __init__(self, max_running: int, max_seq_len: int, device: torch.device, staging: int):
        self.table = torch.zeros((max_running + 1, max_seq_len), dtype=torch.int32, device=device)
        self.host = np.zeros((max_running + 1, max_seq_len), dtype=np.int32)
        self.scratch_row = max_running
        self._free_rows = list(range(max_running - 1, -1, -1))
        self._dirty: list[tuple[int, int, int]] = []
        pin = device.type == "cuda"
        # A flush of n writes stages n int64 flat indices (as 2n int32) then their n values:
        # one copy carries both.
        self._staging = staging
        self._h_stage = torch.zeros(3 * staging, dtype=torch.int32, pin_memory=pin)
        self._d_stage = torch.zeros(3 * staging, dtype=torch.int32, device=device)
        # Recorded after each staged copy: the engine may bind the next step while the device
        # still runs this one, so the staging buffers are refilled only once their copy ran.
        self._copied = torch.cuda.Event() if pin else None

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def set_slots(self, row: int, start: int, slots: np.ndarray) -> None:
        self.host[row, start : start + len(slots)] = slots
        self._dirty.append((row, start, start + len(slots)))

    def flush(self) -> None:
        if not self._dirty:
            return
        width = self.host.shape[1]
        flat = np.concatenate(
            [np.arange(r * width + lo, r * width + hi) for r, lo, hi in self._dirty]
        )
        self._dirty.clear()
        values = self.host.reshape(-1)[flat]
        n = len(flat)
        if n > self._staging:  # a long prefix hit at admission: rare, allocate
            idx = torch.from_numpy(flat).to(self.table.device)
            self.table.view(-1).scatter_(0, idx, torch.from_numpy(values).to(self.table.device))
            return
        if self._copied is not None:
            self._copied.synchronize()
        host = self._h_stage.numpy()
        host[: 2 * n].view(np.int64)[:] = flat
        host[2 * n : 3 * n] = values
        self._d_stage[: 3 * n].copy_(self._h_stage[: 3 * n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        idx = self._d_stage[: 2 * n].view(torch.int64)
        self.table.view(-1).scatter_(0, idx, self._d_stage[2 * n : 3 * n])


@dataclass(frozen=True)
class _BindState:
    """What `bind_tasks` bound last: the ordered requests, their KV lengths, whether all decoded."""

    request_ids: tuple[int, ...]
    seq_lens: tuple[int, ...]
    all_decode: bool


def _is_steady_increment(prev: _BindState | None, now: _BindState) -> bool:
    """True when `now` is `prev` plus exactly one token for the same ordered requests.

    Then every request sampled last step, so its input is the sampled id already on the
    device, and all metadata can be advanced in place.
    """
    return (
        prev is not None
        and prev.all_decode
        and now.all_decode
        and prev.request_ids == now.request_ids
        and all(n == p + 1 for n, p in zip(now.seq_lens, prev.seq_lens, strict=True))
    )


class KVCache(CacheView):
    """Owns the storage and the slot table; admits, grows, binds and releases requests.
    `bind_tasks` fills the workspace with a step's metadata, `write` stores its K/V."""

    def __init__(
        self,
        storage: KVStorage,
        req_pool: ReqToTokenPool,
        page_size: int,
        workspace: InferenceWorkspace,
    ):
        self.k_cache, self.v_cache = storage.k, storage.v
        self.k_scale, self.v_scale = storage.k_scale, storage.v_scale
        self.storage, self.req_pool, self.page_size, self.ws = (
            storage,
            req_pool,
            page_size,
            workspace,
        )
        self.req_to_token, self.req_to_token_host = req_pool.table, req_pool.host
        self._task_len = np.zeros(req_pool.table.shape[0], dtype=np.int64)  # tokens bound per row
        self._last_bind: _BindState | None = None
        self.batch: ForwardBatch | None = None
        # Recorded after a host bind's copies. A step that samples nothing returns without
        # waiting for the device, so the next bind could refill the pinned staging buffers
        # while that step's copies still wait behind earlier work: it waits for them first.
        self._staged = torch.cuda.Event() if workspace.device.type == "cuda" else None

    # -- binding -------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        loc = self.batch.out_cache_loc if self.batch is not None else None
        assert loc is not None, "bind_tasks first"
        if self.k_scale is not None and self.v_scale is not None:
            store_rows(self.k_cache[layer], self.k_scale[layer], loc, k)
            store_rows(self.v_cache[layer], self.v_scale[layer], loc, v)
            return
        # index_copy_ on the layer's view: on CPU, `buf[layer, loc] = k` (index_put) is far slower.
        self.k_cache[layer].index_copy_(0, loc, k)
        if self.v_cache is not self.k_cache:  # a latent row is K and V at once
            self.v_cache[layer].index_copy_(0, loc, v)

    def bind_tasks(
        self, tasks: list[ScheduledTask], carried: Sequence[tuple[int, int]] = ()
    ) -> ForwardBatch:
        """Fill the workspace metadata for this step, once for all layers.

        `carried`: (packed input index, row of `next_token_ids`) for input tokens the previous
        step sampled that the host has not read yet; they are copied on the device. A steady
        step reads every input there anyway."""
        ws = self.ws
        rows = [t.request.row for t in tasks]
        starts = self._task_len[rows]
        seq_lens = [int(s) + t.num_new for s, t in zip(starts, tasks, strict=True)]
        now = _BindState(
            tuple(id(t.request) for t in tasks),
            tuple(seq_lens),
            all(t.num_new == 1 and t.samples for t in tasks),
        )
        steady = _is_steady_increment(self._last_bind, now)
        self._last_bind = now
        self.req_pool.flush()
        b = len(tasks)
        q_lens = [t.num_new for t in tasks]
        n_tokens = sum(q_lens)
        sample_rows = None
        if steady:
            ws.positions[:b] += 1
            ws.seq_lens[:b] += 1
            ws.kv_indptr[: b + 1] += ws.arange[: b + 1]
            # out_cache_loc = req_to_token[row, position], with out= ops only (no allocation)
            torch.add(ws.row_base[:b], ws.positions[:b], out=ws.flat_loc[:b])
            torch.index_select(self.req_to_token.view(-1), 0, ws.flat_loc[:b], out=ws.loc_i32[:b])
            ws.out_cache_loc[:b].copy_(ws.loc_i32[:b])
        else:
            sample_rows = self._bind_from_host(tasks, rows, starts, seq_lens, n_tokens, carried)
        self._task_len[rows] = seq_lens
        self.batch = ForwardBatch(
            input_ids=ws.input_ids[:n_tokens],
            positions=ws.positions[:n_tokens],
            out_cache_loc=ws.out_cache_loc[:n_tokens],
            req_pool_indices=ws.req_pool_indices[:b],
            seq_lens=ws.seq_lens[:b],
            qo_indptr=ws.qo_indptr[: b + 1],
            kv_indptr=ws.kv_indptr[: b + 1],
            logits_indices=ws.logits_indices[:b],
            q_lens=q_lens,
            seq_lens_host=seq_lens,
            rows_host=rows,
            steady=DecodeSteadyState(b) if steady else None,
            sample_rows=sample_rows,
        )
        return self.batch

    def _bind_from_host(
        self, tasks, rows, starts, seq_lens, n_tokens: int, carried: Sequence[tuple[int, int]]
    ) -> torch.Tensor | None:
        """Every buffer from the host lists, with whole-batch numpy ops (one small op per
        request would cost more than the bind), then one copy of the workspace's metadata
        block. Returns the rows of the tasks that sample when some do not
        (`ForwardBatch.sample_rows`), else None."""
        ws, b = self.ws, len(tasks)
        if self._staged is not None:
            self._staged.synchronize()
        h64, h32 = ws.host_i64.numpy(), ws.host_i32.numpy()
        q_lens = np.fromiter((t.num_new for t in tasks), dtype=np.int64, count=b)
        qo = q_lens.cumsum()
        # token i of task j sits at position starts[j] + (i - first index of task j)
        positions = np.arange(n_tokens, dtype=np.int64) + np.repeat(starts - (qo - q_lens), q_lens)
        h64[0, :n_tokens] = np.fromiter(
            chain.from_iterable(
                t.request.token_ids(int(s), int(s) + t.num_new)
                for t, s in zip(tasks, starts, strict=True)
            ),
            dtype=np.int64,
            count=n_tokens,
        )
        h64[1, :n_tokens] = positions
        table = self.req_pool.host
        row_base = np.asarray(rows, dtype=np.int64) * table.shape[1]
        h64[2, :n_tokens] = table.reshape(-1)[np.repeat(row_base, q_lens) + positions]
        h32[0, :b] = rows
        h32[1, :b] = seq_lens
        h32[2, 0], h32[3, 0] = 0, 0
        h32[2, 1 : b + 1] = qo
        h32[3, 1 : b + 1] = np.asarray(seq_lens).cumsum()
        hl = ws.host_logits.numpy()
        hl[0, :b] = h32[2, 1 : b + 1] - 1
        hl[0, b:] = 0  # rows past the batch pad `InferenceWorkspace.last_rows`: valid, unread
        hl[1, :b] = row_base
        sampling = np.flatnonzero(np.fromiter((t.samples for t in tasks), dtype=bool, count=b))
        sample_rows = None
        if len(sampling) < b:  # a prompt chunk that does not end its prompt samples nothing
            hl[2, : len(sampling)] = sampling
            sample_rows = ws.sample_rows[: len(sampling)]
        if carried:
            ws.host_carry.numpy()[:, : len(carried)] = np.asarray(carried, dtype=np.int64).T
        ws.meta.copy_(ws.host_meta, non_blocking=True)
        if carried:  # input_ids[at] = next_token_ids[row], over the host's placeholders
            n = len(carried)
            torch.index_select(ws.next_token_ids, 0, ws.carry[1, :n], out=ws.carried_ids[:n])
            ws.input_ids.index_copy_(0, ws.carry[0, :n], ws.carried_ids[:n])
        if self._staged is not None:
            self._staged.record()
        return sample_rows

    def invalidate_bind(self) -> None:
        """Forget the last bind (after an aborted step), so the next one rebuilds everything."""
        self._last_bind = None

    # -- capacity, in pages --------------------------------------------------------------
    @property
    @abstractmethod
    def num_total_pages(self) -> int: ...

    @property
    @abstractmethod
    def num_free_pages(self) -> int:
        """Pages a new request could get now (free plus evictable cached pages)."""

    @abstractmethod
    def pages_needed(self, request: Request, num_new: int) -> int:
        """Pages `reserve(request, num_new)` would take."""

    @abstractmethod
    def can_grow(self, num_requests: int, num_tokens: int) -> bool:
        """Can `num_requests` requests take `num_tokens` new tokens among them, however split,
        without running out of pages?"""

    # -- lifecycle -----------------------------------------------------------------------
    @abstractmethod
    def admit(self, request: Request) -> bool:
        """Give the request a row (and any cached prefix: sets num_computed). False: no row free."""

    @abstractmethod
    def reserve(self, request: Request, num_new: int) -> bool:
        """Make slots exist for its next `num_new` tokens. False (and no change) when out of pages."""

    @abstractmethod
    def release(self, request: Request) -> None:
        """Return its row and pages (full computed pages stay in the prefix cache)."""

    def commit(self, request: Request) -> None:
        """Called after a step advanced `num_computed`: publish newly full pages (prefix cache)."""

    def hash_ahead(self, tasks: list[ScheduledTask]) -> None:
        """After a step is queued, while the device runs it: key the full pages its prompt
        chunks fill, so that `commit` after it only publishes them (the prefix cache's
        hashing off a prompt's time to first token)."""

    def admitted(self, request: Request) -> None:
        """The scheduler kept an admission (it may roll one back and retry it next step)."""

    def prefix_summary(self) -> list[int]:
        """Keys of every cached page, most recently used first."""
        return []

    @property
    def prefix_stats(self) -> tuple[int, int]:
        """(hit tokens, queried tokens) since start."""
        return 0, 0

    def _reset_row(self, request: Request) -> None:
        self._task_len[request.row] = 0
        self.req_pool.free_row(request.row)
        request.row = -1


class ContiguousCache(KVCache):
    """Row r owns slots [r * max_seq_len, (r + 1) * max_seq_len): a request never runs out mid-way."""

    def __init__(self, storage: KVStorage, req_pool: ReqToTokenPool, workspace: InferenceWorkspace):
        max_running, max_seq_len = req_pool.scratch_row, req_pool.table.shape[1]
        super().__init__(storage, req_pool, page_size=max_seq_len, workspace=workspace)
        for row in range(max_running):
            req_pool.set_slots(
                row, 0, np.arange(row * max_seq_len, (row + 1) * max_seq_len, dtype=np.int32)
            )
        req_pool.flush()

    @property
    def num_total_pages(self) -> int:
        return self.req_pool.scratch_row

    @property
    def num_free_pages(self) -> int:
        return self.req_pool.num_free_rows

    def pages_needed(self, request: Request, num_new: int) -> int:
        return 0

    def can_grow(self, num_requests: int, num_tokens: int) -> bool:
        return True  # a row holds max_seq_len tokens: the context limit ends a request first

    def admit(self, request: Request) -> bool:
        row = self.req_pool.alloc_row()
        if row is None:
            return False
        request.row, request.num_computed = row, 0
        return True

    def reserve(self, request: Request, num_new: int) -> bool:
        return request.num_computed + num_new <= self.page_size

    def release(self, request: Request) -> None:
        if request.row >= 0:
            self._reset_row(request)


class PageCache(KVCache):
    """Pages of `page_size` slots; page 0 is a scratch page (graph padding writes there)."""

    def __init__(
        self,
        storage: KVStorage,
        req_pool: ReqToTokenPool,
        page_size: int,
        num_pages: int,
        workspace: InferenceWorkspace,
        prefix_cache: bool,
    ):
        super().__init__(storage, req_pool, page_size, workspace)
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))
        self._ref = np.zeros(num_pages, dtype=np.int32)
        self._pages: list[list[int]] = [[] for _ in range(req_pool.table.shape[0])]
        # pages of a row in the prefix cache
        self._published = np.zeros(req_pool.table.shape[0], dtype=np.int64)
        self.prefix = PrefixCache(page_size) if prefix_cache else None

    @property
    def num_total_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free) + (self.prefix.num_evictable if self.prefix else 0)

    def can_grow(self, num_requests: int, num_tokens: int) -> bool:
        # each request may open one page partly filled already, the tokens fill whole ones
        return self.num_free_pages >= num_requests + -(-num_tokens // self.page_size)

    def pages_needed(self, request: Request, num_new: int) -> int:
        have = len(self._pages[request.row]) if request.row >= 0 else 0
        return max(0, -(-(request.num_computed + num_new) // self.page_size) - have)

    def admit(self, request: Request) -> bool:
        row = self.req_pool.alloc_row()
        if row is None:
            return False
        request.row, request.num_computed = row, 0
        if self.prefix is not None:
            first = request.num_preemptions == 0
            hits = self._cached_prefix(request)
            for page in hits:
                self._ref[page] += 1
            if hits:
                self._pages[row] = list(hits)
                self._set_page_slots(row, 0, hits)
            self._published[row] = len(hits)
            request.num_computed = len(hits) * self.page_size
            self._task_len[row] = request.num_computed
            if first:
                request.num_cached = request.num_computed
        return True

    def _cached_prefix(self, request: Request) -> list[int]:
        """Pages of the request's longest cached prefix, of at most num_tokens - 1 tokens (the
        last one must run to give logits). Its keys are hashed as the walk needs them: a prompt
        whose first page misses costs one hash before its step, the rest are hashed while the
        step runs (`hash_ahead`)."""
        scored = request.prompt_logprobs
        if scored is not None and len(scored) < len(request.prompt_ids):
            return []  # every prompt token it has not scored yet must run
        assert self.prefix is not None
        limit = (request.num_tokens - 1) // self.page_size
        if limit == 0:
            return []
        _extend_keys(request, self.page_size, self.page_size)
        hits = self.prefix.match(request.page_keys[:1])
        if hits and limit > 1:
            _extend_keys(request, self.page_size, limit * self.page_size)
            hits += self.prefix.match(request.page_keys[1:limit])
        return hits

    def hash_ahead(self, tasks: list[ScheduledTask]) -> None:
        if self.prefix is None:
            return
        # The scheduler puts one-token rows first (decodes: a page fills over many steps, and
        # `commit` keys it cheaply), so a decode step costs one look at its last task.
        for t in reversed(tasks):
            if t.num_new == 1:
                break
            if t.request.row >= 0:
                _extend_keys(t.request, self.page_size, int(self._task_len[t.request.row]))

    def admitted(self, request: Request) -> None:
        if self.prefix is not None and request.num_preemptions == 0:
            self.prefix.record(request.num_tokens, request.num_cached)

    def reserve(self, request: Request, num_new: int) -> bool:
        need = self.pages_needed(request, num_new)
        if need == 0:
            return True
        if need > self.num_free_pages:
            return False
        new = self._take_pages(need)
        pages = self._pages[request.row]
        self._set_page_slots(request.row, len(pages), new)
        pages.extend(new)
        return True

    def commit(self, request: Request) -> None:
        if self.prefix is None:
            return
        row, n_full = request.row, request.num_computed // self.page_size
        if n_full <= self._published[row]:
            return
        _extend_keys(request, self.page_size, request.num_computed)
        first = int(self._published[row])
        self.prefix.publish(request.page_keys[first:n_full], self._pages[row][first:n_full])
        self._published[row] = n_full

    def release(self, request: Request) -> None:
        if request.row < 0:
            return
        self.commit(request)
        row = request.row
        deepest_first = self._pages[row][::-1]  # parked so: evicted before its ancestors
        self._ref[deepest_first] -= 1  # a row holds each page once
        refs = self._ref[deepest_first].tolist()
        unused = [p for p, n in zip(deepest_first, refs, strict=True) if n == 0]
        self._free.extend(self.prefix.park(unused) if self.prefix else unused)
        self._pages[row] = []
        self._published[row] = 0
        self._reset_row(request)

    def prefix_summary(self) -> list[int]:
        return self.prefix.summary() if self.prefix else []

    @property
    def prefix_stats(self) -> tuple[int, int]:
        return (self.prefix.hit_tokens, self.prefix.query_tokens) if self.prefix else (0, 0)

    def _take_pages(self, n: int) -> list[int]:
        """`n` pages, referenced once: free ones first, in the order popping them would give,
        then evicted cached ones (one slice, not a pop a page: a long prompt takes many)."""
        free = self._free
        k = min(n, len(free))
        pages = free[len(free) - k :][::-1]
        del free[len(free) - k :]
        pages += [self.prefix.evict() for _ in range(n - k)]  # type: ignore[union-attr]
        self._ref[pages] = 1
        return pages

    def _set_page_slots(self, row: int, first_page: int, pages: list[int]) -> None:
        ps = self.page_size
        slots = (
            np.asarray(pages, dtype=np.int32)[:, None] * ps + np.arange(ps, dtype=np.int32)
        ).reshape(-1)
        width = self.req_pool.host.shape[1]
        start = first_page * ps
        self.req_pool.set_slots(row, start, slots[: max(0, width - start)])


def _extend_keys(request: Request, page_size: int, upto: int) -> None:
    if len(request.page_keys) < upto // page_size:
        extend_page_hashes(request.page_keys, request.all_ids(), page_size, upto)
