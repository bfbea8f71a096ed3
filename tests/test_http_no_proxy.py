"""A host whose environment names an HTTP proxy (http_proxy in /etc/environment, or in the
inventory's env for the engine's downloads) with a no_proxy that lacks 127.0.0.1: servops' own
requests to the server on that host (the health gate, the first request, the /metrics scrape) go
straight to the loopback, never to the proxy, which cannot reach it. Real sshd, the double, and a
proxy address where nothing listens: before, urllib sent every health poll there and a healthy
server timed out."""

from __future__ import annotations

import http.server
import threading

import pytest

from conftest import WORKER_INDEX, run_invoke
from servops.lab.sshd import free_port, make_server
from servops.remote import _common


def test_a_host_proxy_never_carries_servops_requests_to_its_own_server(lab, ssh_client_key, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # a proxy nothing answers at
    # a host whose sessions get the proxy, as /etc/environment gives it: its own sshd
    srv = make_server(f"127.0.{WORKER_INDEX}.12", tmp_path / "sshd-proxied", ssh_client_key)
    srv.env = {"http_proxy": dead, "HTTP_PROXY": dead, "https_proxy": dead, "no_proxy": "example.com"}
    srv.start()
    inv = lab.inventory(host_vars={"lab1": {"server_port": free_port(), "ssh_host": srv.address, "ssh_port": srv.port}})
    with lab.known_hosts.open("a") as fh:
        fh.write(srv.known_hosts_line)
    try:
        res = run_invoke("deploy", "--variant", "baseline", "-H", "lab1", inventory=inv, timeout=300)
        assert res.returncode == 0 and "healthy in" in res.stdout, res.stdout + res.stderr
        res = run_invoke("metrics", "-H", "lab1", inventory=inv)
        assert res.returncode == 0 and "cannot fetch /metrics" not in res.stdout + res.stderr, res.stdout + res.stderr
    finally:
        run_invoke("stop", "--grace", "2", "-H", "lab1", inventory=inv)
        srv.stop()


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def test_local_urlopen_ignores_the_proxy_variables(monkeypatch):
    """The helper alone, on this machine: with every proxy variable pointing nowhere, a plain
    urlopen of the loopback fails and local_urlopen reaches it."""
    import urllib.request

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    dead = f"http://127.0.0.1:{free_port()}"
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, dead)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    url = f"http://127.0.0.1:{srv.server_address[1]}/health"
    try:
        # the setting this guards against is real here: a fresh default opener (it reads the
        # variables now; urlopen's global one may predate them) goes to the dead proxy
        with pytest.raises(OSError):
            urllib.request.build_opener().open(url, timeout=5)
        with _common.local_urlopen(url, 5) as r:
            assert r.status == 200 and r.read() == b"ok"
    finally:
        srv.shutdown()
