"""A round's verdict kept on the host by what decides it (servops/remote/audit_verdicts.py): the real
audit program (audit_compile, op audit) on this machine's python against a local directory, its engine
a small server that counts its starts. A deploy's audit of a launch audited before starts no server
(on an H100 each round of the 8B piecewise launch took 45-150 s before every deploy of it); any change
to what decides the outcome (the launch, the fix set, a file of the engine's package) runs it again,
and only outcomes that follow from those inputs are kept."""

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from servops import remote

ENGINE = """
import http.server, os, sys
starts = os.environ["STARTS"]
with open(starts, "a") as f:
    f.write("x")
if os.environ.get("CRASH"):
    print("RuntimeError: CUDA error: out of memory", flush=True)
    sys.exit(1)
port = int(sys.argv[sys.argv.index("--port") + 1])
for n in (4, 8, 16):
    print("Capturing num tokens (num_tokens=%d avail_mem=1.0 GB)" % n, flush=True)

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


class Host:
    """A local directory as the host: the engine module, an engine package, the model's config."""

    def __init__(self, tmp: Path):
        self.tmp, self.lib, self.starts = tmp, tmp / "lib", tmp / "starts"
        self.lib.mkdir()
        (self.lib / "vengine.py").write_text(ENGINE)
        (self.lib / "vpkg").mkdir()
        (self.lib / "vpkg" / "__init__.py").write_text("X = 1\n")
        (tmp / "model").mkdir()
        (tmp / "model" / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "vocab_size": 1000}))
        (tmp / "scratch").mkdir()
        self.verdicts = tmp / "deploy" / "audit-verdicts.json"

    def audit(self, reuse: bool, argv=("--port", "{SERVOPS_AUDIT_PORT}"), files=None, crash=False) -> dict:
        env = {"PYTHONPATH": str(self.lib), "STARTS": str(self.starts)}
        if crash:
            env["CRASH"] = "1"
        args = {"op": "audit", "model_path": str(self.tmp / "model"), "device": "cpu", "patches": [],
                "shim": "", "server_files": files or {}, "timeout_s": 60, "verdicts": str(self.verdicts),
                "reuse": reuse, "packages": ["vpkg"],
                "launch": {"module": "vengine", "argv": list(argv), "env": env, "health": "/health"}}
        res = subprocess.run([sys.executable, "-"], input=remote.with_args("audit_compile", args), text=True,
                             capture_output=True, timeout=120,
                             env=dict(os.environ, TMPDIR=str(self.tmp / "scratch"), PYTHONPATH=str(self.lib)))
        return json.loads(res.stdout.strip().splitlines()[-1])

    def started(self) -> int:
        return len(self.starts.read_text()) if self.starts.exists() else 0


def test_the_same_launch_is_not_audited_twice_and_a_change_to_what_decides_it_is(tmp_path):
    host = Host(tmp_path)
    first = host.audit(reuse=False)
    assert first["state"] == "healthy" and first["captured"] == [4, 8, 16] and "kept" not in first
    assert host.started() == 1
    assert stat.S_IMODE(host.verdicts.stat().st_mode) == 0o600
    again = host.audit(reuse=True)
    assert again["state"] == "healthy" and again["captured"] == [4, 8, 16] and again["kept"]["at"]
    assert host.started() == 1  # no server started
    # `invoke audit` (no reuse) runs it whatever is kept
    assert "kept" not in host.audit(reuse=False) and host.started() == 2
    # what decides the outcome changed: the launch's flags, a file served beside it, a file of the
    # engine's package
    assert "kept" not in host.audit(reuse=True, argv=("--port", "{SERVOPS_AUDIT_PORT}", "--x", "1"))
    assert "kept" not in host.audit(reuse=True, files={"beside.py": "Y = 1\n"})
    assert host.started() == 4
    time.sleep(0.01)
    (host.lib / "vpkg" / "__init__.py").write_text("X = 2\n")  # a hand edit of the engine's code
    assert "kept" not in host.audit(reuse=True) and host.started() == 5
    assert host.audit(reuse=True)["kept"] and host.started() == 5
    # bytecode the engine's first import writes is not an input
    (host.lib / "vpkg" / "__pycache__").mkdir()
    (host.lib / "vpkg" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"x")
    assert host.audit(reuse=True)["kept"] and host.started() == 5


def test_the_key_follows_every_input_and_the_installation(tmp_path):
    from servops.remote.audit_verdicts import verdict_key

    base = {"launch": {"argv": ["--port", "{SERVOPS_AUDIT_PORT}"]}, "patches": [{"name": "a", "text": "t1"}]}
    same = verdict_key(base, [], [])
    assert verdict_key(json.loads(json.dumps(base)), [], []) == same
    assert verdict_key(dict(base, patches=[{"name": "a", "text": "t2"}]), [], []) != same  # the fix set's text
    site = tmp_path / "site"
    (site / "torch-2.11.0.dist-info").mkdir(parents=True)
    (site / "torch-2.11.0.dist-info" / "RECORD").write_text("a")
    installed = verdict_key(base, [str(site)], [])
    assert installed != same
    (site / "torch-2.11.0.dist-info" / "RECORD").write_text("ab")  # reinstalled
    assert verdict_key(base, [str(site)], []) != installed


def test_a_same_size_edit_whose_mtime_was_put_back_still_changes_the_key(tmp_path, monkeypatch):
    from servops.remote.audit_verdicts import verdict_key

    pkg = tmp_path / "h8vpkg"
    pkg.mkdir()
    source = pkg / "__init__.py"
    source.write_text("LIMIT = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = verdict_key({}, [], ["h8vpkg"])
    was = source.stat()
    time.sleep(0.02)  # the ctime clock's step, on any filesystem
    source.write_text("LIMIT = 9\n")  # same size
    os.utime(source, ns=(was.st_atime_ns, was.st_mtime_ns))  # `touch -r`: the mtime put back
    assert source.stat().st_mtime_ns == was.st_mtime_ns and source.stat().st_size == was.st_size
    # before: size and mtime only, so the edited engine reused the unedited one's verdict
    assert verdict_key({}, [], ["h8vpkg"]) != before


def test_a_crash_is_never_kept_and_a_damaged_file_is_no_verdict(tmp_path):
    host = Host(tmp_path)
    crashed = host.audit(reuse=False, crash=True)
    assert crashed["state"] == "exited" and host.started() == 1
    assert host.audit(reuse=True, crash=True)["state"] == "exited" and host.started() == 2  # ran again
    assert not host.verdicts.exists()  # nothing kept
    host.verdicts.parent.mkdir()
    host.verdicts.write_text('{"entries": {"x": ')  # cut mid-write by hand, or damaged
    assert host.audit(reuse=True)["state"] == "healthy" and host.started() == 3
    assert host.audit(reuse=True)["kept"] and host.started() == 3  # written anew, whole
