import os

import pytest

from tests.factories.tiny_models import MLA_SPECS, SPECS, build_tiny_model

try:
    from hypothesis import settings
except ModuleNotFoundError:  # the GPU machine's tests use no property tests
    pass
else:
    # Property tests draw the same examples on every run of a given tree, so a commit's CI
    # result is one anyone can reproduce (a random draw once failed CI on a test bug that
    # earlier runs had not drawn). KVRAY_HYPOTHESIS=explore draws fresh examples each run.
    settings.register_profile("repeatable", derandomize=True, database=None)
    settings.register_profile("explore")
    settings.load_profile(os.environ.get("KVRAY_HYPOTHESIS", "repeatable"))

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
MLA_ARCHS = sorted(MLA_SPECS)  # DeepSeek (MLA + MoE): their own parity tests, no FP8 cache
