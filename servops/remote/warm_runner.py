# A warm interpreter for servops' short read-only host programs (issue #24): started once by a
# connection agent on its held SSH connection (`python -c BOOT`, this file sent as BOOT's first
# stdin line), it runs each program it is sent in a fork of itself, so a program costs neither a
# channel's exec round trip, nor the login shell's start-up, nor python's. Stdlib only, and it
# imports little: a forked program imports what it needs afresh, as under `python -`.
#
# Frames both ways: a kind byte, a 4-byte big-endian length, the payload.
#   agent -> runner: P program text (run it; its stdin is /dev/null, its arguments are in it)
#                    k (kill the program running now: its client went)
#   runner -> agent: r ready (JSON: pid, python), then per program: a (taken: it runs now),
#                    o/e output bytes, x exit status; or s (stale: what this interpreter loaded
#                    at its start changed since -- nothing ran, and the runner exits: the agent
#                    runs the program the ordinary way and starts a fresh runner)
# An agent that gets no `a` (or `s`) soon after sending a program gives the runner up (a stopped
# or starved runner) and runs the program the ordinary way; the runner, should it go on, finds
# its stdin closed and runs nothing more.
# The runner ends at its stdin's EOF (the agent or its connection went), or when no program
# came for _IDLE_S seconds (set by the agent before this text: its own idle time and a margin),
# should its connection be held open by something between (a proxy, a half-dead NAT).
import os
import select
import sys

OUT = sys.stdout.buffer
IDLE_S = float(globals().get("_IDLE_S") or 3600)


def loaded_files():
    """What this interpreter read at its start, which a fresh python would read anew: the
    interpreter, the file of every module it imported (sitecustomize, usercustomize, what a .pth
    line imported), every .pth file of its sys.path directories, and those directories (a new
    file in one, a pip install, changes its listing)."""
    files = [sys.executable] + [p for p in sys.path if p]
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str):
            files.append(path)
    for directory in [p for p in sys.path if p]:
        try:
            files.extend(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".pth"))
        except OSError:
            pass
    return sorted(set(files))


def fingerprint(files):
    """The files' identity and content as stat tells it (ctime too: a write or a utime moves it,
    and nothing sets it back), None for one that is gone. Any change: the runner is stale."""
    parts = []
    for path in files:
        try:
            st = os.stat(path)
            parts.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        except OSError:
            parts.append(None)
    return parts


def send(kind, payload=b""):
    OUT.write(kind + len(payload).to_bytes(4, "big") + payload)
    OUT.flush()


class Reader:
    def __init__(self):
        self.buf = b""
        self.eof = False

    def fill(self):
        data = os.read(0, 1 << 16)
        if not data:
            self.eof = True
        self.buf += data

    def frame(self):
        """The next whole frame, or None (read more)."""
        if len(self.buf) < 5:
            return None
        size = int.from_bytes(self.buf[1:5], "big")
        if len(self.buf) < 5 + size:
            return None
        kind, payload, self.buf = self.buf[:1], self.buf[5:5 + size], self.buf[5 + size:]
        return kind, payload


def run_child(program):
    """In the fork: the program as `python -` would run it, its output on fds 1 and 2."""
    import builtins
    import traceback

    sys.stdin = open(os.devnull)
    sys.argv = ["-"]
    status = 0
    try:
        exec(compile(program, "<stdin>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as exc:
        code = exc.code
        if code is None:
            status = 0
        elif isinstance(code, int):
            status = code & 0xFF
        else:
            print(code, file=sys.stderr)
            status = 1
    except BaseException as exc:  # as `python -` prints it: from the program's own frames
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)


def run(program, reader):
    """Fork, relay the child's output as frames until both its pipes close, send its status.
    A `k` frame, or the agent going, kills the child's process group."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        os.close(out_r)
        os.close(err_r)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        run_child(program)
    try:
        os.setpgid(pid, pid)  # from this side too: a kill sent at once must find the group
    except OSError:
        pass  # it exists already (the child was first), or the child is gone
    os.close(out_w)
    os.close(err_w)
    kinds = {out_r: b"o", err_r: b"e"}
    killed = False
    while kinds:
        ready = select.select(list(kinds) + ([] if killed or reader.eof else [0]), [], [])[0]
        for fd in ready:
            if fd == 0:
                reader.fill()
                while True:
                    got = reader.frame()
                    if got is None:
                        break
                    if got[0] == b"k":  # the client went; the agent still waits for the status
                        killed = True
                if reader.eof:
                    killed = True
                if killed:
                    try:
                        os.killpg(pid, 9)
                    except OSError:
                        pass
                continue
            data = os.read(fd, 1 << 16)
            if data:
                send(kinds[fd], data)
            else:
                os.close(fd)
                del kinds[fd]
    _, status = os.waitpid(pid, 0)
    # as a shell reports it: killed by signal N is 128 + N
    code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    send(b"x", str(code).encode())


def main():
    files = loaded_files()
    started = fingerprint(files)
    reader = Reader()
    send(b"r", ('{"pid": %d, "python": "%s"}' % (os.getpid(), sys.version.split()[0])).encode())
    while True:
        got = reader.frame()
        if got is None:
            if reader.eof or not select.select([0], [], [], IDLE_S)[0]:
                return
            reader.fill()
            continue
        kind, payload = got
        if kind != b"P":
            continue  # a `k` for a program that already ended
        if select.select([0], [], [], 0)[0]:
            reader.fill()
            if reader.eof:
                return  # the agent gave up waiting for this program's hand-off: it runs elsewhere
        if fingerprint(files) != started:
            send(b"s")
            return
        send(b"a")
        run(payload.decode("utf-8", "surrogateescape"), reader)
        if reader.eof:
            return


main()
