# Append-only JSON-lines logs that tell the truth or say they cannot: the host's journal.jsonl
# and a campaign's trials.jsonl. Standard library only: included in host programs, and
# importable here as servops.remote.jsonl for the controller's own logs.
#
# Writing: every entry starts on a fresh line (a line torn by a full disk never swallows the
# next one), under an flock, and is chained: `seq` counts entries and `prev` is the hash of the
# previous entry's line, so removing or editing an entry breaks the chain. A `.head` file beside
# the log names the last entry written, so cutting entries off the end shows too.
# Reading: a damaged line (torn, not an object, wrong field types, nested past the parser) is
# skipped and counted with its line number; it never makes the whole log unreadable.
# Also the bounded read of a JSON file the host supplies (read_config_json: a model's config.json).
import fcntl as _fcntl
import hashlib as _hashlib
import json as _json
import os as _os
import stat as _stat

MAX_LINE = 1 << 20          # an entry's line, at most (longer: skipped as damaged)
READ_TAIL = 16 << 20        # what a reader takes from the end of a log, at most


class FileProblem(Exception):
    """A file servops reads or appends is not a regular file (a FIFO, a directory, a symlink)."""


def _kind(mode):
    for test, name in ((_stat.S_ISDIR, "a directory"), (_stat.S_ISFIFO, "a FIFO"), (_stat.S_ISSOCK, "a socket"),
                       (_stat.S_ISCHR, "a character device"), (_stat.S_ISBLK, "a block device"),
                       (_stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path, flags, mode=0o600, follow=False):
    """os.open that never blocks on a FIFO, never follows a symlink (unless `follow`: a file the
    host supplies, such as a model snapshot's config.json linking into the hub's blobs) and never
    hands back anything but a regular file: one line naming the path otherwise."""
    try:
        fd = _os.open(path, flags | (0 if follow else _os.O_NOFOLLOW) | _os.O_NONBLOCK | _os.O_CLOEXEC, mode)
    except OSError as exc:
        try:
            st = (_os.stat if follow else _os.lstat)(path)
        except OSError:
            raise exc from None
        if not _stat.S_ISREG(st.st_mode):
            raise FileProblem("%s is %s, not a regular file; servops reads and writes only regular files "
                              "there: remove it" % (path, _kind(st.st_mode))) from None
        raise
    st = _os.fstat(fd)
    if not _stat.S_ISREG(st.st_mode):
        _os.close(fd)
        raise FileProblem("%s is %s, not a regular file; servops reads and writes only regular files there: "
                          "remove it" % (path, _kind(st.st_mode)))
    return fd


def require_regular(path):
    """Refuse now, with the line open_regular would give, when something other than a regular
    file sits at `path` (absent is fine): for a verb that may end before it writes there."""
    try:
        st = _os.lstat(path)
    except FileNotFoundError:
        return
    if not _stat.S_ISREG(st.st_mode):
        raise FileProblem("%s is %s, not a regular file; servops reads and writes only regular files there: "
                          "remove it" % (path, _kind(st.st_mode)))


CONFIG_CAP = 4 << 20  # a model's config.json, at most (real ones are tens of KB)


def read_config_json(path, cap=CONFIG_CAP):
    """The JSON value of a file the host supplies (a model's config.json): symlinks followed, a
    regular file only (a FIFO or a device, e.g. a link to /dev/zero, is never read), at most `cap`
    bytes. FileNotFoundError when absent; FileProblem, naming the file and why, otherwise."""
    fd = open_regular(path, _os.O_RDONLY, follow=True)
    with _os.fdopen(fd, "rb") as fh:
        data = fh.read(cap + 1)
    if len(data) > cap:
        raise FileProblem("%s is over %d bytes: not read" % (path, cap))
    try:
        return _json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise FileProblem("%s is not JSON: %s" % (path, str(exc)[:200])) from None


def read_regular(path, limit=None):
    """The bytes of a regular file (its last `limit` bytes when given); None when absent."""
    try:
        fd = open_regular(path, _os.O_RDONLY)
    except FileNotFoundError:
        return None
    with _os.fdopen(fd, "rb") as fh:
        if limit is not None:
            size = _os.fstat(fh.fileno()).st_size
            if size > limit:
                fh.seek(size - limit)
        return fh.read()


def line_hash(line):
    """The chain's link: sha256 of an entry's line as written (bytes, without its newline)."""
    return _hashlib.sha256(line).hexdigest()[:32]


def _last_entry(fd):
    """(the last complete entry's line, whether the file ends mid-line) of an open log."""
    size = _os.fstat(fd).st_size
    if size == 0:
        return None, False
    block, end = 65536, size
    data = b""
    torn = _os.pread(fd, 1, size - 1) != b"\n"
    while end > 0 and len(data) < MAX_LINE * 2:
        start = max(0, end - block)
        data = _os.pread(fd, end - start, start) + data
        end = start
        # complete lines only (the last element is b"" or a torn fragment), and not the first
        # when the read began mid-file; the last one that parses as one of our entries counts
        complete = data.split(b"\n")[:-1]
        for line in reversed(complete[1:] if end > 0 else complete):
            entry = _parse(line)
            if isinstance(entry, dict) and isinstance(entry.get("seq"), int):
                return line, torn
        block *= 4
    return None, torn


def _parse(line):
    try:
        return _json.loads(line)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None


def head_path(path):
    return path + ".head"


def append_entry(path, entry):
    """Append `entry` (a dict) as one chained line; returns it with its `seq` and `prev`."""
    entry = dict(entry)
    fd = open_regular(path, _os.O_RDWR | _os.O_CREAT | _os.O_APPEND)
    try:
        _fcntl.flock(fd, _fcntl.LOCK_EX)
        last, torn = _last_entry(fd)
        prev = _parse(last) if last else None
        entry["seq"] = prev["seq"] + 1 if prev else 1
        entry["prev"] = line_hash(last) if last else None
        line = _json.dumps(clean(entry), sort_keys=True, allow_nan=False).encode()
        _os.write(fd, (b"\n" if torn else b"") + line + b"\n")
        _os.fsync(fd)
        _write_head(path, {"seq": entry["seq"], "hash": line_hash(line)})
    finally:
        _os.close(fd)
    return entry


def _write_head(path, head):
    target = head_path(path)
    tmp = "%s.tmp-%d" % (target, _os.getpid())
    try:
        if _os.path.lexists(tmp):
            _os.unlink(tmp)
        fd = _os.open(tmp, _os.O_WRONLY | _os.O_CREAT | _os.O_EXCL | _os.O_NOFOLLOW, 0o600)
        with _os.fdopen(fd, "w") as fh:
            fh.write(_json.dumps(head))
        _os.replace(tmp, target)
    except OSError:
        if _os.path.lexists(tmp):
            _os.unlink(tmp)
        # the head only sharpens truncation reports; the entry itself is written


def clean(value, depth=0):
    """JSON that strict parsers read: NaN and infinities become null."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if depth > 64:
        return None
    if isinstance(value, dict):
        return {str(k): clean(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v, depth + 1) for v in value]
    return value


def read_entries(path, validate=None):
    """(entries, report) of a log. `validate(entry)` returns why an entry is malformed, or None.

    report: skipped [(line number, why)], breaks [(line number, why)], unchained (entries from
    before chaining), truncated (why, or None), partial (only the log's end was read)."""
    report = {"skipped": [], "breaks": [], "unchained": 0, "truncated": None, "partial": False}
    data = read_regular(path, READ_TAIL)
    if data is None:
        return [], report
    full_size = _os.stat(path).st_size
    lines = data.split(b"\n")
    first = 1
    if full_size > len(data):
        report["partial"] = True
        lines = lines[1:]  # cut at its start
        first = None
    if lines and lines[-1] == b"":
        lines.pop()
    entries, previous = [], None
    for i, line in enumerate(lines):
        number = (first + i) if first else None
        where = number if number else "end-%d" % (len(lines) - i)
        if not line.strip():
            continue
        if len(line) > MAX_LINE:
            report["skipped"].append((where, "longer than %d bytes" % MAX_LINE))
            continue
        entry = _parse(line)
        why = None
        if not isinstance(entry, dict):
            why = "not a JSON object" if entry is not None else "not JSON (cut short, or damaged)"
        else:
            why = validate(entry) if validate else None
            if why is None and ("seq" in entry or "prev" in entry):
                if not isinstance(entry.get("seq"), int) or isinstance(entry.get("seq"), bool) or not (
                        entry.get("prev") is None or isinstance(entry.get("prev"), str)):
                    why = "seq/prev of the wrong type"
        if why:
            report["skipped"].append((where, why))
            continue
        if "seq" not in entry:
            report["unchained"] += 1
        elif previous is not None and "seq" in previous[0]:
            expect_seq = previous[0]["seq"] + 1
            if entry["seq"] != expect_seq or entry["prev"] != line_hash(previous[1]):
                report["breaks"].append((where, "entry %d does not follow entry %d (an entry was removed, "
                                                "changed or inserted before it)" % (entry["seq"], previous[0]["seq"])))
        elif previous is None and entry["seq"] != 1 and not report["partial"] and not report["skipped"]:
            report["breaks"].append((where, "the log starts at entry %d: earlier entries were removed"
                                     % entry["seq"]))
        entries.append(entry)
        previous = (entry, line)
    head = _parse(read_regular(head_path(path)) or b"null") if _os.path.lexists(head_path(path)) else None
    if isinstance(head, dict) and isinstance(head.get("seq"), int):
        last = previous[0] if previous else None
        if last is None or not isinstance(last.get("seq"), int) or last["seq"] < head["seq"]:
            report["truncated"] = "the last entry written was %d, the log ends at %s: entries were cut off its end" % (
                head["seq"], last.get("seq") if last else "nothing")
        elif last["seq"] == head["seq"] and head.get("hash") != line_hash(previous[1]):
            report["breaks"].append((len(lines), "the last entry differs from the one written"))
    return entries, report


def describe(report):
    """The report as short sentences for people ([] when the log is whole)."""
    out = []
    if report["skipped"]:
        n = len(report["skipped"])
        shown = ", ".join("line %s (%s)" % (w, why) for w, why in report["skipped"][:3])
        out.append("%d unreadable entr%s skipped: %s%s" % (n, "y" if n == 1 else "ies", shown,
                                                            ", ..." if n > 3 else ""))
    for where, why in report["breaks"][:3]:
        out.append("chain broken at line %s: %s" % (where, why))
    if len(report["breaks"]) > 3:
        out.append("%d more breaks in the chain" % (len(report["breaks"]) - 3))
    if report["truncated"]:
        out.append("truncated: " + report["truncated"])
    if report["partial"]:
        out.append("only the last %d MiB were read" % (READ_TAIL >> 20))
    return out
