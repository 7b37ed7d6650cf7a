"""The FA3 prefill path's glue to FlashInfer (CPU, a recording stand-in for flashinfer): the
layout it plans (indptrs on the host, pinned, one token a page, causal), the wrappers used
in turn (each planned again only after its last plan's copy), and the cache handed over in
place. The kernels themselves are checked in tests/gpu."""

import sys
import types

import torch

from worker.attention import fa3


class _Wrapper:
    made: list["_Wrapper"] = []

    def __init__(self, workspace, layout, backend):
        self.layout, self.backend, self.plans, self.runs = layout, backend, [], []
        self.made.append(self)

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))

    def run(self, q, cache_kv, out=None):
        self.runs.append((q, cache_kv, out))
        return out


class _Event:
    """Records what `Fa3Prefill` does with a CUDA event, into one shared log."""

    log: list[tuple[str, "_Event"]] = []

    def record(self):
        self.log.append(("record", self))

    def synchronize(self):
        self.log.append(("synchronize", self))


def test_plans_each_sequences_slots_as_one_token_pages(monkeypatch):
    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_Wrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    pinned: list[torch.Tensor] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t) or t)
    _Wrapper.made.clear()
    _Event.log.clear()
    runner = fa3.Fa3Prefill(torch.device("cpu"))
    first, second = _Wrapper.made
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
    assert all(any(t is p for p in pinned) for t in host)
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
    assert runner.run(q, k_cache, v_cache, out) is out
    (_, (k, v), _), = second.runs  # fmt: skip
    assert k.shape == (12, 1, 2, 64) and k.data_ptr() == k_cache.data_ptr()  # in place
    assert v.shape == (12, 1, 2, 64) and v.data_ptr() == v_cache.data_ptr()

    runner.plan(slots, [3, 5], [4, 8], 8, 2, 64, torch.bfloat16, 0.125)
    runner.run(q, k_cache, v_cache, out)
    assert len(first.plans) == len(first.runs) == 1  # the next step: the other wrapper
    assert _Event.log[2][1] is not event  # ... and the other wrapper's event


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
