"""Run one operation on many hosts: in parallel, or rolling N at a time, with a recap."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from .errors import ServopsError
from .inventory import Host
from .output import CHANGED, FAILED, OK, SKIPPED, Recap
from .transport import HostSession, Session

# An operation returns (status, message) for its host, or raises ServopsError.
Operation = Callable[[HostSession], tuple[str, str]]


def run_on_hosts(session: Session, hosts: list[Host], op: Operation, recap: Recap,
                 serial: int | None = None, max_fail_percentage: float = 0.0,
                 parallel: int = 32) -> Recap:
    """Apply `op` to each host; with `serial`, roll batches and stop once a batch fails too much.

    Like Ansible: a batch whose failed share exceeds max_fail_percentage stops the rollout and the
    hosts not reached are recorded as skipped.
    """
    batches = [hosts] if not serial else [hosts[i:i + serial] for i in range(0, len(hosts), serial)]

    def one(host: Host) -> None:
        hs = session.host(host)
        try:
            status, message = op(hs)
        except ServopsError as exc:
            recap.mark(host.name, FAILED, str(exc))
            return
        except Exception as exc:  # an unexpected bug must not hide other hosts' results
            recap.mark(host.name, FAILED, hs.redactor(f"{type(exc).__name__}: {exc}"))
            return
        recap.mark(host.name, status if status in (OK, CHANGED, SKIPPED, FAILED) else OK, message)

    for bi, batch in enumerate(batches):
        if len(batch) == 1:
            one(batch[0])
        else:
            with ThreadPoolExecutor(max_workers=min(parallel, len(batch))) as pool:
                list(pool.map(one, batch))
        failed = sum(1 for h in batch if recap.hosts.get(h.name) and recap.hosts[h.name].status == FAILED)
        if serial and failed and failed * 100.0 / len(batch) > max_fail_percentage:
            for later in batches[bi + 1:]:
                for h in later:
                    recap.mark(h.name, SKIPPED, "not started: an earlier batch failed")
            break
    return recap
