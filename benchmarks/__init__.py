"""The benchmark suite behind `kvray bench <name>`: offline, serve, kernels, step, cluster,
soak. Each module has `add_arguments(parser)` and `run(args)`; result files record date,
hardware and kvray's commit (`benchmarks.common`)."""
