"""The round trips a deploy makes to a host, counted at the SSH layer (HostSession.round_trips:
one per command, each its own channel; HostSession.programs: which of servops' remote programs,
in order) over the real sshd lab. The counts are the deploy's contract with a slow link: a
change that adds a round trip changes this test, on purpose (issue 39: the facts, the check and
what the plan needs share one round trip)."""

from __future__ import annotations

from servops import deploy as dep
from servops.inventory import load_inventory
from servops.playbooks import load_variant
from servops.transport import Session


def deploy_in_process(inventory_path, variant: str, **options) -> tuple[tuple[str, str], int, list[str]]:
    """deploy_group on lab1 as `invoke deploy` runs it: (outcome, round trips, remote programs)."""
    inventory = load_inventory(inventory_path)
    with Session(inventory) as session:
        hs = session.host(inventory.hosts["lab1"])
        outcome = dep.deploy_group([hs], load_variant(variant), **options)
    return outcome, hs.round_trips, hs.programs


FACTS = ["launch_check+deploy_facts"]  # one trip: the host's parser on every `when:` branch, release, patch state, lock
TRANSACTION = ["deploy_ctl:lock", "deploy_ctl:prepare", "deploy_ctl:batch", "deploy_ctl:health", "deploy_ctl:batch",
               "deploy_ctl:unlock"]  # lock; release + guard; stop/switch/start; gate; mark + prune; unlock


def test_round_trips_of_a_first_a_repeated_a_forced_and_a_dry_run_deploy(alab):
    """7, 1, 7 and 1 round trips (before the stages merged: 9, 3, 8 and 3). The facts trip
    answers the launch check, the patch plan and "unchanged?" at once: a repeated deploy is one
    round trip, a first one the facts plus the transaction's six."""
    lab, inv, port = alab

    outcome, trips, programs = deploy_in_process(inv, "baseline")
    assert outcome[0] == "changed", outcome
    assert programs == FACTS + TRANSACTION and trips == 7, (trips, programs)

    outcome, trips, programs = deploy_in_process(inv, "baseline")
    assert outcome[0] == "ok" and "unchanged" in outcome[1], outcome
    assert programs == FACTS and trips == 1, (trips, programs)

    outcome, trips, programs = deploy_in_process(inv, "baseline", force=True)
    assert outcome[0] == "changed", outcome
    assert programs == FACTS + TRANSACTION and trips == 7, (trips, programs)

    outcome, trips, programs = deploy_in_process(inv, "baseline", dry_run=True, force=True)
    assert outcome[0] == "changed" and "check mode" in outcome[1], outcome
    assert programs == FACTS and trips == 1, (trips, programs)


def verb_in_process(inventory_path, verb, *args, **options) -> tuple[tuple[str, str], int, list[str]]:
    """A deploy module verb on lab1 as its task runs it: (outcome, round trips, remote programs)."""
    inventory = load_inventory(inventory_path)
    with Session(inventory) as session:
        hs = session.host(inventory.hosts["lab1"])
        outcome = verb(hs, *args, **options)
    return outcome, hs.round_trips, hs.programs


def test_round_trips_of_a_rollback_and_a_restart(alab):
    """The releases and the patch state they plan from are one round trip (deploy_ctl:facts),
    for rollback, restart and start alike (before: releases, then patch_op:status): a rollback
    7 (was 8), a restart 7 (was 8), either in check mode 1 (was 2)."""
    lab, inv, port = alab
    deploy_in_process(inv, "baseline")
    deploy_in_process(inv, "piecewise")

    outcome, trips, programs = verb_in_process(inv, dep.rollback, dry_run=True)
    assert outcome[0] == "changed" and "would roll back" in outcome[1], outcome
    assert programs == ["deploy_ctl:facts"] and trips == 1, (trips, programs)

    outcome, trips, programs = verb_in_process(inv, dep.rollback)
    assert outcome[0] == "changed" and "rolled back" in outcome[1], outcome
    assert programs == ["deploy_ctl:lock", "deploy_ctl:facts", "patch_op:revert",  # piecewise's patch goes
                        "deploy_ctl:batch", "deploy_ctl:health", "deploy_ctl:mark", "deploy_ctl:unlock"] \
        and trips == 7, (trips, programs)

    outcome, trips, programs = verb_in_process(inv, dep.restart_current, "restart", dry_run=True)
    assert outcome[0] == "changed" and "would restart" in outcome[1], outcome
    assert programs == ["deploy_ctl:facts"] and trips == 1, (trips, programs)

    outcome, trips, programs = verb_in_process(inv, dep.restart_current, "restart")
    assert outcome[0] == "changed" and "restarted" in outcome[1], outcome
    assert programs == ["deploy_ctl:facts", "deploy_ctl:lock", "deploy_ctl:rearm", "deploy_ctl:batch",
                        "deploy_ctl:health", "deploy_ctl:batch", "deploy_ctl:unlock"] and trips == 7, (trips, programs)

    outcome, trips, programs = verb_in_process(inv, dep.restart_current, "start")
    assert outcome[0] == "ok" and "already running" in outcome[1], outcome
    assert programs == ["deploy_ctl:facts", "deploy_ctl:identity"] and trips == 2, (trips, programs)


def test_a_dry_run_says_what_the_deploy_lock_would_do_and_leaves_it(alab):
    """The facts trip reads the deploy lock: check mode (deploy, rollback, restart) names its
    holder and what the real run would do (refuse, or break a stale one), in the same one round
    trip, and leaves the lock."""
    import json
    import socket
    import subprocess

    from tests.conftest import root_of

    lab, inv, _port = alab
    assert deploy_in_process(inv, "baseline")[0][0] == "changed"
    assert deploy_in_process(inv, "baseline", force=True)[0][0] == "changed"  # a release to roll back to
    lock = root_of(lab) / "deploy.lock"
    live = {"id": "f" * 32, "who": "ana@example.org", "controller": "another-controller", "pid": 4242,
            "action": "deploy piecewise", "acquired_at": "2026-12-06T10:00:00Z"}
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid of this machine that has ended
    try:
        for holder, said in ((live, "the real run would refuse unless it is released first"),
                             (dict(live, controller=socket.gethostname(), pid=dead.pid),
                              f"the real run would break it (stale: its owner pid {dead.pid} is gone)")):
            lock.write_text(json.dumps(holder))
            before = lock.read_bytes(), lock.stat().st_mtime_ns
            outcome, trips, programs = deploy_in_process(inv, "baseline", dry_run=True, force=True)
            assert outcome[0] == "changed" and "check mode" in outcome[1], outcome
            assert f"lab1: the deploy lock is held by ana@example.org pid {holder['pid']} (deploy piecewise" \
                in outcome[1] and said in outcome[1], outcome
            assert programs == FACTS and trips == 1, (trips, programs)
            for verb, args in ((dep.rollback, ()), (dep.restart_current, ("restart",))):
                outcome, trips, programs = verb_in_process(inv, verb, *args, dry_run=True)
                assert outcome[0] == "changed" and "(check mode); the deploy lock is held by ana@example.org" \
                    in outcome[1] and said in outcome[1], outcome
                assert trips == 1, (verb, trips, programs)
            assert (lock.read_bytes(), lock.stat().st_mtime_ns) == before
    finally:
        lock.unlink(missing_ok=True)
