"""The launch preflight's STATIC path over every sglang release: for each `sglang==X` wheel in the
tests' wheel cache (~/.cache/servops-tests/wheels, servops/lab/venvs.py), the parser rebuilt from
that release's own source (servops/remote/sglang_args.py static_parser, the code the remote
launch_check program runs, on a local directory), and the shipped variants resolved for that
version (their `when:` rules) parsed with it.

    python bench/sglang_release_sweep.py              # the table, from the cached wheels
    python bench/sglang_release_sweep.py --download   # first fetch every release 0.4.0..newest

Only the modules the static read reaches are unpacked from each wheel (a few files, under
~/.cache/servops-tests/sglang-src/<version>/), so the sweep takes seconds once they are there.
Each tree is unpacked under the cache's lock and marked complete last: a tree without its marker
(a killed run's) is unpacked again from scratch, never read. tests/test_sglang_release_sweep.py
asserts its verdicts.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from packaging.version import Version  # noqa: E402

from servops.inventory import parse_inventory  # noqa: E402
from servops.lab import venvs  # noqa: E402
from servops.lab.venvs import CACHE  # noqa: E402
from servops.playbooks import load_variant, resolve  # noqa: E402
from servops.remote import sglang_args as sa  # noqa: E402
from servops.render import render_launch  # noqa: E402

WHEELS = CACHE / "wheels"
SOURCES = CACHE / "sglang-src"
OLDEST = Version("0.4.0")
VARIANTS = ("baseline", "piecewise")
HOST = parse_inventory("all: {hosts: {h1: {venv: /opt/v, server_port: 30000, model_path: /m, tp: 8}}}",
                       "inv.yml").hosts["h1"]


def wheel_versions() -> dict[str, Path]:
    """version -> cached wheel, for every release from 0.4.0 on."""
    out = {}
    for whl in WHEELS.glob("sglang-*.whl"):
        text = whl.name.split("-")[1]
        try:
            v = Version(text)
        except Exception:
            continue
        if v >= OLDEST:
            out[text] = whl
    return dict(sorted(out.items(), key=lambda kv: Version(kv[0])))


def ensure_wheel(version: str) -> Path | None:
    """The cached wheel of sglang==version, downloaded once (servops/lab/venvs.py cached_wheel:
    under the cache's lock, renamed in whole); None where it cannot be had."""
    try:
        return venvs.cached_wheel(f"sglang-{version}-*.whl", f"sglang=={version}",
                                  pip_args=("--only-binary", ":all:"))
    except (subprocess.CalledProcessError, OSError):
        return None


def download(versions: list[str]) -> None:
    for v in versions:
        ensure_wheel(v)


class _Recorder:
    """Which module names a static read asked for (so only those get unpacked)."""

    def __init__(self):
        self.names: set[str] = set()
        self._orig = sa._Source.path_of

    def __enter__(self):
        names, orig = self.names, self._orig

        def path_of(src, module):
            names.add(module)
            return orig(src, module)

        sa._Source.path_of = path_of
        return self

    def __exit__(self, *exc):
        sa._Source.path_of = self._orig


def source_tree(version: str, whl: Path | None = None, root: Path = SOURCES) -> Path:
    """The release's `sglang` package directory holding the modules its static parser reads,
    unpacked from its wheel on first use (repeated until the read asks for nothing new)."""
    dest = root / version
    pkg = dest / "sglang"
    marker = dest / ".complete"
    # the modules a read reaches depend on the reader: unpack again (only what is new) when it changed
    key = hashlib.sha256(Path(sa.__file__).read_bytes()).hexdigest()[:16]
    whl = whl or wheel_versions().get(version)

    def usable() -> bool:  # (without its wheel, a tree unpacked for an earlier reader is what there is)
        return marker.exists() and (marker.read_text().strip() == key or whl is None)

    if usable():
        return pkg
    if whl is None:
        raise FileNotFoundError(f"no sglang {version} wheel under {WHEELS} and no unpacked source")
    with venvs.BuildLock(f"sglang-src-{version}"):  # another test process may be unpacking it
        if not usable():
            _unpack(whl, dest)
            marker.write_text(key + "\n")
    return pkg


def _unpack(whl: Path, dest: Path) -> None:
    """What the static read of the release reaches, unpacked from its wheel into `dest`: onto a
    complete tree of an earlier reader (its marker dropped first, so a kill midway leaves no
    marker), or from scratch where the tree has no marker (a half-unpacked one)."""
    marker = dest / ".complete"
    if marker.exists():
        marker.unlink()
    else:
        shutil.rmtree(dest, ignore_errors=True)
    pkg = dest / "sglang"
    with zipfile.ZipFile(whl) as z:
        members = set(z.namelist())

        def unpack(module: str) -> bool:
            rel = module.replace(".", "/")
            got = False
            parts = rel.split("/")
            wanted = [rel + ".py", rel + "/__init__.py"] + ["/".join(parts[:i]) + "/__init__.py"
                                                            for i in range(1, len(parts))]
            for name in wanted:
                if name in members and not (dest / name).exists():
                    z.extract(name, dest)
                    got = True
            return got

        unpack("sglang.srt.server_args")
        unpack("sglang.version")
        unpack("sglang._version")
        for _ in range(20):
            with _Recorder() as rec:
                try:
                    sa.static_parser(str(pkg))
                except Exception:
                    pass
            if not any([unpack(m) for m in sorted(rec.names) if m.startswith("sglang")]):
                break


def argv_for(variant: str, version: str) -> tuple[list[str], dict]:
    resolved, _rules = resolve(load_variant(variant), version)
    return render_launch(HOST, resolved).argv, resolved


def check_release(version: str, pkg: Path) -> dict:
    """{"actions", "error", "unchecked", "skipped", variant: {"ok", "problems", "warnings", "refuse"}}."""
    out: dict = {"version": version}
    try:
        parser = sa.static_parser(str(pkg))
    except Exception as exc:
        out.update(actions=0, error=sa._one_line(exc))
        return out
    out.update(actions=len(parser._actions), error=None, unchecked=list(parser.servops_unchecked),
               skipped=list(parser.servops_skipped), prog=parser.prog)
    for name in VARIANTS:
        argv, resolved = argv_for(name, version)
        res = sa.validate(parser, argv, version)
        out[name] = {"ok": res["ok"] and not resolved.get("refuse"), "parsed": res["ok"], "argv": argv,
                     "refuse": resolved.get("refuse"),
                     "problems": ["%s: %s" % (p["flag"], p["message"]) + (" (%s)" % ", ".join(p["suggestions"])
                                                                         if p["suggestions"] else "")
                                  for p in res["problems"]],
                     "warnings": ["%s: %s" % (w["flag"], w["message"]) for w in res["warnings"]]}
    return out


def sweep(versions: list[str] | None = None) -> list[dict]:
    found = wheel_versions()
    rows = []
    for v in versions or list(found):
        if v not in found:
            continue
        rows.append(check_release(v, source_tree(v, found[v])))
    return rows


def verdict(cell: dict) -> str:
    if cell["refuse"]:
        return "REFUSED (rule): " + cell["refuse"] + ("" if cell["parsed"] else " | parse: " + "; ".join(cell["problems"]))
    if cell["ok"]:
        return "ok"
    return "FAIL: " + "; ".join(cell["problems"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--download", action="store_true", help="pip download every release 0.4.0..newest first")
    ap.add_argument("--warnings", action="store_true", help="show deprecation/abbreviation warnings too")
    ap.add_argument("versions", nargs="*")
    args = ap.parse_args()
    if args.download:
        out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "sglang"], capture_output=True,
                             text=True).stdout
        line = next(l for l in out.splitlines() if l.startswith("Available versions:"))
        download([v.strip() for v in line.split(":", 1)[1].split(",") if Version(v.strip()) >= OLDEST])
    for row in sweep(args.versions or None):
        if row.get("error"):
            print(f"{row['version']:<14} parser NOT built: {row['error']}")
            continue
        skipped = f" skipped={len(row['skipped'])}" if row["skipped"] else ""
        print(f"{row['version']:<14} actions={row['actions']:<4}{skipped} unchecked={len(row['unchecked'])}")
        for name in VARIANTS:
            print(f"    {name:<10} {verdict(row[name])}")
            if args.warnings and row[name]["warnings"]:
                print(f"    {'':<10} warnings: {'; '.join(row[name]['warnings'])}")
        if row["skipped"]:
            print(f"    skipped: {'; '.join(row['skipped'][:5])}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    main()
