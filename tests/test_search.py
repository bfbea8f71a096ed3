"""search: grid / random / tpe -- the campaign's space parsed and validated (pure, no host), the
bench order that fails fastest, the study's storage and its trial accounting (a real SQLite file)."""

from __future__ import annotations

import pytest
import yaml

from conftest import playbooks_with, run_invoke
from servops import search
from servops.campaign import CampaignError, load_campaign, point_trial
from servops.gate import parse_gate

BASE = {
    "base": "baseline",
    "bench": {"levels": [1, 16], "requests": 16, "input_len": 16, "output_len": 12},
    "objective": {"maximize": "output_tps@16", "constraints": ["p99_ttft_ms@1 <= 300", "failed == 0"]},
    "budget": {"max_trials": 6},
}


def write(tmp_path, name="camp", **over) -> str:
    data = dict(BASE, **over)
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


SPACE = {"name": "knobs", "grid": {"server_args": {
    "cuda-graph-max-bs": {"low": 4, "high": 64, "log": True},
    "mem-fraction-static": {"low": 0.7, "high": 0.9, "step": 0.05},
    "max-running-requests": [1, 8, 16]}}}


def test_a_tpe_campaign_keeps_named_variants_fixed_and_samples_the_grid(tmp_path):
    camp = load_campaign(write(tmp_path, search="tpe", seed=7, candidates=[{"variant": "piecewise"}, SPACE]))
    assert camp.search == "tpe" and camp.seed == 7
    assert [t.id for t in camp.trials] == ["base", "piecewise"]  # fixed, run first
    (space,) = camp.spaces
    axes = {a.key: a for a in space.axes}
    assert axes["cuda-graph-max-bs"].integer and axes["cuda-graph-max-bs"].log
    assert axes["mem-fraction-static"].values() == [0.7, 0.75, 0.8, 0.85, 0.9]
    assert axes["max-running-requests"].choices == [1, 8, 16]
    assert axes["cuda-graph-max-bs"].values() is None and space.size() is None
    t = point_trial(camp.name, space, {("server_args", "cuda-graph-max-bs"): 32,
                                       ("server_args", "mem-fraction-static"): 0.8,
                                       ("server_args", "max-running-requests"): 8}, "s005", "knobs [..]")
    assert t.variant["server_args"]["cuda-graph-max-bs"] == 32 and t.variant["server_args"]["max-running-requests"] == 8
    assert t.variant["name"] == "camp-s005" and t.overrides["source"] == "baseline"


def test_a_grid_expands_a_stepped_range_and_keeps_todays_ids(tmp_path):
    cand = {"name": "g", "grid": {"server_args": {"cuda-graph-max-bs": {"low": 8, "high": 32, "step": 8}}}}
    camp = load_campaign(write(tmp_path, candidates=[cand, {"name": "l", "grid": {"server_args": {"max-running-requests": [2, 4]}}}]))
    assert camp.search == "grid" and not camp.spaces
    assert [t.id for t in camp.trials] == ["base", "g-8", "g-16", "g-24", "g-32", "l-2", "l-4"]


