"""The README as a test: every shell block after the set-up one runs verbatim, in order, against
the lab, and each command exits as its comment says ("(exit N)", else 0). Only the environment
differs from a newcomer's: HOME is a fresh directory and the lab's ports are free ones."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import yaml

from conftest import REPO, newcomer_home
from servops.lab.sshd import free_port


def readme_commands() -> list[tuple[str, int]]:
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        if "scripts/setup.sh" in block:
            continue  # the set-up block is what got us here
        for line in block.splitlines():
            command, _, comment = line.partition("#")
            if not command.strip():
                continue
            m = re.search(r"\(exit (\d+)\)", comment)
            commands.append((command.strip(), int(m.group(1)) if m else 0))
    return commands


@pytest.mark.lab_home
def test_the_readme_runs_as_written(tmp_path):
    commands = readme_commands()
    assert commands[0] == (". .venv/bin/activate", 0) and any(c.startswith("invoke tune") for c, _ in commands)
    lab = yaml.safe_load((REPO / "inventory" / "lab.yml").read_text())
    for vars_ in lab["all"]["children"]["lab"]["hosts"].values():
        vars_["ssh_port"], vars_["server_port"] = free_port(), free_port()
    inventory = tmp_path / "lab.yml"
    inventory.write_text(yaml.safe_dump(lab, sort_keys=False))
    _home, lab_env = newcomer_home(tmp_path)
    env = dict(os.environ, **lab_env, SERVOPS_INVENTORY=str(inventory), SERVOPS_RESULTS=str(tmp_path / "results"),
               NO_COLOR="1", COLUMNS="200")
    env.pop("VIRTUAL_ENV", None)
    env.pop("SERVOPS_HOSTS", None)  # as a newcomer's shell: every changing verb names its hosts
    script = ["set -u", "cd " + str(REPO)]
    for i, (command, expected) in enumerate(commands):
        # one shell, as a user types them; each command's status checked as its comment says
        script.append(f"{command}; rc=$?; echo \"@@README {i} rc=$rc\"")
    try:
        res = subprocess.run(["bash", "-c", "\n".join(script)], env=env, capture_output=True, text=True, timeout=1500)
    finally:
        subprocess.run(["bash", "-c", f"cd {REPO} && .venv/bin/invoke lab.down"], env=env, capture_output=True)
    got = {int(m[0]): int(m[1]) for m in re.findall(r"@@README (\d+) rc=(\d+)", res.stdout)}
    out = res.stdout + res.stderr
    for i, (command, expected) in enumerate(commands):
        assert got.get(i) == expected, f"`{command}` exited {got.get(i)}, README says {expected}\n{out[-6000:]}"
    # the server's own crash traceback is part of the story; servops' and invoke's never are
    assert not re.search(r'File "[^"]*/(servops|invoke)/[^"]*\.py"', out), out[-4000:]
    # the story's comments, checked against what the commands printed
    assert "rolled back to" in out and "matched: dynamo-get-cuda-version-subprocess (dynamo-trace)" in out
    assert "patched by cuda-version-no-subprocess (expected)" in out
    assert "winner " in out
    report = tmp_path / "results" / "lab1" / "campaigns" / "lab" / "report.html"
    assert report.exists()
