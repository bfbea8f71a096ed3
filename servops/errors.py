"""Errors a user can act on: each carries one line that names what to fix."""

from typing import Iterable


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "; ") -> str:
    """'; did you mean X?' for the closest spelling of `word` among `choices` ('' when none is close)."""
    import difflib

    close = difflib.get_close_matches(word, sorted(set(choices)), n=1, cutoff=0.6)
    return f"{prefix}did you mean {close[0]}?" if close else ""


class ServopsError(Exception):
    """A failure reported to the user as one line, with a non-zero exit: by default bad input or a
    refusal before anything changed (2); subclasses name other statuses of the contract."""

    exit_code = 2


class InventoryError(ServopsError):
    pass


class TransportError(ServopsError):
    """The host could not be reached, or the connection was lost."""

    exit_code = 3


class CommandFailed(TransportError):
    """The host answered, but its command did not finish as asked (timed out, flooded its output):
    a failed operation on a reachable host, not an unreachable one."""

    exit_code = 1


class HostKeyError(TransportError):
    """A host key that is unknown, changed or revoked: refused before anything, like bad input."""

    exit_code = 2


class RemoteError(ServopsError):
    """The remote side refused or failed an operation (bad path, missing venv, ...)."""


class NoData(ServopsError):
    """A local-only verb found nothing to work on for a host (no bench results, no campaign log)."""


class NeedsAttention(ServopsError):
    """The operation failed and the host is not as before; the message says what to run."""

    exit_code = 5
