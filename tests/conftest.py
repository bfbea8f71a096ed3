"""Fixtures: real sshd hosts on 127.0.0.x, a real remote venv, and generated inventories."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

import leftovers
from servops.lab import manage, venvs as remote_venv
from servops.lab.sshd import PORTS_ENV, find_sshd, free_port, keygen, make_server
from servops.remote.procs import proc_starttime

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Connections are not persisted in the test lab: each CLI run connects directly, the path most
# tests are about (a frozen or restarted sshd, say) and the cheapest (no agent process per test).
# tests/test_agent.py turns persistence on for its own runs; SERVOPS_TEST_PERSIST=10m runs any
# test through agents. Agents live in this run's own directory, never a developer's, and are
# ended with the session.
# Verbs that change hosts require -H (or $SERVOPS_HOSTS): most tests run on a one- or two-host lab
# of their own and mean all of it, as a user who exported SERVOPS_HOSTS=all would. The tests of
# that rule (and the README's, run verbatim) clear it.
os.environ["SERVOPS_HOSTS"] = "all"
# The suite runs in parallel (pytest-xdist, `-n` in pyproject's addopts): each worker is its own
# process with its own slice of everything machine-wide, so no two workers meet. Worker N (gwN;
# 0 when run without xdist) has the loopback addresses 127.0.N.2-6 for its sshd hosts, the lab's
# server ports 30000+10N.., its own slice of free_port's range, its own agent directory and
# results directory (below) and its own copies of the venvs the tests patch (remote_env).
# Two suites at once on one machine (two checkouts' runs) each take a slot, SERVOPS_TEST_SLOT=0..3:
# slot S's worker N is index N + 8*S, with addresses, server ports, free ports and venv copies of
# its own (two slots' gw0 patching one copy refused each other's patches, or undid them).
WORKER = os.environ.get("PYTEST_XDIST_WORKER") or "main"
SLOT = int(os.environ.get("SERVOPS_TEST_SLOT") or 0)
WORKER_INDEX = (int(WORKER[2:]) if WORKER.startswith("gw") and WORKER[2:].isdigit() else 0) + 8 * SLOT
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
if WORKERS > 1 or SLOT:  # 20000-29999 in slices of 312 (8 workers x 4 slots); 30000+ stays the lab's server ports
    slice_ = 10000 // 32
    os.environ[PORTS_ENV] = f"{20000 + WORKER_INDEX * slice_}-{20000 + (WORKER_INDEX + 1) * slice_ - 1}"
# The worker's own copies of the venvs the tests patch (servops/lab/venvs.py worker_copy): per
# slot too, since every suite on the machine shares the test cache they live in.
COPY_ID = f"slot{SLOT}-{WORKER}"
# The slot's run directory: everything a run leaves on this machine outside the test cache lives
# under it -- pytest's temporary directories (deploy roots, lab homes, sshd configs: its basetemp
# is set in pytest_configure), the agents' and results' directories, the PostgreSQL server's -- and
# every process the tests start names it (on its command line, as its working directory, or in
# its environment). A run killed halfway leaves them there, and the next run of the slot ends
# and removes them before it starts (tests/leftovers.py). 0755: PostgreSQL runs as its own user.
RUN_DIR = Path(tempfile.gettempdir()) / f"servops-tests-{os.getuid()}" / f"slot{SLOT}"
RUN_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
# Files the tests make in $HOME (a deploy root a `~/` path names), named by slot for the same sweep.
HOME_LEFTOVERS = f".servops-test-slot{SLOT}-"
# This module runs twice in one process where a test imports it as tests.conftest: the second run
# keeps the first's directories (the session's cleanup ends the agents of the first).
if os.environ.get("SERVOPS_TEST_PROCESS") != str(os.getpid()):
    os.environ["SERVOPS_TEST_PROCESS"] = str(os.getpid())
    os.environ["SERVOPS_RESULTS"] = tempfile.mkdtemp(prefix="results-", dir=RUN_DIR)  # never the checkout's results/
    os.environ["SERVOPS_AGENT_DIR"] = tempfile.mkdtemp(prefix="agents-", dir=RUN_DIR)
AGENT_DIR = os.environ["SERVOPS_AGENT_DIR"]
os.environ["SERVOPS_PERSIST"] = os.environ.get("SERVOPS_TEST_PERSIST", "0")
# A suite started in the background by a non-interactive shell (`pytest &`, nohup in a script)
# inherits SIGINT ignored, and so would every command and sshd a test starts: the tests that press
# Ctrl-C on a command (a deploy, `metrics --watch`) would see it ignored (seen: the deploy ran to
# the end, exit 0). A Python handler here is reset to the default in every program started.
signal.signal(signal.SIGINT, signal.default_int_handler)


def agent_pids(directory: str) -> list[int]:
    """The connection agents living in `directory` (from their lock files)."""
    pids = []
    for lock in Path(directory).glob("*.lock"):
        try:
            pid = int(lock.read_text().split()[0])
            if b"servops.connagent" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except (OSError, ValueError, IndexError):
            continue
    return pids


def end_agents(directory: str) -> None:
    """Every agent in `directory` told to exit (`invoke disconnect`'s way), a wedged one killed."""
    from servops import connagent

    for sock in Path(directory).glob("*.sock"):
        connagent.stop_agents(sock.name.split("-")[0], directory=directory)
    deadline = time.monotonic() + 10
    while agent_pids(directory) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in agent_pids(directory):
        os.kill(pid, signal.SIGKILL)


def pytest_unconfigure(config):
    """No agent outlives the tests, in any process of the run (xdist's controller made its
    directories too)."""
    end_agents(AGENT_DIR)
    shutil.rmtree(AGENT_DIR, ignore_errors=True)
    shutil.rmtree(os.environ["SERVOPS_RESULTS"], ignore_errors=True)


# -- tiers and parallel groups ----------------------------------------------------------------
# `pytest -m quick` is the edit loop: every test that needs no lab and no server, found by the
# fixtures it uses (directly or through other fixtures), so a new test lands in the right tier
# by itself: none of LAB_FIXTURES (sshd, the real venvs, the real vLLM, test_loadgen's SGLang
# double) and no module-scoped fixture (what a module builds once is a venv, a server or a sweep
# over releases). A test that starts a lab on its own (`invoke lab.up`, the README) says so with
# @pytest.mark.lab_home; a module that sweeps every release of a package, with pytestmark sweep. Under xdist (--dist loadgroup) tests go to workers one by one, except:
# a module whose tests share a module-scoped fixture runs on one worker (one setup, its order
# kept); every real-vLLM test runs on one worker (one vLLM at a time on two cores, and
# test_vllm_e2e patches the shared vLLM venv); lab_home tests share the one lab venv.
LAB_FIXTURES = {"sshd_hosts", "remote_env", "sglang_venvs", "vllm_venv", "double"}


class GroupsApplied:
    """Where pytest-xdist's --dist loadgroup did not apply the groups (it marks a grouped test's
    id with @group), every grouped test fails at once, saying why: with pytest 9.2 and xdist 3.8
    the groups were silently dropped, and the real vLLM's tests, each module's shared fixture and
    the lab venv's users ran side by side on several workers (one test edited a vLLM file while
    another's cache check read it). (A worker that stops instead is lost in xdist's own error.)"""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if not getattr(config.option, "loadgroup", False):
            return
        for item in items:
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
                item.add_marker(pytest.mark.groups_lost)


@pytest.fixture(autouse=True)
def xdist_groups_applied(request):
    if request.node.get_closest_marker("groups_lost"):
        pytest.fail(f"pytest-xdist did not apply this test's xdist_group with pytest {pytest.__version__}: install "
                    f"the pytest that pyproject.toml pins (.venv/bin/python -m pip install -e '.[dev]')", pytrace=False)


def pytest_configure(config):
    if config.option.basetemp is None:  # (xdist's workers get theirs from the controller)
        config.option.basetemp = str(RUN_DIR / "pytest")
    config.pluginmanager.register(GroupsApplied(), "servops-groups-applied")
    config.addinivalue_line("markers", "groups_lost: pytest-xdist did not apply its xdist_group (set by conftest)")
    config.addinivalue_line("markers", "quick: needs no lab and no server (set by conftest from the fixtures used)")
    config.addinivalue_line("markers", "lab_home: starts a lab of its own (invoke lab.up) on the one lab venv")
    config.addinivalue_line("markers", "sweep: walks every release of a package from the wheel cache (not quick)")


def pytest_sessionstart(session):
    """Once per run (in xdist's controller, before any worker starts): the slot is this run's,
    and what a killed earlier run of it left is cleaned."""
    config = session.config
    if hasattr(config, "workerinput"):
        return
    try:
        config._servops_slot = leftovers.claim_slot(RUN_DIR, SLOT)
    except leftovers.SlotTaken as exc:
        pytest.exit(str(exc), returncode=pytest.ExitCode.USAGE_ERROR)
    keep = {Path(config.option.basetemp), Path(AGENT_DIR), Path(os.environ["SERVOPS_RESULTS"])}
    said = leftovers.clean(RUN_DIR, keep, sorted(Path.home().glob(HOME_LEFTOVERS + "*")))
    if said:
        config.get_terminal_writer().line(said)


def uses_module_fixture(item) -> bool:
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(d.scope == "module" for fixturedefs in defs.values() for d in fixturedefs)


def parallel_group(item) -> str | None:
    if "vllm_venv" in item.fixturenames:
        return "vllm"
    if item.get_closest_marker("lab_home"):
        return "lab-home"
    if uses_module_fixture(item):
        return item.module.__name__
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not (LAB_FIXTURES & set(item.fixturenames) or uses_module_fixture(item)
                or item.get_closest_marker("lab_home") or item.get_closest_marker("sweep")):
            item.add_marker(pytest.mark.quick)
        group = parallel_group(item)
        if group and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
    # xdist hands out work in this order (pyproject: --no-loadscope-reorder, which would order the
    # groups by their number of tests): the longest chain first -- the real vLLM's group, ~12 min
    # on one worker, which as the second unit of a busy worker was the last 8 minutes of the run --
    # then the other groups, the single lab tests, and the quick ones last to fill the tail.
    items.sort(key=run_order)


def run_order(item) -> int:
    group = parallel_group(item)
    if group == "vllm":
        return 0
    if group:
        return 1
    return 3 if item.get_closest_marker("quick") else 2


def clear_stale_shell_lock() -> None:
    """The lab's hosts are this machine's own user, so every ssh command runs its ~/.bashrc; with
    pyenv that runs `pyenv rehash`, whose lock file is left behind when a test SIGKILLs a remote
    process tree mid-rehash (the hardening tests do). Every later command then waits 60 s for that
    lock, which turned CI into a timeout. A lock nobody is rehashing under is stale: remove it."""
    lock = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "shims" / ".pyenv-shim"
    if not lock.exists():
        return
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"pyenv-rehash" in cmdline.read_bytes():
                return
        except OSError:
            continue
    lock.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def no_stale_shell_lock():
    clear_stale_shell_lock()
    yield
    clear_stale_shell_lock()


# Files the tests edit; restored after every test so the cached venv stays pristine.
WATCHED = ["flashinfer/jit/cpp_ext.py", "flashinfer/jit/env.py", "flashinfer/__init__.py"]
# ... and in the sglang release venvs, what the piecewise fix set patches there
SGLANG_WATCHED = ["sglang/srt/layers/quantization/fp8_utils.py",
                  "sglang/srt/layers/quantization/modelopt_quant.py"]


def bench_script(name: str):
    """bench/<name>.py as a module (the bench scripts are programs, not part of the package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def own_copy(venv: Path, copy_id: str = COPY_ID) -> Path:
    """This worker's copy of a cached venv, as built: a copy a killed run left patched (files,
    servops' patch state) is repaired first (servops/lab/venvs.py repair)."""
    copy = remote_venv.worker_copy(venv, copy_id)
    remote_venv.repair(copy)
    return copy


@pytest.fixture(scope="session")
def ssh_client_key(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("client")
    return keygen(d / "id_ed25519")


@pytest.fixture(scope="session")
def remote_env() -> dict:
    """This worker's copy of the cached real venv, as built."""
    venv = own_copy(remote_venv.build_venv())
    site = remote_venv.site_packages(venv)
    pristine = {rel: (site / rel).read_bytes() for rel in WATCHED}
    return {"venv": venv, "site": site, "pristine": pristine}


@pytest.fixture
def venv(remote_env):
    """The remote venv for one test; watched files are put back byte for byte afterwards."""
    yield remote_env["venv"]
    # The venv's own patch state (servops keeps it inside the venv) goes with the restore.
    shutil.rmtree(Path(remote_env["venv"]).resolve() / ".servops", ignore_errors=True)
    site = remote_env["site"]
    for rel, data in remote_env["pristine"].items():
        path = site / rel
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
        shutil.rmtree(path.parent / "__pycache__", ignore_errors=True)


@pytest.fixture(scope="session")
def sshd_hosts(tmp_path_factory, ssh_client_key):
    """Real sshd servers on 127.0.N.2-6 for worker N (started lazily: most tests use only the first)."""
    if not find_sshd():
        pytest.fail("sshd is not installed: run the README's install command (openssh-server)")
    servers = {}

    def get(i: int):
        if i not in servers:
            address = f"127.0.{WORKER_INDEX}.{i + 2}"
            servers[i] = make_server(address, tmp_path_factory.mktemp(f"sshd{i}"), ssh_client_key).start()
        return servers[i]

    yield get
    for s in servers.values():
        s.stop()


@pytest.fixture
def lab(tmp_path, sshd_hosts, ssh_client_key, venv):
    """An inventory built from inventory/lab.yml with this run's ports, keys and paths filled in.
    Afterwards every release guard of its deploy roots still alive is ended: a guard left from a
    test that killed its controller would otherwise still count as a deploy in its health gate
    on the shared venv, and a later test's patch change would be refused for it."""
    yield LabFactory(tmp_path, sshd_hosts, ssh_client_key, venv)
    end_guards(tmp_path)
    end_servers(tmp_path)


def live_guards(tmp_path: Path) -> list[int]:
    """pids of the release guards of the lab's deploy roots under tmp_path that still run."""
    pids = []
    for record in tmp_path.glob("deploy-*/releases/*/guard.pid"):
        try:
            guard = json.loads(record.read_text())
            if guard.get("starttime") and proc_starttime(guard["pid"]) == guard["starttime"]:  # not a reused pid
                pids.append(int(guard["pid"]))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return pids


def end_servers(tmp_path: Path) -> None:
    """Every process still running in a release directory of the lab's deploy roots (a server a
    test left up, its TP workers, one a guard brought back): a test that ends without `stop`
    would otherwise leave it serving, and loading the machine, for the rest of the run."""
    roots = [str(d.resolve()) + os.sep for d in tmp_path.glob("deploy-*")]
    if not roots:
        return
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(proc / "cwd") + os.sep
        except OSError:
            continue
        if any(cwd.startswith(root) for root in roots) and int(proc.name) != os.getpid():
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except OSError:
                continue


def end_guards(tmp_path: Path) -> None:
    for pid in live_guards(tmp_path):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


class LabFactory:
    def __init__(self, tmp_path, sshd_hosts, client_key, venv):
        self.tmp = tmp_path
        self.sshd_hosts = sshd_hosts
        self.client_key = client_key
        self.venv = venv
        self.known_hosts = tmp_path / "known_hosts"

    def cuda_home(self) -> Path:
        """A CUDA toolkit layout reduced to its version.json (no GPU toolkit exists here)."""
        d = self.tmp / "cuda"
        d.mkdir(exist_ok=True)
        (d / "version.json").write_text('{"cuda": {"name": "CUDA SDK", "version": "12.9.1"}}')
        return d

    def inventory(self, n_hosts: int = 1, known: bool = True, host_vars: dict | None = None,
                  group_vars: dict | None = None, filename: str = "inventory.yml") -> Path:
        lab = yaml.safe_load((REPO / "inventory" / "lab.yml").read_text())
        template_hosts = lab["all"]["children"]["lab"]["hosts"]
        names = list(template_hosts)[:n_hosts]
        lines = []
        hosts = {}
        for i, name in enumerate(names):
            srv = self.sshd_hosts(i)
            if known:
                lines.append(srv.known_hosts_line)
            hv = dict(template_hosts[name] or {})
            hv["server_port"] += 10 * WORKER_INDEX
            hv.update(ssh_host=srv.address, ssh_port=srv.port, ssh_user=srv.user,
                      deploy_root=str(self.tmp / f"deploy-{name}"))
            hv.update((host_vars or {}).get(name, {}))
            hosts[name] = hv
        self.known_hosts.write_text("".join(lines))
        gvars = dict(lab["all"]["children"]["lab"].get("vars") or {})
        gvars.update(ssh_key=str(self.client_key), known_hosts=str(self.known_hosts), venv=str(self.venv),
                     env={"CUDA_HOME": str(self.cuda_home())})
        gvars.update(group_vars or {})
        lab["all"]["children"]["lab"] = {"hosts": hosts, "vars": gvars}
        path = self.tmp / filename
        path.write_text(yaml.safe_dump(lab, sort_keys=False))
        return path


def run_invoke(*args: str, inventory: Path | None = None, env: dict | None = None,
               timeout: int = 300, merged: bool = False) -> subprocess.CompletedProcess:
    """Run the real CLI (`invoke ...` from the repo root) as a user would.

    merged=True: stderr into stdout, in the order a terminal shows them (stderr is then '')."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200", NO_COLOR="1")
    if inventory:
        full_env["SERVOPS_INVENTORY"] = str(inventory)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, env=full_env, text=True,
                          timeout=timeout, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merged else subprocess.PIPE)


@pytest.fixture
def invoke_cli():
    return run_invoke


def newcomer_home(tmp_path: Path, lab_venv: bool = True) -> tuple[Path, dict]:
    """A newcomer's fresh HOME (tmp_path/home) for a lab of the shipped inventory, and the
    environment `invoke` runs in there: the lab's home is that HOME's ~/.servops-lab (what the
    inventory's paths name), whatever $SERVOPS_LAB_HOME the suite itself runs with. lab_venv: the
    lab's venv is this worker's own copy of the lab's release venv (its deploys patch it), built
    here, so the lab.up under test times no cache build and patches no venv another suite uses."""
    home = tmp_path / "home"
    lab_home = home / ".servops-lab"
    lab_home.mkdir(parents=True, mode=0o700)
    if lab_venv:
        (lab_home / "venv").symlink_to(own_copy(remote_venv.build_sglang_venv(manage.LAB_SGLANG)))
    return home, {"HOME": str(home), "SERVOPS_LAB_HOME": str(lab_home), "SERVOPS_TEST_CACHE": str(remote_venv.CACHE)}


# A wait for an event has a deadline sized for a loaded machine (a second run beside other work,
# load ~7 on 2 cores, took 5-10x a quiet run's time for a process to start): the wait ends when the
# event happens, so a generous deadline costs a quiet run nothing, and a short one fails a busy run.
LOADED = 120.0


def wait_for(predicate, timeout: float = LOADED, what: str | None = None, step: float = 0.1):
    """`predicate`'s first true value, polled until `timeout` seconds. Past the deadline: an
    AssertionError naming `what` (and the predicate's last value), or, without `what`, False for
    the caller to judge."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            break
        time.sleep(step)
    if not value and what is not None:
        raise AssertionError(f"{what}: not after {timeout:g} s (last: {value!r})")
    return value


def playbooks_with(tmp_path: Path, **variants: str) -> Path:
    """A copy of playbooks/ plus test variants (name -> YAML text); point SERVOPS_PLAYBOOKS at it."""
    books = tmp_path / "books"
    books.mkdir(exist_ok=True)
    for f in (REPO / "playbooks").glob("*.yml"):
        (books / f.name).write_text(f.read_text())
    for name, text in variants.items():
        (books / f"{name}.yml").write_text(text)
    return books


@pytest.fixture(scope="session")
def sglang_venvs():
    """version -> {"venv", "site", "real", "pristine"}: cached venvs holding the real sglang==version
    wheel (servops/lab/venvs.py build_sglang_venv), built on first use. "real": sglang's real
    parser imports there; otherwise a check of it is the static (source-reading) one."""
    built = {}

    def get(version: str) -> dict:
        if version not in built:
            venv = own_copy(remote_venv.build_sglang_venv(version))
            site = remote_venv.site_packages(venv)
            watched = WATCHED + [rel for rel in SGLANG_WATCHED if (site / rel).exists()]
            built[version] = {"venv": venv, "site": site, "real": remote_venv.sglang_real_parser(version),
                              "pristine": {rel: (site / rel).read_bytes() for rel in watched}}
        return built[version]

    return get


@pytest.fixture
def sglang_release(sglang_venvs):
    """sglang_release("0.5.23") -> that release venv's record; like `venv`, its watched files and
    servops' patch state are put back after the test."""
    used = []

    def get(version: str) -> dict:
        env = sglang_venvs(version)
        used.append(env)
        return env

    yield get
    for env in used:
        shutil.rmtree(Path(env["venv"]).resolve() / ".servops", ignore_errors=True)
        for rel, data in env["pristine"].items():
            path = env["site"] / rel
            if not path.exists() or path.read_bytes() != data:
                path.write_bytes(data)
            shutil.rmtree(path.parent / "__pycache__", ignore_errors=True)


# -- shared by the adversarial suites (test_hardening, test_attacks) --------------------------

MARKER = Path("/tmp/servops-pwned")  # what injected code would create


@pytest.fixture
def no_marker():
    MARKER.unlink(missing_ok=True)
    yield
    assert not MARKER.exists(), "injected code ran"


@pytest.fixture
def alab(lab):
    """One lab host with its own server port; its server is stopped (lock broken) afterwards."""
    port = free_port()
    inv = lab.inventory(host_vars={"lab1": {"server_port": port}})
    yield lab, inv, port
    run_invoke("stop", "--grace", "2", "--break-lock", inventory=inv)


def healthy(port: int) -> bool:
    """Whether a server on 127.0.0.1:port answers /health with 200."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def root_of(lab) -> Path:
    """lab1's deploy root."""
    return lab.tmp / "deploy-lab1"


def current(lab) -> str | None:
    """lab1's current release, or None when there is none."""
    link = root_of(lab) / "current"
    return os.readlink(link).split("/")[-1] if link.is_symlink() else None


def server_pid(lab) -> int | None:
    """The pid servops recorded for lab1's server, or None."""
    try:
        return json.loads((root_of(lab) / "server.pid").read_text())["pid"]
    except OSError:
        return None


def append_until_followed(follower: subprocess.Popen, log: Path, line: str, timeout: float = 30) -> str:
    """`line` appended to `log` each half second until the follower (`invoke logs -f`, text
    stdout) prints it, then the follower ended; all it printed. Waits for the condition: a fixed
    sleep before the first line was either too short on a loaded machine or time wasted."""
    import select

    out = ""
    deadline = time.time() + timeout
    while time.time() < deadline and line not in out:
        with open(log, "a") as fh:
            fh.write(line + "\n")
        if select.select([follower.stdout], [], [], 0.5)[0]:
            out += os.read(follower.stdout.fileno(), 65536).decode(errors="replace")
    follower.terminate()
    return out + follower.communicate(timeout=10)[0]


def one_line_error(res, *needles: str, code: int = 2) -> None:
    """One stderr line holding every needle, no traceback; exit 2 (bad input) unless told (3: unreachable)."""
    assert res.returncode == code, res.stdout + res.stderr
    lines = [l for l in res.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
