"""GemmTuner's bookkeeping on CPU, with a stand-in for csrc's kernels and fixed timings: what
it notes while recording, which candidate it keeps, what CudaOps then runs, and the file
that makes a restart choose the same. (The GPU suite times and runs the real thing.)"""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn.functional as F

from worker.model import gemm_tuning
from worker.model.gemm_tuning import DEFAULT, GemmTuner
from worker.model.ops import CudaOps

BF16 = torch.bfloat16


class _Kernels(types.SimpleNamespace):
    """csrc's lt_gemm stand-in: `count` candidates; candidate i computes F.linear and notes i."""

    def __init__(self, count: int) -> None:
        super().__init__(ran=[])
        self.count = count

    def lt_gemm_algos(self, x, w, bias, out, workspace, max_algos) -> int:
        return min(self.count, max_algos)

    def lt_gemm(self, x, w, bias, out, workspace, algo) -> None:
        self.ran.append(algo)
        out.copy_(F.linear(x, w, bias))


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setattr(gemm_tuning, "ALIGN", 1)  # CPU tensors are 64-byte aligned

    def workspace(self, device):
        self._workspace = torch.empty(0, dtype=torch.uint8)
        return self._workspace

    monkeypatch.setattr(GemmTuner, "workspace", workspace)


def _timings(monkeypatch, default_us: float, candidates_us: list[float]) -> None:
    """Timing answers default_us for torch's path and candidates_us[i] for candidate i."""

    def candidate(tuner, algo, x, out, workspace):
        def call(w, b):
            pass

        call.algo = algo
        return call

    def graph_us(call, weights, replays: int = 3) -> float:
        return default_us if call.algo == DEFAULT else candidates_us[call.algo]

    monkeypatch.setattr(GemmTuner, "_candidate", candidate)
    monkeypatch.setattr(gemm_tuning, "_graph_us", graph_us)


def _record(tuner: GemmTuner, m: int, layers: int = 3, n: int = 64, k: int = 32):
    ws = [torch.randn(n, k, dtype=BF16) for _ in range(layers)]
    x = torch.randn(m, k, dtype=BF16)
    with tuner.recording() as shapes:
        for w in ws:
            assert tuner.algo(x, w, None) == DEFAULT  # recording runs torch's own path
    return shapes, x, ws


def test_recording_notes_each_shape_once_per_weight_and_at_most_32_weights(tmp_path):
    tuner = GemmTuner(_Kernels(4), tmp_path / "c.json")
    shapes, x, ws = _record(tuner, 24, layers=40)
    assert list(shapes) == [gemm_tuning.key_of(x, ws[0], None)]
    assert len(shapes[gemm_tuning.key_of(x, ws[0], None)]) == 32
    with tuner.recording() as again:
        tuner.algo(x.float(), ws[0].float(), None)  # float32 stays on torch's path
    assert again == {}


@pytest.mark.parametrize(
    ("candidates_us", "want"),
    [([10.0, 8.0, 9.0], 1), ([10.0, 9.8, 11.0], DEFAULT), ([12.0, 13.0], DEFAULT)],
    ids=["faster", "within-noise", "slower"],
)
def test_a_candidate_replaces_the_default_only_when_clearly_faster(
    tmp_path, monkeypatch, candidates_us, want
):
    _timings(monkeypatch, 10.0, candidates_us)
    tuner = GemmTuner(_Kernels(len(candidates_us)), tmp_path / "c.json")
    shapes, x, ws = _record(tuner, 24)
    tuner.tune([shapes])
    assert tuner.choices == {gemm_tuning.key_of(x, ws[0], None): want}
    assert tuner.algo(x, ws[0], None) == want


def test_cuda_ops_run_the_kept_candidate_and_other_shapes_stay_on_torch(tmp_path, monkeypatch):
    _timings(monkeypatch, 10.0, [10.0, 5.0])
    kernels = _Kernels(2)
    ops = CudaOps(types.SimpleNamespace(), tuner=False)  # no csrc kernel runs these shapes
    ops._one_pass_kernel = lambda x, w: None
    ops.tuner = GemmTuner(kernels, tmp_path / "c.json")
    shapes, x, ws = _record(ops.tuner, 24)
    ops.tuner.tune([shapes])
    assert torch.equal(ops.linear(x, ws[0]), F.linear(x, ws[0])) and kernels.ran == [1]
    other = torch.randn(25, 32, dtype=BF16)  # a batch size that was never timed
    assert torch.equal(ops.linear(other, ws[0]), F.linear(other, ws[0])) and kernels.ran == [1]
    big = torch.randn(300, 32, dtype=BF16)  # past every timed batch: not even looked up
    assert ops.tuner.algo(big, ws[0], None) == DEFAULT and ops.tuner.max_rows == 24


def test_a_restart_reads_the_choices_and_times_only_new_shapes(tmp_path, monkeypatch):
    _timings(monkeypatch, 10.0, [10.0, 5.0])
    path = tmp_path / "c.json"
    first = GemmTuner(_Kernels(2), path)
    shapes, x, ws = _record(first, 24)
    first.tune([shapes])
    stored = json.loads(path.read_text())["choices"]
    assert stored == [{"key": list(gemm_tuning.key_of(x, ws[0], None)), "algo": 1}]

    _timings(monkeypatch, 10.0, [1.0, 50.0])  # would choose 0 if it timed the shape again
    restarted = GemmTuner(_Kernels(2), path)
    again, _, _ = _record(restarted, 24)
    more, x48, _ = _record(restarted, 48)
    restarted.tune([again, more])
    assert restarted.algo(x, ws[0], None) == 1
    assert restarted.algo(x48, ws[0], None) == 0


def test_an_unreadable_or_unwritable_file_leaves_the_choices_in_memory(tmp_path, monkeypatch):
    _timings(monkeypatch, 10.0, [5.0])
    path = tmp_path / "c.json"
    path.write_text("not json")
    tuner = GemmTuner(_Kernels(1), path / "below-a-file.json")  # its folder cannot be made
    shapes, x, ws = _record(tuner, 24)
    tuner.tune([shapes])
    assert tuner.algo(x, ws[0], None) == 0
