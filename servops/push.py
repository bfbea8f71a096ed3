"""Optional push of bench results and deploy events to a Prometheus Pushgateway."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Gauge, push_to_gateway

from .errors import ServopsError


def _push(url: str, job: str, registry: CollectorRegistry, grouping: dict) -> None:
    try:
        push_to_gateway(url, job=job, registry=registry, grouping_key=grouping, timeout=10)
    except OSError as exc:
        raise ServopsError(f"push to Pushgateway {url} failed: {exc}") from None


def push_bench(url: str, result: dict) -> None:
    reg = CollectorRegistry()
    labels = ["concurrency", "variant", "release"]
    gauges = {k: Gauge(f"servops_bench_{k}", f"servops bench {k}", labels, registry=reg)
              for k in ("output_tps", "request_rate", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")}
    for level in result["levels"]:
        for key, g in gauges.items():
            if level.get(key) is not None:
                g.labels(str(level["concurrency"]), result["variant"] or "", result["release"] or "").set(level[key])
    _push(url, "servops_bench", reg, {"instance": result["host"]})


def push_deploy_event(url: str, host: str, variant: str, release: str, state: str) -> None:
    reg = CollectorRegistry()
    g = Gauge("servops_deploy_timestamp_seconds", "When servops last deployed", ["variant", "release", "outcome"],
              registry=reg)
    g.labels(variant, release, state).set(time.time())
    _push(url, "servops_deploy", reg, {"instance": host})


def validate_url(url: str) -> None:
    """A Pushgateway address: http(s)://host[:port][/path], checked before anything runs."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
        raise ServopsError(f"--push {url!r}: expected a Pushgateway URL like http://pushgateway:9091")
    try:
        parts.port
    except ValueError:
        raise ServopsError(f"--push {url!r}: the port is not a number 1-65535") from None
