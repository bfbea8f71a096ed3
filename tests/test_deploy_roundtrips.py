"""The round trips a deploy makes to a host, counted at the SSH layer (HostSession.round_trips:
one per command, each its own channel; HostSession.programs: which of servops' remote programs,
in order) over the real sshd lab. The counts are the deploy's contract with a slow link: a
change that adds a round trip changes this test, on purpose (issue 39: facts, check and plan
are to share round trips as the stages merge)."""

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


PREFLIGHT = ["launch_check", "patch_op:status"]  # the host's parser on the launch; the patch plan
TRANSACTION = ["deploy_ctl:lock", "deploy_ctl:prepare", "deploy_ctl:batch", "deploy_ctl:health", "deploy_ctl:batch",
               "deploy_ctl:unlock"]  # lock; release + guard; stop/switch/start; gate; mark + prune; unlock


def test_round_trips_of_a_first_a_repeated_a_forced_and_a_dry_run_deploy(alab):
    """Today: 9, 3, 8 and 3 round trips. The "unchanged?" question costs its own trip (identity),
    also on a host with no release yet; folded into one facts program with the preflight, a
    repeated deploy would be 1 round trip and a first one 7."""
    lab, inv, port = alab

    outcome, trips, programs = deploy_in_process(inv, "baseline")
    assert outcome[0] == "changed", outcome
    assert programs == PREFLIGHT + ["deploy_ctl:identity"] + TRANSACTION and trips == 9, (trips, programs)

    outcome, trips, programs = deploy_in_process(inv, "baseline")
    assert outcome[0] == "ok" and "unchanged" in outcome[1], outcome
    assert programs == PREFLIGHT + ["deploy_ctl:identity"] and trips == 3, (trips, programs)

    outcome, trips, programs = deploy_in_process(inv, "baseline", force=True)
    assert outcome[0] == "changed", outcome
    assert programs == PREFLIGHT + TRANSACTION and trips == 8, (trips, programs)

    outcome, trips, programs = deploy_in_process(inv, "baseline", dry_run=True, force=True)
    assert outcome[0] == "changed" and "check mode" in outcome[1], outcome
    assert programs == PREFLIGHT + ["deploy_ctl:releases"] and trips == 3, (trips, programs)
