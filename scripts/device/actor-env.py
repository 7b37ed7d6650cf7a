"""Is an engine on CPU slower inside a Ray actor than in a plain process? Decode step time of
one request at a time (the bench's concurrency 1), in this process and in actors like a
worker replica (num_cpus=1), with the environment each one sees (thread and OMP settings).
On the GPU host: python3 scripts/device/actor-env.py [THREADS]  (.tok carried)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.getcwd())
MODEL = "/tmp/demo-shape"
ENV_KEYS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "LD_PRELOAD",
    "OMP_PROC_BIND",
    "KMP_AFFINITY",
)


def probe(threads: int) -> dict:
    import torch

    from worker.config import EngineConfig
    from worker.engine import Engine, EngineRequest
    from worker.sampling import SamplingParams

    torch.set_num_threads(threads)
    info: dict = {k: os.environ.get(k) for k in ENV_KEYS}
    info |= {
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "torch_threads": torch.get_num_threads(),
    }
    engine = Engine(EngineConfig(model=MODEL, load_format="random", device="cpu"))
    engine.start()
    steps = []
    for i in range(4):
        before = engine.stats()
        stream = engine.submit(
            [
                EngineRequest(
                    f"r{i}",
                    list(range(100, 164)),
                    SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0),
                )
            ]
        )
        while not stream.finished:
            time.sleep(0.002)
            stream.poll()
        after = engine.stats()
        steps.append(
            round(
                1e3
                * (after.step_seconds_total - before.step_seconds_total)
                / (after.num_steps - before.num_steps),
                2,
            )
        )
    engine.shutdown()
    info["step_ms"] = steps
    info["parallel"] = [
        line
        for line in torch.__config__.parallel_info().splitlines()
        if "OpenMP" in line or "threads" in line.lower()
    ][:6]
    return info


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    from worker.model.random_model import write_random_model

    write_random_model(MODEL, "smollm2-135m", weights=False)
    for f in os.listdir(".tok"):
        shutil.copy(os.path.join(".tok", f), MODEL)
    print("driver", json.dumps(probe(threads)), flush=True)
    import ray

    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    remote = ray.remote(num_cpus=1)(probe)
    print("actor", json.dumps(ray.get(remote.remote(threads))), flush=True)
    env = {"PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": str(os.cpu_count())}
    print(
        "actor-omp-all",
        json.dumps(ray.get(remote.options(runtime_env={"env_vars": env}).remote(threads))),
        flush=True,
    )
    print("driver-again", json.dumps(probe(threads)), flush=True)


if __name__ == "__main__":
    main()
