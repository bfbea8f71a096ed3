"""The second adversarial round, over the real sshd lab: what an attacker-controlled host, log,
campaign, patch or flag still could do, each closed at its shared mechanism."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import LOADED, REPO, healthy, one_line_error, playbooks_with, root_of, run_invoke, wait_for
from servops.lab.sshd import free_port

TOKEN = "hf_attackRoundSecret987654"
# What a hostile server log can carry: clear screen + home, a window title, a clipboard write
# (OSC 52), hidden text, a one-byte CSI (C1), a bare CR that overwrites the line, a bidi override.
ESCAPES = ["\x1b[2J", "\x1b[H", "\x1b]0;owned\x07", "\x1b]52;c;cm0gLXJmIH4K\x07", "\x1b[8m", "\x9b2J",
           "\rOVERWRITE", "\u202e"]
HOSTILE = "hostile " + "".join(ESCAPES) + " end"
pytestmark = pytest.mark.usefixtures("no_marker")


def current_release(lab) -> Path:
    return (root_of(lab) / "current").resolve()


def no_terminal_control(text: str) -> None:
    """Nothing a terminal would act on: no raw ESC/C1/CR/bidi from the host survives; each shows
    as a visible escape instead."""
    for seq in ("\x1b", "\x9b", "\x07", "\u202e"):
        assert seq not in text, repr(text[max(0, text.find(seq) - 40):text.find(seq) + 40])
    assert "\rOVERWRITE" not in text


def run_in_pty(*args: str, inventory: Path, env: dict | None = None, timeout: float = 120) -> str:
    """The CLI on a real terminal (a pty): rich's terminal path, colours on."""
    master, slave = pty.openpty()
    full = dict(os.environ, SERVOPS_INVENTORY=str(inventory), COLUMNS="200", TERM="xterm-256color", **(env or {}))
    full.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "invoke", *args], cwd=REPO, env=full, stdin=slave, stdout=slave,
                            stderr=slave, close_fds=True)
    os.close(slave)
    chunks = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


# ---- terminal escapes in text from the host --------------------------------------------------

def test_remote_text_cannot_drive_the_operators_terminal(alab):
    """A hostile server log, journal entry and release record reach logs, history, status,
    releases and diagnose as visible escapes, piped and on a real terminal."""
    lab, inv, _port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    rel = current_release(lab)
    with open(rel / "server.log", "a") as fh:
        fh.write(HOSTILE + "\n" + "Traceback (most recent call last):\n  File \"/x.py\", line 1, in <module>\n"
                 f"RuntimeError: {HOSTILE}\n")
    with open(root_of(lab) / "journal.jsonl", "a") as fh:
        fh.write(json.dumps({"at": "2026-01-01T00:00:00Z", "action": "stop", "who": HOSTILE,
                             "outcome": HOSTILE, "detail": HOSTILE}) + "\n")
    record = json.loads((rel / "release.json").read_text())
    record["patches"] = [HOSTILE]
    (rel / "release.json").write_text(json.dumps(record))
    for verb in (["logs", "--lines", "20"], ["history"], ["status"], ["releases"], ["diagnose"]):
        res = run_invoke(*verb, inventory=inv)
        assert res.returncode in (0, 1), (verb, res.stdout + res.stderr)
        no_terminal_control(res.stdout + res.stderr)
        assert "hostile" in res.stdout + res.stderr, verb
        if verb[0] != "diagnose":  # diagnose drops ANSI sequences itself
            assert "\\x1b" in res.stdout + res.stderr, verb  # shown, not hidden
    for verb in (["logs", "--lines", "20"], ["history"], ["releases"], ["diagnose"]):
        out = run_in_pty(*verb, inventory=inv)
        assert "hostile" in out, (verb, out)
        for seq in ESCAPES:
            assert seq not in out, (verb, seq)
        if verb[0] != "diagnose":
            assert "\\x1b]52" in out, verb


# ---- secrets in tuning campaigns ---------------------------------------------------------------

