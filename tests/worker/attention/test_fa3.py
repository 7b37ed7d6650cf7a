"""The FA3 prefill path's glue to FlashInfer (CPU, a recording stand-in for flashinfer): the
layout it plans (indptrs on the host, pinned, one token a page, causal), the wrappers used
in turn (each planned again only after its last plan's copy), the cache handed over in
place, and fresh prompts' new K/V to the ragged kernel. The kernels themselves are checked
in tests/gpu."""

import functools
import itertools
import sys
import types

import numpy as np
import torch

from worker.attention import fa3
from worker.batch import ForwardBatch


class _Wrapper:
    made: list["_Wrapper"] = []

    def __init__(self, workspace, layout, backend):
        self.layout, self.backend, self.plans, self.runs = layout, backend, [], []
        self.made.append(self)

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))

    def run(self, q, *kv, out=None):
        self.runs.append((q, *kv, out))
        return out


class _Ragged(_Wrapper):
    pass


def _runner(monkeypatch, pinned: list[torch.Tensor]) -> fa3.Fa3Prefill:
    """A `Fa3Prefill` over the stand-ins; the tensors it pins go to `pinned`."""
    fake = types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_Wrapper,
        BatchPrefillWithRaggedKVCacheWrapper=_Ragged,
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t) or t)
    _Wrapper.made.clear()
    _Event.log.clear()
    return fa3.Fa3Prefill(torch.device("cpu"))


class _Event:
    """Records what `Fa3Prefill` does with a CUDA event, into one shared log."""

    log: list[tuple[str, "_Event"]] = []

    def record(self):
        self.log.append(("record", self))

    def synchronize(self):
        self.log.append(("synchronize", self))


def test_plans_each_sequences_slots_as_one_token_pages(monkeypatch):
    pinned: list[torch.Tensor] = []
    runner = _runner(monkeypatch, pinned)
    first, second, *ragged = _Wrapper.made
    assert not any(isinstance(w, _Ragged) for w in (first, second))
    assert (first.layout, first.backend) == ("NHD", "fa3") and first is not second
    slots = torch.arange(12, dtype=torch.int32)
    runner.plan(slots, [3, 5], [4, 8], 8, 2, 64, torch.bfloat16, 0.125)
    (args, kwargs), = second.plans  # fmt: skip
    qo, kv, indices, last, heads, kv_heads, head_dim, page = args
    assert qo.tolist() == [0, 3, 8] and kv.tolist() == [0, 4, 12] and last.tolist() == [1, 1]
    assert kwargs["seq_lens"].tolist() == [4, 8]
    host = (qo, kv, last, kwargs["seq_lens"])
    assert all(t.device.type == "cpu" and t.dtype == torch.int32 for t in host)
    # pinned, or FlashInfer's non_blocking copies of them would wait for the device
    assert all(_pinned_by(t, pinned) for t in host)
    # the wrapper's last plan was copied before its pinned buffer is planned into again
    (waited, event), (recorded, same) = _Event.log  # fmt: skip
    assert (waited, recorded) == ("synchronize", "record") and event is same
    assert (heads, kv_heads, head_dim, page) == (8, 2, 64, 1)
    # the slots, then a K/V tile's worth of valid ones that FA3's unchecked index reads may reach
    assert torch.equal(indices[:12], slots) and len(indices) == 12 + fa3.INDEX_PAD
    assert not indices[12:].any()
    assert kwargs["causal"] and kwargs["sm_scale"] == 0.125
    assert kwargs["q_data_type"] == kwargs["kv_data_type"] == torch.bfloat16

    q, out = torch.zeros(8, 8, 64), torch.zeros(8, 8, 64)
    k_cache, v_cache = torch.zeros(12, 2, 64), torch.zeros(12, 2, 64)
    assert not runner.ragged
    assert runner.run(q, k_cache, v_cache, out) is out
    (_, (k, v), _), = second.runs  # fmt: skip
    assert k.shape == (12, 1, 2, 64) and k.data_ptr() == k_cache.data_ptr()  # in place
    assert v.shape == (12, 1, 2, 64) and v.data_ptr() == v_cache.data_ptr()

    runner.plan(slots, [3, 5], [4, 8], 8, 2, 64, torch.bfloat16, 0.125)
    runner.run(q, k_cache, v_cache, out)
    assert len(first.plans) == len(first.runs) == 1  # the next step: the other wrapper
    assert _Event.log[2][1] is not event  # ... and the other wrapper's event
    # ... and the other set's pinned buffer: the first set's may still be in flight
    other_qo = first.plans[0][0][0]
    assert _pinned_by(other_qo, pinned) and not _shares(other_qo, qo)
    assert not any(w.plans for w in ragged)


