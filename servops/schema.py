"""A small schema layer for what users write: inventory vars, variants, patch metadata.

Each field declares its type and limits once; `check` turns the first violation into one line
naming the file and the key (`inventory/lab.yml: all.children.lab.vars.ssh_port: expected an
integer 1-65535, got 'abc'`). Values that later reach a shell or a script (names, paths,
hosts) are held to patterns that cannot break out of quoting or comments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import yaml  # a hard dependency: a broken install fails at import, in tasks.py's one line

from .errors import ServopsError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")          # hosts, groups, variants, patches
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")           # POSIX shell variable names
FLAG = re.compile(r"-{0,2}[A-Za-z0-9][A-Za-z0-9_.-]*")     # server_args keys
MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
HOSTNAME = re.compile(r"[A-Za-z0-9_.:%\[\]-]+")           # DNS names, IPv4/IPv6 literals
USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\$?")
JUMP = re.compile(r"([A-Za-z0-9_][A-Za-z0-9_.-]*@)?[A-Za-z0-9_.:\[\]-]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class SchemaError(ServopsError):
    pass


@dataclass(frozen=True)
class Field:
    kind: str                      # int, number, bool, str, name, path, list, map, any
    low: float | None = None
    high: float | None = None
    pattern: re.Pattern | None = None
    what: str = ""                 # words for the error ("a port 1-65535")
    items: "Field | None" = None   # list items / map values
    keys: re.Pattern | None = None  # map keys
    keys_what: str = ""
    nullable: bool = False
    check: Callable[[Any], str | None] | None = None  # extra rule: returns an error or None
    fields: "dict[str, Field] | None" = None  # kind "record": a mapping with these keys


def _describe(f: Field) -> str:
    if f.what:
        return f.what
    def num(x: float) -> str:
        return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"

    rng = ""
    if f.low is not None and f.high is not None:
        rng = f" {num(f.low)} to {num(f.high)}"
    elif f.low is not None:
        rng = f" >= {num(f.low)}"
    return {"int": "an integer", "number": "a number", "bool": "true or false", "str": "a single-line string",
            "path": "a path", "name": "a name", "list": "a list", "map": "a mapping",
            "record": "a mapping"}.get(f.kind, "a value") + rng


def coerce(value: Any, f: Field, where: str) -> Any:
    """The value, converted where YAML left a number as text ('30'); raises SchemaError."""
    if value is None:
        if f.nullable:
            return None
        raise SchemaError(f"{where}: expected {_describe(f)}, got nothing")
    bad = SchemaError(f"{where}: expected {_describe(f)}, got {value!r}")
    if f.kind == "record":
        if not isinstance(value, dict):
            raise bad
        value = check_mapping(value, f.fields or {}, where)
    elif f.kind in ("int", "number"):
        if isinstance(value, bool):
            raise bad
        try:
            number = int(value) if f.kind == "int" else float(value)
        except (TypeError, ValueError):
            raise bad from None
        if f.kind == "int" and isinstance(value, float) and value != int(value):
            raise bad
        if number != number or number in (float("inf"), float("-inf")):
            raise bad
        if (f.low is not None and number < f.low) or (f.high is not None and number > f.high):
            raise bad
        value = number
    elif f.kind == "bool":
        if not isinstance(value, bool):
            raise bad
    elif f.kind in ("str", "name", "path"):
        if isinstance(value, bool) or isinstance(value, (list, dict)):
            raise bad
        value = str(value)
        if _CONTROL.search(value) or (f.kind == "path" and not value):
            raise SchemaError(f"{where}: {value!r} contains a newline or control character" if value
                              else f"{where}: expected {_describe(f)}, got an empty string")
        if f.pattern is not None and not f.pattern.fullmatch(value):
            raise bad
    elif f.kind == "list":
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise bad
        value = [coerce(v, f.items, f"{where}[{i}]") if f.items else v for i, v in enumerate(value)]
    elif f.kind == "map":
        if not isinstance(value, dict):
            raise bad
        out = {}
        for k, v in value.items():
            key = str(k)
            if f.keys is not None and not f.keys.fullmatch(key):
                raise SchemaError(f"{where}: key {key!r} is not {f.keys_what or 'a valid key'}")
            out[key] = coerce(v, f.items, f"{where}.{key}") if f.items else v
        value = out
    if f.check is not None:
        problem = f.check(value)
        if problem:
            raise SchemaError(f"{where}: {problem}")
    return value


def check_mapping(data: dict, fields: dict[str, Field], where: str, allow_unknown: bool = False) -> dict:
    """Validate and convert every known key; unknown keys are an error unless allowed."""
    out = {}
    for key, value in data.items():
        key = str(key)
        f = fields.get(key)
        if f is None:
            if not allow_unknown:
                raise SchemaError(f"{where}: unknown key '{key}' (known: {', '.join(sorted(fields))})")
            out[key] = value
            continue
        out[key] = coerce(value, f, f"{where}.{key}" if not where.endswith(": ") else f"{where}{key}")
    return out


def _scalar(value: Any) -> str | None:
    if isinstance(value, (dict, list)):
        return f"expected a single value, got {type(value).__name__}"
    return None


def _scalar_or_list(value: Any) -> str | None:
    if isinstance(value, dict):
        return "expected a value or a list, got a mapping"
    return None


def parse_duration(value: Any) -> str | None:
    """'90m', '6h', '1h30m', '45s' or a number of seconds -> an error message, or None when valid."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return None
    if isinstance(value, str) and re.fullmatch(r"\s*(\d+(\.\d+)?\s*[hms]\s*)+", value):
        return None
    return "expected a duration like 90m, 6h, 1h30m or seconds"


