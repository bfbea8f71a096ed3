"""Issue 48 (hardening, round 6), items 4 and 5: the call-site proof (servops/remote/preflight_dynamo.py,
`patch.preflight`, the deploy's proof) over the real sshd lab, on CPU torch.

The lab host's venv sees the cached venv's torch and holds a small library shaped as FlashInfer's
kernel selection (a cached version query running a subprocess) and an engine whose FP8
block-scale linear calls it, as sglang's does (test_call_site_preflight.py has the mechanism);
the proof builds that call site's tensors from the host's model config.json (`args:
block_fp8_linear`, `device: cpu`). The hostile inputs are made here: a module whose import hangs
(and starts a grandchild), a FIFO and a /dev/zero link as config.json, legal configs whose real
shapes would take gigabytes."""

from __future__ import annotations

import difflib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, playbooks_with, run_invoke
from servops.lab import venvs
from servops.remote import jsonl

LIB = '''\
import functools, subprocess

@functools.cache
def get_version():
    return subprocess.check_output(["echo", "13.0"]).decode().strip()

def gemm(x, w):
    if tuple(map(int, get_version().split("."))) < (12, 8):
        raise RuntimeError("too old")
    return x @ w.T
'''
LIB_FIXED = LIB.replace('''@functools.cache
def get_version():
    return subprocess.check_output(["echo", "13.0"]).decode().strip()
''', '''_VERSION = subprocess.check_output(["echo", "13.0"]).decode().strip()

def get_version():
    return _VERSION
''')
ENGINE = '''\
import torch
from fakelib.kernels import gemm

def block_fp8_linear(x, weight, block_size, weight_scale):
    bn, bk = block_size
    n, k = weight.shape
    w = weight.float().view(n // bn, bn, k // bk, bk) * weight_scale[:, None, :, None]
    return gemm(x.float(), w.view(n, k)).to(x.dtype)
'''
ENGINE_FIXED = ENGINE.replace("from fakelib.kernels import gemm\n", '''from fakelib.kernels import gemm as _raw_gemm

@torch.library.custom_op("servopstest6::gemm", mutates_args=(), schema="(Tensor x, Tensor w) -> Tensor")
def gemm(x, w):
    return _raw_gemm(x, w)

@gemm.register_fake
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[0]))
''')
# an engine module whose import never ends, after starting a grandchild in its process group;
# both pids go to the file SERVOPS_TEST_PIDS names
HANG = '''\
import os, subprocess, time
with open(os.environ["SERVOPS_TEST_PIDS"], "a") as fh:
    fh.write("%d %d\\n" % (os.getpid(), subprocess.Popen(["sleep", "600"]).pid))
time.sleep(3600)

def linear(x):
    return x + 1
'''


