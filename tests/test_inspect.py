"""`invoke inspect` over a real sshd against the real flashinfer-python 0.7.2.post1 file."""

from pathlib import Path

import pytest

from conftest import run_invoke

CPP_EXT = "flashinfer/jit/cpp_ext.py"


def printed(res) -> list[str]:
    """inspect's output lines, without the recap every verb ends with (a blank line, one line per host)."""
    lines = res.stdout.splitlines()
    assert lines[-2:] == ["", "lab1 : ok"], lines[-3:]
    return lines[:-2]


def test_lines_60_90_of_the_real_file(lab, remote_env):
    inv = lab.inventory()
    res = run_invoke("inspect", "--file", CPP_EXT, "--lines", "60:90", inventory=inv)
    assert res.returncode == 0, res.stderr
    out = printed(res)
    assert out[0].startswith("==> lab1: ") and "[flashinfer-python 0.7.2.post1]" in out[0]
    assert out[0].endswith(str(remote_env["site"] / CPP_EXT) + " [flashinfer-python 0.7.2.post1] <==")
    real = (remote_env["site"] / CPP_EXT).read_text().splitlines()
    body = out[1:]
    assert len(body) == 31
    assert body[0] == f"{60:>6}  {real[59]}" and body[-1] == f"{90:>6}  {real[89]}"
    assert any("def get_cuda_version() -> Version:" in line and line.lstrip().startswith("68") for line in body)


def test_symbol_prints_decorator_and_body_with_the_subprocess_call(lab):
    res = run_invoke("inspect", "--file", CPP_EXT, "--symbol", "get_cuda_version", inventory=lab.inventory())
    assert res.returncode == 0, res.stderr
    body = printed(res)[1:]
    assert body[0] == "    67  @functools.cache"
    assert body[1].startswith("    68  def get_cuda_version()")
    assert any('subprocess.check_output([nvcc, "--version"], text=True)' in l for l in body)
    assert body[-1].strip().startswith("87") and "return Version(torch.version.cuda)" in body[-1]


def test_grep_with_context_marks_matches(lab):
    res = run_invoke("inspect", "--file", CPP_EXT, "--grep", r"subprocess\.", "--context", "1",
                     inventory=lab.inventory())
    assert res.returncode == 0, res.stderr
    lines = printed(res)[1:]
    matches = [l for l in lines if l[6:7] == ":"]
    assert any("subprocess.check_output([nvcc" in l for l in matches)
    assert any('subprocess.run(["which", "nvcc"]' in l for l in matches)
    assert all(l[6:7] in ":-" for l in lines if l != "--")
    assert any(l[6:7] == "-" for l in lines)  # context lines present


def test_highlighted_output_when_forced(lab):
    res = run_invoke("inspect", "--file", CPP_EXT, "--lines", "67:70", "--color", "yes",
                     inventory=lab.inventory(), env={"NO_COLOR": "", "FORCE_COLOR": "1", "TERM": "xterm-256color"})
    assert res.returncode == 0, res.stderr
    assert "\x1b[" in res.stdout and "get_cuda_version" in res.stdout


