"""Issue 44: the suite's first run on a fresh machine, and its run after a killed one.

Every cached build is made once, under a lock, by whichever test process comes first (the base
venv had no lock: four workers built it side by side and removed each other's half-built copy);
a build a killed run left half-made is found by its missing ready marker and built again; a venv
copy a killed test left patched is put back before use; what a killed run left running and on
disk is ended and removed by the next run of its slot, and nothing of another slot's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import leftovers
from conftest import REPO, wait_for
from servops.lab import venvs

# build_once in a process of its own, on a cache of the test's own (SERVOPS_TEST_CACHE, as CI sets it)
BUILDER = """
import os, sys, time
from pathlib import Path
from servops.lab import venvs
def build(path):
    with open(os.environ["BUILDS"], "a") as fh:
        fh.write(f"{os.getpid()}\\n")
    path.mkdir()
    (path / "half").write_text("x")
    time.sleep(float(os.environ.get("BUILD_S", "0")))
    (path / "whole").write_text("x")
print(venvs.build_once(venvs.CACHE / "thing", "thing", build))
"""


def builder(cache: Path, builds: Path, build_s: float = 0.0) -> subprocess.Popen:
    env = dict(os.environ, SERVOPS_TEST_CACHE=str(cache), BUILDS=str(builds), BUILD_S=str(build_s),
               PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", BUILDER], env=env, stdout=subprocess.PIPE, text=True)


def test_four_processes_at_once_build_a_cached_thing_once_and_all_get_it_whole(tmp_path):
    builds = tmp_path / "builds"
    procs = [builder(tmp_path / "cache", builds, build_s=1.0) for _ in range(4)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs == [str(tmp_path / "cache" / "thing")] * 4
    assert len(builds.read_text().split()) == 1  # one builder; the other three waited and took its result
    assert (tmp_path / "cache" / "thing" / "whole").exists()


def test_a_build_killed_halfway_is_built_again_never_used(tmp_path):
    builds = tmp_path / "builds"
    killed = builder(tmp_path / "cache", builds, build_s=60)
    wait_for(lambda: (tmp_path / "cache" / "thing" / "half").exists(), what="the build under way")
    killed.send_signal(signal.SIGKILL)  # its lock goes with it (an flock), the half-built thing stays
    killed.wait()
    thing = tmp_path / "cache" / "thing"
    assert not (thing / "whole").exists() and not (thing / ".servops-test-ready").exists()
    again = builder(tmp_path / "cache", builds)
    assert again.communicate(timeout=120)[0].strip() == str(thing) and again.returncode == 0
    assert (thing / "whole").exists() and (thing / ".servops-test-ready").exists()
    assert len(builds.read_text().split()) == 2
    third = builder(tmp_path / "cache", builds)  # built: taken as it is
    assert third.communicate(timeout=120)[0].strip() == str(thing) and len(builds.read_text().split()) == 2


def test_a_copy_a_killed_test_left_patched_is_put_back(venv, remote_env):
    """The worker's copy with a flashinfer file changed as a patch leaves it (by rename) and
    servops' patch state in the venv: repair restores the file from the wheel, byte for byte as
    RECORD has it, and drops the state; the base venv it is hard-linked to is untouched."""
    rel = "flashinfer/jit/cpp_ext.py"
    target = remote_env["site"] / rel
    base = venvs.site_packages(venvs.build_venv()) / rel
    before = base.read_bytes()
    tmp = target.with_name(".patched")
    tmp.write_bytes(target.read_bytes() + b"\n# patched, then the run was killed\n")
    tmp.replace(target)
    (Path(venv) / ".servops").mkdir()
    (Path(venv) / ".servops" / "state.json").write_text(json.dumps({"applied": ["cuda-version-no-subprocess"]}))
    assert rel in venvs.drifted(remote_env["site"], next(remote_env["site"].glob("flashinfer_python-*.dist-info")))
    assert venvs.repair(Path(venv)) == [rel]
    assert target.read_bytes() == remote_env["pristine"][rel] and not (Path(venv) / ".servops").exists()
    assert base.read_bytes() == before
    assert venvs.repair(Path(venv)) == []  # as built: nothing to do


def test_what_a_killed_run_left_is_ended_and_removed_and_nothing_else(tmp_path):
    run_dir = tmp_path / "slot9"
    (run_dir / "agents-x").mkdir(parents=True)
    (run_dir / "pytest").mkdir()
    mine = run_dir / "results-mine"
    mine.mkdir()
    home_left = tmp_path / ".servops-test-slot9-render-123-deploy"
    (home_left / "releases" / "r1").mkdir(parents=True)
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    # the killed run's: one by its environment (an agent), one by its working directory (a server)
    by_env = subprocess.Popen(sleeper, env=dict(os.environ, SERVOPS_AGENT_DIR=str(run_dir / "agents-x")),
                              start_new_session=True)
    by_cwd = subprocess.Popen(sleeper, cwd=home_left / "releases" / "r1", start_new_session=True)
    # another slot's, beside it (its directory's name starts like this one's)
    other = subprocess.Popen(sleeper, env=dict(os.environ, SERVOPS_AGENT_DIR=str(tmp_path / "slot90" / "agents-y")),
                             start_new_session=True)
    try:
        wait_for(lambda: {by_env.pid, by_cwd.pid, other.pid} <= set(leftovers.processes_naming([str(tmp_path)])),
                 what="the three sleepers started")
        said = leftovers.clean(run_dir, keep={run_dir / "pytest", mine}, home_dirs=[home_left])
        assert by_env.wait(30) == -signal.SIGKILL and by_cwd.wait(30) == -signal.SIGKILL
        assert other.poll() is None
        assert "processes ended: python" in said and "x2" in said
        assert sorted(p.name for p in run_dir.iterdir()) == ["pytest", "results-mine"] and not home_left.exists()
        assert leftovers.clean(run_dir, keep={run_dir / "pytest", mine}, home_dirs=[]) is None  # nothing more
    finally:
        for p in (by_env, by_cwd, other):
            p.kill()
            p.wait()


def test_a_slot_is_one_runs_at_a_time(tmp_path):
    run_dir = tmp_path / "slot9"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
sys.path[:0] = [{str(REPO / 'tests')!r}, {str(REPO)!r}]
import leftovers
lock = leftovers.claim_slot(__import__('pathlib').Path({str(run_dir)!r}), 9)
print('held', flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(leftovers.SlotTaken, match=rf"test slot 9 is in use by a running suite \(pid {holder.pid} "):
            leftovers.claim_slot(run_dir, 9)
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    assert leftovers.claim_slot(run_dir, 9)  # its holder died: the kernel let go of the lock


def test_a_torn_vllm_compile_index_is_dropped_and_a_whole_one_kept(tmp_path):
    """vLLM writes its compile cache's index in place: one a killed server left half-written would
    fail the next start with a SyntaxError; it is dropped (that graph compiles again)."""
    ranks = tmp_path / "cache" / "vllm-compile" / "vllm-cpu-x" / "vllm" / "torch_compile_cache" / "abc"
    whole, torn = ranks / "rank_0_0" / "backbone", ranks / "rank_0_1" / "backbone"
    for d in (whole, torn):
        d.mkdir(parents=True)
        (d / "computation_graph.py").write_text("# the graph\n")
    (whole / "vllm_compile_cache.py").write_text("{((1, 8), 0, 'inductor'): ('key', 'path')}")
    (torn / "vllm_compile_cache.py").write_text("{((1, 8), 0, 'induc")
    res = subprocess.run([sys.executable, "-c", "from pathlib import Path\nfrom servops.lab import vllmlab\n"
                          "print(vllmlab.compile_cache(Path('/v/vllm-cpu-x')))"],
                         env=dict(os.environ, SERVOPS_TEST_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, check=True)
    assert res.stdout.strip() == str(tmp_path / "cache" / "vllm-compile" / "vllm-cpu-x")
    assert (whole / "vllm_compile_cache.py").exists() and not torn.exists()