def test_a_candidate_only_secret_never_reaches_trials_jsonl_or_the_report(alab, tmp_path):
    """A secret given only by one candidate (env HF_TOKEN, --api-key) is masked in the campaign's
    trials.jsonl, its Markdown and HTML report and everything printed, from the first entry on;
    and no text reaches the Markdown as raw HTML."""
    lab, inv, _port = alab
    camp = tmp_path / "camps" / "sec.yml"
    camp.parent.mkdir()
    camp.write_text(f"description: '<img src=x onerror=alert(1)> tok\\n| cell'\nbase: baseline\ncandidates:\n  - name: tok\n    env: {{HF_TOKEN: {TOKEN}}}\n"
                    f"    server_args: {{api-key: {TOKEN}k}}\n"
                    "bench: {levels: [1], requests: 2, input_len: 4, output_len: 4, warmup: 0}\n"
                    "objective: {maximize: output_tps@1}\nleave: base\n")
    results = tmp_path / "results"
    env = {"SERVOPS_RESULTS": str(results), "SERVOPS_CAMPAIGNS": str(camp.parent)}
    res = run_invoke("tune", "sec", inventory=inv, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    d = results / "lab1" / "campaigns" / "sec"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (d / "report.md").symlink_to(victim)  # planted: the report must not write through it
    rep = run_invoke("tune.report", "sec", inventory=inv, env=env)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert victim.read_text() == "keep me\n" and not (d / "report.md").is_symlink()
    texts = {p.name: p.read_text() for p in d.iterdir() if p.suffix in (".jsonl", ".md", ".html")}
    assert {"trials.jsonl", "report.md", "report.html"} <= set(texts)
    for name, text in dict(texts, stdout=res.stdout + res.stderr + rep.stdout + rep.stderr).items():
        assert TOKEN not in text, name
    assert "***" in texts["report.md"]
    # text from the campaign and the host is never raw HTML in the Markdown or the page
    assert "<img src=x" not in texts["report.md"] and "<img src=x" not in texts["report.html"]
    assert "&lt;img src=x" in texts["report.md"]
    for p in (results / "lab1").rglob("*.jsonl"):
        assert TOKEN not in p.read_text(), p
    hist = run_invoke("history", inventory=inv)
    assert TOKEN not in hist.stdout + hist.stderr


# ---- hostile input files: YAML bombs, non-UTF-8, deep nesting, huge grids ----------------------

BOMB = ("a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
        "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
        "g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\nh: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]\n")


def _indented(text: str) -> str:
    return "".join("  " + line + "\n" for line in text.splitlines())


def test_hostile_yaml_files_are_one_line_and_change_nothing(alab, tmp_path):
    """Inventories, variants, campaigns and patch metadata share one loader: a billion-laughs
    file, a recursive alias, nesting 100k deep or bytes that are not UTF-8 are each a one-line
    error naming the file, fast, with the host untouched."""
    lab, inv, port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    before = sorted(p.name for p in (root_of(lab) / "releases").iterdir()), current_release(lab)

    def untouched():
        assert (sorted(p.name for p in (root_of(lab) / "releases").iterdir()), current_release(lab)) == before
        assert not (root_of(lab) / "deploy.lock").exists()

    bodies = {"bomb": f"extends: baseline\ndescription:\n{_indented(BOMB)}server_args: {{served-model-name: [*h]}}\n",
              "recursive": "extends: baseline\ndescription: &r [*r]\n",
              "deep": "extends: baseline\ndescription: " + "[" * 100_000 + "\n",
              "nonutf": "extends: baseline\n"}
    books = playbooks_with(tmp_path, **bodies)
    (books / "nonutf.yml").write_bytes(b"extends: baseline\ndescription: caf\xe9\n")
    env = {"SERVOPS_PLAYBOOKS": str(books)}
    needles = {"bomb": "aliases expand to more than", "recursive": "refers to itself", "deep": "nested too deeply",
               "nonutf": "not UTF-8 text (byte 34, line 2)"}
    for name, needle in needles.items():
        t0 = time.monotonic()
        res = run_invoke("deploy", "--variant", name, inventory=inv, env=env, timeout=60)
        one_line_error(res, f"{name}.yml", needle)
        assert time.monotonic() - t0 < 30
    untouched()
    # the inventory itself
    text = inv.read_text()
    for name, extra, needle in [("inv-bomb", "\n" + BOMB.replace("h: &h", "zz: &h"), "aliases expand"),
                                ("inv-deep", "\nzz: " + "{a: " * 50_000 + "\n", "nested too deeply")]:
        bad = tmp_path / f"{name}.yml"
        bad.write_text(text + extra)
        one_line_error(run_invoke("deploy", "--variant", "baseline", "--force", inventory=bad, timeout=60), f"{name}.yml", needle)
    bad = tmp_path / "inv-nonutf.yml"
    bad.write_bytes(text.encode() + b"# \xff\n")
    one_line_error(run_invoke("deploy", "--variant", "baseline", "--force", inventory=bad), "inv-nonutf.yml", "not UTF-8")
    # a campaign
    camps = tmp_path / "camps"
    camps.mkdir()
    (camps / "cb.yml").write_text(f"base: baseline\ndescription:\n{_indented(BOMB)}bench: {{levels: [1]}}\n"
                                  "objective: {maximize: output_tps@1}\n")
    one_line_error(run_invoke("tune", str(camps / "cb.yml"), inventory=inv, timeout=60), "cb.yml", "aliases expand")
    # ten million grid points are refused before they are built
    ten = "[1,2,3,4,5,6,7,8,9,10]"
    (camps / "grid.yml").write_text(f"base: baseline\nbench: {{levels: [1]}}\nobjective: {{maximize: output_tps@1}}\n"
                                    f"candidates:\n  - name: g\n    grid: {{server_args: {{max-running-requests: {ten}}}, "
                                    f"env: {{A: {ten}, B: {ten}, C: {ten}, D: {ten}, E: {ten}, F: {ten}}}}}\n")
    t0 = time.monotonic()
    res = run_invoke("tune", str(camps / "grid.yml"), inventory=inv, timeout=60)
    one_line_error(res, "grid.yml: candidates[0].grid", "10,000,000 trials", "at most 10,000")
    assert res.stderr.count("grid.yml") == 1 and time.monotonic() - t0 < 30
    # patch metadata and a patch file that is not UTF-8
    store = tmp_path / "patches" / "flashinfer-python"
    store.mkdir(parents=True)
    (store / "p.patch").write_text((REPO / "patches" / "flashinfer-python" / "cuda-version-no-subprocess.patch").read_text())
    (store / "p.yml").write_text(f"applies_to: flashinfer-python>=0.2\nwhy:\n{_indented(BOMB)}files: [*h]\n")
    penv = {"SERVOPS_PATCHES": str(tmp_path / "patches")}
    one_line_error(run_invoke("patch.apply", "p", inventory=inv, env=penv, timeout=60), "p.yml", "aliases expand")
    (store / "p.yml").write_text("applies_to: flashinfer-python>=0.2\nwhy: t\nfiles: [flashinfer/jit/cpp_ext.py]\n")
    (store / "p.patch").write_bytes(b"--- a/flashinfer/jit/cpp_ext.py\n+++ b/flashinfer/jit/cpp_ext.py\n\xff\n")
    one_line_error(run_invoke("patch.apply", "p", inventory=inv, env=penv), "p.patch", "not UTF-8")
    untouched()


@pytest.mark.parametrize("content,needle", [("[" * 200_000, "nested too deeply"),
                                             ('{"prompt": ' + "[" * 200_000 + "\n", "is not JSON"),
                                             ('["not", "an object"]\n{"prompt": 1}\n' + '{"a": 1}\n', None)],
                         ids=["nested", "nested-line", "not-objects"])  # a 200 kB id overflows PYTEST_CURRENT_TEST
def test_hostile_dataset_files_are_one_line(lab, tmp_path, content, needle):
    ds = tmp_path / "ds.json"
    ds.write_text(content)
    kind = "sharegpt" if content.startswith("[[") else "prompts"
    res = run_invoke("bench", "--dataset", kind, "--dataset-path", str(ds), inventory=lab.inventory())
    if needle:
        one_line_error(res, "--dataset-path", needle)
    else:  # a JSON line that is not an object is a prompt line, never a traceback
        assert "Traceback" not in res.stderr and "no server running" in res.stderr


# ---- credentials and names that reach messages and local paths ---------------------------------

def test_push_credentials_never_show(alab):
    """A Pushgateway URL with basic-auth credentials: the password is masked in every message,
    the refusal of a bad URL included; the failed push rolls the deploy back."""
    lab, inv, _port = alab
    secret = "pushPassw0rdSecret"
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    res = run_invoke("deploy", "--variant", "baseline", "--force", "--push",
                     f"http://ops:{secret}@127.0.0.1:{free_port()}/", inventory=inv)
    # the push reached for 127.0.0.1 (refused), never for a host named "ops:...@127.0.0.1"
    assert res.returncode == 4 and "Pushgateway" in res.stderr and "ops:***@" in res.stderr, res.stdout + res.stderr
    assert "refused" in res.stderr and "rolled back to" in res.stderr, res.stderr
    assert secret not in res.stdout + res.stderr
    res = run_invoke("deploy", "--variant", "baseline", "--force", "--push", f"ftp://ops:{secret}@host/", inventory=inv)
    one_line_error(res, "--push", "ops:***@")
    assert secret not in res.stdout + res.stderr


def test_compare_variant_names_are_names(lab):
    res = run_invoke("compare", "../../../tmp/x", "baseline", inventory=lab.inventory())
    assert res.returncode == 2 and "use letters, digits" in res.stderr and "Traceback" not in res.stderr


def test_a_patch_captured_from_a_host_is_written_only_under_patches(tmp_path):
    """patch.create names its directory after the distribution the host reports: a hostile host's
    '../..' is refused before anything is written."""
    from servops.patchstore import PatchError, write_patch

    diff = ("--- a/m/x.py\n+++ b/m/x.py\n@@ -1 +1 @@\n-a\n+b\n")
    root = tmp_path / "patches"
    for dist, version in [("../../evil", "1.0"), ("ok", "1.0\napplies_to: x"), ("/abs", "1")]:
        with pytest.raises(PatchError) as err:
            write_patch(root, dist, "p", diff, ["m/x.py"], version)
        assert "nothing written" in str(err.value)
    assert not root.exists() and not (tmp_path / "evil").exists()
    assert write_patch(root, "ok-dist", "p", diff, ["m/x.py"], "1.0.post1").is_file()


def test_files_on_the_host_are_private(alab):
    """Everything servops leaves under the deploy root is the operator's alone: the journal, the
    lock, the pid file, the guard's files, every release file."""
    lab, inv, _port = alab
    for _ in range(2):  # two releases, a guard each, a stop, the journal
        assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    assert root_of(lab).stat().st_mode & 0o077 == 0
    # (__pycache__ is the server's own python compiling the release's files, behind the 0700 dirs)
    loose = {str(p): oct(p.stat().st_mode & 0o777) for p in root_of(lab).rglob("*")
             if not p.is_symlink() and p.stat().st_mode & 0o077 and "__pycache__" not in p.parts}
    assert not loose, loose


# ---- crash consistency: the controller killed while it holds the lock ---------------------------

def test_a_controller_killed_holding_the_lock_is_repaired_by_the_next_command(alab, remote_env):
    """SIGKILL of `patch.apply` while it holds the host lock: the next command breaks the stale
    lock (its owner pid is gone), finishes or undoes the patch, and leaves no lock behind; the
    file is either pristine or patched, never half."""
    lab, inv, _port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    lock = root_of(lab) / "deploy.lock"
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "invoke", "patch.apply", "cuda-version-no-subprocess"], cwd=REPO,
                                env=dict(os.environ, SERVOPS_INVENTORY=str(inv)), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.time() + LOADED
        while time.time() < deadline and not lock.exists() and proc.poll() is None:
            time.sleep(0.005)
        proc.kill()
        proc.wait()
        if lock.exists():
            break
        run_invoke("patch.revert", "cuda-version-no-subprocess", inventory=inv)
    assert lock.exists(), "never caught the controller holding the lock"
    res = run_invoke("patch.apply", "cuda-version-no-subprocess", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "breaking the deploy lock" in res.stderr and "is gone" in res.stderr
    assert not lock.exists()
    target = remote_env["site"] / "flashinfer/jit/cpp_ext.py"
    assert target.read_bytes() != remote_env["pristine"]["flashinfer/jit/cpp_ext.py"]
    res = run_invoke("patch.revert", "cuda-version-no-subprocess", inventory=inv)
    assert res.returncode == 0 and target.read_bytes() == remote_env["pristine"]["flashinfer/jit/cpp_ext.py"]
    assert not lock.exists()


# ---- Jinja: the sandbox's resource holes ------------------------------------------------------

@pytest.mark.parametrize("payload,needle", [
    ("{{ 1/0 }}", "ZeroDivisionError"),
    ("{{ 'x' * 300000000 }}", "too large"),
    ("{{ 'x'.ljust(10**9) }}", "too large"),
    ("{{ 'x'|center(999999999) }}", "too large"),
    ("{{ '%999999999s'|format(1) }}", "format width"),
    ("{{ '%*d' % (999999999, 1) }}", "format width"),
    ("{{ '{:999999999}'.format(1) }}", "format width"),
    ("{{ 7**99999999 }}", "too large"),
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "runs too long"),
])
def test_template_code_cannot_exhaust_the_controller(alab, tmp_path, payload, needle):
    """A value or variant holding template code that divides by zero, allocates gigabytes or
    loops 10^10 times is a one-line error within seconds; nothing reaches the host."""
    lab, inv, _port = alab
    books = playbooks_with(tmp_path, evil='extends: baseline\nserver_args: {served-model-name: "%s"}\n' % payload)
    t0 = time.monotonic()
    res = run_invoke("deploy", "--variant", "evil", inventory=inv, env={"SERVOPS_PLAYBOOKS": str(books)}, timeout=60)
    assert time.monotonic() - t0 < 30
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "server_args.served-model-name" in res.stderr and needle in res.stderr, res.stderr
    assert not (root_of(lab) / "releases").exists() or not any((root_of(lab) / "releases").iterdir())
    # ordinary template code still works
    books = playbooks_with(tmp_path, fine='extends: baseline\nserver_args: {served-model-name: '
                                          '"m-{{ 2 * 3 }}-{{ \'%s\'|format(host_name) }}{% for i in range(2) %}{{ i }}{% endfor %}"}\n')
    res = run_invoke("render", "--variant", "fine", inventory=inv, env={"SERVOPS_PLAYBOOKS": str(books)})
    assert res.returncode == 0 and "--served-model-name m-6-lab101" in res.stdout, res.stdout + res.stderr