def test_verify_is_clean_then_detects_a_one_byte_edit(lab, remote_env):
    inv = lab.inventory()
    res = run_invoke("inspect", "--verify", "flashinfer-python", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "files match RECORD" in res.stdout
    path = remote_env["site"] / CPP_EXT
    data = bytearray(path.read_bytes())
    data[100] = ord("#") if data[100] != ord("#") else ord("!")
    path.write_bytes(bytes(data))
    res = run_invoke("inspect", "--verify", "flashinfer_python", inventory=inv)
    assert res.returncode != 0
    assert "modified" in res.stdout and CPP_EXT in res.stdout
    assert "lab1 : failed - 1 file(s) differ from RECORD" in res.stderr
    # and inspect flags the drift in its header
    res = run_invoke("inspect", "--file", CPP_EXT, "--lines", "1", inventory=inv)
    assert "(MODIFIED since install)" in res.stdout


def test_unknown_host_key_is_refused(lab):
    inv = lab.inventory(known=False)
    res = run_invoke("inspect", "--file", CPP_EXT, "--lines", "1", inventory=inv)
    assert res.returncode != 0
    assert "is not in" in res.stdout + res.stderr and "accept_new_host_keys" in res.stdout + res.stderr
    assert lab.known_hosts.read_text() == ""


def test_changed_host_key_is_refused_even_with_accept_new(lab, tmp_path):
    inv = lab.inventory(known=False, group_vars={"accept_new_host_keys": True})
    srv = lab.sshd_hosts(0)
    other = srv.known_hosts_line.split()[0] + " ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGZ0ZXN0a2V5ZmFrZWtleWZha2VrZXlmYWtla2V5ZmFr\n"
    lab.known_hosts.write_text(other)
    res = run_invoke("inspect", "--file", CPP_EXT, "--lines", "1", inventory=inv)
    assert res.returncode != 0 and "CHANGED" in res.stdout + res.stderr


def test_accept_new_is_opt_in_and_records_the_key(lab):
    inv = lab.inventory(known=False, group_vars={"accept_new_host_keys": True})
    res = run_invoke("inspect", "--file", CPP_EXT, "--lines", "1", inventory=inv)
    assert res.returncode == 0, res.stderr
    recorded = lab.known_hosts.read_text()
    srv = lab.sshd_hosts(0)
    assert srv.known_hosts_line.split()[2] in recorded


@pytest.mark.parametrize("bad", ["; touch /tmp/pwned", "$(touch /tmp/pwned)", "`touch /tmp/pwned`"])
def test_shell_metacharacters_in_file_are_inert(lab, bad):
    marker = Path("/tmp/pwned")
    marker.unlink(missing_ok=True)
    res = run_invoke("inspect", "--file", bad, inventory=lab.inventory())
    assert res.returncode != 0
    assert "not found in site-packages" in res.stderr
    assert not marker.exists()


def test_path_traversal_refused_unless_allowed(lab):
    inv = lab.inventory()
    res = run_invoke("inspect", "--file", "../../../../../../etc/passwd", inventory=inv)
    assert res.returncode != 0 and "resolves outside site-packages" in res.stderr
    assert "root:" not in res.stdout
    res = run_invoke("inspect", "--file", "/etc/passwd", inventory=inv)
    assert res.returncode != 0 and "--allow-outside" in res.stderr
    res = run_invoke("inspect", "--file", "/etc/hostname", "--allow-outside", inventory=inv)
    assert res.returncode == 0 and open("/etc/hostname").read().strip() in res.stdout


def test_bad_flags_fail_before_connecting(lab):
    inv = lab.inventory()
    for args, msg in [(["--lines", "9:1"], "--lines"), (["--grep", "("], "invalid regular expression"),
                      (["--symbol", "a b"], "--symbol"), (["--lines", "1", "--grep", "x"], "choose one")]:
        res = run_invoke("inspect", "--file", CPP_EXT, *args, inventory=inv)
        assert res.returncode == 2 and msg in res.stderr, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1


def test_unknown_host_pattern(lab):
    res = run_invoke("inspect", "--file", CPP_EXT, "-H", "nosuch", inventory=lab.inventory())
    assert res.returncode == 2 and "no host or group named 'nosuch'" in res.stderr


def test_one_ssh_round_trip_per_inspect(lab):
    from servops.inspect import InspectRequest, inspect_file
    from servops.inventory import load_inventory
    from servops.transport import Session

    inv = load_inventory(lab.inventory())
    with Session(inv) as s:
        hs = s.host(inv.hosts["lab1"])
        res = inspect_file(hs, InspectRequest(CPP_EXT, lines="60:90"))
        assert hs.round_trips == 1 and res["owner"]["version"] == "0.7.2.post1"
        inspect_file(hs, InspectRequest(CPP_EXT, symbol="is_cuda_version_at_least"))
        assert hs.round_trips == 2  # connection reused, one command each
        assert hs.cache["site_dirs"] and hs.connection.transport.is_active()
