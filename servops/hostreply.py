"""A host's reply, held to the shape servops' own program writes before any of it is used.

A remote program's JSON comes from the host: files there (the deploy lock, release.json, the patch
state, nvidia-smi's rows) feed it, and a damaged or hostile host can send anything. Each reply a
verb plans from is checked field by field against a shape declared here once; the first field
that is not as servops writes it is one line naming the field and its value (`lock.pid 'abc' is
not a pid`), raised as a RemoteError before the reply is used: exit 2, nothing was done with it.
Text is only checked to be text: where it is printed, `shown` cuts it.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

from .errors import RemoteError

Check = Callable[[Any, str], None]


class Malformed(Exception):
    """A field not as servops' program writes it: str() is `<where> <value> is not <what>`."""


def _value(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:60] + "..."


def _fail(v: Any, where: str, what: str) -> None:
    raise Malformed(f"{where or 'the reply'} {_value(v)} is not {what}")


def shown(text: str, limit: int = 200) -> str:
    """Host-supplied text as printed: at most `limit` characters, saying how much was cut."""
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text) - limit:,} more characters]"


# ---- the building blocks ---------------------------------------------------------------------------

def text(v: Any, where: str) -> None:
    if not isinstance(v, str):
        _fail(v, where, "text")


def flag(v: Any, where: str) -> None:
    if not isinstance(v, bool):
        _fail(v, where, "true or false")


def number(v: Any, where: str) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        _fail(v, where, "a finite number")


