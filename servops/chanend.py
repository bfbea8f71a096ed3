"""When a command on an SSH channel is over: shared by the direct loop (transport._exec) and the
connection agent's relay (connagentd), so both hand back the same, whole output."""

from __future__ import annotations

import time

# sshd reports a command's exit status when the child exits, while it may still be draining the
# child's pipes: the status can come before the last of the output. The command is over at the
# status AND the channel's EOF. A background process that keeps the pipe open holds EOF back
# (ssh(1) hangs so): EOF_GRACE seconds after the status, what came is taken as all of it.
EOF_GRACE = 2.0


class CommandEnd:
    def __init__(self) -> None:
        self.status_at: float | None = None

    def reached(self, chan) -> bool:
        """`chan`: a paramiko Channel or connagent.AgentChannel, its buffers read up to now."""
        if not chan.exit_status_ready() or chan.recv_ready() or chan.recv_stderr_ready():
            return False
        if chan.eof_received or chan.closed:
            return True
        now = time.monotonic()
        if self.status_at is None:
            self.status_at = now
        return now - self.status_at > EOF_GRACE
