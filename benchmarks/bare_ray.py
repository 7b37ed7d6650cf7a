"""A Ray with nothing but idle actors, started as kvray starts its own (its settings, the
control plane lowered, the actors at the replicas' niceness, no dashboard): the least that any
app on Ray keeps running beside an engine. `benchmarks/standing_by.py` measures what it costs an
engine's steps, as it does for a kvray app; a cost above a target for the whole of Serve's way
means no app on Ray meets that target on this machine.

    python -m benchmarks.bare_ray [--actors 2] &    # prints "ready", runs until stopped
    python -m benchmarks.standing_by --any-ray --kinds running,stopped:all --prompts 1
"""

from __future__ import annotations

import argparse
import signal
import threading


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--actors", type=int, default=2, help="idle actors (an app's ingress and worker: 2)"
    )
    args = ap.parse_args(argv)

    import ray

    from cluster.app import set_serve_env
    from cluster.local_ray import lower_control_plane, ray_session, set_own_ray_env

    @ray.remote(num_cpus=0)
    class Idle:
        """An actor that waits: the process, core worker and event loop every replica has."""

        async def ready(self) -> bool:
            return True

    set_own_ray_env()
    set_serve_env()  # among them the workers' niceness: 0, as a kvray app's replicas
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with ray_session(include_dashboard=False, log_to_driver=False):
        actors = [Idle.remote() for _ in range(args.actors)]  # type: ignore[attr-defined]
        ray.get([actor.ready.remote() for actor in actors])
        lowered = lower_control_plane()
        print(
            f"ready: {args.actors} idle actors, {len(lowered)} control-plane processes lowered",
            flush=True,
        )
        stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
