import pytest

from tests.factories.tiny_models import SPECS, build_tiny_model

try:
    from cluster.app import set_serve_env
except ModuleNotFoundError:  # the GPU machine runs tests/gpu without Ray installed
    pass
else:
    # Every Ray this test process starts (and `kvray serve` subprocesses) runs with the
    # Serve settings kvray runs with in production.
    set_serve_env()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(name) -> (dir, hf_model), built once per session per architecture."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = build_tiny_model(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


ARCHS = sorted(SPECS)
