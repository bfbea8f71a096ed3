"""The downtime of a deploy that needs new JIT kernels against a plain restart of the same
release, with the kernels built before the old server stops (issue #46.4) and without.

A poller GETs the server's /health every 20 ms throughout; a verb's downtime is the longest run of
answers that were not 200 (or no answer). Each round deploys a variant whose kernels no earlier
round built, then restarts that same release (the reference): once with the host's pre-build
(jit_warmup, the default with a jit_cache_dir) and once with `jit_warmup: false`.

On the lab (the default) a real sshd host (bench/_lab.py) serves the SGLang double with the GPU
kit's start-up shape, scaled down: weights load in LOAD_TIME s, a CUDA-graph capture, and each
JIT kernel module its cache lacks takes JIT_TIME s to build (the kit's H200: a first start ~200 s,
a restart 25-30 s); each round's variant has an attention backend of its own (new kernels).

    .venv/bin/python bench/jit_downtime.py      # last line: new-JIT deploy / restart downtime (goal <= 1.3)
    ROUNDS=5 JIT_TIME=8 .venv/bin/python bench/jit_downtime.py

On a real host (the GPU kit): its inventory, the variant to start from and the one whose kernels
are new (its caches must not hold them: a fresh jit_cache_dir, or a new engine version), one round:

    python bench/jit_downtime.py -I inventory/gpu-8b.yml -H h200 --base llama8b --new llama8b-pw
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _lab import REPO, BenchLab  # noqa: E402

from servops.lab.sshd import free_port  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "3"))
LOAD_TIME = os.environ.get("LOAD_TIME", "3")
JIT_TIME = os.environ.get("JIT_TIME", "6")
BASE = ("extends: baseline\nserver_args: {cuda-graph-max-bs: 16}\n"
        f"env: {{SGLANG_DOUBLE_LOAD_TIME: '{LOAD_TIME}', SGLANG_DOUBLE_CAPTURE_PER_BS: '0.05', "
        f"SGLANG_DOUBLE_JIT_TIME: '{JIT_TIME}'}}\n")


class Outage:
    """Polls http://127.0.0.1:PORT/health; the longest stretch without a 200 while armed."""

    def __init__(self, port: int):
        self.url, self.armed, self.longest, self.down_since = f"http://127.0.0.1:{port}/health", False, 0.0, None
        self.last_ok, self.last_error = 0.0, "no poll yet"
        # never through a proxy, which cannot reach the host's loopback (on the GPU kit's H100 every poll
        # failed and both downtimes read 0; proxy variables in its environment the likely cause)
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _ok(self) -> bool:
        try:
            with self.opener.open(self.url, timeout=2) as r:
                if r.status == 200:
                    return True
                self.last_error = f"HTTP {r.status}"
        except OSError as exc:
            self.last_error = str(exc)
        return False

    def _run(self) -> None:
        while not self.stop.is_set():
            ok, now = self._ok(), time.monotonic()
            if self.armed and not ok and self.down_since is None:
                self.down_since = now
            if ok:
                if self.down_since is not None:
                    self.longest = max(self.longest, now - self.down_since)
                    self.down_since = None
                self.last_ok = now  # after the outage is closed: measure() reads longest once it sees this
            time.sleep(0.02)

    def measure(self, run) -> float:
        """The verb's downtime: once it returns, the poller must see the server answer (which
        closes the outage); an error where it does not within 10 s."""
        self.longest, self.down_since, self.armed = 0.0, None, True
        run()
        back = time.monotonic()
        while self.last_ok <= back and time.monotonic() < back + 10:
            time.sleep(0.02)
        self.armed = False
        if self.last_ok <= back:
            raise SystemExit(f"error: {self.url} gave no 200 to this bench's poller after the verb "
                             f"(last: {self.last_error}), though servops found the server healthy: no downtime "
                             "can be measured from here")
        return self.longest


