"""The host-side warm interpreter (servops/remote/warm_runner.py) on a local python, no host:
a program runs in it as `python -` runs it, a killed client kills the program, a changed
interpreter or sys.path makes it stale, and nothing one program does reaches the next."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import wait_for
from servops import remote
from servops.connagent import Frames, frame
from servops.warmrunner import BOOT


class Runner:
    """warm_runner.py started as the agent starts it (`python -c BOOT`, its text on stdin)."""

    def __init__(self, env=None, idle=None):
        self.proc = subprocess.Popen([sys.executable, "-c", BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)
        self.frames = Frames()
        text = (f"_IDLE_S = {idle!r}\n" if idle else "") + remote.standalone("warm_runner")
        self.proc.stdin.write(json.dumps(text).encode() + b"\n")
        self.proc.stdin.flush()
        kind, payload = self.until("r")[-1]
        assert kind == "r" and json.loads(payload)["pid"] == self.proc.pid

    def until(self, kinds: str) -> list[tuple[str, bytes]]:
        got = []
        while True:
            data = self.proc.stdout.read1(1 << 16)
            if not data:
                return got
            for f in self.frames.feed(data):
                got.append(f)
                if f[0] in kinds:
                    return got

    def send(self, kind: str, payload: bytes = b"") -> None:
        self.proc.stdin.write(frame(kind, payload))
        self.proc.stdin.flush()

    def run(self, program: str) -> tuple[int, str, str]:
        self.send("P", program.encode())
        got = self.until("xs")
        if got[-1][0] == "s":
            return None
        out = b"".join(p for k, p in got if k == "o").decode()
        err = b"".join(p for k, p in got if k == "e").decode()
        return int(got[-1][1]), out, err

    def close(self) -> int:
        self.proc.stdin.close()
        return self.proc.wait(10)


@pytest.fixture
def runner():
    r = Runner()
    yield r
    if r.proc.poll() is None:
        r.close()


def python_dash(program: str) -> tuple[int, str, str]:
    res = subprocess.run([sys.executable, "-"], input=program, capture_output=True, text=True)
    return res.returncode, res.stdout, res.stderr


PROGRAMS = [
    "import sys\nprint('out')\nprint('err', file=sys.stderr)\nprint(__name__, sys.argv, sys.stdin.read() == '')\n",
    "import sys\nprint('x' * 300000)\nsys.exit(3)\n",
    "def f():\n    raise ValueError('bad value')\nprint('before')\nf()\n",
    "import sys\nsys.exit('a message')\n",
    "import os\nos._exit(5)\n",
]


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_program_runs_as_python_dash_runs_it(runner, program):
    assert runner.run(program) == python_dash(program)


def test_a_real_remote_program_gives_the_same_reply(runner):
    import yaml

    rel = "yaml/__init__.py"
    program = remote.with_args("inspect_file", {"file": rel, "lines": "1:3"})
    status, out, _err = runner.run(program)
    assert status == 0
    direct = python_dash(program)
    assert json.loads(out.splitlines()[-1]) == json.loads(direct[1].splitlines()[-1])
    reply = json.loads(out.splitlines()[-1])
    assert reply["path"] == os.path.realpath(yaml.__file__) or reply["path"] == yaml.__file__
    assert reply["owner"]["name"].lower() == "pyyaml"


def test_one_program_leaves_nothing_to_the_next(runner):
    first = "import os, json, sys\nos.environ['SERVOPS_LEAK'] = '1'\njson.LEAK = 1\nsys.path.append('/leak')\n"
    assert runner.run(first)[0] == 0
    status, out, _ = runner.run("import os, json, sys\n"
                                "print(os.environ.get('SERVOPS_LEAK'), hasattr(json, 'LEAK'), '/leak' in sys.path)\n")
    assert (status, out) == (0, "None False False\n")


def test_a_client_that_goes_has_the_program_and_its_children_killed(runner):
    runner.send("P", b"import subprocess, time\n"
                     b"child = subprocess.Popen(['sleep', '60'])\n"
                     b"print(child.pid, flush=True)\n"
                     b"time.sleep(60)\n")
    got = runner.until("o")
    child = int(got[-1][1])
    t0 = time.monotonic()
    runner.send("k")
    assert runner.until("x")[-1] == ("x", b"137")  # 128 + SIGKILL
    assert time.monotonic() - t0 < 30  # killed, not its 60 s sleep waited out

    def ended() -> bool:
        try:
            return Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True

    wait_for(ended, what="the program's child ended with it", step=0.05)
    assert runner.run("print('next')\n") == (0, "next\n", "")  # the runner itself goes on


def test_a_changed_sys_path_makes_it_stale(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    r = Runner(env=dict(os.environ, PYTHONPATH=str(site)))
    assert r.run("print(1)\n") == (0, "1\n", "")
    time.sleep(0.01)
    (site / "new_dist.pth").write_text("")  # what a pip install does to a site directory
    assert r.run("print(2)\n") is None  # nothing ran
    assert r.proc.wait(10) == 0  # and it ended: a fresh one sees the new sys.path


def test_it_ends_with_its_stdin(runner):
    assert runner.run("print(1)\n")[0] == 0
    assert runner.close() == 0


def test_it_ends_when_idle_even_if_its_stdin_stays_open():
    """A connection held open between agent and host (a proxy) must not keep it for ever."""
    r = Runner(idle=0.5)
    assert r.run("print(1)\n") == (0, "1\n", "")
    t0 = time.monotonic()
    assert r.proc.wait(10) == 0  # stdin still open: it ended on its idle time
    assert time.monotonic() - t0 < 5
