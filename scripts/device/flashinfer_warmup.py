"""JIT-compile FlashInfer's paged decode kernels (tensor-core and CUDA-core paths) for the
benchmark's shapes, so the benchmark later only loads them. Run in the background by
gpu-check while the kvray kernels build and their tests run."""

from __future__ import annotations

import sys
import time

import torch


def main() -> None:
    import flashinfer

    hq, hkv, d, page, batch, pages = 32, 8, 128, 16, 2, 4
    k = torch.randn(batch * pages, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * pages
    indices = torch.arange(batch * pages, device="cuda", dtype=torch.int32)
    last = torch.full((batch,), page, device="cuda", dtype=torch.int32)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    modes = [m == "tc" for m in sys.argv[1:]] or [True, False]
    for tc in modes:
        t0 = time.time()
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tc)
        w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=torch.bfloat16)
        w.run(q, (k, v))
        torch.cuda.synchronize()
        print(
            f"flashinfer {flashinfer.__version__} tensor_cores={tc}: ready in {time.time() - t0:.1f}s",
            flush=True,
        )


if __name__ == "__main__":
    main()
