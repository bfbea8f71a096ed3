"""The connection agent (servops.connagent) over real sshd: reuse, host keys, who may use it,
dead and wedged agents, changed inventory entries, and the command contract through it.

Each test has its own agent directory with persistence on (the rest of the suite runs with it
off, see conftest); every agent a test leaves is ended with it. The lab host is reached through
a TCP proxy that counts connections: a command that opens no TCP connection made no handshake.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import LOADED, REPO, RUN_DIR, agent_pids, append_until_followed, end_agents, run_invoke, wait_for
from servops.lab.tcpproxy import TcpProxy

CPP_EXT = "flashinfer/jit/cpp_ext.py"
FAKE_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGZ0ZXN0a2V5ZmFrZWtleWZha2VrZXlmYWtla2V5ZmFr"


@pytest.fixture
def agents():
    """A private agent directory, persistence on, for this test's CLI runs; its agents end with it."""
    directory = tempfile.mkdtemp(prefix="agents-", dir=RUN_DIR)  # short: a socket path holds ~100 bytes
    yield SimpleNamespace(dir=directory, env={"SERVOPS_AGENT_DIR": directory, "SERVOPS_PERSIST": "2m"})
    end_agents(directory)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def counted(lab):
    """counted(**lab1_vars) -> an inventory whose lab1 is reached through a connection-counting
    proxy, and the proxy."""
    srv, proxies = lab.sshd_hosts(0), []

    def make(**host_vars):
        proxies.append(TcpProxy((srv.address, srv.port), address=srv.address))
        inv = lab.inventory(host_vars={"lab1": dict(host_vars, ssh_port=proxies[-1].port)})
        lab.known_hosts.write_text(proxies[-1].known_hosts_line(srv.known_hosts_line))
        return inv, proxies[-1]

    yield make
    for proxy in proxies:
        proxy.close()


def inspect(inv, agents, env=None):
    return run_invoke("inspect", "--file", CPP_EXT, "--lines", "60:62", inventory=inv,
                      env=dict(agents.env, **(env or {})), timeout=120)