def seconds(value: Any) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, _f, u in re.findall(r"(\d+(\.\d+)?)\s*([hms])", value))


DEFAULT_PERSIST = 600.0
MAX_PERSIST = 24 * 3600.0  # an agent that never idles out keeps a logged-in connection for ever
_PERSIST_EXPECTED = "expected a duration like 10m, 30s or 1h30m, seconds, or 0/false (no persistent connection)"


def persist_seconds(value: Any) -> float:
    """`persist` (how long a host's connection agent outlives its last command) in seconds:
    a duration ('10m', '30s', '1h30m'), a number of seconds, true (10m) or false/0 (none)."""
    if isinstance(value, bool):
        return DEFAULT_PERSIST if value else 0.0
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("no", "off", "false"):
            return 0.0
        if re.fullmatch(r"\d+(\.\d+)?", text):
            value = float(text)
    if isinstance(value, (int, float)) and value == 0:
        return 0.0
    if parse_duration(value) or seconds(value) == float("inf"):
        raise SchemaError(_PERSIST_EXPECTED)
    if seconds(value) > MAX_PERSIST:
        raise SchemaError("at most 24h (an agent that never idles out keeps its connection for ever)")
    return seconds(value)


def _persist_problem(value: Any) -> str | None:
    try:
        persist_seconds(value)
    except SchemaError as exc:
        return str(exc)
    return None


PORT = Field("int", 1, 65535, what="a port 1-65535")
POSITIVE = Field("number", low=0.001, what="a number above 0")
ENV = Field("map", keys=ENV_NAME, keys_what="an environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
            items=Field("any", nullable=True, check=_scalar))
SERVER_ARGS = Field("map", keys=FLAG, keys_what="a flag name like cuda-graph-max-bs",
                    items=Field("any", nullable=True, check=_scalar_or_list))


def _warmup_args_problem(args: dict) -> str | None:
    """jit_warmup_args change the warm-up's flags over the release's, never where it listens: the
    pre-build waits for health on jit_warmup_port, and a warm-up on the serving port fails to bind."""
    moved = [k for k in args if k.lstrip("-").replace("_", "-") in ("port", "host")]
    return (f"{', '.join(moved)} cannot be set here: the warm-up listens on jit_warmup_port (set that)"
            if moved else None)