@pytest.mark.parametrize("over, needle", [
    ({"search": "tpee"}, "search: expected grid, random or tpe; did you mean tpe?"),
    ({"search": "grid", "seed": 3}, "seed: only search: random or tpe samples"),
    ({"search": "random", "candidates": [{"variant": "piecewise"}]}, "search: search: random samples the candidates' grid"),
    ({"search": "tpe", "budget": {}}, "budget: search: tpe runs until its budget"),
    ({"candidates": [{"name": "g", "grid": {"server_args": {"cuda-graph-max-bs": {"low": 8, "high": 32}}}}]},
     "a range needs a step under search: grid"),
    ({"search": "tpe", "candidates": [{"grid": {"server_args": {"cuda-graph-max-bs": {"low": 8, "hihg": 32}}}}]},
     "unknown key 'hihg'; did you mean high?"),
    ({"search": "tpe", "candidates": [{"grid": {"server_args": {"x": {"low": 9, "high": 3}}}}]}, "low 9 is above high 3"),
    ({"search": "tpe", "candidates": [{"grid": {"server_args": {"x": {"low": 0, "high": 3, "log": True}}}}]},
     "log: true needs low above 0"),
    ({"search": "tpe", "candidates": [{"grid": {"server_args": {"x": {"low": 0.1, "high": 3, "step": 0.5, "log": True}}}}]},
     "give step or log: true, not both"),
    ({"search": "tpe", "candidates": [{"grid": {"server_args": {"x": []}}}]}, "give at least one value"),
    ({"search": "tpe", "candidates": [{"grid": {"server_args": {"x": [{"a": 1}]}}}]}, "each value must be a number"),
    ({"search": "tpe", "candidates": [{"grid": {"server_args": {"x": {"low": 0, "high": 1, "step": 0}}}}]},
     "step: expected a number above 0"),
    ({"search": "tpe", "candidates": [{"name": "a", "grid": {"server_args": {"x": [1]}}},
                                      {"name": "a", "grid": {"server_args": {"y": [1]}}}]}, "'a' names two candidates"),
])
def test_a_bad_space_is_one_line_naming_file_and_key(tmp_path, over, needle):
    data = dict(over)
    data.setdefault("candidates", [SPACE])
    with pytest.raises(CampaignError) as exc:
        load_campaign(write(tmp_path, **data))
    assert str(exc.value).startswith(str(tmp_path / "camp.yml") + ": ") and needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_the_cli_refuses_a_bad_search_before_any_connection(tmp_path):
    path = write(tmp_path, search="bayes", candidates=[SPACE])
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump({"hosts": {"gpu1": {"ssh_host": "192.0.2.1", "ssh_port": 22}}}))
    res = run_invoke("tune", path, "-H", "gpu1", inventory=inv, timeout=60)
    assert res.returncode == 2 and "search: expected grid, random or tpe" in res.stderr and "Traceback" not in res.stderr
    good = write(tmp_path, "good", search="tpe", candidates=[SPACE])
    res = run_invoke("tune", good, "-H", "gpu1", "--storage", "nosuchdb://x", inventory=inv, timeout=60)
    assert res.returncode == 2 and "--storage 'nosuchdb://x': expected a database URL" in res.stderr
    from servops.lab.sshd import free_port

    # a database nobody listens on: one line, exit 2, before the (unreachable) host is tried
    res = run_invoke("tune", good, "-H", "gpu1", "--storage", f"postgresql://servops@127.0.0.1:{free_port()}/x",
                     inventory=inv, timeout=60)
    assert res.returncode == 2 and "storage postgresql://servops@127.0.0.1:" in res.stderr, res.stdout + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    grid = write(tmp_path, "grid", candidates=[{"variant": "piecewise"}])
    res = run_invoke("tune", grid, "-H", "gpu1", "--storage", "sqlite:///x.db", inventory=inv, timeout=60)
    assert res.returncode == 2 and "is a grid (search: grid)" in res.stderr


def test_a_campaign_whose_host_cannot_be_reached_journals_nothing(tmp_path):
    """A first run that fails at its first host command leaves no log a plain rerun would refuse."""
    good = write(tmp_path, "good", search="tpe", candidates=[SPACE])
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"gpu1": {
        "ssh_host": "127.0.0.1", "ssh_key": str(tmp_path / "no-key"), "venv": "/opt/venv", "model_path": "/models/M", "tp": 8}}}}))
    env = {"SERVOPS_RESULTS": str(tmp_path / "results")}
    for _ in range(2):
        res = run_invoke("tune", good, "-H", "gpu1", inventory=inv, env=env, timeout=60)
        out = res.stdout + res.stderr
        assert res.returncode != 0 and "no-key does not exist" in out and "--resume" not in out, out
    assert not list((tmp_path / "results").rglob("trials.jsonl"))


def test_levels_are_benched_in_the_order_that_fails_fastest():
    conds = parse_gate("p99_ttft_ms@10 <= 300, error_rate@1 <= 0, output_tps@256 >= 5, p99_ttft_ms@1024 <= 900")
    # ttft at 10 and the error rate at 1 are below the objective's 256: alone, lowest first
    assert search.prunable_levels(conds, 256) == [1, 10]
    assert search.bench_order([1, 10, 256, 1024], conds, 256) == [[1], [10], [256, 1024]]
    # a throughput floor cannot prune (more load may raise it); nothing below the objective: one run
    assert search.prunable_levels(parse_gate("output_tps@1 >= 5"), 256) == []
    assert search.bench_order([1, 16], parse_gate("p99_ttft_ms@16 <= 300"), 16) == [[1, 16]]
    assert [c.level for c in search.level_conditions(conds, 10)] == [10]


