"""How diagnose does on the real logs in tests/fixtures/real, counted as the README reports it.

Of the failure logs: found (diagnose reports a failure or an abnormal end, never "no errors
found"), right category (the first known issue named is in the category of the cause the thread
established; logs whose cause has no category are left out), right root (the root exception is
the line the thread shows: the manifest's `root`), wrong matches (a known issue of another
category named). Of the healthy logs: false alarms (anything reported).

    python tests/diagnose_score.py [--batch blind-22] [--code CHECKOUT]

--batch counts one batch of the manifests only; --code measures another checkout's servops on
these logs (the README's blind figures: the commit the batch was first run on)."""

from __future__ import annotations

import argparse
import re
import sys
from io import StringIO
from pathlib import Path

import yaml

REAL = Path(__file__).resolve().parent / "fixtures" / "real"


def manifests(batch: str | None = None) -> tuple[list[dict], list[dict]]:
    failures = yaml.safe_load((REAL / "manifest.yml").read_text())
    healthy = yaml.safe_load((REAL / "healthy" / "manifest.yml").read_text())
    if batch:
        failures = [e for e in failures if e.get("batch") == batch]
        healthy = [e for e in healthy if e.get("batch") == batch]
    return failures, healthy


def shown_finding(findings: list[dict], hits: list[list[dict]]) -> dict | None:
    """The finding whose root the user reads as the log's: the first a known issue names, else the
    first with its exception line, else the first."""
    from servops.remote.tracebacks import NO_EXCEPTION_LINE

    return next((f for f, h in zip(findings, hits) if h), None) \
        or next((f for f in findings if f["root_exception"] != NO_EXCEPTION_LINE), None) or (findings or [None])[0]


def score(failures: list[dict], healthy: list[dict]) -> dict:
    from rich.console import Console

    from servops.diagnose import known_issues, match_log, report
    from servops.remote.tracebacks import scan

    issues = known_issues()
    category = {e["id"]: e["category"] for e in issues}
    out = {"failures": len(failures), "found": 0, "with_category": 0, "right_category": 0, "with_root": 0,
           "right_root": 0, "wrong_match": 0, "healthy": len(healthy), "false_alarms": 0, "missed": []}
    for case in failures:
        result = scan((REAL / case["file"]).read_text())
        verdict = report(case["file"], {"scan": result, "source": case["file"], "offline": True}, issues,
                         con=Console(file=StringIO())).verdict
        hits = match_log(result["findings"], issues)[0]
        want = category[case["expect"]] if case["expect"] else case.get("category")
        named = {h[0]["category"] for h in hits if h}
        found = verdict != "no errors found"
        wrong = bool(named - {want})
        out["found"] += found
        out["wrong_match"] += wrong
        right = not wrong
        if want:
            first = next((h[0] for h in hits if h), None)
            out["with_category"] += 1
            right = first is not None and first["category"] == want
            out["right_category"] += right
        rooted = True
        if case.get("root"):
            shown = shown_finding(result["findings"], hits)
            rooted = bool(shown and re.search(case["root"], shown["root_exception"]))
            out["with_root"] += 1
            out["right_root"] += rooted
        if not (found and right and rooted):
            out["missed"].append(case["file"])
    for case in healthy:
        result = scan((REAL / "healthy" / case["file"]).read_text())
        out["false_alarms"] += bool(result["findings"] or result.get("ended"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", help="count only the logs of this batch (e.g. blind-22)")
    ap.add_argument("--code", help="a checkout whose servops to measure (default: this one)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(args.code).resolve() if args.code else REAL.parents[2]))
    s = score(*manifests(args.batch))
    print(f"found {s['found']}/{s['failures']}, right category {s['right_category']}/{s['with_category']}, "
          f"right root {s['right_root']}/{s['with_root']}, wrong matches {s['wrong_match']}, "
          f"false alarms {s['false_alarms']}/{s['healthy']} healthy")
    for name in s["missed"]:
        print("  missed:", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