def test_the_live_health_wait_shows_a_hostile_log_line_safely(alab, tmp_path):
    """On a terminal the health wait shows the server's latest log line: one holding rich markup
    (`[/]`) or escape sequences neither breaks the deploy nor reaches the terminal raw."""
    lab, inv, _port = alab
    books = playbooks_with(tmp_path, loud='extends: baseline\nenv: {SGLANG_DOUBLE_LOAD_TIME: "8"}\n'
                                         'server_args: {model-path: "/m[/]x[bold]"}\n')
    # (a value holding escapes is refused before the host, so the server "logs" them: written
    # into the new release's server.log while the health wait shows its last line)
    stop = threading.Event()

    def hostile_server():
        old = set((root_of(lab) / "releases").glob("*/server.log"))
        while not stop.wait(0.2):  # again and again: the last line whenever the wait looks
            for log in set((root_of(lab) / "releases").glob("*/server.log")) - old:
                with open(log, "a") as fh:
                    fh.write("loading /m[/]x[bold]\x1b]0;owned\x07\x1b[2Jy\n")

    writer = threading.Thread(target=hostile_server, daemon=True)
    writer.start()
    try:
        out = run_in_pty("deploy", "--variant", "loud", inventory=inv, env={"SERVOPS_PLAYBOOKS": str(books)})
    finally:
        stop.set()
        writer.join()
    assert "deployed" in out and "MarkupError" not in out and "Traceback" not in out, out
    assert "\x1b]0;owned" not in out and "\x1b[2Jy" not in out
    assert "[/]x[bold]" in out and "\\x1b]0;owned" in out and "\\x1b[2Jy" in out  # shown as written, escaped
    assert "\x1b[" in out and "\\x1b[38;5" not in out  # rich's own colours reach the terminal, unescaped


