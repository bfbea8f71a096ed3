"""Files servops writes on the operator's machine (results/, campaign logs, reports, plots).

The last component of such a path is never followed as a symlink: one planted there (in a
shared results directory, say) would carry servops' write to another file (~/.bashrc,
~/.ssh/authorized_keys). Whole files are written by rename (a symlink at the name is replaced);
appends and new files open with O_NOFOLLOW, and a symlink in their place is one line naming it.

They are private whatever the umask: files 0600, the directories servops creates 0700 (a
results/ another user could write to would let them plant results `tune --resume` trusts).
Text is UTF-8 whatever the locale.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import ServopsError


def _refuse(path: Path, exc: OSError) -> None:
    if os.path.islink(path):
        raise ServopsError(f"{path} is a symlink (to {os.readlink(path)}); servops does not write through it: "
                           f"remove it") from None
    raise exc


def private_dir(path: Path) -> Path:
    """`path` and any missing parents, each directory created 0700 (chmod: the umask can only
    take bits away, and 000 or 077 would leave it unusable or too open)."""
    missing = []
    p = Path(path)
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue  # made meanwhile by another servops run
        os.chmod(d, 0o700)
    return Path(path)


def write_new(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write a fresh file and rename it into place: a symlink planted at `path` is replaced,
    never followed, and a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_link(path: Path, target: Path) -> None:
    """`path` a symlink to `target`, put in place by one rename: never missing in between (another
    process reading it meanwhile), nor left half-made by a kill."""
    if path.is_symlink() and Path(os.readlink(path)) == Path(target):
        return
    tmp = Path(tempfile.mktemp(dir=path.parent, prefix=f".{path.name}."))
    tmp.symlink_to(target)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def create_new(path: Path) -> bool:
    """Create an empty file that did not exist (False if something, a symlink included, is there)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        return True
    except FileExistsError:
        return False


def append_text(path: Path, text: str) -> None:
    """Append to a log servops keeps (a bench result, trials.jsonl), never through a symlink."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        _refuse(path, exc)
    with os.fdopen(fd, "a", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
