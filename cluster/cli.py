"""`kvray` command line: serve | generate | prepare-demo | bench <name>.

Heavy imports (ray, torch, the engine) happen inside the subcommand that needs them, so
`kvray --help` is instant and `kvray bench offline` loads only what it uses.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ValidationError

BENCH_MODULES = {
    name: f"benchmarks.{name}"
    for name in ("offline", "serve", "kernels", "step", "cluster", "soak", "grammar")
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvray", description="LLM serving on Ray Serve.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start local Ray and the OpenAI-compatible server")
    serve.add_argument("-c", "--config", help="ClusterConfig YAML file")
    serve.add_argument("--model", help="HF model directory or 'demo' (overrides the config)")
    serve.add_argument("--replicas", type=int, help="worker replicas (overrides the config)")
    serve.add_argument("--host", help="HTTP host (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="HTTP port (default 8000)")
    serve.add_argument(
        "--http-proxy",
        choices=["auto", "serve", "haproxy"],
        help="HTTP in front of the ingress (overrides the config; auto = HAProxy in a Ray "
        "this starts on one node, when its binary is there)",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=["none", "qwen3", "deepseek_r1"],
        help="a reasoning model's <think> block as reasoning_content (overrides the config)",
    )
    serve.add_argument(
        "--address",
        help="join this Ray cluster ('auto': the one on this machine) instead of starting a new one",
    )
    serve.add_argument(
        "--ray-nodes",
        type=int,
        default=1,
        help="start this many local Ray nodes, GPUs split evenly (nodes past the GPU count get "
        "none), each with its own HTTP proxy on the port: streamed throughput past one proxy's "
        "limit (e.g. one node per GPU, or twice that)",
    )
    serve.add_argument(
        "--dashboard",
        action="store_true",
        help="start Ray's dashboard with the Ray kvray starts (http://127.0.0.1:8265; off by "
        "default: idle, it takes ~3 %% of a core that the engine shares on a small machine; "
        "`serve status` needs it)",
    )

    sub.add_parser("prepare-demo", help="convert the demo model once and print its directory")

    gen = sub.add_parser("generate", help="generate text in this process (no server)")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--model", default="demo", help="HF model directory or 'demo'")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)

    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(sorted(BENCH_MODULES)))
    bench.add_argument("target", choices=sorted(BENCH_MODULES))
    bench.add_argument(
        "args", nargs=argparse.REMAINDER, help="options of the benchmark (see its --help)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {
        "serve": _serve,
        "prepare-demo": _prepare_demo,
        "generate": _generate,
        "bench": _bench,
    }
    return commands[args.command](args)


# -- serve -----------------------------------------------------------------------------------


def _serve_config(args: argparse.Namespace) -> Any:
    """The ClusterConfig of `-c` and the flags; a config that cannot be read or does not
    validate ends the command with one line per fault, not a traceback."""
    import yaml
    from pydantic import ValidationError

    from cluster.config import ClusterConfig, yaml_fields

    where = f"kvray serve: {args.config or 'the options'}"
    data: dict[str, Any] = {}
    if args.config:
        try:
            data = yaml_fields(args.config)
        except (OSError, yaml.YAMLError) as exc:
            raise SystemExit(f"{where}: {exc}") from None
        except ValueError as exc:  # its message names the file
            raise SystemExit(f"kvray serve: {exc}") from None
    if args.model:
        data["engine"] = {**data.get("engine", {}), "model": args.model}
    overrides = {
        "worker_replicas": args.replicas,
        "host": args.host,
        "port": args.port,
        "http_proxy": args.http_proxy,
        "reasoning_parser": args.reasoning_parser,
    }
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise SystemExit(_faults(f"{where}: not a valid config", exc)) from None


def _faults(head: str, exc: ValidationError) -> str:
    """`head`, then a line for each fault: its field, its message."""
    return "\n".join(
        [head, *(f"  {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())]
    )


def _check_model_here(model: str) -> None:
    """With a Ray of its own, every replica loads `model` from this machine: a path that is
    not there fails now, not as a deployment error after Ray has started."""
    from worker.model.demo import DEMO, resolve_model_path

    if model != DEMO:  # the demo model is converted where it is missing
        try:
            resolve_model_path(model)
        except FileNotFoundError as exc:
            raise SystemExit(f"kvray serve: {exc}") from None


def _serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from cluster.app import build_app, cluster_runtime_env, resolve_http_proxy, set_serve_env
    from cluster.local_ray import ray_session, set_own_ray_env

    if args.address and (args.ray_nodes != 1 or args.dashboard):
        raise SystemExit(
            "kvray serve: --ray-nodes and --dashboard start a local Ray; they cannot be "
            "combined with --address"
        )
    config = resolve_http_proxy(
        _serve_config(args), own_ray=args.address is None, nodes=args.ray_nodes
    )
    if args.address is None:
        _check_model_here(config.engine.model)
    set_serve_env()
    if args.address is None:
        set_own_ray_env()
    own_ray = {} if args.address else {"include_dashboard": args.dashboard}
    with ray_session(
        nodes=args.ray_nodes,
        address=args.address,
        runtime_env=cluster_runtime_env(config),
        **own_ray,
    ):
        try:
            # a proxy on every node (with --ray-nodes, all on the one port)
            serve.start(
                http_options={"host": config.host, "port": config.port, "location": "EveryNode"}
            )
            front = "HAProxy" if config.http_proxy == "haproxy" else "Serve's proxy"
            if args.address and config.http_proxy == "serve":
                front += " (or HAProxy where the cluster's nodes enable it)"
            print(
                f"kvray: deploying {config.model_name} on {len(ray.nodes())} Ray node(s), "
                f"HTTP through {front} ...",
                flush=True,
            )
            start = time.perf_counter()
            serve.run(
                build_app(config),
                name=config.advanced.app_name,
                route_prefix=config.advanced.route_prefix,
            )
            print(f"kvray: ready in {time.perf_counter() - start:.0f} s\n", flush=True)
            print(_examples(config), flush=True)
            _wait_for_interrupt()
            drain_ingress(config)
        except KeyboardInterrupt:
            pass
        finally:
            print("\nkvray: shutting down ...", flush=True)
            serve.shutdown()
    return 0


def _examples(config: Any) -> str:
    """How to call the server. A configured key is never printed: the examples read it from
    $KVRAY_API_KEY, which the user sets to one of their keys."""
    base = f"http://{config.host}:{config.port}"
    keyed = bool(config.api_keys)
    auth = ' -H "Authorization: Bearer $KVRAY_API_KEY"' if keyed else ""
    client_key = 'os.environ["KVRAY_API_KEY"]' if keyed else '"unused"'
    return (
        f"Try it:\n\n  curl {base}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{config.model_name}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}\'\n\n'
        "  python - <<'EOF'\n"
        "  import os\n"
        "  from openai import OpenAI\n"
        f'  client = OpenAI(base_url="{base}/v1", api_key={client_key})\n'
        f'  stream = client.chat.completions.create(model="{config.model_name}", stream=True,\n'
        '      messages=[{"role": "user", "content": "Tell me a story"}])\n'
        "  for chunk in stream:\n"
        '      print(chunk.choices[0].delta.content or "", end="", flush=True)\n'
        "  EOF\n\n"
        f"Metrics: {base}/metrics   Stop: Ctrl-C"
    )


def drain_ingress(config: Any) -> None:
    """Before Serve shuts down: every ingress replica refuses new requests (503 with
    Retry-After) while the running ones finish, for at most `drain_timeout_s`. Serve's own
    shutdown then stops the replicas, which by then have nothing left to cut."""
    from ray import serve

    from cluster.app import INGRESS_NAME

    handle = serve.get_deployment_handle(INGRESS_NAME, app_name=config.advanced.app_name)
    deadline = time.monotonic() + config.advanced.drain_timeout_s
    in_flight = _in_flight(handle.broadcast("start_draining"))
    print(f"\nkvray: draining {in_flight} running request(s) ...", flush=True)
    while in_flight and time.monotonic() < deadline:
        time.sleep(config.advanced.drain_poll_s)
        in_flight = _in_flight(handle.broadcast("drain_status"), key="in_flight")
    if in_flight:
        print(f"kvray: {in_flight} request(s) still running after the drain timeout", flush=True)


def _in_flight(response: Any, key: str | None = None) -> int:
    """Sum a broadcast's counts; replicas that do not answer within 10 s count as done."""
    try:
        results = response.results(timeout_s=10, return_exceptions=True)
    except TimeoutError:
        return 0
    counts = [r[key] if key else r for r in results if not isinstance(r, BaseException)]
    return int(sum(counts))