def real(v: Any, where: str) -> None:
    """A number, NaN and infinities included (a measured difference may be one)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        _fail(v, where, "a number")


def integer(low: int, high: int, what: str) -> Check:
    def check(v: Any, where: str) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            _fail(v, where, what)
    return check


def matching(pattern: re.Pattern, what: str) -> Check:
    def check(v: Any, where: str) -> None:
        if not isinstance(v, str) or not pattern.fullmatch(v):
            _fail(v, where, what)
    return check


def one_of(*values: str) -> Check:
    def check(v: Any, where: str) -> None:
        if v not in values:
            _fail(v, where, "one of " + ", ".join(values))
    return check


def optional(inner: Check) -> Check:
    """None, or what `inner` accepts."""
    def check(v: Any, where: str) -> None:
        if v is not None:
            inner(v, where)
    return check


def list_of(item: Check) -> Check:
    def check(v: Any, where: str) -> None:
        if not isinstance(v, list):
            _fail(v, where, "a list")
        for i, x in enumerate(v):
            item(x, f"{where}[{i}]")
    return check


def map_of(value: Check) -> Check:
    def check(v: Any, where: str) -> None:
        if not isinstance(v, dict):
            _fail(v, where, "an object")
        for k, x in v.items():
            value(x, f"{where}.{k}" if where else str(k))
    return check


def record(required: tuple[str, ...] = (), **fields: Check) -> Check:
    """An object whose listed fields (absent or null unless `required`) are as their checks say;
    fields it does not list pass (a newer program may add some)."""
    def check(v: Any, where: str) -> None:
        if not isinstance(v, dict):
            _fail(v, where, "an object")
        for key in required:
            if v.get(key) is None:
                raise Malformed(f"{where}.{key} is missing" if where else f"{key} is missing")
        for key, field in fields.items():
            if v.get(key) is not None:
                field(v[key], f"{where}.{key}" if where else key)
    return check


ANY_OBJECT = record()
ANY_LIST = list_of(lambda v, where: None)
PID = integer(1, (1 << 22) - 1, "a pid")  # Linux's largest pid_max; macOS's are smaller
PORT = integer(1, 65535, "a port")
COUNT = integer(0, 1 << 62, "a count")
RELEASE_NAME_RE = re.compile(r"[0-9]{8}T[0-9]{6}Z-[A-Za-z0-9][A-Za-z0-9._-]*")  # <UTC time>-<variant>
RELEASE_NAME = matching(RELEASE_NAME_RE, "a release name")
TEXTS = list_of(text)


def malformed(host: str, program: str, problem: str) -> RemoteError:
    return RemoteError(f"{host}: {program} sent a malformed reply ({problem}); the host's servops files may be "
                       f"damaged or tampered with")


def check(reply: Any, shape: Check, host: str, program: str) -> Any:
    """`reply` when it has `shape`; else RemoteError, one line naming the host, program and field."""
    try:
        shape(reply, "")
    except Malformed as exc:
        raise malformed(host, program, str(exc)) from None
    return reply


# ---- the deploy lock, the patch state, releases --------------------------------------------------

# deploy_ctl's lock record (deploylock: a controller's, the host guard's, or an unreadable file's)
# with its age; `damaged` says why a record was taken for an unreadable one
LOCK = record(id=text, unreadable=flag, damaged=text, size=COUNT, mtime=number, who=text, user=text,
              controller=text, action=text, acquired_at=text, detail=text, pid=PID, host_pid=PID,
              host_starttime=text, alive_on_host=flag, guard=flag, age=number)
# patch_core.status_rows: one entry per patch asked about
PATCH_ENTRY = record(("name", "state"), name=text, dist=text, version=text, recorded=flag,
                     state=one_of("not-applied", "applied", "conflicts", "not-installed"), detail=text)
DIGESTS = map_of(optional(matching(re.compile(r"sha256=[0-9a-f]{64}"), "a sha256 digest")))
# release.json as deploy writes it (release_files), with its name
HEALTH = record(endpoint=text, timeout=number, interval=number)
RELEASE = record(("name",), name=RELEASE_NAME, status=text, variant=text, patches=TEXTS, port=PORT,
                 health=HEALTH, stop_grace=number, crash_signatures=ANY_LIST, created=text, failure=text,
                 files=DIGESTS)
SERVER = record(("pid",), pid=PID, pgid=PID, release=RELEASE_NAME, port=PORT, starttime=text, log=text)
LEFTOVER = record(("release",), pid=PID, name=text, release=RELEASE_NAME)
UNFINISHED = record(("release", "guard", "detail"), release=RELEASE_NAME, guard=text, detail=text)
DRIFT = record(("file",), file=text, recorded=text, now=text, bytes=COUNT, modified=text, kind=text)
# op_releases: the listing every plan starts from
LISTING = record(root=text, current=RELEASE_NAME, releases=list_of(RELEASE), server=SERVER,
                 leftovers=list_of(LEFTOVER), unfinished=list_of(UNFINISHED), protected=ANY_OBJECT,
                 pins_damaged=text)
# release_identity: the current release as a deploy compares it
IDENTITY = record(name=RELEASE_NAME, files=map_of(optional(text)), status=text, patches=TEXTS,
                  health=HEALTH, running=flag, healthy=flag, launch_sh=text)
# deploy_facts, in the facts round trip
DEPLOY_FACTS = record(("root", "current", "patches"), root=text, current=IDENTITY, patches=list_of(PATCH_ENTRY),
                      patches_recovered=text, lock=LOCK)


# each op's own fields, and those it must send
_OWN = {"facts": ((), {"patches": list_of(PATCH_ENTRY), "patches_recovered": text, "lock": LOCK,
                       "drift": list_of(DRIFT)}),
        "lock": (("acquired",), {"acquired": flag, "held": LOCK, "age": number, "orphans": TEXTS,
                                 "port": record(busy=flag, ours=flag, server=SERVER)}),
        "status": ((), {"release": RELEASE})}


def deploy_ctl(op: str) -> Check:
    """The shape of deploy_ctl `op`'s reply: the listing's fields wherever they appear (a batch's
    steps, the lock's listing), and each op's own."""
    required, own = _OWN.get(op, ((), {}))

    def reply(v: Any, where: str) -> None:
        LISTING(v, where)
        record(required, lines=ANY_LIST, entries=ANY_LIST, problems=ANY_LIST, listing=LISTING, **own)(v, where)
        if op == "lock" and v["acquired"] is False:  # who holds it, and for how long
            record(("held", "age"))(v, where)
        if "results" in v:
            list_of(reply)(v["results"], f"{where}.results" if where else "results")
    return reply


# ---- the launch check's facts ---------------------------------------------------------------------

GPU_USER = record(("pid",), pid=PID, gpu_uuid=text, used_mib=number, name=text,
                  gpu=integer(0, 1 << 16, "a GPU index"), ours=flag)
GPUS = record(count=COUNT, names=TEXTS, error=text, users=list_of(GPU_USER), users_error=text,
              users_skipped=record(("count", "rows"), count=COUNT, rows=TEXTS))
MODEL = record(path=text, state=one_of("dir", "file", "missing", "hub-id"), config=flag, architectures=TEXTS,
               missing_architectures=TEXTS)
BRANCH = record(ok=flag, problems=list_of(record(flag=text, kind=text, message=text, suggestions=TEXTS)),
                warnings=list_of(record(("flag", "message"), flag=text, message=text)), values=ANY_OBJECT,
                facts=record(model=MODEL, gpus_needed=COUNT))
ENGINE = record(version=text, parser=one_of("real", "cached", "static"), note=text, prog=text, actions=COUNT,
                unchecked=TEXTS, skipped=ANY_LIST, cache=text)
# launch_check / launch_check_vllm (the engine's facts under "sglang" or "engine"); deploy_facts'
# part, where the deploy asked for it
LAUNCH_FACTS = record(python=text, python_version=text, sglang=ENGINE, engine=ENGINE, branches=map_of(BRANCH),
                      port=record(("port", "state"), port=PORT, state=one_of("free", "ours", "busy"), pid=PID),
                      gpus=GPUS, timings=map_of(number), deploy=DEPLOY_FACTS)


# host_facts: what a fleet campaign compares between hosts
HOST_FACTS = record(gpu=GPUS, engine=record(dist=text, version=text), model=MODEL, python=text, patches=TEXTS)


# ---- the call-site proof ----------------------------------------------------------------------------

PROOF_STATE = record(result=text, message=text, error_type=text, traceback=text, torch=text, device=text,
                     module_file=text, cases=list_of(record(what=text, result=text, stage=text, max_abs_diff=real)))
# preflight_dynamo: a dynamo_call_site proof (each state's run), or a dynamo_fullgraph trace
PREFLIGHT = record(("result",), result=text, call_site=text, message=text, files=TEXTS, pristine=PROOF_STATE,
                   fixed=PROOF_STATE, torch=text, error_type=text, traceback=text)