def _cache_dir_problem(value: str) -> str | None:
    """jit_cache_dir: one directory every release of the host shares, named the same in the launch
    script's exports (quoted: no ~ expansion there) and in the ledger servops keeps: so an absolute
    path, without `..` (a relative or ~ path would be a new directory in each release's own)."""
    if not value.startswith("/"):
        return f"{value!r} is not an absolute path: the engines' cache variables get it as written (no ~, no " \
               f"relative path); write it from / (e.g. /var/cache/servops-jit)"
    if ".." in value.split("/"):
        return f"{value!r} holds a '..' component: name the directory itself"
    return None


INVENTORY_VARS = {
    "ssh_host": Field("str", pattern=HOSTNAME, what="a host name or address"),
    "ssh_port": PORT,
    "ssh_user": Field("str", pattern=USER, what="a user name"),
    "ssh_key": Field("path"),
    "known_hosts": Field("path"),
    "accept_new_host_keys": Field("bool"),
    "proxy_jump": Field("str", pattern=JUMP, what="an inventory host or [user@]host[:port]"),
    "venv": Field("path"),
    "python": Field("path"),
    "server_port": PORT,
    "server_module": Field("str", pattern=MODULE, what="a Python module name like sglang.launch_server"),
    "server_files": Field("list", items=Field("path")),
    "vllm_module": Field("str", pattern=MODULE, what="a Python module name like vllm.entrypoints.openai.api_server"),
    "model_path": Field("path"),
    "tp": Field("int", 1, 1024),
    "env": ENV,
    "connect_timeout": POSITIVE,
    "persist": Field("any", check=_persist_problem),
    "command_timeout": POSITIVE,
    "preflight_timeout": POSITIVE,
    "health_timeout": POSITIVE,
    "lease_timeout": Field("number", low=5, what="a number of seconds >= 5"),
    "deploy_root": Field("path"),
    "keep_releases": Field("int", 1),
    "lock_stale_after": POSITIVE,
    "dist_init_host": Field("str", pattern=HOSTNAME, what="a host name or address"),
    "dist_init_port": PORT,
    "secret_vars": Field("list", items=Field("str", pattern=ENV_NAME, what="an environment variable name")),
    "jit_cache_dir": Field("path", check=_cache_dir_problem),
    "jit_warmup": Field("bool"),
    "jit_warmup_args": Field("map", keys=FLAG, keys_what="a flag name like mem-fraction-static",
                             items=Field("any", nullable=True, check=_scalar_or_list), check=_warmup_args_problem),
    "jit_warmup_port": PORT,
    # the audit of the compiled region (servops/audit.py): where its side server runs (cuda, or cpu for
    # an engine that needs no GPU: the lab's double), the static memory share and headroom it takes on
    # each GPU beside the serving server, and how long one audit server may take
    "audit_device": Field("str", pattern=re.compile(r"cuda|cpu"), what="cuda or cpu"),
    "audit_mem_fraction": Field("number", low=0.01, high=0.5, what="a share of GPU memory, 0.01-0.5"),
    "audit_overhead_mib": Field("int", 0, 1 << 20),
    "audit_timeout": Field("number", low=30, high=7200, what="seconds, 30-7200"),
}
INT_VARS = tuple(k for k, f in INVENTORY_VARS.items() if f.kind == "int")


def _regex(value: Any) -> str | None:
    try:
        re.compile(value)
    except (re.error, TypeError) as exc:
        return f"{value!r} is not a valid regex: {exc}"
    if _nested_repeat(value):
        return (f"{value!r} repeats a repetition (like (a+)+), which can take exponential time on one "
                f"log line; write it without the outer repeat")
    return None


