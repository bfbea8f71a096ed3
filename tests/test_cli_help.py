"""`invoke --list` and `invoke --help TASK` explain every task and every flag."""

import json
import re

from conftest import run_invoke


def task_names():
    res = run_invoke("--list", "--list-format", "json")
    data = json.loads(res.stdout)
    names = [t["name"] for t in data["tasks"]]
    for coll in data["collections"]:
        names += [f"{coll['name']}.{t['name']}" for t in coll["tasks"]]
    return names, data


def test_every_task_is_listed_with_a_description():
    names, data = task_names()
    expected = {"inspect", "deploy", "rollback", "render", "status", "logs", "stop", "releases", "metrics",
                "bench", "compare", "diagnose", "patch.status", "patch.apply", "patch.revert", "patch.create",
                "patch.preflight", "lab.up", "lab.down"}
    assert expected <= set(names)
    for t in data["tasks"] + [t for c in data["collections"] for t in c["tasks"]]:
        assert t["help"], t["name"]


def test_every_flag_of_every_task_has_help():
    names, _ = task_names()
    for name in names:
        res = run_invoke("--help", name)
        assert res.returncode == 0, name
        options = res.stdout.split("Options:", 1)[1] if "Options:" in res.stdout else ""
        for line in options.splitlines():
            m = re.match(r"^  (-\S.*?)\s{2,}(\S.*)?$", line)
            if line.startswith("  -"):
                assert m and m.group(2), f"{name}: flag without help: {line!r}"
