"""Issue 48 (hardening, round 6), item 8, over the real sshd lab: GPU memory holders from a fake
nvidia-smi on the host's PATH (the inventory's env). A process name with a Latin-1 byte and a pid
field '²' are decoded with replacement and skipped (said so), never a refused check or deploy; an
nvidia-smi that hangs is ended at its deadline with its process group and reported as "GPU facts
unknown", and the other hosts of the fleet go on."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import healthy, run_invoke
from servops.remote.procs import SMI_DEADLINE

UUID = "GPU-1c3e4bd2-57a1-8d5e-0f3c-3b2b1a0c9d11"
ODD_ROWS = f"""#!/bin/sh
case "$1" in
  -L) printf 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: {UUID})\\n' ;;
  *) printf '%s, {UUID}, 2048, caf\\351 worker\\n\\302\\262, {UUID}, 10, odd\\n' "$SERVOPS_TEST_OTHER" ;;
esac
"""
# every query hangs in a grandchild (its pid recorded): only ending the group frees the pipe
HANGS = """#!/bin/sh
sleep 600 &
echo $! >> "$SERVOPS_TEST_PIDS"
wait
"""


def fake_smi(lab, script: str, **env: str) -> dict:
    """The inventory env that puts `script` on the host's PATH as nvidia-smi."""
    bindir = lab.tmp / "fakebin"
    bindir.mkdir(exist_ok=True)
    (bindir / "nvidia-smi").write_text(script)
    (bindir / "nvidia-smi").chmod(0o755)
    return {"CUDA_HOME": str(lab.cuda_home()), "PATH": f"{bindir}:{os.environ['PATH']}", **env}


def test_8_odd_rows_of_a_foreign_process_are_skipped_and_said_never_a_refusal(alab):
    lab, _inv, port = alab
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)  # another job holding GPU memory
    try:
        inv = lab.inventory(host_vars={"lab1": {"server_port": port, "env": fake_smi(
            lab, ODD_ROWS, SERVOPS_TEST_OTHER=str(other.pid))}}, filename="odd.yml")
        res = run_invoke("check", "--variant", "baseline", inventory=inv)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "nvidia-smi shows 1; GPU memory: 0 of servops' server, 1 other process(es)" in res.stdout, res.stdout
        assert ("nvidia-smi listed 1 process row(s) that do not parse (a pid that is not a number): skipped "
                f"('\u00b2, {UUID}, 10, odd')") in res.stdout
        assert "Traceback" not in res.stdout + res.stderr
        res = run_invoke("deploy", "--variant", "baseline", inventory=inv)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "process row(s) that do not parse" in res.stdout and healthy(port)
    finally:
        other.kill()
        other.wait()


def test_8_a_hanging_nvidia_smi_is_ended_and_gpu_facts_unknown_the_other_hosts_go_on(lab):
    pids = lab.tmp / "smi-pids"
    inv = lab.inventory(n_hosts=2, host_vars={"lab1": {"env": fake_smi(lab, HANGS, SERVOPS_TEST_PIDS=str(pids))}})
    res = run_invoke("check", "--variant", "baseline", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (f"lab1: warning: GPU facts unknown: nvidia-smi -L: nvidia-smi did not finish within {SMI_DEADLINE}s: "
            f"ended with its process group") in res.stdout, res.stdout
    assert "lab2: warning" not in res.stdout
    assert "lab1 : ok" in res.stdout and "lab2 : ok" in res.stdout
    started = [int(p) for p in pids.read_text().split()]
    assert started and all(not Path(f"/proc/{p}").exists() or _zombie(p) for p in started), started


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_8_stop_lines_say_gpu_facts_unknown_and_rows_skipped():
    from servops.bringup import stop_lines

    assert stop_lines({"gpu": {"error": "nvidia-smi --query-compute-apps: nvidia-smi did not finish within 20s: "
                                        "ended with its process group"}}) == [
        "GPU facts unknown: nvidia-smi --query-compute-apps: nvidia-smi did not finish within 20s: ended with its "
        "process group"]
    assert stop_lines({"gpu": {"ours": [], "others": [], "skipped": 2}}) == [
        "2 row(s) of nvidia-smi's process list did not parse (a pid that is not a number): skipped"]
