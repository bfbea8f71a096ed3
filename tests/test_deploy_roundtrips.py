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


FACTS = ["launch_check"]  # one trip: the host's parser on every `when:` branch, release, patch state, lock
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
