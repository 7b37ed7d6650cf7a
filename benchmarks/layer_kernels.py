"""Kernels one decoder layer launches in a decode step: TorchOps (the torch op sequence) vs
CudaOps (csrc's fused norm / RoPE / SiLU·mul), both with the CUDA attention backend.

Counted with the torch profiler on one eager decode step (B=1) as the difference between
a 3-layer and a 1-layer model of the same shape, so the embedding, final norm, logits and
sampling cancel out. Every kernel costs ~11 µs of host time when a step runs eagerly and
~1 µs inside a replayed graph (shared/GPU.md), which is why the count matters.

    python benchmarks/layer_kernels.py --shapes smollm2-135m llama3-8b --out kernels.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.decode_step import run_until_decoding
from worker.config import EngineConfig
from worker.engine import Engine, EngineRequest
from worker.model.ops import TorchOps
from worker.model.random_model import get_shape, hf_config
from worker.sampling import SamplingParams


def step_kernels(shape: str, layers: int, ops: str) -> int:
    """GPU kernels (copies and memsets excluded) of one steady eager decode step at B=1."""
    path = Path(tempfile.mkdtemp(prefix=f"kvray-{shape}-{layers}-"))
    cfg = hf_config(dataclasses.replace(get_shape(shape), num_layers=layers), "bfloat16")
    (path / "config.json").write_text(json.dumps(cfg))
    engine = Engine(EngineConfig(model=str(path), load_format="random", dtype="bfloat16", device="cuda",
                                 max_running=4, max_seq_len=256, num_pages=64, cuda_graphs=False))  # fmt: skip
    if ops == "torch":
        engine.executor.model.ops = TorchOps()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine.submit([EngineRequest("k", list(range(10, 42)), params)])
    run_until_decoding(engine)
    engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(1 for n in names if not n.startswith(("Memcpy", "Memset")))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama3-8b"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        for ops in ("torch", "cuda"):
            one, three = step_kernels(shape, 1, ops), step_kernels(shape, 3, ops)
            rows.append(
                dict(
                    shape=shape,
                    ops=ops,
                    per_layer=(three - one) / 2,
                    outside_layers=one - (three - one) // 2,
                )
            )
            print(f"{shape:14s} {ops:5s} ops: {(three - one) / 2:5.1f} kernels per layer, "
                  f"{one - (three - one) // 2} outside the layers", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(
            json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
