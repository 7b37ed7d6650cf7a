"""Which physical GPU does each one-GPU Ray actor get, with one Ray node and with one node per
GPU (`cluster.local_ray.ray_session`)? Run on a multi-GPU machine with Ray installed:
    python3 scripts/device/ray-gpus.py
"""

from __future__ import annotations

import os

import ray
import torch

from cluster.local_ray import ray_session


@ray.remote(num_gpus=1)
class Probe:
    def where(self) -> dict:
        props = torch.cuda.get_device_properties(0)
        return {
            "node": ray.get_runtime_context().get_node_id()[:8],
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "ray_gpu_ids": ray.get_gpu_ids(),
            "uuid": str(props.uuid),
        }


def main() -> None:
    n = torch.cuda.device_count()
    print("physical:", [str(torch.cuda.get_device_properties(i).uuid) for i in range(n)])
    for nodes in (1, n):
        with ray_session(nodes=nodes, log_to_driver=False):
            probes = [Probe.remote() for _ in range(n)]
            print(f"{nodes} node(s):", ray.get([p.where.remote() for p in probes]))


if __name__ == "__main__":
    main()
