"""`invoke metrics` on a TP8 server whose every rank reports (--enable-metrics-for-all-schedulers)."""

import json
import re
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from servops.lab.sshd import free_port
from conftest import LOADED, REPO, playbooks_with, run_invoke, wait_for

RANKS8 = """extends: baseline
server_args: {enable-metrics-for-all-schedulers: true}
env: {SGLANG_DOUBLE_TOKEN_USAGE: '0.42', SGLANG_DOUBLE_CACHE_HIT_RATE: '0.25', SGLANG_DOUBLE_RANK_SKEW: '0.01',
      SGLANG_DOUBLE_TOKEN_DELAY: '0.05'}
"""


@pytest.fixture
def ranks8(lab, tmp_path):
    port = free_port()
    inv = lab.inventory(host_vars={"lab1": {"server_port": port}})
    env = {"SERVOPS_PLAYBOOKS": str(playbooks_with(tmp_path, ranks8=RANKS8))}
    res = run_invoke("deploy", "--variant", "ranks8", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    yield inv, port
    run_invoke("stop", "--grace", "2", inventory=inv)


def busy(port: int, n: int, tokens: int) -> list[threading.Thread]:
    def one():
        body = json.dumps({"prompt": "hello there", "max_tokens": tokens}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=60).read()

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_eight_ranks_report_the_true_values(ranks8):
    inv, port = ranks8
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    running = [l for l in text.splitlines() if l.startswith("sglang:num_running_reqs{")]
    assert len(running) == 8 and {f'tp_rank="{i}"' in " ".join(running) for i in range(8)} == {True}
    threads = busy(port, 5, 300)  # 5 requests, ~15 s each: still running when `metrics` reads them on a loaded machine

    def all_running() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return all(float(l.split()[-1]) == 5 for l in r.read().decode().splitlines()
                       if l.startswith("sglang:num_running_reqs{"))

    wait_for(all_running, what="the 5 requests running on every rank")
    res = run_invoke("metrics", "--json", inventory=inv)
    assert res.returncode == 0, res.stderr
    row = json.loads(res.stdout)[0]
    assert row["ranks"] == 8 and row["running"] == 5          # not 40: the 8 ranks run one batch
    assert row["token_usage"] == pytest.approx(0.455)         # the mean, not a sum of 8 (3.64)
    assert row["token_usage_max"] == pytest.approx(0.49) and row["cache_hit_rate"] == pytest.approx(0.285)  # 0.25 + skew
    assert row["gauges"]["token_usage"]["per_rank"]["tp7"] == pytest.approx(0.49)
    res = run_invoke("metrics", inventory=inv)
    assert "45.5% (max 49.0%)" in res.stdout and "per-rank spread" in res.stdout
    for t in threads:
        t.join(30)


def test_watch_shows_windowed_quantiles_next_to_the_since_start_ones(ranks8):
    inv, port = ranks8
    for t in busy(port, 3, 4):  # some history before the watch starts
        t.join(30)
    env = dict(os.environ, SERVOPS_INVENTORY=str(inv), NO_COLOR="1", COLUMNS="250", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "metrics", "--watch", "1"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        busy(port, 4, 20)
        deadline = time.time() + LOADED
        while time.time() < deadline and sum("server metrics" in l for l in lines) < 3:
            lines.append(proc.stdout.readline())
    finally:
        proc.terminate()
        proc.wait(10)
    out = "".join(lines)
    assert sum("server metrics" in l for l in lines) >= 3, out
    first, later = out.split("server metrics")[1], out.split("server metrics")[2]
    assert "last" not in first.splitlines()[1]          # one scrape: no window yet
    header = next(l for l in later.splitlines() if "TTFT" in l)
    assert "TTFT p50/p90/p99 ms" in header and re.search(r"TTFT last [\d.]+s", header) and "req/s" in header


def test_watch_on_a_terminal_redraws_in_place_and_keeps_p99_at_120_columns(ranks8):
    """Issue 20.5: on a 120-column terminal `metrics --watch` redraws one display in place (rich
    Live: the cursor goes back up over the last frame) instead of scrolling table after table,
    and its windowed columns keep p99 whole."""
    import fcntl
    import pty
    import select
    import signal
    import struct
    import termios

    inv, port = ranks8
    for t in busy(port, 3, 4):  # some history: the first frame's since-start quantiles
        t.join(30)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = dict(os.environ, SERVOPS_INVENTORY=str(inv), TERM="xterm", COLUMNS="120", LINES="40", PYTHONUNBUFFERED="1")
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "metrics", "--watch", "0.5"], cwd=REPO, env=env,
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    data = b""

    def read(seconds, frames=None):
        """Read the terminal for `seconds`, or until `frames` frames have been drawn (a loaded
        machine can take seconds to start the command and reach the host)."""
        nonlocal data
        end = time.time() + seconds
        while time.time() < end and not (frames and data.count(b"server metrics") >= frames):
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data += os.read(master, 65536)
                except OSError:
                    return

    try:
        busy(port, 4, 40)
        read(60, frames=4)
        proc.send_signal(signal.SIGINT)
        read(3)
        proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = data.decode("utf-8", "replace")
    assert re.search(r"\x1b\[\d*A", text), text[-2000:]                     # back up over the last frame
    assert text.count("server metrics") >= 3, text[-2000:]                   # redrawn, several times
    frames = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", f) for f in text.split("server metrics")[1:]]
    for frame in frames:
        assert "TTFT p50/p99 ms" in frame and "…" not in frame, frame
        assert all(len(line) <= 120 for line in frame.splitlines()), frame
    rows = [next(l for l in f.splitlines() if "lab1" in l) for f in frames]
    assert any(re.fullmatch(r" [\d.]+/[\d.]+ *", r.split("│")[5]) for r in rows), rows  # TTFT p50/p99, whole