def test_a_variant_only_secret_never_shows_in_check_or_bench_results(alab, tmp_path):
    """`check` prints the launch's argv, and bench results keep the server's /server_info (its
    launch_command repeats --api-key): neither shows a variant-only secret, on the terminal, in
    --json or in the results file."""
    lab, inv, _port = alab
    books = playbooks_with(tmp_path, secret=f"extends: baseline\nenv: {{HF_TOKEN: {TOKEN}}}\n"
                                            f"server_args: {{api-key: {TOKEN}x}}\n")
    results = tmp_path / "results"
    env = {"SERVOPS_PLAYBOOKS": str(books), "SERVOPS_RESULTS": str(results)}
    outputs = [run_invoke("check", "--variant", "secret", inventory=inv, env=env),
               run_invoke("check", "--variant", "secret", "--json", inventory=inv, env=env)]
    assert all(r.returncode == 0 for r in outputs) and "--api-key" in outputs[1].stdout
    assert run_invoke("deploy", "--variant", "secret", inventory=inv, env=env).returncode == 0
    outputs += [run_invoke("bench", "--levels", "1", "--requests", "2", inventory=inv, env=env),
                run_invoke("status", inventory=inv, env=env)]
    assert outputs[2].returncode == 0, outputs[2].stdout + outputs[2].stderr
    for r in outputs:
        assert TOKEN not in r.stdout + r.stderr, r.args
    saved = [p for p in results.rglob("*.jsonl")]
    assert saved and all(TOKEN not in p.read_text() for p in saved)
    assert "--api-key ***" in saved[0].read_text()