def _wait_for_interrupt() -> None:
    """Block until Ctrl-C or SIGTERM."""
    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop:
        time.sleep(0.2)


# -- the others ------------------------------------------------------------------------------


def _prepare_demo(args: argparse.Namespace) -> int:
    from worker.model.demo import ensure_demo_model

    print(ensure_demo_model())
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from worker.llm import LLM
    from worker.sampling import SamplingParams

    try:  # before the model loads
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    except ValidationError as exc:
        raise SystemExit(_faults("kvray generate: not valid sampling options", exc)) from None
    try:
        llm = LLM(args.model)
    except FileNotFoundError as exc:  # the model path: a message, not a traceback
        raise SystemExit(f"kvray generate: {exc}") from None
    for prompt in args.prompts:
        if len(args.prompts) > 1:
            print(f"\n>>> {prompt}")
        for piece in llm.stream(prompt, params, chat=args.chat):
            sys.stdout.write(piece)
            sys.stdout.flush()
        print()
    return 0


def _bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCH_MODULES[args.target])
    parser = argparse.ArgumentParser(prog=f"kvray bench {args.target}")
    module.add_arguments(parser)
    result = module.run(parser.parse_args(args.args))
    return result if isinstance(result, int) else 0  # benchmarks return their results dict


if __name__ == "__main__":
    sys.exit(main())
