"""servops/hostreply.py (pure, no host): the shapes a host's replies are held to before use, and
the one line a field not as servops writes it becomes (issue 48 item 6)."""

from __future__ import annotations

import math

import pytest

from servops import hostreply
from servops.errors import RemoteError


def problem(reply, shape) -> str | None:
    try:
        hostreply.check(reply, shape, "gpu1", "prog")
    except RemoteError as exc:
        return str(exc)
    return None


def test_a_lock_record_is_held_to_what_servops_writes():
    facts = hostreply.deploy_ctl("facts")
    good = {"id": "f" * 32, "who": "x" * (3 << 20), "user": "bo", "controller": "c", "pid": 4242, "action": "deploy",
            "acquired_at": "t", "age": 1.5}
    assert problem({"lock": good}, facts) is None  # long text is text: cut where printed, not refused
    for lock, field in (("string", "lock 'string' is not an object"), (dict(good, pid="abc"), "lock.pid 'abc' is not a pid"),
                        (dict(good, pid=10**30), f"lock.pid {10**30} is not a pid"),
                        (dict(good, pid=True), "lock.pid True is not a pid"),
                        (dict(good, age=math.inf), "lock.age inf is not a finite number"),
                        (dict(good, who=["a"]), "lock.who ['a'] is not text")):
        assert problem({"lock": lock}, facts) == (f"gpu1: prog sent a malformed reply ({field}); the host's servops "
                                                  f"files may be damaged or tampered with"), lock


def test_patch_entries_releases_and_lock_replies():
    facts = hostreply.deploy_ctl("facts")
    assert "patches[0].name 5 is not text" in problem({"patches": [{"name": 5, "state": "applied"}]}, facts)
    assert "patches[0].state 'fine' is not one of not-applied" in problem({"patches": [{"name": "p", "state": "fine"}]}, facts)
    assert "patches[0].state is missing" in problem({"patches": [{"name": "p"}]}, facts)
    assert "releases[0].port 'abc' is not a port" in problem(
        {"releases": [{"name": "20261208T100000Z-baseline", "port": "abc"}]}, facts)
    assert "releases[0].name '../../etc' is not a release name" in problem({"releases": [{"name": "../../etc"}]}, facts)
    assert "results[1].server.pid -1 is not a pid" in problem(
        {"results": [{}, {"server": {"pid": -1}}]}, hostreply.deploy_ctl("batch"))
    lock = hostreply.deploy_ctl("lock")
    assert "acquired is missing" in problem({}, lock)
    assert "held is missing" in problem({"acquired": False}, lock)
    assert problem({"acquired": False, "held": {"id": "g", "guard": True}, "age": 0}, lock) is None
    assert "drift[0].file is missing" in problem({"drift": [{"now": None}]}, facts)


def test_the_launch_facts_and_the_proof():
    facts = hostreply.LAUNCH_FACTS
    assert problem({"gpus": {"count": 1, "users": [{"pid": 7, "name": "caf\ufffd", "used_mib": None}]}}, facts) is None
    assert "gpus.users[0].pid '\u00b2' is not a pid" in problem({"gpus": {"users": [{"pid": "\u00b2"}]}}, facts)
    assert "port.state 'open' is not one of free, ours, busy" in problem({"port": {"port": 1, "state": "open"}}, facts)
    assert "sglang.parser 'magic' is not one of real" in problem({"sglang": {"parser": "magic"}}, facts)
    assert "deploy.current is missing" in problem({"deploy": {"root": "/r", "patches": []}}, facts)
    # a measured difference may be NaN (the compiled call gave NaN): a number still, not malformed
    assert problem({"result": "fail", "fixed": {"cases": [{"what": "w", "max_abs_diff": math.nan}]}},
                   hostreply.PREFLIGHT) is None
    assert "result is missing" in problem({}, hostreply.PREFLIGHT)


def test_shown_cuts_host_text_saying_how_much():
    assert hostreply.shown("abc", 5) == "abc"
    assert hostreply.shown("x" * 300, 200) == "x" * 200 + "... [100 more characters]"


@pytest.mark.parametrize("value", [float("nan"), "1", None])
def test_a_number_is_finite_and_a_number(value):
    with pytest.raises(hostreply.Malformed):
        hostreply.number(value, "v")
