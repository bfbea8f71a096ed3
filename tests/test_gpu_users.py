"""Who holds GPU memory before a deploy (servops/remote/launch_facts.py gpu_users over
procs.parse_gpu_apps' rows of nvidia-smi's CSV; launchcheck.gpu_user_warnings): servops' own
server and its TP workers are told apart from another job by the session the server leads, on
this machine's real /proc."""

from __future__ import annotations

import os
import subprocess
import sys

from servops.launchcheck import gpu_user_warnings
from servops.remote import procs
from tests.conftest import REPO, wait_for

REMOTE = REPO / "servops" / "remote"
GPU0, GPU1 = "GPU-1c3e4bd2-57a1-8d5e-0f3c-3b2b1a0c9d11", "GPU-7a2f6e93-0d44-4c1e-9b5b-62e1f0a4c722"


def launch_facts() -> dict:
    """launch_facts' functions as the program ships them: after procs (its /proc readers)."""
    ns: dict = {"__name__": "launch_facts_under_test"}
    text = "import os, sys\n" + (REMOTE / "procs.py").read_text() + "\n" + (REMOTE / "launch_facts.py").read_text()
    exec(compile(text, "launch_facts", "exec"), ns)
    return ns


# `nvidia-smi -L` as it prints (index, name, UUID), with a MIG device line under GPU 1, which
# has no index of its own
LISTING = f"""GPU 0: NVIDIA H100 80GB HBM3 (UUID: {GPU0})
GPU 1: NVIDIA H100 80GB HBM3 (UUID: {GPU1})
  MIG 3g.40gb     Device  0: (UUID: MIG-5f1a2b3c-4d5e-6f70-8192-a3b4c5d6e7f8)
"""


def test_the_csv_and_the_listing_parse_and_odd_rows_are_skipped():
    assert launch_facts()["gpu_indexes"](LISTING) == {GPU0: 0, GPU1: 1}
    csv = (f"4012, {GPU0}, 40536, /usr/bin/python3\n"
           f"4013, {GPU1}, [N/A], python\n"
           "\n"
           "No running processes found\n"
           "pid, gpu_uuid, used_gpu_memory [MiB], process_name\n"
           f"4014, {GPU1}, [Insufficient Permissions], trainer, run 7\n"    # a name with a comma: taken whole
           f"\u00b2, {GPU1}, 10, odd\n"                                       # a pid '²' (isdigit, not a number)
           f"99999999999999999999, {GPU1}, 10, huge\n"
           f"4015, {GPU0}, nan, caf\ufffd\n")                                 # a Latin-1 byte, decoded with replacement
    assert procs.parse_gpu_apps(csv) == ([
        {"pid": 4012, "gpu_uuid": GPU0, "used_mib": 40536.0, "name": "/usr/bin/python3"},
        {"pid": 4013, "gpu_uuid": GPU1, "used_mib": None, "name": "python"},
        {"pid": 4014, "gpu_uuid": GPU1, "used_mib": None, "name": "trainer,run 7"},
        {"pid": 4015, "gpu_uuid": GPU0, "used_mib": None, "name": "caf\ufffd"}],
        [f"\u00b2, {GPU1}, 10, odd", f"99999999999999999999, {GPU1}, 10, huge"])
    assert procs.parse_gpu_apps("") == ([], [])


def _children(pid: int) -> list[int]:
    return [int(k) for k in wait_for(lambda: open(f"/proc/{pid}/task/{pid}/children").read().split(),
                                     what=f"a child of pid {pid}", step=0.05)]


def test_the_servers_session_is_ours_another_process_is_not_and_an_unseen_pid_is_unknown():
    lf = launch_facts()
    # servops starts its server leading a session of its own; its workers are its children
    server = subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '60']); "
                               "time.sleep(60)"], start_new_session=True)
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        worker = _children(server.pid)[0]
        gone = subprocess.Popen(["true"])
        gone.wait()
        csv = "".join(f"{pid}, {GPU0}, 1024, {name}\n" for pid, name in (
            (server.pid, "python3"), (worker, "python3"), (other.pid, "sleep"), (gone.pid, "python3")))
        users = lf["gpu_users"](procs.parse_gpu_apps(csv)[0], lf["gpu_indexes"](LISTING), server.pid)
        assert [u["ours"] for u in users] == [True, True, False, None]
        assert {u["gpu"] for u in users} == {0}
        # no server of ours: every process seen is another's
        assert [u["ours"] for u in lf["gpu_users"](users, {}, None)] == [False, False, False, None]
        assert gpu_user_warnings(users) == [
            f"GPU memory is held by 1 process(es) servops did not start: pid {other.pid} sleep on GPU 0 (1,024 MiB); "
            f"1.0 GiB in all; the new server gets that much less than its memory fraction assumes (stop them, or "
            f"lower --mem-fraction-static)",
            f"GPU memory is held by 1 process(es) this host's /proc cannot see (another container's pids?): "
            f"pid {gone.pid} python3 on GPU 0 (1,024 MiB); 1.0 GiB in all"]
        assert gpu_user_warnings([u for u in users if u["ours"]]) == []
    finally:
        for p in (server, other):
            os.killpg(p.pid, 9)
            p.wait()