def test_fresh_prompts_go_to_the_ragged_kernel_on_their_new_rows(monkeypatch):
    """No cached context (no slots): the ragged wrapper of the turn's set, planned with the
    query offsets as the key offsets (pinned, causal), runs on the new K/V as given."""
    pinned: list[torch.Tensor] = []
    runner = _runner(monkeypatch, pinned)
    paged = [w for w in _Wrapper.made if not isinstance(w, _Ragged)]
    first, second = [w for w in _Wrapper.made if isinstance(w, _Ragged)]
    assert (first.layout, first.backend) == ("NHD", "fa3")
    runner.plan(None, [3, 5], [3, 5], 8, 2, 64, torch.bfloat16, 0.125)
    assert runner.ragged
    (args, kwargs), = second.plans  # fmt: skip
    qo, kv, heads, kv_heads, head_dim = args
    assert qo.tolist() == kv.tolist() == [0, 3, 8]
    assert all(_pinned_by(t, pinned) for t in (qo, kv))
    assert (heads, kv_heads, head_dim) == (8, 2, 64)
    assert kwargs["causal"] and kwargs["sm_scale"] == 0.125
    assert kwargs["q_data_type"] == kwargs["kv_data_type"] == torch.bfloat16

    fused = torch.zeros(8, 12, 64)  # q, k, v rows of one projection: strided views
    q, k, v, out = fused[:, :8], fused[:, 8:10], fused[:, 10:], torch.zeros(8, 8, 64)
    assert runner.run(q, k, v, out) is out
    (_, k_in, v_in, _), = second.runs  # fmt: skip
    assert k_in is k and v_in is v  # as given: no copy, no cache
    # the next step has cached context: the paged wrapper of the other set
    runner.plan(torch.arange(12, dtype=torch.int32), [3, 5], [4, 8], 8, 2, 64, torch.bfloat16, 1.0)
    assert not runner.ragged and len(paged[0].plans) == 1 and not first.plans
    runner.plan(None, [3, 5], [3, 5], 8, 2, 64, torch.bfloat16, 0.125)
    assert len(second.plans) == 2  # ... and the ragged one of this set after it
    # each plan waited for its set's last copy: the event recorded two plans before
    assert [kind for kind, _ in _Event.log] == ["synchronize", "record"] * 3
    assert _Event.log[4][1] is _Event.log[1][1]


def test_a_batch_past_the_pinned_buffer_gets_a_larger_one(monkeypatch):
    pinned: list[torch.Tensor] = []
    runner = _runner(monkeypatch, pinned)
    n = fa3.HOST_INTS  # four rows of lengths and offsets: four times the buffer
    runner.plan(torch.arange(2 * n, dtype=torch.int32), [1] * n, [2] * n, 8, 2, 64,
                torch.bfloat16, 0.125)  # fmt: skip
    (args, kwargs), = _Wrapper.made[1].plans  # fmt: skip
    qo, kv, _, last = args[:4]
    assert qo.tolist() == list(range(n + 1)) and kv.tolist() == list(range(0, 2 * n + 1, 2))
    assert last.tolist() == [1] * n and kwargs["seq_lens"].tolist() == [2] * n
    assert all(_pinned_by(t, pinned[2:]) for t in (qo, kv, last, kwargs["seq_lens"]))


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _pinned_by(t: torch.Tensor, pinned: list[torch.Tensor]) -> bool:
    """`t` lies in one of the tensors handed to `pin_memory`."""
    return any(_shares(t, p) for p in pinned)


def test_unavailable_without_a_hopper_gpu():
    """kvray keeps its own kernels where FA3 cannot run: no CUDA here, so no FlashInfer
    import or build is attempted."""
    fa3.available.cache_clear()
    assert not fa3.available(torch.bfloat16, 128)
    assert not fa3.available(torch.float32, 128)


