"""csrc's greedy argmax vs torch.argmax on the GPU: the same index in every row, ties, NaN,
signed zeros, masked rows and strided rows included, and its scratch left ready for the next
launch (inside a CUDA graph too)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from worker.attention import cuda_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
MAX_ROWS = 300


@pytest.fixture(scope="module")
def scratch() -> tuple[torch.Tensor, torch.Tensor]:
    cuda_ops.load()
    partial = torch.zeros(MAX_ROWS * cuda_ops.ARGMAX_MAX_BLOCKS, dtype=torch.int64, device=DEV)
    return partial, torch.zeros(MAX_ROWS, dtype=torch.int32, device=DEV)


def _argmax(x: torch.Tensor, scratch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    out = torch.full((x.shape[0],), -1, dtype=torch.int64, device=DEV)
    cuda_ops.argmax(x, out, *scratch)
    return out


def _check(x: torch.Tensor, scratch: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(_argmax(x, scratch), torch.argmax(x, dim=-1))
    assert int(scratch[1].abs().sum()) == 0  # counters back at zero


# vocabularies: tiny, unaligned (n % 4 != 0), one block's 4k either side, the demo's, Llama-3's
@pytest.mark.parametrize("vocab", [1, 7, 1000, 4095, 4097, 49152, 128256, 151937])
@pytest.mark.parametrize("rows", [1, 3, 32, MAX_ROWS])
def test_random_rows_match_torch(vocab, rows, scratch):
    torch.manual_seed(vocab + rows)
    _check(torch.randn(rows, vocab, device=DEV) * 4, scratch)


def test_ties_take_the_first_index_across_blocks(scratch):
    x = torch.randn(6, 128256, device=DEV)
    for r, cols in enumerate([[5, 90000], [90000, 5], [4095, 4096], [128255, 7], [0, 1, 2]]):
        x[r, cols] = 100.0
    x[5] = 3.0  # a constant row: index 0
    _check(x, scratch)
    assert _argmax(x, scratch).tolist() == [5, 5, 4095, 7, 0, 0]


def test_signed_zeros_tie_and_nan_ranks_above_everything(scratch):
    x = torch.full((5, 50000), -1.0, device=DEV)
    x[0, 30000], x[0, 10] = 0.0, -0.0  # equal maxima: the first index
    x[1, 9000], x[1, 40000] = float("nan"), float("nan")
    x[1, 20] = float("inf")
    x[2] = float("-inf")  # a fully masked row
    x[3, 49999] = float("inf")
    x[4, 123] = float("nan")
    _check(x, scratch)
    assert _argmax(x, scratch).tolist() == [10, 9000, 0, 49999, 123]


def test_strided_and_unaligned_rows(scratch):
    base = torch.randn(9, 49160, device=DEV)
    _check(base[:, :49152], scratch)  # a row stride past the vocabulary
    _check(base[:, 1:49153], scratch)  # rows off 16-byte alignment
    _check(base[:, :49155], scratch)  # neither n nor stride a multiple of 4


def test_replays_in_a_cuda_graph(scratch):
    x = torch.randn(32, 128256, device=DEV)
    out = torch.zeros(32, dtype=torch.int64, device=DEV)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cuda_ops.argmax(x, out, *scratch)  # warm-up off the default stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_ops.argmax(x, out, *scratch)
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, torch.argmax(x, dim=-1))
    assert int(scratch[1].abs().sum()) == 0


def test_bad_arguments_are_refused(scratch):
    x = torch.randn(4, 100, device=DEV)
    out = torch.zeros(4, dtype=torch.int64, device=DEV)
    with pytest.raises(RuntimeError, match="float32"):
        cuda_ops.argmax(x.half(), out, *scratch)
    with pytest.raises(RuntimeError, match="int64"):
        cuda_ops.argmax(x, out.int(), *scratch)
    with pytest.raises(ValueError, match="partial"):
        cuda_ops.argmax(x, out, scratch[0][:10], scratch[1])


def test_a_refusal_with_numbers_in_its_message_raises(scratch):
    """KV_CHECK in csrc/ops.cpp: such refusals once crashed the process on the lent GPUs, so
    this one runs in a child process, where a crash fails this test alone."""
    code = textwrap.dedent("""
        import torch
        from worker.attention import cuda_ops
        x = torch.randn(4, 100, device="cuda")
        out = torch.zeros(4, dtype=torch.int64, device="cuda")
        partial = torch.zeros(4 * cuda_ops.ARGMAX_MAX_BLOCKS, dtype=torch.int64, device="cuda")
        counters = torch.zeros(2, dtype=torch.int32, device="cuda")
        try:
            cuda_ops.argmax(x, out, partial, counters)
        except RuntimeError as exc:
            print(exc)
    """)
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    child = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=root,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert "counters has 2 entries, need 4" in child.stdout
