"""`invoke check` over real sshd on the plain lab venv (no sglang: the double is the server)."""

import json
import os
import shutil
import socket
import stat
import time

import pytest

from servops.lab.sshd import free_port
from conftest import playbooks_with, run_invoke


def test_check_without_sglang_says_so_and_passes(lab):
    inv = lab.inventory(host_vars={"lab1": {"server_port": free_port()}})
    res = run_invoke("check", "--variant", "piecewise", "-H", "lab1", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "launch check of piecewise" in out and "sglang" in out and "not installed" in out
    assert "nothing to check against; sglang_double parses its own flags" in out
    assert "/models/GLM-5-NVFP4: MISSING (not needed by sglang_double)" in out
    assert "--enable-piecewise-cuda-graph" in out  # no sglang: no rule applies, the variant as written
    assert "round trip" in out and "1 SSH command" in out
    assert "lab1 : ok - no sglang on the host: flags not checked (sglang_double); facts ok in" in out


def test_check_json_and_a_busy_port_is_refused_in_one_line(lab, tmp_path):
    port = free_port()
    inv = lab.inventory(host_vars={"lab1": {"server_port": port}})
    res = run_invoke("check", "--variant", "baseline", "--json", inventory=inv)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["sglang_version"] is None and data["parser"] is None and data["ok"] is True
    assert data["facts"]["port"] == {"port": port, "state": "free"} and data["facts"]["gpus_needed"] == 8
    assert data["argv"][:2] == ["--model-path", "/models/GLM-5-NVFP4"] and data["elapsed_s"] > 0
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        s.listen()
        res = run_invoke("check", "--variant", "baseline", inventory=inv)
    assert res.returncode == 2
    line = [l for l in res.stderr.splitlines() if l.startswith("lab1")]
    assert line == [f"lab1 : failed - refused: port {port} is already in use "
                    f"by a process servops did not start; free it or change server_port"]
    assert "PROBLEM" in res.stdout


def test_one_round_trip_and_the_time_it_takes(lab):
    from servops.inventory import load_inventory
    from servops.launchcheck import check_variant
    from servops.playbooks import load_variant
    from servops.transport import Session

    inv = load_inventory(lab.inventory(host_vars={"lab1": {"server_port": free_port()}}))
    with Session(inv) as s:
        hs = s.host(inv.hosts["lab1"])
        hs.connection.open()
        started = time.monotonic()
        check = check_variant(hs, load_variant("piecewise"), deploy_root=str(lab.tmp / "deploy-lab1"))
        took = time.monotonic() - started
    assert hs.round_trips == 1 and check.ok and check.sglang_version is None
    assert 0 < check.elapsed_s <= took
    print(f"launch check round trip (lab, no sglang): {check.elapsed_s:.3f}s")


def test_gpu_count_is_checked_against_tp_where_nvidia_smi_exists(lab, tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: NVIDIA B200 (UUID: GPU-$i)\"; done\n")
    smi.chmod(0o755)
    # a real server module (not the double) on this host: GPUs and the model path matter
    inv = lab.inventory(host_vars={"lab1": {"server_port": free_port(), "server_module": "mysglang.launch",
                                            "model_path": str(tmp_path)}},
                        group_vars={"env": {"PATH": f"{fake}:/usr/bin:/bin", "CUDA_HOME": "/tmp"}})
    res = run_invoke("check", "--variant", "baseline", inventory=inv)
    assert res.returncode == 2, res.stdout
    assert "needs 8 GPUs (tp x pp per node), nvidia-smi shows 4" in res.stderr + res.stdout
    assert "8 needed; nvidia-smi shows 4" in res.stdout
    books = playbooks_with(tmp_path, tp4="extends: baseline\nserver_args: {tp: 4}\n")
    res = run_invoke("check", "--variant", "tp4", inventory=inv, env={"SERVOPS_PLAYBOOKS": str(books)})
    assert res.returncode == 0, res.stdout + res.stderr


def test_multi_node_variant_is_checked_per_node(lab, tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: NVIDIA B200\"; done\n")
    (fake / "nvidia-smi").chmod(0o755)
    inv = lab.inventory(n_hosts=2, host_vars={"lab1": {"server_port": free_port()}, "lab2": {"server_port": free_port()}},
                        group_vars={"env": {"PATH": f"{fake}:/usr/bin:/bin", "CUDA_HOME": "/tmp"},
                                    "server_module": "mysglang.launch", "model_path": str(tmp_path)})
    books = playbooks_with(tmp_path, tp16="extends: baseline\nnnodes: 2\nserver_args: {tp: 16}\n")
    env = {"SERVOPS_PLAYBOOKS": str(books)}
    res = run_invoke("check", "--variant", "tp16", "-H", "lab1,lab2", "--json", inventory=inv, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(chunk) for chunk in res.stdout.replace("}\n{", "}\x00{").split("\x00")]
    for rank, row in enumerate(rows):
        rank0 = lab.sshd_hosts(0).address  # the first node's address (127.0.0.2 without xdist)
        assert " ".join(row["argv"]).endswith(f"--nnodes 2 --node-rank {rank} --dist-init-addr {rank0}:5000")
        assert row["facts"]["gpus_needed"] == 8 and row["ok"]  # tp 16 over 2 nodes: 8 GPUs each
    bad = run_invoke("check", "--variant", "tp16", "-H", "lab1", inventory=inv, env=env)
    assert bad.returncode == 2 and "runs on 2 nodes per server; select a multiple of 2 hosts" in bad.stderr


def test_several_hosts_get_one_compact_table_and_v_gives_each_hosts_detail(lab, sglang_release, tmp_path):
    """Issue 20.5: `check` over three hosts printed one 300-column table per host; now one row per
    host (host, sglang, flags, model, port, GPUs, verdict), each host's detail with --verbose
    (-v is --variant here)."""
    env = sglang_release("0.5.23")
    busy = free_port()
    inv = lab.inventory(n_hosts=3, host_vars={"lab1": {"server_port": free_port()},
                                              "lab2": {"server_port": free_port(), "venv": str(env["venv"])},
                                              "lab3": {"server_port": busy}})
    books = playbooks_with(tmp_path, typo="extends: baseline\nserver_args: {cuda-graph-max-bz: 128}\n")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", busy))
        s.listen()
        res = run_invoke("check", "--variant", "typo", inventory=inv, env={"SERVOPS_PLAYBOOKS": str(books)})
        verbose = run_invoke("check", "--variant", "typo", "--verbose", inventory=inv,
                             env={"SERVOPS_PLAYBOOKS": str(books)})
    assert res.returncode == 2 and verbose.returncode == 2
    out = res.stdout
    assert "launch check of typo on 3 hosts" in out and out.count("launch check of") == 1, out
    header = next(l for l in out.splitlines() if "sglang" in l and "verdict" in l)
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == ["host", "sglang", "flags", "model", "port", "GPUs",
                                                              "verdict"]
    rows = {l.split("│")[1].strip(): [c.strip() for c in l.split("│")[1:-1]] for l in out.splitlines()
            if l.startswith("│") and l.split("│")[1].strip() in ("lab1", "lab2", "lab3")}
    assert rows["lab1"][1] == "not installed" and rows["lab1"][6] == "ok"
    assert rows["lab2"][1] == "0.5.23 (real)" and rows["lab2"][2].startswith("1 of ") and rows["lab2"][2].endswith("refused")
    assert rows["lab2"][6].startswith("REFUSED: --cuda-graph-max-bz: unrecognized on sglang 0.5.23")
    assert rows["lab3"][4] == f"{busy} IN USE" and rows["lab3"][6].startswith(f"REFUSED: port {busy} is already in use")
    assert max(len(l) for l in out.splitlines()) < 300
    # --verbose: each host's own detail table, as one host gets by default
    assert verbose.stdout.count("launch check of typo") == 3 and "round trip" in verbose.stdout


def test_the_real_parsers_flag_table_is_cached_on_the_host(lab, sglang_release, tmp_path):
    """Issue 24.3 with the real sglang 0.5.23 over real sshd: the first check imports the real
    parser and keeps its flag table under the deploy root; the next check decides from the
    table with the same verdict; a parser source that changed, or a damaged cache file, sends
    the check back to the real parser, which rewrites it. A check never makes the deploy root."""
    env = sglang_release("0.5.23")
    if not env["real"]:
        pytest.skip("this run's 0.5.23 venv has no importable parser (SERVOPS_TEST_SGLANG_PARSER=static)")
    root = lab.tmp / "deploy-lab1"
    inv = lab.inventory(host_vars={"lab1": {"server_port": free_port(), "venv": str(env["venv"])}})
    books = playbooks_with(tmp_path, typo="extends: baseline\nserver_args: {cuda-graph-max-bz: 128}\n")

    def check(variant):
        res = run_invoke("check", "--variant", variant, "--json", "-H", "lab1", inventory=inv,
                         env={"SERVOPS_PLAYBOOKS": str(books)})
        data = json.loads(res.stdout)
        return res.returncode, data["parser"], data["facts"]["parser_cache"], data["problems"]

    shutil.rmtree(root, ignore_errors=True)
    code, parser, cache, _ = check("baseline")
    assert (code, parser) == (0, "real") and "not written: no deploy root" in cache
    assert not root.exists()  # a host servops never deployed to stays as it was

    root.mkdir()
    assert check("baseline")[:3] == (0, "real", "missing; written")
    files = list((root / ".launch-cache").iterdir())
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    hit = check("typo")
    assert hit[:3] == (2, "cached", "hit") and any("--cuda-graph-max-bz" in p for p in hit[3])

    source = env["site"] / "sglang" / "srt" / "server_args.py"
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the parser's source changed
    try:
        stale = check("typo")
        assert stale[1] == "real" and stale[2].startswith("stale: sources changed") and stale[2].endswith("written")
        assert stale[3] == hit[3]  # the table decided as the real parser does
    finally:
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    check("baseline")  # rewritten for the restored source
    files[0].write_bytes(b"{not json")
    damaged = check("baseline")
    assert damaged[:2] == (0, "real") and damaged[2].startswith("damaged: ") and damaged[2].endswith("written")
    assert check("baseline")[1:3] == ("cached", "hit")