def serving(directory: str, other_than=()) -> tuple[int, Path]:
    """The agent that serves in `directory` (its socket is up): its pid and socket."""
    def up():
        for sock in Path(directory).glob("*.sock"):
            try:
                pid = int(sock.with_suffix(".lock").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            if pid not in other_than and Path(f"/proc/{pid}").exists():
                return pid, sock
        return None

    return wait_for(up, what=f"an agent serving in {directory}", step=0.05)


def warm(inv, agents) -> tuple[int, Path, str]:
    """A first command (direct), and the agent it left once that serves."""
    first = inspect(inv, agents)
    assert first.returncode == 0, first.stderr
    return *serving(agents.dir), first.stdout


def gone(pid: int) -> bool:
    """Whether process `pid` ends (or is a zombie) before a loaded machine's deadline."""
    def ended() -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True

    return wait_for(ended, step=0.05)


def imported(module: str, importtime: str) -> bool:
    """Whether -X importtime output (PYTHONPROFILEIMPORTTIME) shows `module` imported."""
    return re.search(rf"\|\s+{module}$", importtime, re.M) is not None


def test_the_next_commands_reuse_the_agents_connection(counted, agents):
    inv, proxy = counted()
    importtime = {"PYTHONPROFILEIMPORTTIME": "1"}
    first = inspect(inv, agents, importtime)
    assert first.returncode == 0 and "def get_cuda_version" not in first.stdout
    assert imported("paramiko", first.stderr)  # the first command connected itself
    serving(agents.dir)
    assert proxy.connections == 2  # the first command's, then the agent's own
    for _ in range(3):
        res = inspect(inv, agents, importtime)
        assert res.returncode == 0 and res.stdout == first.stdout
        assert not imported("paramiko", res.stderr) and not imported("fabric", res.stderr)
    assert proxy.connections == 2  # no new TCP connection, so no handshake


def test_the_agent_checks_the_host_key_it_connects_with(lab, agents):
    """The agent opens its connection as a direct command does: a key that is not the one in
    known_hosts is refused, and no agent serves."""
    from servops import connagent
    from servops.inventory import load_inventory

    inv = load_inventory(lab.inventory())
    lab.known_hosts.write_text(lab.sshd_hosts(0).known_hosts_line.split()[0] + f" {FAKE_KEY}\n")
    client = connagent.Client(inv.hosts["lab1"], inv, agents.dir, 60)
    client.leave()
    log = Path(client.path).with_suffix(".log")
    wait_for(lambda: "CHANGED" in (log.read_text() if log.exists() else ""), what="the agent's refusal in its log",
             step=0.05)
    assert "host key for" in log.read_text() and "CHANGED" in log.read_text()
    assert not list(Path(agents.dir).glob("*.sock")) and agent_pids(agents.dir) == []


def test_a_changed_host_key_is_refused_through_the_agent(lab, agents):
    inv = lab.inventory()
    pid, sock, _ = warm(inv, agents)
    # the host presents a key known_hosts no longer lists (reinstalled, or someone in between)
    lab.known_hosts.write_text(lab.sshd_hosts(0).known_hosts_line.split()[0] + f" {FAKE_KEY}\n")
    res = inspect(inv, agents)
    assert res.returncode == 2 and "CHANGED" in res.stderr and "cuda_home" not in res.stdout
    assert gone(pid)  # the agent of the entry as it was was told to exit
    assert not list(Path(agents.dir).glob("*.sock"))  # and a refused connection leaves none


NOBODY_CLIENT = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("connect:", exc.errno)
    sys.exit()
req = json.dumps({"op": "run", "command": "touch " + sys.argv[2], "timeout": 10, "persist": 60}).encode()
try:
    s.sendall(b"R" + len(req).to_bytes(4, "big") + req)
    print("answer:", s.recv(100) or "hung up")
except OSError:
    print("answer: hung up")
"""


def test_another_user_cannot_use_the_agent(lab, agents, tmp_path):
    inv = lab.inventory()
    pid, sock, _ = warm(inv, agents)
    nobody = pwd.getpwnam("nobody")
    marker = tmp_path / "ran"

    def as_nobody() -> str:
        return subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                               "/usr/bin/python3", "-I", "-c", NOBODY_CLIENT, str(sock), str(marker)],
                              capture_output=True, text=True, timeout=30).stdout.strip()

    assert as_nobody() == "connect: 13"  # EACCES: the directory is its owner's only
    os.chmod(agents.dir, 0o711)  # say it leaked: the socket reachable by anyone
    os.chmod(sock, 0o666)
    try:
        assert as_nobody() == "answer: hung up"  # the agent checks its peer's uid, and hangs up
        assert f"refused a client of uid {nobody.pw_uid}" in sock.with_suffix(".log").read_text()
        # and servops itself will not use agents from a directory others can reach
        res = inspect(inv, agents)
        assert res.returncode == 0 and "is not a private directory" in res.stderr
    finally:
        os.chmod(agents.dir, 0o700)
    assert not marker.exists()
    assert Path(f"/proc/{pid}").exists() and sock.exists()  # and the agent serves on


def test_a_killed_agent_is_bypassed_and_replaced(lab, agents):
    inv = lab.inventory()
    pid, _sock, expected = warm(inv, agents)
    os.kill(pid, signal.SIGKILL)
    assert gone(pid)
    res = inspect(inv, agents)  # its socket is still there, and refuses: connect directly
    assert res.returncode == 0 and res.stdout == expected, res.stderr
    new, _ = serving(agents.dir, other_than={pid})
    assert new != pid


def test_a_wedged_agent_is_bypassed(lab, agents):
    inv = lab.inventory()
    pid, _sock, expected = warm(inv, agents)
    os.kill(pid, signal.SIGSTOP)  # alive, holding its socket, answering nothing
    try:
        res = inspect(inv, agents)
        assert res.returncode == 0 and res.stdout == expected, res.stderr
        assert Path(f"/proc/{pid}/stat").read_text().split()[2] == "T"  # not waited for: still stopped
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_changed_inventory_entry_gets_a_new_agent(lab, agents):
    inv = lab.inventory()
    pid, sock, expected = warm(inv, agents)
    lab.inventory(host_vars={"lab1": {"server_port": 31999}})  # not about the connection: kept
    res = inspect(inv, agents)
    assert res.returncode == 0 and agent_pids(agents.dir) == [pid] and sock.exists()
    # a connection var changes: the agent sees it and ends, without waiting for a command
    lab.inventory(group_vars={"connect_timeout": 7})
    assert gone(pid)
    res = inspect(inv, agents)
    assert res.returncode == 0 and res.stdout == expected
    new, new_sock = serving(agents.dir, other_than={pid})
    assert new_sock != sock
    # the key file changes content (same path): a new agent again; `disconnect` ends it
    key = Path(inv.read_text().split("ssh_key: ", 1)[1].split("\n", 1)[0])
    copy = lab.tmp / "key-copy"
    shutil.copy(key, copy)
    copy.with_name("key-copy.pub").write_text(key.with_name(key.name + ".pub").read_text())
    lab.inventory(group_vars={"connect_timeout": 7, "ssh_key": str(copy)})
    assert gone(new)
    assert inspect(inv, agents).returncode == 0
    third, _ = serving(agents.dir, other_than={pid, new})
    res = run_invoke("disconnect", inventory=inv, env=agents.env)
    assert res.returncode == 0 and f"lab1 : changed - closed (agent pid {third})" in res.stdout
    assert gone(third)
    res = run_invoke("disconnect", inventory=inv, env=agents.env)
    assert "lab1 : ok - no persistent connection" in res.stdout


def test_no_persist_connects_directly_and_leaves_nothing(counted, agents):
    inv, proxy = counted()
    for _ in range(2):
        res = run_invoke("inspect", "--no-persist", "--file", CPP_EXT, "--lines", "1", inventory=inv, env=agents.env)
        assert res.returncode == 0, res.stderr
    assert proxy.connections == 2 and os.listdir(agents.dir) == []


LATE_OUTPUT = "(sleep 0.5; echo late) & echo early"


@pytest.fixture
def agent_session(counted, agents, monkeypatch):
    """A HostSession of lab1 through a warm agent (the first command connected and left it), the
    agent's pid and the connection-counting proxy."""
    from servops.inventory import load_inventory
    from servops.transport import Session

    inv_path, proxy = counted()
    monkeypatch.setenv("SERVOPS_AGENT_DIR", agents.dir)
    monkeypatch.setenv("SERVOPS_PERSIST", "2m")
    inv = load_inventory(inv_path)
    with Session(inv) as session:
        assert session.host(inv.hosts["lab1"]).run("true").ok  # direct: leaves an agent
    pid, _sock = serving(agents.dir)
    with Session(inv) as session:
        yield SimpleNamespace(hs=session.host(inv.hosts["lab1"]), pid=pid, proxy=proxy, inventory=inv_path)


def test_commands_through_the_agent_keep_the_direct_contract(agent_session):
    """Stdin, exit codes, stderr, timeouts, streaming and the streamed-tail bound, remote
    programs, and a connection lost mid-command: as HostSession.run does directly."""
    from servops.errors import TransportError
    from servops.inspect import InspectRequest, inspect_file
    from servops.transport import KEEP_STREAMED

    hs, pid, proxy = agent_session.hs, agent_session.pid, agent_session.proxy
    connections = proxy.connections
    text = "".join(f"line {i}\n" for i in range(400_000))  # 5 MB each way
    assert hs.run("cat", stdin=text, timeout=120).stdout == text
    # sshd sends the exit status when the shell exits; a child still writing its output
    # sends the rest after it: the command is over at the channel's EOF, not the status
    assert hs.run(LATE_OUTPUT).stdout == "early\nlate\n"
    res = hs.run("echo out; echo err >&2; exit 7")
    assert (res.exited, res.stdout, res.stderr) == (7, "out\n", "err\n")
    with pytest.raises(TransportError, match=r"remote command failed \(exit 7\): err"):
        hs.run("echo err >&2; exit 7", check=True)
    with pytest.raises(TransportError, match="timed out after 1s"):
        hs.run("sleep 20", timeout=1)
    assert hs.run("echo still-here").stdout == "still-here\n"
    chunks = []
    hs.run("for i in 1 2 3; do echo $i; sleep 0.5; done", on_output=chunks.append)
    assert "".join(chunks) == "1\n2\n3\n" and len(chunks) >= 2  # handed on as printed
    seen = [0]
    res = hs.run("python3 -c \"import sys; [sys.stdout.write('é' * 65535 + 'x') for _ in range(700)]\"; echo done",
                 timeout=120, on_output=lambda t: seen.__setitem__(0, seen[0] + len(t)))
    assert res.ok and res.stdout.endswith("done\n") and seen[0] >= 700 * 65536
    assert len(res.stdout.encode()) <= 2 * KEEP_STREAMED + 65536
    assert inspect_file(hs, InspectRequest(CPP_EXT, lines="60:62"))["owner"]["version"] == "0.7.2.post1"
    assert proxy.connections == connections  # all of it through the agent
    # the agent dies mid-command: that command is lost (it may have run), the next connects afresh
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(TransportError, match="SSH connection lost: the connection agent went away"):
        hs.run("sleep 10; echo late")
    assert hs.run("echo direct").stdout == "direct\n"
    assert proxy.connections == connections + 1


def test_deploy_ctrl_c_and_logs_follow_through_the_agent(counted, agents, lab, tmp_path):
    """A deploy's streamed health progress, Ctrl-C during its health gate (undo: roll back), and
    `logs -f` until its end: through a warm agent, as directly (test_newcomer, test_deploy)."""
    from conftest import playbooks_with
    from servops.lab.sshd import free_port
    from test_deploy import remote_programs

    inv, proxy = counted(server_port=free_port())
    books = playbooks_with(tmp_path, slow="extends: baseline\nenv: {SGLANG_DOUBLE_LOAD_TIME: '30'}\n")
    env = dict(os.environ, SERVOPS_INVENTORY=str(inv), SERVOPS_PLAYBOOKS=str(books), NO_COLOR="1", **agents.env)
    root = lab.tmp / "deploy-lab1"
    try:
        warm(inv, agents)
        connections = proxy.connections
        res = run_invoke("deploy", "--variant", "baseline", inventory=inv, env=agents.env)
        assert res.returncode == 0 and re.search(r"^lab1  \[\s*[\d.]+s\] health", res.stdout, re.M), res.stdout
        good = os.readlink(root / "current").split("/")[-1]
        proc = subprocess.Popen([sys.executable, "-m", "invoke", "deploy", "--variant", "slow", "--force"], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        out = ""
        deadline = time.time() + LOADED
        while time.time() < deadline and "health" not in out:
            out += proc.stdout.readline()
        time.sleep(1)  # well inside the slow variant's gate
        proc.send_signal(signal.SIGINT)
        out += proc.communicate(timeout=120)[0]
        assert proc.returncode == 130 and "Ctrl-C during health" in out and f"rolled back to {good}" in out, out
        assert os.readlink(root / "current").split("/")[-1] == good
        follower = subprocess.Popen([sys.executable, "-m", "invoke", "logs", "-f", "--lines", "0"], cwd=REPO, env=env,
                                    stdout=subprocess.PIPE, text=True)
        out = append_until_followed(follower, root / "current" / "server.log", "a line written while following")
        assert "a line written while following" in out
        # its program on the host goes with its channel: nothing left tailing
        wait_for(lambda: not remote_programs(lab.sshd_hosts(0).port), what="the follower's host program ended")
        assert proxy.connections == connections  # every command of it went through the agent
    finally:
        run_invoke("stop", "--grace", "2", "--break-lock", inventory=inv, env=agents.env)


# -- the host's warm interpreter (servops.warmrunner): read-only programs skip exec, shell and python start-up

WHO = ("import os\n"
       "print(os.getpid(), os.getppid())\n"
       "print(open('/proc/%d/cmdline' % os.getppid(), 'rb').read().replace(b'\\0', b' ').decode())\n")


def who(hs) -> tuple[int, bool]:
    """Run WHO as a warm program: (its parent's pid, whether that parent is the warm interpreter)."""
    from servops.shell import python_stdin

    res = hs.run(python_stdin(hs.host.python), stdin=WHO, warm=hs.host.python)
    assert res.ok, res.stderr
    return int(res.stdout.split()[1]), "<servops-warm-runner>" in res.stdout


def until_warm(hs, other_than=()) -> int:
    """The warm interpreter's pid, once one (not in `other_than`) runs the warm programs."""
    def runner():
        ppid, in_runner = who(hs)
        return ppid if in_runner and ppid not in other_than else None

    return wait_for(runner, what="a warm interpreter taking the warm programs")


def test_read_only_programs_run_in_the_hosts_warm_interpreter(agent_session, agents):
    from servops.inspect import InspectRequest, inspect_file
    from servops.shell import python_stdin

    hs, proxy = agent_session.hs, agent_session.proxy
    connections = proxy.connections
    direct = inspect(agent_session.inventory, agents, {"SERVOPS_PERSIST": "0"})
    runner = until_warm(hs)
    # the warm path keeps the command contract: output, stderr, exit status, remote programs
    res = hs.run(python_stdin(hs.host.python), stdin="import sys\nprint('o')\nprint('e', file=sys.stderr)\nsys.exit(3)\n",
                 warm=hs.host.python)
    assert (res.exited, res.stdout, res.stderr) == (3, "o\n", "e\n")
    assert inspect_file(hs, InspectRequest(CPP_EXT, lines="60:62"))["owner"]["version"] == "0.7.2.post1"
    assert who(hs) == (runner, True)
    # the CLI's inspect through it prints what a direct one does
    again = inspect(agent_session.inventory, agents)
    assert again.returncode == 0 and again.stdout == direct.stdout
    assert who(hs) == (runner, True)  # one interpreter, reused
    # back to back: the runner is free when a command's status arrives, so the next one (sent at
    # once) never finds it busy and runs the ordinary way (CI saw that)
    assert [who(hs) for _ in range(20)] == [(runner, True)] * 20
    # a program that is not marked warm always gets its own `python -`
    plain = hs.run(python_stdin(hs.host.python), stdin=WHO)
    assert "<servops-warm-runner>" not in plain.stdout
    assert proxy.connections == connections + 1  # only the --no-persist inspect connected


def test_a_killed_or_stale_warm_interpreter_is_replaced(agent_session, venv):
    hs = agent_session.hs
    first = until_warm(hs)
    os.kill(first, signal.SIGKILL)
    assert who(hs)[1] is False  # it did not run there: the ordinary way, and it succeeded
    second = until_warm(hs, other_than=(first,))
    # a pip install changes a sys.path directory: the interpreter is stale, nothing runs there
    site = next(Path(venv).glob("lib/python3*/site-packages"))
    st = site.stat()
    os.utime(site, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert who(hs)[1] is False
    assert gone(second)  # it ended itself
    until_warm(hs, other_than=(first, second))


def test_a_warm_program_whose_client_goes_is_killed(agent_session):
    from servops.errors import TransportError
    from servops.shell import python_stdin

    hs = agent_session.hs
    runner = until_warm(hs)
    printed = []
    with pytest.raises(TransportError, match="timed out after 2s"):
        hs.run(python_stdin(hs.host.python), stdin="import os, time\nprint(os.getpid(), os.getppid(), flush=True)\ntime.sleep(60)\n",
               warm=hs.host.python, timeout=2, on_output=printed.append)
    pid, parent = map(int, "".join(printed).split()[:2])
    assert parent == runner  # it ran in the warm interpreter (the one that kills it)
    assert gone(pid)
    assert who(hs) == (runner, True)  # and the interpreter serves the next
