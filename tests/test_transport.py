"""Transport over real sshd: ProxyJump, timeouts, quoting, connect errors."""

import socket
import time

import pytest

from conftest import run_invoke
from servops.errors import TransportError
from servops.inventory import load_inventory
from servops.transport import Session

CPP_EXT = "flashinfer/jit/cpp_ext.py"


def test_proxy_jump_through_another_inventory_host(lab):
    inv = lab.inventory(n_hosts=2, host_vars={"lab1": {"proxy_jump": "lab2"}})
    res = run_invoke("inspect", "--file", CPP_EXT, "--lines", "68", "-H", "lab1", inventory=inv)
    assert res.returncode == 0, res.stderr
    assert "def get_cuda_version() -> Version:" in res.stdout
    # the jump host's key is checked too: without it the connection is refused at the jump
    lines = lab.known_hosts.read_text().splitlines(True)
    lab.known_hosts.write_text("".join(l for l in lines if not l.startswith(f"[{lab.sshd_hosts(1).address}]")))
    res = run_invoke("inspect", "--file", CPP_EXT, "--lines", "68", "-H", "lab1", inventory=inv)
    assert res.returncode != 0 and lab.sshd_hosts(1).address in res.stderr and "is not in" in res.stderr


def test_command_timeout_and_connection_reuse(lab):
    inv = load_inventory(lab.inventory())
    with Session(inv) as s:
        hs = s.host(inv.hosts["lab1"])
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="timed out after 1s"):
            hs.run("sleep 20", timeout=1)
        assert time.monotonic() - t0 < 5
        assert hs.run("echo still-here").stdout.strip() == "still-here"


def test_output_sent_after_the_exit_status_is_kept(lab):
    """sshd reports the exit status as the shell exits: output its child writes later still
    belongs to the command (until the channel's EOF), and a child that keeps the pipe open past
    the grace does not hold the command forever."""
    from servops.chanend import EOF_GRACE
    inv = load_inventory(lab.inventory())
    with Session(inv) as s:
        hs = s.host(inv.hosts["lab1"])
        assert hs.run("(sleep 0.5; echo late) & echo early").stdout == "early\nlate\n"
        t0 = time.monotonic()
        res = hs.run("(sleep 30; echo never) & echo early", timeout=20)
        assert res.stdout == "early\n" and time.monotonic() - t0 < EOF_GRACE + 5


def test_connect_refused_and_timeout_are_one_line(lab, tmp_path):
    address = lab.sshd_hosts(0).address  # lab1's
    with socket.socket() as s:
        s.bind((address, 0))
        closed = s.getsockname()[1]
    inv = lab.inventory(host_vars={"lab1": {"ssh_port": closed}})
    res = run_invoke("inspect", "--file", CPP_EXT, inventory=inv)
    assert res.returncode == 3 and f"cannot connect to {address}:{closed}" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_wrong_key_is_an_auth_error(lab, tmp_path):
    from servops.lab.sshd import keygen
    other = keygen(tmp_path / "other_key")
    inv = lab.inventory(group_vars={"ssh_key": str(other)})
    res = run_invoke("inspect", "--file", CPP_EXT, inventory=inv)
    assert res.returncode == 3 and "SSH authentication failed" in res.stderr and "check ssh_user and ssh_key" in res.stderr


def test_secrets_never_reach_the_output(lab):
    inv = lab.inventory(group_vars={"env": {"HF_TOKEN": "hf_TOPSECRET123", "CUDA_HOME": str(lab.cuda_home())}})
    res = run_invoke("render", "--variant", "baseline", "-H", "lab1", inventory=inv)
    assert res.returncode == 0 and ". ./secrets.env" in res.stdout and "hf_TOPSECRET123" not in res.stdout


def test_an_sshd_that_never_sends_its_banner_is_one_line(lab):
    """Issue 18 #15: the one-line error, and nothing of paramiko's own logging (a traceback)."""
    from conftest import one_line_error

    with socket.socket() as silent:
        silent.bind((lab.sshd_hosts(0).address, 0))
        silent.listen(8)  # accepts, never speaks
        inv = lab.inventory(host_vars={"lab1": {"ssh_port": silent.getsockname()[1]}},
                            group_vars={"connect_timeout": 1})
        res = run_invoke("inspect", "--file", CPP_EXT, inventory=inv)
    one_line_error(res, "lab1", "did not answer within 1s", code=3)


def test_a_missing_ssh_key_names_the_inventory_host_and_key(lab, tmp_path):
    """Issue 18 #16: not paramiko's bare "No such file or directory"."""
    from conftest import one_line_error

    missing = tmp_path / "no-such-key"
    inv = lab.inventory(group_vars={"ssh_key": str(missing)})
    res = run_invoke("inspect", "--file", CPP_EXT, inventory=inv)
    one_line_error(res, str(inv), "host 'lab1'", f"ssh_key {missing} does not exist")
    res = run_invoke("inspect", "--file", CPP_EXT, inventory=lab.inventory(group_vars={"ssh_key": str(tmp_path)}))
    one_line_error(res, f"ssh_key {tmp_path} is not a file")