def test_suggest_and_point_of_round_trip_through_a_real_sqlite_study(tmp_path):
    import optuna

    from servops import study as studymod

    camp = load_campaign(write(tmp_path, search="random", seed=1, candidates=[
        SPACE, {"name": "two", "grid": {"env": {"SGLANG_DOUBLE_TTFT": ["0.01", "0.5"]}}}]))
    url = studymod.default_url(tmp_path)
    study, storage = studymod.open_study("camp", url, "random", "maximize", 1, 6)
    seen = set()
    for _ in range(8):
        ot = study.ask()
        space, point = search.suggest(camp.spaces, ot)
        assert search.point_of(camp.spaces, ot.params) == (space, point)
        seen.add(space.name)
        study.tell(ot, 1.0)
    assert seen == {"knobs", "two"} and (tmp_path / "study.db").is_file()
    # a trial this host was running when its controller died: failed, its point asked again, counted once
    ot = study.ask()
    search.suggest(camp.spaces, ot)
    ot.set_user_attr("host", "gpu1")
    ot.set_user_attr("tid", "s008")
    assert studymod.counted(study) == 9
    again, _ = studymod.open_study("camp", url, "random", "maximize", 1, 6)
    assert studymod.reclaim_own(again, storage, "gpu1") == [8]
    assert studymod.counted(again) == 8  # the failed one is not counted; its retry waits in the queue
    retry = again.ask()
    search.suggest(camp.spaces, retry)
    assert retry.user_attrs["tid"] == "s008" and retry.params == ot.params and retry.user_attrs["reclaims"] == 8
    assert studymod.counted(again) == 9
    states = [t.state for t in again.get_trials()]
    assert states.count(optuna.trial.TrialState.FAIL) == 1
    with pytest.raises(studymod.StudyError, match="is to maximize, the campaign's objective to minimize"):
        studymod.open_study("camp", url, "tpe", "minimize", 1, 6)


def test_an_asked_trial_is_its_hosts_from_its_first_write_so_a_kill_at_any_step_is_reclaimed(tmp_path):
    """A controller SIGKILLed at any point of an ask leaves nothing RUNNING that --resume cannot finish."""
    import optuna
    from optuna.trial import TrialState

    from servops import study as studymod

    camp = load_campaign(write(tmp_path, search="tpe", seed=3, candidates=[SPACE]))
    url = studymod.default_url(tmp_path)
    study, storage = studymod.open_study("camp", url, "tpe", "maximize", 3, 6)
    # killed right after the ask, before its point was drawn: already gpu1's, nothing to ask again
    pointless = studymod.ask_owned(study, {"host": "gpu1"})
    assert storage.get_trial(pointless._trial_id).user_attrs["host"] == "gpu1"
    # killed after its point was drawn, before its tid was written
    cut = studymod.ask_owned(study, {"host": "gpu1"})
    search.suggest(camp.spaces, cut)
    # an ownerless RUNNING trial (a plain ask() cut off, as before ask_owned): failed once it is old
    orphan = study.ask()
    # killed between the owner's enqueue and the ask: a waiting trial, not counted, asked next
    study.enqueue_trial({}, user_attrs={"host": "gpu2"})
    assert studymod.counted(study) == 3
    again, storage = studymod.open_study("camp", url, "tpe", "maximize", 3, 6)
    assert studymod.reclaim_own(again, storage, "gpu1") == [cut.number]
    assert storage.get_trial(pointless._trial_id).user_attrs["reclaimed_as"] == "never ran"
    assert storage.get_trial(orphan._trial_id).state == TrialState.RUNNING  # could be a live controller's
    assert studymod.reclaim_own(again, storage, "gpu2", ownerless_after_s=0) == []
    assert storage.get_trial(orphan._trial_id).state == TrialState.FAIL
    # the queue: gpu2's stub, then cut's point; every ask pops one and owns it
    first = studymod.ask_owned(again, {"host": "gpu3"})
    second = studymod.ask_owned(again, {"host": "gpu3"})
    search.suggest(camp.spaces, first)
    search.suggest(camp.spaces, second)
    assert second.user_attrs["reclaims"] == cut.number and first.user_attrs["host"] == second.user_attrs["host"] == "gpu3"
    for ot in (first, second):
        again.tell(ot, 1.0)
    assert all(t.state.is_finished() for t in again.get_trials())
    assert studymod.counted(again) == 2  # the cut one counts through its retry, the pointless and orphan not at all
    assert not again.get_trials(states=(TrialState.WAITING,)) and isinstance(first, optuna.Trial)
