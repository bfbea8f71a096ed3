# Ends what a timed-out command left running on the host (servops.transport): every process of
# this user whose environment carries the command's mark (servops puts `SERVOPS_COMMAND=<id>` at
# the head of each command line), the sessions and process groups those lead (the shell sshd
# started leads its own session: pipeline members, backgrounded children) and all their
# descendants -- the process-tree rules `stop` uses for a release (procs.release_processes).
# A server servops started carries its release's own mark and is `stop`'s to end: it, and what it
# started, are left alone. SIGTERM first, SIGKILL for what is still there a second later.
import signal
import time

COMMAND_ENV = "SERVOPS_COMMAND"


def _env_value(pid, name):
    try:
        with open("/proc/%d/environ" % pid, "rb") as fh:
            data = fh.read(1 << 20)
    except OSError:
        return None
    key = name.encode() + b"="
    for item in data.split(b"\0"):
        if item.startswith(key):
            return item[len(key):].decode("utf-8", "replace")
    return None


def command_processes(mark, table):
    """{pid: facts} of the processes the command marked `mark` left, as `stop` finds a release's."""
    spare = _ancestors(os.getpid(), table) | {1}
    servers = set(pid for pid in table if _env_value(pid, RELEASE_ENV))
    found = {}
    for pid in table:
        if pid not in spare and pid not in servers and _env_value(pid, COMMAND_ENV) == mark:
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
    found = command_processes(mark, process_table())
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
