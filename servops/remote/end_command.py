# Ends what a timed-out command left running on the host (servops.transport): every process of
# this user whose environment carries the command's mark (servops puts `SERVOPS_COMMAND=<id>` at
# the head of each command line), the sessions and process groups those lead (the shell sshd
# started leads its own session: pipeline members, backgrounded children) and all their
# descendants -- the process-tree rules `stop` uses for a release (procs.release_processes).
# Left alone: a server servops started (it carries its release's own mark and is `stop`'s to end)
# and what it started; a release guard of the host's deploy root (deploy_ctl's spawn_guard: it
# outlives its command on purpose, to roll back a deploy whose controller went) and its children.
# SIGTERM first, SIGKILL for what is still there a second later.
import signal
import time

COMMAND_ENV = "SERVOPS_COMMAND"


def guards(deploy_root):
    """The live release guards of `deploy_root`, from their guard.pid records (pid and start time)."""
    releases = os.path.join(os.path.realpath(os.path.expanduser(deploy_root)), "releases")
    try:
        names = os.listdir(releases)
    except OSError:
        return set()
    found = set()
    for name in names:
        record = read_json(os.path.join(releases, name, "guard.pid"))
        try:
            pid = int(record["pid"])
        except (TypeError, KeyError, ValueError):
            continue
        if record.get("starttime") is not None and proc_starttime(pid) == record["starttime"]:
            found.add(pid)
    return found


def _with_descendants(pids, table):
    out, grew = set(pids), True
    while grew:
        grew = False
        for pid, facts in table.items():
            if pid not in out and facts["ppid"] in out:
                out.add(pid)
                grew = True
    return out


def command_processes(mark, table, kept=()):
    """{pid: facts} of the processes the command marked `mark` left, as `stop` finds a release's;
    none of `kept` (pids) or their descendants."""
    spare = _ancestors(os.getpid(), table) | {1} | _with_descendants(kept, table)
    servers = _with_descendants(set(pid for pid in table if environ_value(pid, RELEASE_ENV)), table)
    found = {}
    for pid in table:
        if pid not in spare and pid not in servers and environ_value(pid, COMMAND_ENV) == mark:
            found[pid] = table[pid]
    leaders = set(pid for pid, facts in found.items() if facts["sid"] == pid or facts["pgid"] == pid)
    for pid, facts in table.items():
        if pid not in spare and pid not in servers and (facts["sid"] in leaders or facts["pgid"] in leaders):
            found[pid] = facts
    grew = True
    while grew:
        grew = False
        for pid, facts in table.items():
            if pid not in found and pid not in spare and pid not in servers and facts["ppid"] in found:
                found[pid] = facts
                grew = True
    return found


def main():
    mark = str(ARGS["mark"])
    if not re.match(r"^[0-9a-f]{16,64}$", mark):
        fail("not a command mark: %r" % mark[:80])
    table = process_table()
    found = command_processes(mark, table, guards(str(ARGS.get("deploy_root") or "~/.servops/deploy")))
    for pid, facts in found.items():
        if proc_starttime(pid) == facts["starttime"]:
            try:
                os.kill(pid, signal.SIGTERM)
                os.kill(pid, signal.SIGCONT)  # a stopped one gets its SIGTERM now
            except OSError:
                pass
    deadline = time.monotonic() + 1.0
    left = dict(found)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = dict((pid, f) for pid, f in left.items() if proc_starttime(pid) == f["starttime"])
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    reply({"ended": len(found), "killed": len(left)})


main()
