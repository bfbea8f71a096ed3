"""Issue 40 (pure parts, no host): the sequential verdicts (servops.verdict and the campaign's
record), the search learning from crashes (search.predicted_crash, study.tell_outcome) and the
campaign's start-up bounds (the phases themselves: tests/test_startup.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from servops import campaignrecord, search, startup, verdict
from servops.campaign import load_campaign, start_conditions


def campaign(tmp_path: Path, objective: str):
    path = tmp_path / "c.yml"
    path.write_text(f"base: baseline\nbench: {{levels: [16]}}\nobjective: {{maximize: output_tps@16{objective}}}\n")
    return load_campaign(str(path))


def test_the_noise_is_pooled_over_every_repeated_trial_and_intervals_shrink_with_runs():
    noise = verdict.pooled_noise({"base": [100.0, 102.0], "a": [200.0, 196.0, 204.0], "b": [150.0]})
    assert noise.df == 3 and "base x2, a x3 (3 df)" in noise.how
    # relative deviations: base +-1/101, a +-4/200 twice: pooled sd = sqrt((2*(1/101)^2 + 2*(0.02)^2) / 3)
    assert noise.sd == pytest.approx(((2 * (1 / 101) ** 2 + 2 * 0.02 ** 2) / 3) ** 0.5)
    one, four = verdict.interval([100.0], noise), verdict.interval([100.0] * 4, noise)
    assert one[0] == four[0] == 100.0 and (four[2] - four[1]) == pytest.approx((one[2] - one[1]) / 2)
    assert verdict.pooled_noise({"a": [1.0], "b": [2.0]}) is None
    assert verdict.t_quantile(0.95, 1) == pytest.approx(12.706, abs=1e-3)
    assert verdict.t_quantile(0.95, 30) == pytest.approx(2.042, abs=0.01)


def test_a_contender_is_benched_again_only_while_unsure_and_a_tie_says_its_figures():
    noise = verdict.Noise(0.02, 20, "2% per run")
    # 10% better: the intervals separate on the first run
    again, why = verdict.next_step([100.0, 100.0], [110.0], noise, "maximize", 3)
    assert not again and why.startswith("better: +10.0% [") and "the intervals separate" in why
    again, why = verdict.next_step([100.0, 100.0], [101.0], noise, "maximize", 3)
    assert again and why.startswith("unsure: +1.0%")
    again, why = verdict.next_step([100.0, 100.0], [101.0, 100.5, 101.0], noise, "maximize", 3)
    assert not again and why.startswith("tie within noise: +0.8% [") and "max_repeats 3" in why
    # a minimised objective: lower is better
    assert verdict.compare([100.0], [80.0], noise, "minimize").state == "better"
    # a gain that cannot reach min_gain does not matter: no more runs
    again, why = verdict.next_step([100.0] * 4, [99.0] * 2, noise, "maximize", 5, negligible=0.05)
    assert not again and why.startswith("cannot matter")
    # the winner is the best lower bound, not the best single value
    noisy = verdict.Noise(0.05, 20, "5% per run")
    assert verdict.choose({"lucky": [112.0], "steady": [108.0, 109.0, 108.5, 108.0]}, noisy) == "steady"
    assert verdict.choose({"lucky": [112.0], "steady": [108.0, 109.0, 108.5, 108.0]}, noise) == "lucky"
    assert verdict.finalists({"a": [100.0], "b": [140.0], "c": [139.0], "d": [138.0]}, noise, "maximize", 2) == ["b", "c"]


def test_sequential_standings_replay_the_intervals_and_the_rebench_decides(tmp_path):
    camp = campaign(tmp_path, ", max_repeats: 3, confidence: 95%")
    assert camp.sequential and camp.confidence == pytest.approx(0.95) and camp.rebench_top == 3
    done = [{"trial": "base", "outcome": "ok", "objective": 100.0, "runs": [99.0, 101.0]},
            {"trial": "a", "outcome": "ok", "objective": 130.0, "runs": [129.0, 131.0]},
            {"trial": "b", "outcome": "ok", "objective": 131.0, "runs": [131.0]},
            {"trial": "c", "outcome": "crashed"}]
    best, verdicts = campaignrecord.standings(camp, done, 0.0)
    assert best["trial"] == "b"   # a tie within noise: ahead on the mean
    assert verdicts["a"].startswith("better: +30.0% [") and verdicts["a"].endswith("vs base: the new best")
    assert verdicts["b"].startswith("tie within noise: +0.8% [") and "ahead on the mean" in verdicts["b"]
    # the end re-bench: b's second run falls back; a, steady, wins on its lower bound
    best, verdicts = campaignrecord.standings(camp, done, 0.0, {"a": [130.0], "b": [126.0]})
    assert best["trial"] == "a" and "the best lower bound: chosen" in verdicts["a"]
    assert "finalist" in verdicts["b"]
    entries = [{"phase": "rebench", "trial": "a", "round": 1, "runs": [130.0]},
               {"phase": "rebench", "trial": "a", "round": 2, "runs": [131.0]}, {"phase": "rebench", "outcome": "finished"}]
    assert campaignrecord.rebench_runs(entries) == {"a": [130.0, 131.0]}
    assert campaignrecord.entry_problem({"phase": "done", "runs": [1.0, "x"]}) == "runs/objective_ci/start are not numbers"
    with pytest.raises(Exception, match="objective.confidence: expected a level like 80%"):
        campaign(tmp_path, ", confidence: 30%")


def test_a_flag_value_that_only_ever_crashed_is_predicted_and_a_bystander_is_not():
    mem, graph = ("server_args", "mem-fraction-static"), ("server_args", "disable-cuda-graph")
    history = [({mem: 0.9, graph: False}, True), ({mem: 0.9, graph: False}, True)]
    # both values only ever crashed, together: neither alone explains a crash yet
    assert search.predicted_crash({mem: 0.9, graph: True}, history) is None
    history.append(({mem: 0.9, graph: True}, True))     # mem 0.9 crashes without the other: the culprit
    assert search.predicted_crash({mem: 0.9, graph: True}, history) == \
        "every trial with mem-fraction-static = 0.9 crashed (3 of 3)"
    assert search.predicted_crash({mem: 0.8, graph: False}, history) is None
    history.append(({mem: 0.8, graph: False}, False))
    assert search.predicted_crash({mem: 0.8, graph: False}, history) is None


def test_a_crash_is_told_as_a_violated_constraint_tpe_learns_from():
    import optuna

    from servops import study as studymod

    study = optuna.create_study(direction="maximize", sampler=studymod.make_sampler("tpe", 1, 20))
    ok, crash, fail = study.ask(), study.ask(), study.ask()
    studymod.tell_outcome(study, ok, "ok", 500.0, ["pass: a"])
    studymod.tell_outcome(study, crash, "crashed", None, [], "cuda-oom-graph-capture (cuda-oom): Exception: ...")
    studymod.tell_outcome(study, fail, "failed", None, [], "host gone")
    trials = study.get_trials(deepcopy=False)
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "FAIL"]
    # the crash: the worst value seen, and a violated constraint that ranks it below every feasible point
    assert trials[1].value == 500.0 and trials[1].system_attrs["constraints:violated"] == 1.0
    assert trials[1].user_attrs["reason"].startswith("cuda-oom-graph-capture")
    old = study.ask()
    studymod.tell_outcome(study, old, "crashed", None, [], "x", crash_teaches=False)
    assert study.get_trials(deepcopy=False)[-1].state.name == "FAIL"


def test_start_up_bounds_are_the_campaigns_own_constraints(tmp_path):
    conds = start_conditions(["start_s <= 15min", "p99_ttft_ms@16 <= 300", "capture_s < 60"])
    assert [(c.metric, c.op, c.seconds) for c in conds] == [("start_s", "<=", 900.0), ("capture_s", "<", 60.0)]
    assert conds[0].check({"start_s": 950.0}) == (False, "start_s <= 15min (start_s = 950.0)")
    assert conds[1].check({"start_s": 3.0}) == (True, "capture_s < 60 (capture_s not timed by this start)")
    camp = campaign(tmp_path, ", constraints: ['start_s <= 900', 'failed == 0']")
    assert [c.written for c in camp.start_constraints] == ["start_s <= 900"]
    assert not any("start_s" in str(c) for c in camp.constraints)
    assert startup.text({"start_s": 35.24, "capture_s": 12.1}) == "start to healthy 35.2s (capture 12.1s)"


def test_warm_start_takes_earlier_best_points_of_the_same_engine_version_model_and_objective():
    facts = {"engine": "sglang", "engine_version": "0.5.23", "model_path": "/models/m"}

    def log(objective: str, ran_on: dict, values: dict[str, float]) -> list[dict]:
        out = [{"phase": "campaign", "campaign": "old", "objective": objective, "facts": ran_on}]
        for i, (tid, v) in enumerate(values.items()):
            out += [{"phase": "start", "trial": tid, "spec": {"server_args": {"cuda-graph-max-bs": 8 * (i + 1)},
                                                             "env": "{}"}},
                    {"phase": "done", "trial": tid, "outcome": "ok", "objective": v}]
        return out

    logs = [("gpu1", "old/trials.jsonl", log("output_tps@16", facts, {"a": 100.0, "b": 120.0})),
            ("gpu1", "other/trials.jsonl", log("output_tps@16", dict(facts, engine_version="0.5.9"), {"c": 900.0})),
            ("gpu2", "lat/trials.jsonl", log("ttft_p99@16", facts, {"d": 5.0}))]
    points, skipped = campaignrecord.warm_points(logs, facts, "output_tps@16", "maximize")
    assert [(p["server_args"], p["from"]) for p in points] == [
        ({"cuda-graph-max-bs": 16}, "campaign old on gpu1 (old/trials.jsonl): its best trial b, output_tps@16 = 120.0")]
    assert skipped == []
    assert campaignrecord.warm_points(logs, {}, "output_tps@16", "maximize") == ([], [])  # facts unknown: nothing applies
    # issue 48.9: an objective that is not finite (Infinity, NaN read back from a log) never wins: skipped, said
    hostile = [("gpu1", "old/trials.jsonl", log("output_tps@16", facts, {"a": 100.0, "inf": math.inf, "nan": math.nan,
                                                                         "ninf": -math.inf}))]
    for sense in ("maximize", "minimize"):
        points, skipped = campaignrecord.warm_points(hostile, facts, "output_tps@16", sense)
        assert [p["objective"] for p in points] == [100.0]
        assert skipped == [f"campaign old on gpu1 (old/trials.jsonl): trial {t}'s output_tps@16 is {v}, not a finite "
                           f"number: skipped" for t, v in (("inf", "inf"), ("nan", "nan"), ("ninf", "-inf"))]
    axes = [search.parse_axis("server_args", "cuda-graph-max-bs", [8, 16, 32]),
            search.parse_axis("server_args", "mem-fraction-static", {"low": 0.8, "high": 0.9})]
    spaces = [search.Space("knobs", "baseline", {}, {}, axes)]
    spec = {"server_args": {"cuda-graph-max-bs": 16, "mem-fraction-static": 0.85}}
    params = search.params_of(spaces, spec)
    assert search.point_of(spaces, params)[1] == {("server_args", "cuda-graph-max-bs"): 16,
                                                  ("server_args", "mem-fraction-static"): 0.85}
    assert search.params_of(spaces, {"server_args": {"cuda-graph-max-bs": 12, "mem-fraction-static": 0.85}}) is None
    assert search.params_of(spaces, {"server_args": {"cuda-graph-max-bs": 16, "mem-fraction-static": 0.95}}) is None


def test_start_up_weighs_on_the_objective_as_a_cost_and_a_bad_spec_is_one_line(tmp_path):
    camp = campaign(tmp_path, ", starts_per_day: 48")
    o = camp.objective
    assert o.starts_per_day == 48 and o.written == "output_tps@16 net of 48 starts/day"
    result = {"levels": [{"concurrency": 16, "output_tps": 1000.0}]}
    # 48 starts of 900 s: half the day served (a start not timed costs nothing)
    assert o.value(result, {"start_s": 900.0}) == pytest.approx(500.0)
    assert o.value(result, {"start_s": 1800.0}) == 0.0 and o.value(result) == 1000.0
    assert campaign(tmp_path, "").objective.value(result, {"start_s": 900.0}) == 1000.0
    for spec, want in ((", starts_per_day: 0", "objective.starts_per_day: "),
                       (", starts_per_day: four", "objective.starts_per_day: "),
                       (", starts_per_day: 2000", "objective.starts_per_day: ")):
        with pytest.raises(Exception, match=want):
            campaign(tmp_path, spec)
    path = tmp_path / "c.yml"
    path.write_text("base: baseline\nbench: {levels: [16]}\nobjective: {minimize: p99_ttft_ms@16, starts_per_day: 4}\n")
    with pytest.raises(Exception, match="objective.starts_per_day: weighs start-up against a rate served .*not "
                                        "minimize: p99_ttft_ms@16"):
        load_campaign(str(path))