def diff(rel: str, old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{rel}", f"b/{rel}"))


def store_patch(store: Path, dist: str, name: str, rel: str, old: str, new: str, preflight: dict | None = None):
    (store / dist).mkdir(parents=True, exist_ok=True)
    (store / dist / f"{name}.patch").write_text(diff(rel, old, new))
    meta = {"distribution": dist, "applies_to": f"{dist}>=1.0", "why": "test", "files": [rel]}
    if preflight:
        meta["preflight"] = preflight
    (store / dist / f"{name}.yml").write_text(yaml.safe_dump(meta))


@pytest.fixture(scope="module")
def proof_venv(tmp_path_factory):
    """A bare venv seeing the cached venv's torch through a .pth, with fakelib and fakeengine
    installed (dist-infos, so a deploy's patch plan finds them)."""
    base = venvs.site_packages(venvs.build_venv())
    root = tmp_path_factory.mktemp("proofvenv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = venvs.site_packages(root)
    (site / "base.pth").write_text(f"{base}\n")
    for rel, text in (("fakelib/__init__.py", ""), ("fakelib/kernels.py", LIB), ("fakeengine/__init__.py", ""),
                      ("fakeengine/fp8.py", ENGINE), ("fakeengine/hang.py", HANG),
                      ("fakelib-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: fakelib\nVersion: 1.0\n"),
                      ("fakeengine-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: fakeengine\nVersion: 1.0\n")):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    return root


@pytest.fixture
def proof_lab(lab, proof_venv, tmp_path):
    """(lab, a factory of inventories for lab1 on the proof venv, the env pointing at the test's patch
    store and pid file, the pid file, the model directory)."""
    store = tmp_path / "patches"
    store_patch(store, "fakelib", "version-constant", "fakelib/kernels.py", LIB, LIB_FIXED)
    store_patch(store, "fakeengine", "fp8-opaque", "fakeengine/fp8.py", ENGINE, ENGINE_FIXED,
                {"check": "dynamo_call_site", "module": "fakeengine.fp8", "call": "block_fp8_linear",
                 "args": "block_fp8_linear", "device": "cpu", "with": ["version-constant"]})
    store_patch(store, "fakeengine", "hang-opaque", "fakeengine/hang.py", HANG, HANG.replace("x + 1", "x + 2"),
                {"check": "dynamo_call_site", "module": "fakeengine.hang", "call": "linear",
                 "args": [{"shape": [4, 8]}], "device": "cpu"})
    model = tmp_path / "model"
    model.mkdir()
    pids = tmp_path / "pids"

    def inventory(**host_vars) -> Path:
        return lab.inventory(host_vars={"lab1": dict({"venv": str(proof_venv), "model_path": str(model)}, **host_vars)},
                             group_vars={"env": {"SERVOPS_TEST_PIDS": str(pids)}},
                             filename=f"inv-{len(list(tmp_path.glob('inv-*')))}.yml")

    env = {"SERVOPS_PATCHES": str(store)}
    yield lab, inventory, env, pids, model
    for pid in started(pids):  # a failing test leaves nothing behind
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def started(pids: Path) -> list[int]:
    return [int(p) for p in pids.read_text().split()] if pids.exists() else []


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def all_gone(pids: list[int], within: float = 30.0) -> bool:
    """Whether every pid has ended (waited for, up to `within` seconds: the condition, not a time)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


# ---- 4. deadlines: a hanging import, a FIFO config.json, Ctrl-C ---------------------------------------

def test_4_a_hanging_import_is_ended_at_its_deadline_with_its_process_group(proof_lab):
    lab, inventory, env, pids, _model = proof_lab
    res = run_invoke("patch.preflight", "hang-opaque", inventory=inventory(preflight_timeout=30), env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "preflight unproven" in res.stdout and "did not finish within" in res.stdout, res.stdout
    assert "ended with its process group" in res.stdout
    assert "lab1 : failed - preflight unproven (see above: nothing was shown either way)" in res.stdout + res.stderr
    assert "pristine: unproven: the pristine run did not finish within" in res.stdout
    assert "with the fix set: unproven: the fixed run did not finish within" in res.stdout
    # the import, and the grandchild it started, were ended on the host with their group
    assert started(pids) and all_gone(started(pids), within=5), started(pids)


def test_4_ctrl_c_ends_the_controller_and_everything_the_proof_started_on_the_host(proof_lab):
    lab, inventory, env, pids, _model = proof_lab
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "patch.preflight", "hang-opaque"], cwd=REPO,
                            env=dict(os.environ, SERVOPS_INVENTORY=str(inventory()), PYTHONUNBUFFERED="1",
                                     COLUMNS="200", NO_COLOR="1", **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not started(pids) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)  # until the import hangs on the host
        assert started(pids), proc.communicate(timeout=30)[0]
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal sends it
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out
    assert "interrupted" in out and "Traceback" not in out
    assert all_gone(started(pids)), started(pids)  # the host program ended its child's whole group


@pytest.mark.parametrize("planted", ["fifo", "dev-zero"])
def test_4_5_a_config_json_that_is_no_file_is_named_never_read(proof_lab, planted):
    lab, inventory, env, _pids, model = proof_lab
    config = model / "config.json"
    if planted == "fifo":
        os.mkfifo(config)
        kind = "is a FIFO, not a regular file"
    else:
        config.symlink_to("/dev/zero")
        kind = "is a character device, not a regular file"
    inv = inventory()
    res = run_invoke("patch.preflight", "fp8-opaque", inventory=inv, env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"not run: the model's config.json cannot be read: {config} {kind}" in res.stdout, res.stdout
    assert "NOT proven on this host" in res.stdout
    # a deploy never reads the model through this call-site check (its proof of a compiled variant is the
    # audit of the whole region, servops/audit.py): the unreadable file stops nothing, changes nothing
    books = playbooks_with(lab.tmp, fp8="extends: baseline\npatches: [version-constant, fp8-opaque]\n")
    res = run_invoke("deploy", "--variant", "fp8", "--dry-run", inventory=inv,
                     env=dict(env, SERVOPS_PLAYBOOKS=str(books)))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "would deploy fp8" in res.stdout and "apply fp8-opaque, apply version-constant (check mode)" in res.stdout
    assert not (lab.tmp / "deploy-lab1" / "releases").exists()


# ---- 5. the proof's tensors: the real dims, bounded rows ----------------------------------------------

def test_5_legal_wide_shapes_are_proven_on_bounded_rows(proof_lab):
    """hidden 20,480 and intermediate 81,920 (13 GB as the real weights, fp32 while quantized): the
    real widths, rows cut to whole blocks; the crash and the fix are shown all the same."""
    _lab, inventory, env, _pids, model = proof_lab
    (model / "config.json").write_text('{"hidden_size": 20480, "intermediate_size": 81920, '
                                       '"quantization_config": {"weight_block_size": [128, 128]}}')
    res = run_invoke("patch.preflight", "fp8-opaque", inventory=inventory(), env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "preflight pass: pristine: unsupported: torch._dynamo.exc.Unsupported" in res.stdout
    assert "weight (768 of 163840 rows, 20480) e4m3, scales (6, 160) fp32" in res.stdout
    assert "weight (128 of 20480 rows, 81920) e4m3, scales (1, 640) fp32" in res.stdout
    assert "proven: pristine crashes as the server does" in res.stdout


def test_5_a_layer_too_wide_for_one_block_of_rows_is_skipped_saying_what_it_would_take(proof_lab):
    _lab, inventory, env, _pids, model = proof_lab
    (model / "config.json").write_text('{"hidden_size": 4096, "intermediate_size": 1048576}')
    res = run_invoke("patch.preflight", "fp8-opaque", inventory=inventory(), env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert ("down_proj's weight is 1048576 columns wide: even one block of 128 rows (0.5 GiB as fp32 while "
            "quantized) is over the proof's 16777216-element bound; not run") in res.stdout, res.stdout


# ---- the pure parts, no host ------------------------------------------------------------------------

def shapes_of(tmp_path: Path, config: str | None):
    """preflight_dynamo.block_fp8_shapes on a model dir holding `config` as its config.json."""
    ns: dict = {"__name__": "proof_under_test", "ARGS": {}}
    text = ("import os, sys, json\n" + (REPO / "servops/remote/jsonl.py").read_text()
            + (REPO / "servops/remote/preflight_dynamo.py").read_text().rsplit("\nmain()", 1)[0])
    exec(compile(text, "preflight_dynamo", "exec"), ns)
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    try:
        return ns["block_fp8_shapes"](str(tmp_path))
    except ns["ShapesRefused"] as exc:
        return str(exc)


def test_5_shapes_of_a_70b_class_config_and_refusals_of_bad_values(tmp_path):
    shapes, where = shapes_of(tmp_path, '{"text_config": {"hidden_size": 8192, "intermediate_size": 28672}}')
    assert where == str(tmp_path / "config.json")
    assert [(s["layer"], s["n"], s["rows"], s["k"]) for s in shapes] == [
        ("gate_up_proj", 57344, 2048, 8192), ("down_proj", 8192, 512, 28672)]
    assert all(s["rows"] * s["k"] <= 1 << 24 for s in shapes)
    path = tmp_path / "config.json"
    for config, problem in (
            ('{"hidden_size": "4096"}', "hidden_size '4096' is not a dimension"),
            ('{"hidden_size": true}', "hidden_size True is not a dimension"),
            ('{"hidden_size": 1e30}', "hidden_size 1e+30 is not a dimension"),
            ('{"hidden_size": 4096, "intermediate_size": -1}', "intermediate_size -1 is not a dimension"),
            ('{"hidden_size": 20000, "intermediate_size": 80000}',
             "gate_up_proj (160000, 20000) is not whole 128x128 blocks"),
            ('{"quantization_config": {"weight_block_size": [128]}}', "weight_block_size [128] is not [rows, columns]"),
            ('[1, 2]', "is not a JSON object"),
            ('{"hidden_size": ', "is not JSON")):
        assert problem in shapes_of(tmp_path, config), config
    path.unlink()
    assert shapes_of(tmp_path, None)[1] == "no model config.json: default shapes"
    path.write_bytes(b" " * (jsonl.CONFIG_CAP + 1))
    assert f"{path} is over {jsonl.CONFIG_CAP} bytes: not read" in shapes_of(tmp_path, None)


# ---- procs' children with deadlines (what the proof and nvidia-smi run through), no host ----------------

def test_4_a_child_past_its_deadline_is_ended_with_its_group_and_one_done_is_not_held_back(tmp_path):
    from servops.remote import procs

    record = tmp_path / "grandchild"

    def hangs():
        record.write_text(str(subprocess.Popen(["sleep", "600"]).pid))
        time.sleep(600)

    assert procs.run_child_with_deadline(hangs, 3, "the run") == {
        "result": "timeout", "message": "the run did not finish within 3s: ended with its process group"}
    assert all_gone([int(record.read_text())], within=5)

    def answers_while_a_forked_worker_keeps_the_pipe():
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
        return {"result": "pass"}

    assert procs.run_child_with_deadline(answers_while_a_forked_worker_keeps_the_pipe, 120, "the run") == {
        "result": "pass"}  # its answer, not the deadline's
    assert procs.run_child_with_deadline(lambda: os._exit(3), 60, "the run") == {
        "result": "error", "message": "the run ended without an answer (exit status 3)"}
    with pytest.raises(procs.DeadlineExceeded, match="sh did not finish within 2s: ended with its process group"):
        procs.run_command_with_deadline(["sh", "-c", f"sleep 600 & echo $! > {record}; wait"], 2)
    assert all_gone([int(record.read_text())], within=5)
    assert procs.run_command_with_deadline(["sh", "-c", "cat; echo err >&2"], 10, stdin=b"in") == (0, b"in", b"err\n")