def test_logs_of_a_huge_server_log_are_read_from_the_end(alab):
    """A server.log of 20 GiB (sparse here; weeks of a server, or a flood) and a 1 MB line: `logs`
    answers in seconds with the last lines, the long one cut, instead of reading it all."""
    lab, inv, _port = alab
    assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    run_invoke("stop", "--grace", "2", inventory=inv)
    log = current_release(lab) / "server.log"
    with open(log, "ab") as fh:
        fh.truncate(20 << 30)
    with open(log, "ab") as fh:
        fh.write(b"\nflood " + b"y" * 1_000_000 + b"\nsecond to last\nlast line\n")
    t0 = time.monotonic()
    res = run_invoke("logs", "--lines", "3", inventory=inv, timeout=120)
    assert res.returncode == 0, res.stderr
    assert time.monotonic() - t0 < 20
    lines = res.stdout.splitlines()
    assert lines[-2:] == ["second to last", "last line"]
    assert lines[0].startswith("flood yyy") and lines[0].endswith("more characters]") and len(lines[0]) < 20_000
    log.unlink()


def test_a_controller_killed_mid_rollback_leaves_a_running_server(alab):
    """SIGKILL of `rollback` once it has asked the host to stop, switch and start: the host
    program finishes that step alone, so a server runs; the next command breaks the stale lock."""
    lab, inv, port = alab
    for _ in range(2):
        assert run_invoke("deploy", "--variant", "baseline", inventory=inv).returncode == 0
    first = sorted((root_of(lab) / "releases").iterdir())[0].name
    journal = root_of(lab) / "journal.jsonl"
    seen = journal.read_text().count('"server.stop"')
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "rollback"], cwd=REPO,
                            env=dict(os.environ, SERVOPS_INVENTORY=str(inv)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and journal.read_text().count('"server.stop"') == seen:
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    wait_for(lambda: current_release(lab).name == first and healthy(port), what="the first release back, healthy",
             step=0.3)
    res = run_invoke("status", inventory=inv)
    assert res.returncode == 0 and first in res.stdout
    res = run_invoke("stop", "--grace", "2", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (root_of(lab) / "deploy.lock").exists()


def test_a_streamed_command_keeps_only_its_tail_in_memory(lab):
    """`logs -f` and bench progress stream for hours: the transport hands each chunk on and keeps
    only a bounded tail, so a chatty (or hostile) server cannot exhaust the controller; a
    character split across chunks still decodes whole."""
    from servops.inventory import load_inventory
    from servops.transport import KEEP_STREAMED, Session

    inv = load_inventory(lab.inventory())
    seen = [0, 0]

    def consume(text: str) -> None:
        seen[0] += len(text)
        seen[1] += text.count("\ufffd")

    with Session(inv) as session:
        hs = session.host(inv.hosts["lab1"])
        res = hs.run("python3 -c \"import sys; [sys.stdout.write('é' * 65535 + 'x') for _ in range(700)]\"; echo; echo done",
                     timeout=120, on_output=consume)
    assert res.ok and res.stdout.endswith("done\n")
    assert seen[0] >= 700 * 65536 and seen[1] == 0  # every byte handed on, no character broken
    assert len(res.stdout.encode()) <= 2 * KEEP_STREAMED + 65536


@pytest.mark.parametrize("gate,needle", [
    ("output_tps@1 >= 1" + " " * 60_000 + "x", "expected METRIC@LEVEL"),   # was seconds of regex backtracking
    ("output_tps@" + "9" * 5000 + " >= 1", "expected METRIC@LEVEL"),          # was a ValueError traceback
    ("output_tps@1 >= 1e999", "not a finite number"),
    ("output_tps@1 >= 1e999*baseline", "not a finite number"),
    ("output_tps@1 >= 1," * 6_000, "at most 100,000"),
])
def test_hostile_gates_are_one_short_line_before_the_host(alab, gate, needle):
    lab, inv, _port = alab
    t0 = time.monotonic()
    res = run_invoke("deploy", "--variant", "baseline", "--gate", gate, inventory=inv)
    one_line_error(res, "--gate", needle)
    assert len(res.stderr) < 400 and time.monotonic() - t0 < 15
    assert not (root_of(lab) / "releases").exists()


# ---- host keys ------------------------------------------------------------------------------------

@pytest.mark.parametrize("accept_new", [False, True])
def test_a_revoked_host_key_is_refused_even_when_listed(lab, accept_new):
    """known_hosts' `@revoked` marker (OpenSSH): the key is refused although another line lists
    it, and trust-on-first-use never records it anew; the refusal is one line."""
    inv = lab.inventory(group_vars={"accept_new_host_keys": accept_new})
    known = Path(lab.known_hosts)
    listed = known.read_text().strip()
    _hosts, keytype, key = listed.split()[:3]
    known.write_text(f"{listed}\n@revoked * {keytype} {key}\n@cert-authority *.example ssh-ed25519 {key}\n")
    res = run_invoke("inspect", "--file", "flashinfer/jit/cpp_ext.py", "--lines", "1", inventory=inv)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert "marked @revoked" in res.stderr and "malformed" not in res.stderr
    assert known.read_text().count(key) == 3  # nothing appended
    known.write_text(listed + "\n")  # the same file without the revocation connects
    assert run_invoke("inspect", "--file", "flashinfer/jit/cpp_ext.py", "--lines", "1", inventory=inv).returncode == 0


# ---- a campaign file cannot ship the operator's files to a host ------------------------------------

def test_a_campaign_dataset_path_cannot_name_the_operators_secrets(lab, tmp_path):
    """A campaign's dataset rows go to the host as prompts: a hostile campaign naming
    ~/.ssh/id_ed25519, /proc/self/environ or a symlink to them is refused before anything runs;
    a dataset beside the campaign still works."""
    inv = lab.inventory()
    camps = tmp_path / "camps"
    camps.mkdir()
    (camps / "data").mkdir()
    (camps / "data" / "prompts.txt").write_text("hello\nworld\n")
    (camps / "data" / "link.txt").symlink_to(lab.client_key)
    (camps / ".hidden").mkdir()
    (camps / ".hidden" / "p.txt").write_text("x\n")
    body = "base: baseline\nbench: {{levels: [1], dataset: prompts, dataset_path: '{}'}}\nobjective: {{maximize: output_tps@1}}\n"
    for i, target in enumerate([str(lab.client_key), "/proc/self/environ", "data/link.txt", "../camps/.hidden/p.txt",
                                "~/.ssh/id_ed25519"]):
        (camps / f"evil{i}.yml").write_text(body.format(target))
        res = run_invoke("tune", str(camps / f"evil{i}.yml"), inventory=inv)
        one_line_error(res, f"evil{i}.yml: bench.dataset_path", "outside the campaign's directory")
    (camps / "fine.yml").write_text(body.format("data/prompts.txt"))
    res = run_invoke("tune", str(camps / "fine.yml"), "--dry-run", inventory=inv)
    assert res.returncode == 0, res.stdout + res.stderr


def test_damaged_local_results_are_skipped_not_a_traceback(lab, tmp_path):
    """compare and tune.report read local JSONL that a crash, an editor or a hostile copy can
    damage: lines that are not objects, bytes that are not UTF-8, deep nesting are skipped."""
    results = tmp_path / "results"
    d = results / "lab1" / "20260101T000000Z-baseline"
    d.mkdir(parents=True)
    (d / "20260101T000000Z.jsonl").write_bytes(b'[1, 2]\n"text"\n\xff\xfe\n' + b"[" * 100_000 + b"\n")
    (d / "20260101T000001Z.json").write_text("[]")
    (d / "20260101T000002Z.jsonl").write_text('{"servops": "not a mapping"}\n')
    env = {"SERVOPS_RESULTS": str(results)}
    res = run_invoke("compare", "baseline", "piecewise", inventory=lab.inventory(), env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "no saved bench for variant" in res.stderr
    camps = tmp_path / "camps"
    camps.mkdir()
    (camps / "c.yml").write_text("base: baseline\nbench: {levels: [1]}\nobjective: {maximize: output_tps@1}\n")
    log = results / "lab1" / "campaigns" / "c" / "trials.jsonl"
    log.parent.mkdir(parents=True)
    log.write_bytes(b'[]\n7\n\xff\n{"phase": "campaign", "outcome": "started"}\n')
    res = run_invoke("tune.report", str(camps / "c.yml"), inventory=lab.inventory(), env=env)
    assert "Traceback" not in res.stderr, res.stderr


def test_a_value_with_control_characters_is_one_line_before_the_host(alab, tmp_path):
    """ESC, CR or NUL in a flag or env value would make the launch script say something other
    than what `render` shows; tabs and newlines (a JSON config) are kept."""
    lab, inv, _port = alab
    books = playbooks_with(tmp_path,
                           esc='extends: baseline\nserver_args: {served-model-name: "a\\x1b[2Jb"}\n',
                           cr='extends: baseline\nenv: {NOTE: "shown\\rhidden"}\n',
                           multi='extends: baseline\nenv: {NOTE: "line one\\n\\tline two"}\n')
    env = {"SERVOPS_PLAYBOOKS": str(books)}
    for name, where in (("esc", "server_args.served-model-name"), ("cr", "env.NOTE")):
        res = run_invoke("deploy", "--variant", name, inventory=inv, env=env)
        one_line_error(res, where, "control character")
        assert not (root_of(lab) / "releases").exists() or not any((root_of(lab) / "releases").iterdir())
    res = run_invoke("render", "--variant", "multi", inventory=inv, env=env)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("pattern", [r"(a+)+$", r"(\w+\s?)*x", r"(?:x*)*y"])
def test_a_crash_signature_that_backtracks_exponentially_is_refused(lab, tmp_path, pattern):
    books = playbooks_with(tmp_path, slow="extends: baseline\ncrash_signatures: ['%s']\n" % pattern.replace("'", "''"))
    res = run_invoke("render", "--variant", "slow", env={"SERVOPS_PLAYBOOKS": str(books)},
                     inventory=lab.inventory())
    one_line_error(res, "crash_signatures", "repeats a repetition")
    # a repeat of a delimited group is no such pattern
    books = playbooks_with(tmp_path, fine="extends: baseline\ncrash_signatures: ['version (\\d+\\.)+\\d+ failed']\n")
    res = run_invoke("render", "--variant", "fine", env={"SERVOPS_PLAYBOOKS": str(books)}, inventory=lab.inventory())
    assert res.returncode == 0, res.stderr


def test_the_health_gate_drops_a_signature_that_overruns_its_budget(tmp_path):
    """A pathological signature the static check cannot see ((a|aa)*c: alternation, not nested
    repeats) must not pin the host's gate: it is dropped after its time budget and reported, and
    the gate still decides (here: no server running, so it crashed)."""
    from servops.remote import with_args

    name = "20260101T000000Z-slow"
    rel = tmp_path / "releases" / name
    rel.mkdir(parents=True)
    (rel / "server.log").write_text("loading\n" + "a" * 64 + "\nCUDA out of memory\n")
    args = {"op": "health", "deploy_root": str(tmp_path), "name": name, "port": free_port(), "health": {},
            "signatures": [r"(a|aa)*c", r"CUDA out of memory"], "timeout": 60}
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-"], input=with_args("deploy_ctl", args), capture_output=True,
                         text=True, timeout=60)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert time.monotonic() - t0 < 20
    assert out["slow_signatures"] == [r"(a|aa)*c"]
    assert out["state"] == "crashed" and "CUDA out of memory" in out["reason"], out


def test_a_huge_local_log_is_diagnosed_from_its_end(tmp_path):
    log = tmp_path / "server.log"
    crash = (REPO / "tests" / "fixtures" / "real" / "sglang-5285-capture-oom.log").read_text()
    with open(log, "w") as fh:
        for i in range(300_000):
            fh.write(f"[2025-01-01 00:00:00] Decode batch. #running-req: {i}, #token: 100, gen throughput (token/s): 1.0\n")
        fh.write(crash)
    assert log.stat().st_size > 16 << 20
    res = run_invoke("diagnose", "--offline", "--log", str(log))
    assert "only the last 16 MiB of the log was read" in res.stdout, res.stdout + res.stderr
    assert "cuda-oom" in res.stdout or "CUDA out of memory" in res.stdout, res.stdout


def test_a_damaged_knowledge_base_is_one_line(tmp_path):
    from servops.diagnose import DiagnoseError, known_issues

    bad = tmp_path / "known_issues.yml"
    for text, needle in (("- just a string\n", "entry 1 must be a mapping"), ("a: b\n", "must be a list"),
                         ("- &a [*a]\n", "refers to itself")):
        bad.write_text(text)
        with pytest.raises(DiagnoseError, match=needle):
            known_issues(bad)
