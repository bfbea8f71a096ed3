"""Optional push of bench results and deploy events to a Prometheus Pushgateway."""

from __future__ import annotations

import re
import time
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Gauge, push_to_gateway
from prometheus_client.exposition import basic_auth_handler, default_handler

from .errors import ServopsError

# summary key -> metric name suffix (servops_bench_<suffix>)
BENCH_GAUGES = ("output_tps", "request_rate", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50", "itl_p99",
                "e2e_p50", "e2e_p99", "error_rate", "goodput", "achieved_concurrency", "max_output_tokens_per_s")


def shown(url: str) -> str:
    """The URL for messages: a password in it (http://user:PASSWORD@host) masked."""
    text = str(url or "")
    try:
        parts = urlsplit(text)
        if parts.password:
            host = parts.netloc.rpartition("@")[2]
            return parts._replace(netloc=f"{parts.username}:***@{host}").geturl()
    except ValueError:
        pass
    return re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", text)


def validate_url(url: str) -> str:
    """The Pushgateway URL, checked before anything runs: http(s)://HOST[:PORT][/path]."""
    text = (url or "").strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if (not parts or parts.scheme not in ("http", "https") or not parts.hostname or any(ch.isspace() for ch in text)
            or parts.query or parts.fragment):
        raise ServopsError(f"--push {shown(url)!r}: expected a Pushgateway URL like http://pushgateway:9091")
    del port
    return text.rstrip("/")


def _push(url: str, job: str, registry: CollectorRegistry, grouping: dict) -> None:
    # urllib would take "user:pass@host" for a host name: the credentials travel as basic auth instead
    parts = urlsplit(url)
    target, handler = url, default_handler
    if parts.username is not None:
        user, password = parts.username, parts.password or ""
        target = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()

        def handler(url, method, timeout, headers, data):
            return basic_auth_handler(url, method, timeout, headers, data, user, password)
    try:
        push_to_gateway(target, job=job, registry=registry, grouping_key=grouping, timeout=10, handler=handler)
    except OSError as exc:
        raise ServopsError(f"push to Pushgateway {shown(url)} failed: {str(exc).replace(url, shown(url))}") from None


def push_bench(url: str, result: dict) -> None:
    reg = CollectorRegistry()
    labels = ["concurrency", "variant", "release"]
    gauges = {k: Gauge(f"servops_bench_{k}", f"servops bench {k} (mean over repeats)", labels, registry=reg)
              for k in BENCH_GAUGES}
    for level in result["levels"]:
        for key, g in gauges.items():
            if level.get(key) is not None:
                g.labels(str(level["concurrency"]), result.get("variant") or "", result.get("release") or "").set(level[key])
    _push(validate_url(url), "servops_bench", reg, {"instance": result["host"]})


def push_deploy_event(url: str, host: str, variant: str, release: str, state: str) -> None:
    reg = CollectorRegistry()
    g = Gauge("servops_deploy_timestamp_seconds", "When servops last deployed", ["variant", "release", "outcome"],
              registry=reg)
    g.labels(variant, release, state).set(time.time())
    _push(validate_url(url), "servops_deploy", reg, {"instance": host})