def _nested_repeat(pattern: str) -> bool:
    """Whether an unbounded repeat's body can be matched by an inner unbounded repeat alone (every
    other part of the body optional): `(a+)+`, `(\\w+\\s?)*`. Such a body splits one run of text in
    exponentially many ways, the shape of catastrophic backtracking that would pin the host's
    health gate (a crash signature runs on every log line). `(\\d+\\.)+` is fine: its dot delimits."""
    from re import _constants as C, _parser

    repeats = (C.MAX_REPEAT, C.MIN_REPEAT)

    def unbounded(av) -> bool:
        return av[1] == C.MAXREPEAT or av[1] > 64

    def min_width(seq) -> int:
        total = 0
        for op, av in seq:
            if op in repeats or op == C.POSSESSIVE_REPEAT:
                total += av[0] * min_width(av[2])
            elif op == C.SUBPATTERN:
                total += min_width(av[-1])
            elif op == C.ATOMIC_GROUP:
                total += min_width(av)
            elif op == C.BRANCH:
                total += min(min_width(b) for b in av[1])
            elif op in (C.LITERAL, C.NOT_LITERAL, C.ANY, C.IN, C.CATEGORY, C.RANGE):
                total += 1
        return total

    def repeats_alone(seq) -> bool:
        """Some item of `seq` is (or holds, alone) an unbounded repeat, and the rest is optional."""
        for j, (op, av) in enumerate(seq):
            rest = [x for k, x in enumerate(seq) if k != j]
            if min_width(rest):
                continue
            if op in repeats and unbounded(av):
                return True
            if op == C.SUBPATTERN and repeats_alone(av[-1]):
                return True
            if op == C.BRANCH and any(repeats_alone(b) for b in av[1]):
                return True
        return False

    def walk(seq) -> bool:
        for op, av in seq:
            if op in repeats:
                if unbounded(av) and repeats_alone(av[2]):
                    return True
                if walk(av[2]):
                    return True
            elif op in (C.SUBPATTERN, C.ATOMIC_GROUP, C.POSSESSIVE_REPEAT):
                if walk(av if op == C.ATOMIC_GROUP else av[-1]):
                    return True
            elif op == C.BRANCH:
                if any(walk(b) for b in av[1]):
                    return True
            elif op in (C.ASSERT, C.ASSERT_NOT):
                if walk(av[1]):
                    return True
        return False

    return walk(list(_parser.parse(pattern)))


HEALTH = {
    "endpoint": Field("str", pattern=re.compile(r"/\S*"), what="an HTTP path like /health"),
    "model_info": Field("str", pattern=re.compile(r"/\S*"), what="an HTTP path like /model_info", nullable=True),
    # one real 1-token completion the gate sends after /health (a server that dies at its first request)
    "first_request": Field("str", pattern=re.compile(r"/\S*"), what="an HTTP path like /v1/completions",
                           nullable=True),
    "timeout": POSITIVE,
    "interval": POSITIVE,
}
VARIANT = {
    "extends": Field("str", pattern=NAME, what="a variant name"),
    "engine": Field("str", pattern=NAME, what="an engine name (sglang, vllm)"),
    "template": Field("str", pattern=NAME, what="a template file name under templates/"),
    "description": Field("any", nullable=True),
    "server_args": Field("map", keys=FLAG, keys_what="a flag name like cuda-graph-max-bs", nullable=True,
                         items=Field("any", nullable=True, check=_scalar_or_list)),
    "env": Field("map", keys=ENV_NAME, keys_what="an environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
                 nullable=True, items=Field("any", nullable=True, check=_scalar)),
    "patches": Field("list", nullable=True, items=Field("str", pattern=NAME, what="a patch name")),
    "health": Field("record", fields=HEALTH, nullable=True),
    "crash_signatures": Field("list", nullable=True, items=Field("str", check=_regex)),
    "stop_grace": Field("number", low=0, what="seconds (a number >= 0)"),
    "nnodes": Field("int", 1, 64),
    "when": Field("any", nullable=True),  # per-sglang-version rules: checked by servops.playbooks
}


MAX_YAML_BYTES = 4 << 20      # an inventory, variant, campaign or patch metadata file
MAX_YAML_NODES = 200_000      # values after aliases are expanded (a "billion laughs" file)


