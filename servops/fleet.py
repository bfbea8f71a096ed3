"""Run one operation on many hosts: in parallel, or rolling N at a time, with a recap.

The unit of work is a group of hosts: one host normally, or the nodes of one multi-node
server (which deploy together). Like Ansible's `serial` + `max_fail_percentage`: a batch whose
failed share exceeds the percentage stops the rollout, and hosts not reached are skipped.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

from . import interrupt
from .errors import ServopsError
from .inventory import Host
from .output import ATTENTION, CHANGED, FAILED, OK, SKIPPED, Failed, Recap, err_console
from .transport import HostSession, Session

# An operation returns (status, message) for its host, or raises ServopsError.
Operation = Callable[[HostSession], tuple[str, str]]
GroupOperation = Callable[[list[HostSession]], tuple[str, str]]


def run_on_groups(session: Session, groups: list[list[Host]], op: GroupOperation, recap: Recap,
                  serial: int | None = None, max_fail_percentage: float = 0.0, parallel: int = 32) -> Recap:
    batches = [groups] if not serial else [groups[i:i + serial] for i in range(0, len(groups), serial)]
    recap.expect([h.name for g in groups for h in g])

    def one(group: list[Host]) -> None:
        sessions = [session.host(h) for h in group]
        try:
            status, message = op(sessions)
        except ServopsError as exc:
            status, message = Failed(exc.exit_code), str(exc)
        except KeyboardInterrupt:
            interrupt.request()
            status, message = FAILED, "interrupted"
        except Exception as exc:  # an unexpected bug must not hide other hosts' results
            status, message = ATTENTION, sessions[0].redactor(f"servops bug? {type(exc).__name__}: {exc}")
        for h in group:
            recap.mark(h.name, status if status in (OK, CHANGED, SKIPPED, FAILED) else OK, message)

    for bi, batch in enumerate(batches):
        if interrupt.requested():
            for g in batch:
                for h in g:
                    recap.mark(h.name, SKIPPED, "not started: interrupted")
            continue
        if len(batch) == 1:
            one(batch[0])
        else:
            _parallel(one, batch, parallel)
        failed = sum(1 for g in batch if any(recap.hosts[h.name].status == FAILED for h in g))
        if serial and failed and failed * 100.0 / len(batch) > max_fail_percentage:
            for later in batches[bi + 1:]:
                for g in later:
                    for h in g:
                        recap.mark(h.name, SKIPPED, "not started: an earlier batch failed")
            break
    return recap


def _parallel(one, batch, parallel: int) -> None:
    """Run the batch's groups in threads. The first Ctrl-C asks every host to finish or undo
    what it is doing; a second one abandons them (each host's guard still watches a deploy)."""
    pool = ThreadPoolExecutor(max_workers=min(parallel, len(batch)))
    futures = [pool.submit(one, g) for g in batch]
    try:
        while not all(f.done() for f in futures):
            try:
                wait(futures, timeout=0.2)
            except KeyboardInterrupt:
                if interrupt.requested():
                    err_console.print("abandoned: hosts may be mid-operation; see invoke status / invoke history",
                                      markup=False)
                    os._exit(130)
                interrupt.request()
                err_console.print("interrupted: each host finishes or undoes its step "
                                  "(Ctrl-C again to abandon)", markup=False)
    finally:
        pool.shutdown(wait=True)


def run_on_hosts(session: Session, hosts: list[Host], op: Operation, recap: Recap,
                 serial: int | None = None, max_fail_percentage: float = 0.0, parallel: int = 32) -> Recap:
    """Apply `op` to each host (each its own group)."""
    return run_on_groups(session, [[h] for h in hosts], lambda hss: op(hss[0]), recap,
                         serial, max_fail_percentage, parallel)