def lab_setup():
    """A lab host with ROUNDS variants of new kernels each way: (lab, inventory, cold inventory, base, news)."""
    lab = BenchLab(1)
    books = lab.tmp / "books"
    books.mkdir()
    for f in (REPO / "playbooks").glob("*.yml"):
        (books / f.name).write_text(f.read_text())
    (books / "jd-base.yml").write_text(BASE)
    for r in range(ROUNDS):
        for how in ("pre", "cold"):
            (books / f"jd-{how}{r}.yml").write_text(f"extends: jd-base\nserver_args: {{attention-backend: {how}{r}}}\n")
    os.environ["SERVOPS_PLAYBOOKS"] = str(books)
    inv = yaml.safe_load(lab.inventory.read_text())
    host = inv["all"]["children"]["lab"]["hosts"]["lab1"]
    host.update(jit_cache_dir=str(lab.tmp / "jit"), jit_warmup_port=free_port(),
                env={"CUDA_HOME": "/tmp/servops-lab-cuda"})
    lab.inventory.write_text(yaml.safe_dump(inv))
    cold = lab.tmp / "inventory-cold.yml"
    host["jit_warmup"] = False
    cold.write_text(yaml.safe_dump(inv))
    news = [(f"jd-pre{r}", f"jd-cold{r}") for r in range(ROUNDS)]
    return lab, lab.inventory, cold, "jd-base", news, int(host["server_port"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-I", "--inventory", type=Path, help="a real host's inventory (default: a lab host made here)")
    ap.add_argument("-H", "--host", default="lab1")
    ap.add_argument("--base", help="the variant deployed first (real host)")
    ap.add_argument("--new", help="the variant whose kernels are new (real host; pre-built)")
    ap.add_argument("--skip-audit", action="store_true",
                    help="deploy --new without its audit stage: the audit runs before the old server stops, so "
                         "the downtime is the same; on the GPU host it saves ~70 s of device time")
    a = ap.parse_args(argv)
    lab = None
    if a.inventory:
        if not (a.base and a.new):
            raise SystemExit("error: --inventory needs --base and --new")
        from servops.errors import ServopsError
        from servops.inventory import load_inventory

        try:
            hosts = load_inventory(a.inventory).hosts
        except ServopsError as exc:
            raise SystemExit(f"error: {exc}") from None
        if a.host not in hosts:
            raise SystemExit(f"error: {a.host}: not a host of {a.inventory} ({', '.join(sorted(hosts))})")
        host = hosts[a.host]
        inventory, cold, base, news, port = a.inventory, None, a.base, [(a.new, None)], int(host.require("server_port"))
    else:
        lab, inventory, cold, base, news, port = lab_setup()
    env = dict(os.environ, SERVOPS_PERSIST="0", COLUMNS="200")

    def invoke(*args: str, inv: Path = inventory) -> str:
        res = subprocess.run([sys.executable, "-m", "invoke", *args, "-I", str(inv), "-H", a.host], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=3600)
        print(res.stdout.rstrip().splitlines()[-1] if res.stdout.strip() else "", flush=True)
        if res.returncode:
            raise SystemExit(f"invoke {' '.join(args)} failed ({res.returncode}):\n{res.stdout}{res.stderr}")
        return res.stdout

    skip_audit = ["--skip-audit"] if a.skip_audit else []
    outage = Outage(port)
    ratios_pre, ratios_cold = [], []
    try:
        invoke("deploy", "--variant", base)
        for r, (pre, no_pre) in enumerate(news):
            down = outage.measure(lambda: invoke("deploy", "--variant", pre, *skip_audit))
            ref = outage.measure(lambda: invoke("restart"))
            ratios_pre.append(down / ref)
            line = f"round {r + 1}/{len(news)}: {pre}: new-JIT deploy {down:.2f}s with pre-build, restart {ref:.2f}s"
            if no_pre:
                down = outage.measure(lambda: invoke("deploy", "--variant", no_pre, inv=cold))
                ref = outage.measure(lambda: invoke("restart", inv=cold))
                ratios_cold.append(down / ref)
                line += f"; {no_pre}: without pre-build {down:.2f}s, restart {ref:.2f}s"
            print(line, flush=True)
        if lab:
            invoke("stop")
    finally:
        outage.stop.set()
        if lab:
            lab.close()
    if lab:
        print(f"lab: weights {LOAD_TIME}s, JIT {JIT_TIME}s a module")
    if ratios_cold:
        print(f"without pre-build: new-JIT deploy / restart downtime = {statistics.median(ratios_cold):.2f}")
    print(f"new-JIT deploy / restart downtime = {statistics.median(ratios_pre):.2f} (goal <= 1.3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
