"""Errors a user can act on: each carries one line that names what to fix."""


class ServopsError(Exception):
    """A failure reported to the user as one line, with a non-zero exit."""

    exit_code = 2


class InventoryError(ServopsError):
    pass


class TransportError(ServopsError):
    pass


class HostKeyError(TransportError):
    pass


class RemoteError(ServopsError):
    """The remote side refused or failed an operation (bad path, missing venv, ...)."""