def read_text(path, error: type[ServopsError], limit: int = MAX_YAML_BYTES) -> str:
    """A user's text file, as UTF-8, at most `limit` bytes; else one line naming the file."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise error(f"{path}: larger than {limit >> 20} MiB; is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise error(f"{path}: not UTF-8 text (byte {exc.start}, line {line})") from None


def _expanded_size(obj: Any, memo: dict, path: set) -> int:
    """How many values `obj` holds with every alias expanded (shared objects counted each time)."""
    if not isinstance(obj, (dict, list)):
        return 1
    key = id(obj)
    if key in path:
        raise ValueError("refers to itself (a recursive alias)")
    if key in memo:
        return memo[key]
    path.add(key)
    items = [x for kv in obj.items() for x in kv] if isinstance(obj, dict) else obj
    total = 1
    for item in items:
        total += _expanded_size(item, memo, path)
        if total > MAX_YAML_NODES:
            break
    path.discard(key)
    memo[key] = total
    return total


class _StrictLoader(yaml.SafeLoader):
    """safe_load's loader, refusing what it would silently resolve: a key given twice in one
    mapping (the last one would win: the same host twice with different ports) and an integer
    too long to convert (Python's 4,300-digit limit: a raw ValueError)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _value in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *defaults`: keys given here override the merged ones, as meant
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # an unhashable key: the base class says so
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice in one mapping (first at line {first + 1}); "
                        f"the last would silently win", key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        try:
            value = super().construct_yaml_int(node)
        except ValueError:  # only past int()'s digit limit: YAML's int pattern matched already
            value = None
        # 0x... has no digit limit, but such a number could not be printed in an error message
        if value is None or value.bit_length() > 14_000:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(str(node.value)):,} characters; give a number of sane size",
                node.start_mark)
        return value


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def load_yaml(text: str, where, error: type[ServopsError]) -> Any:
    """safe_load, with the problems a hostile file can pose as one line each: invalid YAML,
    nesting too deep, aliases that expand to millions of values, a recursive alias, a key given
    twice, an integer of thousands of digits."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise error(f"{where}: invalid YAML{f' at line {mark.line + 1}' if mark else ''}: "
                    f"{getattr(exc, 'problem', None) or exc}") from None
    except RecursionError:
        raise error(f"{where}: invalid YAML: nested too deeply") from None
    try:
        size = _expanded_size(data, {}, set())
    except RecursionError:
        raise error(f"{where}: invalid YAML: nested too deeply") from None
    except ValueError as exc:
        raise error(f"{where}: invalid YAML: an alias {exc}") from None
    if size > MAX_YAML_NODES:
        raise error(f"{where}: its aliases expand to more than {MAX_YAML_NODES:,} values; write the values out")
    return data


def load_mapping(path, fields: dict[str, Field], error: type[ServopsError]) -> dict:
    """A YAML file of `fields`: read, parsed and checked, every problem one line (of class
    `error`) naming the file and the key or line."""
    data = load_yaml(read_text(path, error), path, error) or {}
    if not isinstance(data, dict):
        raise error(f"{path}: must be a mapping")
    try:
        return check_mapping(data, fields, f"{path}: ")
    except SchemaError as exc:
        raise error(str(exc)) from None


PATCH_META = {
    "distribution": Field("str", pattern=NAME, what="a distribution name"),
    "applies_to": Field("str", what="a PEP 440 requirement like flashinfer-python>=0.2,<0.8"),
    "why": Field("any"),
    "files": Field("list", items=Field("path")),
    "strip": Field("int", 0, 32),
    "preflight": Field("record", fields={
        "check": Field("str", pattern=NAME), "module": Field("str", pattern=MODULE, what="a module name"),
        "call": Field("str", pattern=re.compile(r"[A-Za-z_][A-Za-z0-9_]*"), what="a function name"),
        "args": Field("any", nullable=True), "backend": Field("str", pattern=NAME, what="a torch.compile backend"),
        "with": Field("list", nullable=True, items=Field("str", pattern=NAME)),
        "device": Field("str", pattern=NAME, what="cuda or cpu")}),
    # written by `invoke audit --fix` (servops/audit.py): what the patch wraps, from which audit and
    # break, probed where, and its proof (`proven`); only a proven one is deployed
    "synthesised": Field("any", nullable=True),
}