def test_auto_takes_fa3_only_where_it_runs(monkeypatch):
    monkeypatch.setattr(fa3, "available", lambda dtype, head_dim: True)
    assert fa3.resolve("auto", torch.bfloat16, 128) == "fa3"
    assert fa3.resolve("flash", torch.bfloat16, 128) == "flash"  # asked for: kept
    monkeypatch.setattr(fa3, "available", lambda dtype, head_dim: False)
    assert fa3.resolve("auto", torch.bfloat16, 128) == "auto"


def test_a_lone_fresh_prompt_plans_fa3_behind_its_first_layer(monkeypatch):
    """The CUDA backend's order of work (its kernels stood in for): a lone fresh prompt runs
    its first layer on FlashAttention-2, which needs no plan, and plans FA3 at the second, when
    the device has that layer's MLP to run; prompts beside others, or with cached context,
    plan FA3 before the first layer. (The kernels' numbers: tests/gpu/test_engine_gpu.py.)"""
    from worker.attention import cuda as cuda_backend
    from worker.attention import flash

    _runner(monkeypatch, [])  # the stand-in flashinfer, events and pinning
    monkeypatch.setattr(cuda_backend.cuda_ops, "load", lambda: None)
    monkeypatch.setattr(fa3, "available", lambda dtype, head_dim: True)
    monkeypatch.setattr(flash, "available", lambda dtype, head_dim: True)
    calls: list[str] = []

    def fresh(q, k, v, cu, max_len, scale):
        calls.append(f"fa2 {cu.tolist()} {max_len}")
        return torch.zeros_like(q)

    monkeypatch.setattr(flash, "fresh", fresh)
    ws = types.SimpleNamespace(decode_out=torch.zeros(1, 8, 64, dtype=torch.bfloat16))
    backend = cuda_backend.CudaBackend(8, 64, ws, "fa3")
    runner = backend._fa3
    assert runner is not None
    plan, run = runner.plan, runner.run
    monkeypatch.setattr(
        runner, "plan", lambda slots, *a: calls.append(f"plan {slots}") or plan(slots, *a)
    )
    monkeypatch.setattr(runner, "run", lambda *a: calls.append("fa3") or run(*a))
    cache = torch.zeros(3, 64, 2, 64, dtype=torch.bfloat16)
    view = types.SimpleNamespace(
        k_cache=cache,
        v_cache=cache,
        k_scale=None,
        req_to_token_host=np.arange(128, dtype=np.int32).reshape(2, 64),
    )

    def prompt_step(q_lens: list[int], kv_lens: list[int]) -> list[str]:
        calls.clear()
        n, cu = sum(q_lens), [0, *itertools.accumulate(q_lens)]
        i32 = functools.partial(torch.tensor, dtype=torch.int32)
        batch = ForwardBatch(
            input_ids=torch.zeros(n, dtype=torch.int64), positions=torch.zeros(n), out_cache_loc=torch.zeros(n),
            req_pool_indices=i32(range(len(q_lens))), seq_lens=i32(kv_lens), qo_indptr=i32(cu),
            kv_indptr=i32([0, *itertools.accumulate(kv_lens)]), logits_indices=torch.zeros(len(q_lens)),
            q_lens=q_lens, seq_lens_host=kv_lens, rows_host=list(range(len(q_lens))),
        )  # fmt: skip
        backend.prepare(batch, view)
        fused = torch.zeros(n, 12, 64, dtype=torch.bfloat16)  # q, k, v as views of one projection
        q, k, v = fused[:, :8], fused[:, 8:10], fused[:, 10:]
        for layer in range(3):
            backend.fwd_prefill(layer, q, view, new_kv=(k, v))
        return list(calls)

    assert prompt_step([5], [5]) == ["fa2 [0, 5] 5", "plan None", "fa3", "fa3"]
    assert prompt_step([5, 3], [5, 3]) == ["plan None", "fa3", "fa3", "fa3"]
    with_context = prompt_step([5], [9])
    assert with_context[0].startswith("plan tensor") and with_context[1:] == ["fa3"] * 3
    # the deferred plan is FA3's ragged one of the prompt as a whole
    assert prompt_step([7], [7])[:2] == ["fa2 [0, 7] 7", "plan None"] and runner.ragged
