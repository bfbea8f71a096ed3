"""`invoke diagnose`: failures in a server log, mapped to the host's source, matched against
patches/known_issues.yml.

The log is read and parsed where it lives: on the host (one SSH command for the log, every
frame's file, its version and patch marks) or, with --offline, here. Parsing is the standard-
library code of servops/remote/logscan.py and tracebacks.py; this module matches its findings
against the knowledge base and prints them, every line through the host's redactor.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from .errors import ServopsError
from .nextstep import ACTION, CATEGORY_ACTIONS, HostFacts, action_of  # noqa: F401 (CATEGORY_ACTIONS: re-exported)
from .output import console, err_console, json_text
from .patchstore import PATCH_ROOT
from .redact import Redactor
from .releases import deploy_root
from .remote_exec import run_program
from .remote.tracebacks import BOILERPLATE, NO_EXCEPTION_LINE, epitaph
from .schema import load_yaml, read_text
from .transport import HostSession

CATEGORIES = ("dynamo-trace", "cuda-oom", "nccl", "illegal-memory-access", "jit-build", "arch-unsupported",
              "model-load", "port-in-use", "triton-resources", "quantization", "config", "install", "host-limits",
              "engine-death")
_CONDITIONS = {"exception", "root", "final", "message", "frames", "code", "not"}
# Weights for ranking hits: a frame or a source line pins a failure down more than a message.
_WEIGHTS = {"frames": 3, "code": 3, "exception": 2, "root": 2, "final": 2, "message": 1}
_RELEASE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
# Tokens masked in everything diagnose prints, whatever the inventory says is secret.
_TOKENS = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b|\bsk-[A-Za-z0-9_-]{20,}\b|\bgh[pousr]_[A-Za-z0-9]{30,}\b|"
                     r"\bAKIA[0-9A-Z]{16}\b|\bxox[abprs]-[A-Za-z0-9-]{10,}|(?<=[Bb]earer )[A-Za-z0-9._~+/=-]{20,}")
_KEYED = re.compile(r"(?i)((?:api[_-]?key|access[_-]?token|auth[_-]?token|hf[_-]?token|password|secret)['\"]?\s*[=:]\s*['\"]?)"
                    r"(?!None\b|null\b|\*\*\*)[^\s'\",)]{6,}")


class DiagnoseError(ServopsError):
    pass


# -- the knowledge base ----------------------------------------------------------------------

def known_issues(path: Path | None = None, *, bounded: bool = True) -> list[dict]:
    """The knowledge base; `bounded`: refuse a pattern whose cost grows with the square of a line
    (off only to read a historic knowledge base as it was, tests/diagnose_score.py --before)."""
    path = path or PATCH_ROOT / "known_issues.yml"
    data = load_yaml(read_text(path, DiagnoseError), path, DiagnoseError) or []
    if not isinstance(data, list):
        raise DiagnoseError(f"{path}: must be a list of entries (- id: ...)")
    seen = set()
    for k, entry in enumerate(data, 1):
        if not isinstance(entry, dict):
            raise DiagnoseError(f"{path}: entry {k} must be a mapping (id, title, category, explanation, match)")
        eid = entry.get("id", "?")
        for key in ("id", "title", "category", "explanation"):
            if key not in entry:
                raise DiagnoseError(f"{path}: entry {eid} lacks '{key}'")
        if eid in seen:
            raise DiagnoseError(f"{path}: entry {eid} appears twice")
        if not isinstance(entry.get("fallback", False), bool):
            raise DiagnoseError(f"{path}: entry {eid}: 'fallback' must be true or false")
        seen.add(eid)
        if entry["category"] not in CATEGORIES:
            raise DiagnoseError(f"{path}: entry {eid}: category {entry['category']!r} is not one of {', '.join(CATEGORIES)}")
        if "action" in entry and not ACTION.match(str(entry["action"])):
            raise DiagnoseError(f"{path}: entry {eid}: action {entry['action']!r} is not one of: apply patch NAME, "
                                f"change flag --FLAG, restart, free GPU memory, drain host, fix the model path, fix the install, "
                                f"audit the compiled region, disable CUDA graphs")
        alternatives = _alternatives(entry)
        if not alternatives:
            raise DiagnoseError(f"{path}: entry {eid} has no 'match' (or 'any') conditions")
        for alt in alternatives:
            unknown = set(alt) - _CONDITIONS
            if unknown:
                raise DiagnoseError(f"{path}: entry {eid}: unknown condition(s) {', '.join(sorted(unknown))}")
            for key, value in alt.items():
                for rx in value if isinstance(value, list) else [value]:
                    try:
                        re.compile(rx)
                    except re.error as exc:
                        raise DiagnoseError(f"{path}: {eid}.{key}: bad regex {rx!r}: {exc}") from None
                    if bounded and _LEADING_REPEAT.match(rx):
                        raise DiagnoseError(f"{path}: {eid}.{key}: regex {rx!r} starts with an unbounded repeat, which "
                                            f"retries at every position of a long line: bound it ({{1,80}}) or anchor it")
    return data


# A pattern (or an alternative of it) that opens with \w+, \S+, .* or .+ costs the square of a
# line's length on a line of one long word: refused in the knowledge base.
_LEADING_REPEAT = re.compile(r"^(?:\(\?[a-zA-Z]+\))?(?:[^()|\\]*\|)*(?:\\[wWsSdD]|\.|\[[^\]]*\])[+*]")


def _alternatives(entry: dict) -> list[dict]:
    """An entry matches when all conditions of `match`, or of one item of `any`, hold."""
    alts = []
    if entry.get("match"):
        alts.append(entry["match"])
    alts.extend(entry.get("any") or [])
    return alts


# -- evidence and matching -------------------------------------------------------------------

def finding_frames(f: dict) -> list[dict]:
    frames = []
    for exc in f.get("chain") or []:
        frames.extend(exc["frames"])
        frames.extend(exc["user_frames"])
    if f.get("fatal"):
        threads = f["fatal"]["threads"]
        for t in [t for t in threads if t["current"]] or threads:
            frames.extend(t["frames"])
    return frames


@dataclass
class Evidence:
    types: list[str]
    text: str
    frames: list[str]
    codes: list[str]
    root: str
    final: str


# What the knowledge base and the category read of one failure: each line by its first 2,000
# characters, at most 200 lines and 400 frames (every pattern then sees a bounded text, whatever
# the log holds), without the boilerplate every CUDA/HIP error carries.
_EVIDENCE_LINE = 2000
_EVIDENCE_LINES = 200
_EVIDENCE_FRAMES = 400


def evidence(f: dict) -> Evidence:
    """What the knowledge base is matched against: the normalised failure, not only its last traceback."""
    types, text = [], []
    for exc in f.get("chain") or []:
        if exc.get("type"):
            types.append(exc["type"])
            text.append(f"{exc['type']}: {exc.get('message', '')}")
        elif exc.get("frames") and str(exc["frames"][-1].get("code") or "").startswith("raise "):
            # a traceback cut before its exception line: the last frame's own `raise X("...")`
            # says what was raised
            text.append(exc["frames"][-1]["code"])
        if exc.get("context"):
            text.append(exc["context"])
        text.extend(exc.get("details") or [])
        if exc.get("skipped_call"):
            text.append("skipped call: " + exc["skipped_call"])
        if exc.get("user_frames"):
            text.append("from user code:")  # dynamo's own section: it was tracing when this was raised
    if f.get("abort"):
        if f["abort"]["type"]:  # "" when the excerpt starts at what()
            types.append(f["abort"]["type"])
        text.append(f"{f['abort']['type']}: {f['abort']['what']}" if f["abort"]["type"] else f["abort"]["what"])
        if "\n" in f["abort"]["what"]:  # a terminal-wrapped what(): matched joined too
            text.append(f["abort"]["what"].replace("\n", ""))
        if f["abort"].get("raised_from"):
            text.append("raised from " + f["abort"]["raised_from"])
    if f.get("fatal"):
        text.append("Fatal Python error: " + f["fatal"]["message"])
    text.extend(e["text"] for e in f.get("errors") or [])
    lines = [ln[:_EVIDENCE_LINE] for chunk in text for ln in chunk.split("\n") if not BOILERPLATE.search(ln)]
    frames = [f"{fr['path']}:{fr['func']}" for fr in finding_frames(f)]
    cxx = (f.get("abort") or {}).get("cxx_frames") or []
    cxx += (f.get("cxx") or {}).get("cxx_frames") or []
    frames.extend(cxx)
    codes = [fr["code"][:_EVIDENCE_LINE] for fr in finding_frames(f)[:_EVIDENCE_FRAMES] if fr.get("code")]
    return Evidence(types[:_EVIDENCE_LINES], "\n".join(lines[:_EVIDENCE_LINES]),
                    [fr[:_EVIDENCE_LINE] for fr in frames[:_EVIDENCE_FRAMES]], codes,
                    f.get("root_exception", "")[:_EVIDENCE_LINE], f.get("final_exception", "")[:_EVIDENCE_LINE])


def _score(cond: dict, ev: Evidence) -> int | None:
    """The weight of the conditions that hold, or None when one does not."""
    score = 0
    for key, value in cond.items():
        if key == "not":
            if re.search(value, ev.text, re.M):
                return None
            continue
        if key == "exception":
            ok = any(re.search(value, t) for t in ev.types)
        elif key == "root":
            ok = bool(re.search(value, ev.root))
        elif key == "final":
            ok = bool(re.search(value, ev.final))
        elif key == "message":
            ok = bool(re.search(value, ev.text, re.M))
        elif key == "code":
            ok = any(re.search(value, c) for c in ev.codes)
        elif key == "frames":
            rxs = value if isinstance(value, list) else [value]
            ok = all(any(re.search(rx, fr) for fr in ev.frames) for rx in rxs)
            score += _WEIGHTS["frames"] * (len(rxs) - 1)
        else:
            ok = False
        if not ok:
            return None
        score += _WEIGHTS[key]
    return score


def match(finding: dict, issues: list[dict]) -> list[dict]:
    """Entries whose conditions hold for a finding, most specific first. A `fallback` entry (one
    that names what failed, not why: "the engine core died") counts only when nothing else does."""
    ev = evidence(finding)
    hits = []
    for order, entry in enumerate(issues):
        scores = [s for s in (_score(alt, ev) for alt in _alternatives(entry)) if s is not None]
        if scores:
            hits.append((-max(scores), order, entry))
    ranked = [entry for _, _, entry in sorted(hits, key=lambda h: (h[0], h[1]))]
    causes = [e for e in ranked if not e.get("fallback")]
    return causes or ranked


def rank_by_evidence(finding: dict, hits: list[dict]) -> list[dict]:
    """Known issues of different categories that match a finding equally well: the one whose
    category its evidence points to (categorize) goes first."""
    if len({h["category"] for h in hits}) < 2:
        return hits
    ev = evidence(finding)
    best = [max(s for s in (_score(alt, ev) for alt in _alternatives(h)) if s is not None) for h in hits]
    tied = [h for h, b in zip(hits, best) if b == best[0]]
    if len({h["category"] for h in tied}) < 2:
        return hits
    scores = categorize([finding]).scores
    tied.sort(key=lambda h: -scores.get(h["category"], float("-inf")))
    return tied + hits[len(tied):]


def match_log(findings: list[dict], issues: list[dict]) -> tuple[list[list[dict]], list[dict | None]]:
    """match() for each finding of one log, with the fallback rule lifted to the log: a finding
    only a `fallback` entry matches ("the engine core failed to start") reports a failure, and
    where another finding of the same log names a cause - a known issue, or a real error of its
    own before it (the first real error wins over a wrapper's epitaph) - that is the failure it
    reports: it names no known issue of its own. Returns each finding's hits and, for such a
    finding, the fallback entry it was left without (else None)."""
    all_hits = [rank_by_evidence(f, match(f, issues)) for f in findings]
    cause_named = any(hits and not hits[0].get("fallback") for hits in all_hits)

    def left_for_then(k: int) -> bool:
        f, hits = findings[k], all_hits[k]
        if not (hits and hits[0].get("fallback")):
            return False
        if cause_named:
            return True
        # a wrapper's epitaph after an error the log shows itself (in this finding, or an earlier one)
        return holds_an_epitaph(f) and (shows_a_cause(f) or any(
            shows_a_cause(g) and not all_hits[j] for j, g in enumerate(findings) if g["line"] < f["line"]))

    reports = [all_hits[k][0] if left_for_then(k) else None for k in range(len(findings))]
    return [[] if fallback else hits for hits, fallback in zip(all_hits, reports)], reports


def shows_a_cause(f: dict) -> bool:
    """A finding that says what went wrong: an exception line or an error of its own, not only a
    wrapper's epitaph or advice."""
    return f["root_exception"] != NO_EXCEPTION_LINE and not reports_a_death(f) and not (
        f.get("kind") == "errors" and all(e["class"] in ("hint", "dynamo-hint") for e in f.get("errors") or []))


def holds_an_epitaph(f: dict) -> bool:
    """A finding that reports a death somewhere in it: its root, an exception of its chain, an exit line."""
    return reports_a_death(f) or _cause_part(f) is not f or any(
        e["class"] == "exit" or epitaph(e["text"]) for e in f.get("errors") or [])


def reports_a_death(f: dict) -> bool:
    """A finding whose root only says that a process died or failed to start (an engine core, a
    worker, a scheduler's "hit an exception", an actor): the epitaph of a failure, not its cause."""
    return epitaph(f.get("root_exception") or "")


def shown_finding(findings: list[dict], hits: list[list[dict]]) -> dict | None:
    """The finding whose root the user reads as the log's: the first a known issue names, else the
    first real error (with its exception line, not a wrapper's epitaph), else the first with its
    exception line, else the first."""
    return next((f for f, h in zip(findings, hits) if h), None) \
        or next((f for f in findings if f["root_exception"] != NO_EXCEPTION_LINE and not reports_a_death(f)), None) \
        or next((f for f in findings if f["root_exception"] != NO_EXCEPTION_LINE), None) or (findings or [None])[0]


def _cause_part(f: dict) -> dict:
    """The finding without its exceptions that only report a death (a wrapper's epitaph, with its
    frames), where its root is a cause of its own: what its category is read from."""
    if reports_a_death(f):
        return f
    chain = [e for e in f.get("chain") or [] if not (e.get("type") and epitaph(f"{e['type']}: {e.get('message', '')}"))]
    return f if len(chain) == len(f.get("chain") or []) else dict(f, chain=chain)


def finding_features(f: dict) -> tuple[set[str], list[str]]:
    """What the category model reads of a finding: its evidence's words, classes and frames (of its
    cause: a wrapper's epitaph weighs nothing beside it)."""
    from .categorize import features

    ev = evidence(_cause_part(f))
    return features(ev.types, ev.text, ev.frames, [e["class"] for e in f.get("errors") or []], epitaph)


def categorize(findings: list[dict], model: dict | None = None, cue_weight: float | None = None,
               extra: list[str] = ()):
    """The category the evidence of these findings (and of `extra` lines: the line showing the
    server died) points to (categorize.Category): what a log's failure is when no known issue
    names it."""
    from .categorize import classify, line_features, load_model

    model = model if model is not None else load_model()
    feats: set[str] = set()
    causes = [f for f in findings if not reports_a_death(f)]
    findings = causes or findings  # (a wrapper's epitaph weighs nothing beside the error it reports)
    extra = [ln for ln in extra if not (causes and epitaph(ln))]
    lines: list[str] = list(extra)
    for ln in extra:
        feats |= line_features(ln)
    for f in findings:
        fs, ls = finding_features(f)
        feats |= fs
        lines.extend(ln for ln in ls if ln not in lines)
    weight = cue_weight if cue_weight is not None else (model or {}).get("cue_weight", 1.0)
    return classify(feats, lines, model, weight, CATEGORIES)


def call_chain(finding: dict, entry_rx: str | None) -> list[str]:
    """From the entry point (e.g. the capture) to the failing call, through dynamo's traced user code."""
    chain_exc = [e for e in finding.get("chain") or [] if e["frames"] or e["user_frames"]]
    frames = [fr for e in chain_exc for fr in e["frames"]]
    user = [fr for e in chain_exc for fr in e["user_frames"]]
    start = 0
    if entry_rx:
        idx = [i for i, f in enumerate(frames) if re.search(entry_rx, f["func"])]
        start = idx[0] if idx else 0
    steps = [f for f in frames[start:] + user if "torch/_dynamo" not in f["path"]]
    out = [f"{f['func']} ({os.path.basename(f['path'])}:{f['line']})" for f in steps]
    skipped = next((e["skipped_call"] for e in finding.get("chain") or [] if e.get("skipped_call")), None)
    if skipped:
        out.append(f"{skipped}  <- dynamo cannot trace this")
    return out


# -- running it --------------------------------------------------------------------------------

def validate_release(name: str) -> str:
    if name and (not _RELEASE_NAME.match(name) or ".." in name):
        raise DiagnoseError(f"--release {name!r}: give a release name as listed by `invoke releases`, not a path")
    return name


def parse_context(value) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        raise DiagnoseError(f"--context: expected a whole number of lines, got {value!r}") from None
    if not 0 <= n <= 200:
        raise DiagnoseError(f"--context: expected 0 to 200 lines, got {n}")
    return n


MAX_LOCAL_LOG = 16 << 20  # as on the host (remote/diagnose_ctx.py): the end of the log is where it failed


def read_local_log(path: Path) -> tuple[str, bool]:
    """The last MAX_LOCAL_LOG bytes of a local log (from a line start, the line the cut falls in
    read by its head), and whether it was cut."""
    from .remote.logscan import read_tail

    try:
        with open(path, "rb") as fh:
            data, cut = read_tail(fh, os.fstat(fh.fileno()).st_size, MAX_LOCAL_LOG)
    except OSError as exc:
        raise DiagnoseError(f"--log {str(path)!r}: cannot read it: {exc.strerror or exc}") from None
    return data.decode("utf-8", "replace"), cut


def diagnose(hs: HostSession, release: str | None = None, log_text: str | None = None, context: int = 3,
             allow_outside: bool = False, log_name: str | None = None, log_truncated: bool = False) -> dict:
    """The host's findings, frames resolved to its files: one SSH command."""
    args = {"deploy_root": deploy_root(hs.host), "release": validate_release(release or "") or None,
            "context": context, "log_text": log_text, "log_name": log_name, "allow_outside": allow_outside,
            "log_truncated": log_truncated}
    return run_program(hs, "diagnose_ctx", args)


def scan_local(text: str, source: str, truncated: bool = False) -> dict:
    """--offline: the same findings, parsed here; frames are left as the log shows them."""
    from .remote.tracebacks import scan

    return {"source": source, "offline": True, "scan": scan(text), "truncated": truncated}


def diagnose_command(host: str, release: str | None = None) -> str:
    """The command to run after a failed deploy (deploy prints it)."""
    cmd = ["invoke", "diagnose", "-H", host]
    if release:
        cmd += ["--release", release]
    return " ".join(shlex.quote(c) for c in cmd)


def mask_tokens(text: str) -> str:
    text = _TOKENS.sub("***", text)
    return _KEYED.sub(lambda m: m.group(1) + "***", text)


def make_redactor(redactor: Redactor | Callable[[str], str] | None) -> Callable[[str], str]:
    base = redactor or Redactor()
    return lambda text: mask_tokens(base(str(text)))


# -- output ------------------------------------------------------------------------------------

@dataclass
class HostReport:
    host: str
    findings: int = 0
    matched: list[tuple[str, str]] = field(default_factory=list)   # (entry id, category) per matched finding
    ended: dict | None = None      # the line showing the server died (scan's "ended"), if the log has one
    category: object = None        # categorize.Category of the evidence, where no known issue names it
    action: str | None = None      # what to do next: the known issue's, else the category's
    root: str = ""                 # the root exception the user reads (the fleet view groups by it)

    @property
    def failed(self) -> bool:
        """Whether the log shows a failure (explained or not)."""
        return bool(self.findings or self.ended or self.matched)

    @property
    def verdict(self) -> str:
        act = f"; action: {self.action}" if self.action else ""
        if self.matched:
            entry, cat = self.matched[0]
            more = len({m[0] for m in self.matched}) - 1
            return f"matched: {entry} ({cat})" + (f" and {more} more known issue(s)" if more > 0 else "") + act
        head = "no known issue matched"
        if self.category is not None:
            head += " — " + category_text(self.category) + (act if self.category.shown else "")
        if self.ended:
            how = " (the log stops inside a traceback)" if self.ended.get("how") == "mid-traceback" else ""
            return f"{head} — the server ended abnormally: {self.ended['text']}{how}"
        if self.findings:
            return f"{head} — {self.findings} error(s) found"
        return "no errors found"

    @property
    def exit_code(self) -> int:
        """0 only when the log shows no failure; a failure, explained by a known issue or not, is 1
        (`diagnose && deploy` stops after a crash; the verdict says whether a known issue explains it)."""
        return 1 if self.failed else 0


def category_text(cat) -> str:
    """A category from the evidence as a user reads it: shown above the model's threshold, else
    uncategorised with the category it leans to (neither right nor wrong)."""
    if cat.name == "unknown":
        return "uncategorised (nothing in its lines points to a category)"
    if cat.shown:
        return f"category {cat.name} ({cat.confidence:.2f})"
    return f"uncategorised (leans {cat.name}, {cat.confidence:.2f})"


def _ranks_text(f: dict) -> str:
    ranks = f.get("ranks") or []
    if len(ranks) <= 1:
        return f"rank {ranks[0]}" if ranks and ranks[0] != "main" else "1 process"
    return f"{len(ranks)} ranks, first at {ranks[0]}"


def finding_action(hits: list[dict], cat, facts: HostFacts) -> str | None:
    """A finding's next step: its known issue's, else its shown category's (none where uncategorised)."""
    if hits:
        return action_of(hits[0], facts=facts)
    return action_of(None, cat.name, facts) if cat is not None and cat.shown else None


def to_json(host: str, result: dict, f: dict, hits: list[dict], cat=None, facts: HostFacts = HostFacts(),
            then: list[str] = ()) -> dict:
    top = hits[0] if hits else None
    shown = top is None and cat is not None and cat.shown
    return {"host": host, "source": result.get("source"), "release": result.get("release"),
            # "explained": a known issue names it; "unexplained": a failure nothing in the knowledge base explains
            "verdict": "explained" if top else "unexplained",
            "category": top["category"] if top else (cat.name if shown else None),
            "category_from": "known issue" if top else ("evidence" if shown else ("uncategorised" if cat else None)),
            "leans": cat.name if cat is not None and not top and not shown and cat.name != "unknown" else None,
            "confidence": 1.0 if top else (cat.confidence if cat else None),
            "evidence": cat.evidence if cat and not top else [],
            "action": finding_action(hits, cat, facts),
            "entry": top["id"] if top else None,
            "title": top["title"] if top else None, "also": [h["id"] for h in hits[1:]],
            "root_exception": f.get("root_exception"), "final_exception": f.get("final_exception"),
            "frames": len(finding_frames(f)), "ranks": f.get("ranks") or [], "occurrences": f.get("occurrences", 1),
            "kind": f.get("kind"), "first_line": f.get("line"),
            "then": [c["text"] for c in f.get("consequences") or []] + list(then),
            "errors": sorted({e["class"] for e in f.get("errors") or []}),
            "next": (top.get("suggest") or {}) if top else {}, "link": top.get("link") if top else None}


def _redact_json(value, redact):
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, list):
        return [_redact_json(v, redact) for v in value]
    if isinstance(value, dict):
        return {k: _redact_json(v, redact) for k, v in value.items()}
    return value


class _Printer:
    """Every line a user (or a log) supplied goes out as plain rich Text: no markup is parsed."""

    def __init__(self, redact: Callable[[str], str], con=None):
        self.redact = redact
        self.con = con or console

    def line(self, *parts, indent: int = 0):
        from rich.text import Text

        t = Text(" " * indent)
        for part in parts:
            if isinstance(part, tuple):
                t.append(self.redact(part[0]), style=part[1])
            else:
                t.append(self.redact(part))
        self.con.print(t, soft_wrap=True)

    def rule(self, title: str):
        from rich.text import Text

        self.con.rule(Text(self.redact(title)))


def _frame_marks(fr: dict, offline: bool) -> list[tuple[str, str]]:
    marks = []
    if fr.get("patch"):
        marks.append((f"patched: {fr['patch']}" + (", changed since" if fr.get("patch_drift") else ""), "green"))
    elif fr.get("modified"):
        marks.append(("modified since install", "magenta"))
    if fr.get("dist"):
        marks.append((f"{fr['dist']} {fr.get('version') or ''}".strip(), ""))
    if "same_code" in fr:
        if fr["same_code"]:
            marks.append(("same code", "dim"))
        else:
            where = f"{fr['dist']} {fr.get('version') or ''}".strip() if fr.get("dist") else "host"
            moved = f", that line is at {fr['moved_to']}" if fr.get("moved_to") else ""
            marks.append((f"host file differs (host {where}){moved}", "yellow"))
    if not offline:
        if fr.get("outside"):
            marks.append(("outside site-packages: pass --allow-outside to read it", "dim"))
        elif not fr.get("host_path"):
            marks.append(("not on host", "dim"))
    return marks


def _print_frames(p: _Printer, title: str, frames: list[dict], offline: bool):
    from rich.syntax import Syntax

    if not frames:
        return
    p.line((title, "bold"))
    for fr in frames:
        where = fr.get("rel") or fr["path"]
        marks = _frame_marks(fr, offline)
        parts: list = [f"{where}:{fr['line']} in ", (fr["func"], "cyan")]
        if marks:
            parts.append("  (")
            for k, (text, style) in enumerate(marks):
                parts.append((text, style) if style else text)
                if k < len(marks) - 1:
                    parts.append(", ")
            parts.append(")")
        p.line(*parts, indent=2)
        src = fr.get("source")
        if src and src["lines"]:
            at = src.get("at") or fr["line"]
            if p.con.is_terminal:
                code = "\n".join(p.redact(x) for x in src["lines"])
                p.con.print(Syntax(code, "python", line_numbers=True, start_line=src["start"],
                                   highlight_lines={at}, theme="monokai"))
            else:
                for i, line in enumerate(src["lines"], src["start"]):
                    p.line(f"    {'>' if i == at else ' '}{i:>5}  {line}")
        elif offline and fr.get("code"):
            p.line(f"      {fr['code']}")


def print_finding(p: _Printer, host: str, n: int, total: int, f: dict, hits: list[dict], explain: bool,
                  offline: bool, reported: dict | None = None, cat=None, facts: HostFacts = HostFacts(),
                  then: list[str] = ()):
    lines = f"log line {f['line']}" + (f"-{f['last']}" if f.get("last", f["line"]) > f["line"] else "")
    occ = f", {f['occurrences']} times" if f.get("occurrences", 1) > 1 else ""
    p.rule(f"{host}: failure {n}/{total} ({lines}, {_ranks_text(f)}{occ})")
    root, final = f.get("root_exception") or "", f.get("final_exception") or ""
    p.line(("root cause: ", "bold"), (root, "bold red"))
    if final and final != root:
        p.line(("final exception: ", "bold"), (final, "red"))
    chain = [e for e in f.get("chain") or [] if e.get("type")]
    if len(chain) > 1:
        links = f.get("links") or []
        steps = [chain[0]["type"]]
        for k, exc in enumerate(chain[1:]):
            link = links[k] if k < len(links) else ""
            how = {"cause": "caused", "group": "reported by", "earlier": "logged earlier, then"}.get(
                link, "then, while handling it")
            steps.append(f"({how}) {exc['type']}")
        p.line("chain: ", " -> ".join(steps))
    if f.get("cut_above"):
        p.line(("the log starts mid-chain: an earlier exception was cut off", "dim"))
    for c in (f.get("consequences") or [])[:3]:
        p.line("then: ", c["text"], f"  (line {c['line']})")
    for t in then:
        p.line("then: ", t)
    for exc in f.get("chain") or []:
        if exc.get("context") and exc["context"] not in root:
            p.line("context: ", exc["context"])
            break
    details = [d for e in f.get("chain") or [] for d in e.get("details") or []]
    for d in details[:6]:
        p.line(d, indent=2)
    if f.get("errors"):
        p.line(("error lines", "bold"))
        for e in f["errors"][:8]:
            p.line((f"{e['class']}: ", "yellow"), e["text"], f"  (line {e['line']})", indent=2)
    if f.get("abort"):
        a = f["abort"]
        p.line(("C++ abort: ", "bold"), f"terminate called after throwing an instance of '{a['type']}'" if a["type"]
               else "(its terminate line is not in the log)")
        for w in a["what"].split("\n")[:4]:
            p.line("what(): ", w, indent=2)
        if a.get("raised_from"):
            p.line("raised from ", a["raised_from"], indent=2)
        if a.get("cxx_frames"):
            p.line(f"{len(a['cxx_frames'])} C++ frames, top: ", a["cxx_frames"][0], indent=2)
    elif f.get("cxx") and f["cxx"].get("cxx_frames"):
        p.line(f"C++ trace: {len(f['cxx']['cxx_frames'])} frames, top: ", f["cxx"]["cxx_frames"][0])
    if f.get("fatal"):
        threads = f["fatal"]["threads"]
        p.line(("fatal: ", "bold"), f"Fatal Python error: {f['fatal']['message']} ({len(threads)} thread(s) dumped)")
        cur = [t for t in threads if t["current"]] or threads[:1]
        for t in cur:
            _print_frames(p, "current thread" if t["current"] else "first thread dumped", t["frames"], offline)
    for exc in f.get("chain") or []:
        label = f"traceback of {exc['type']}" if exc.get("type") else "traceback (its exception line is not in the log)"
        _print_frames(p, label, exc["frames"], offline)
        _print_frames(p, "traced by dynamo (from user code)", exc["user_frames"], offline)
    differ = [fr for fr in finding_frames(f) if fr.get("same_code") is False]
    if differ:
        dists = sorted({f"{fr['dist']} {fr.get('version') or ''}".strip() for fr in differ if fr.get("dist")})
        p.line((f"warning: {len(differ)} frame(s) show code this host does not have at that line: the log came from "
                f"another version" + (f" (host: {', '.join(dists)})" if dists else ""), "yellow"))
    if hits:
        hit = hits[0]
        p.line(("known issue ", "bold yellow"), (hit["id"], "bold yellow"), f" ({hit['category']}): ", hit["title"],
               ("  action: ", "bold"), action_of(hit, facts=facts))
        p.line(" ".join(str(hit["explanation"]).split()), indent=2)
        for key, value in (hit.get("suggest") or {}).items():
            p.line(f"suggest {key}: ", str(value), indent=2)
        if hit.get("link"):
            p.line("see: ", hit["link"], indent=2)
        if len(hits) > 1:
            p.line("also matches (less specific): ", ", ".join(f"{h['id']} ({h['category']})" for h in hits[1:]), indent=2)
    elif reported:
        p.line((f"reports the failure another finding of this log names ({reported['id']} is named only where "
                f"the log shows no cause)", "dim"))
    else:
        p.line(("no known issue matches this failure", "dim"))
    if not hits and not reported and cat is not None:
        if cat.name == "unknown":
            p.line(("category: ", "bold"), "uncategorised (nothing in its lines points to one)")
        elif cat.shown:
            p.line(("category: ", "bold"), (cat.name, "bold yellow"),
                   f" (confidence {cat.confidence:.2f}; evidence: ", " | ".join(cat.evidence) or "its words", ")",
                   ("  action: ", "bold"), action_of(None, cat.name, facts))
        else:
            # below the threshold held-out logs set (1 wrong in 20 shown): what is known, and that it is not enough
            p.line(("category: ", "bold"), f"uncategorised (leans {cat.name}, {cat.confidence:.2f}: too weak to name; "
                   f"evidence: ", " | ".join(cat.evidence) or "its words", ")")
    if explain:
        p.line(("call chain", "bold"))
        for depth, step in enumerate(call_chain(f, hits[0].get("entry") if hits else None)):
            p.line(f"{'  ' * min(depth, 12)}-> ", step, indent=2)


def report(host: str, result: dict, issues: list[dict], *, explain: bool = False, as_json: bool = False,
           redact: Callable[[str], str] | None = None, con=None) -> HostReport:
    """Print one host's findings (text, or one JSON object per finding) and return its verdict."""
    redact = redact or make_redactor(None)
    p = _Printer(redact, con)
    scan = result["scan"]
    findings = scan["findings"]
    rep = HostReport(host, findings=len(findings) + scan.get("more", 0), ended=scan.get("ended"))
    offline = bool(result.get("offline"))
    all_hits, reports = match_log(findings, issues)
    facts = HostFacts.of(result, [fr["path"] for f in findings for fr in finding_frames(f)])
    for hits in all_hits:
        if hits:
            rep.matched.append((hits[0]["id"], hits[0]["category"]))
    cats = [None if hits or reported else categorize([f]) for f, hits, reported in zip(findings, all_hits, reports)]
    shown = shown_finding(findings, all_hits)
    rep.root = redact(shown["root_exception"] if shown else (rep.ended or {}).get("text", ""))
    # the wrapper a known issue names where the log shows the cause itself: "then" of that cause
    then = [f"{fb['id']} ({fb['category']}): {g['final_exception']}  (line {g['line']})"
            for g, fb in zip(findings, reports) if fb is not None]
    thens = [then if f is shown else [] for f in findings]
    if rep.matched:
        rep.action = action_of(next(h[0] for h in all_hits if h), facts=facts)
    elif findings or rep.ended:
        rep.category = categorize(findings, extra=[rep.ended["text"]] if rep.ended else [])
        rep.action = action_of(None, rep.category.name, facts) if rep.category.shown else None
    if as_json:
        for f, hits, cat, t in zip(findings, all_hits, cats, thens):
            line = json_text(_redact_json(to_json(host, result, f, hits, cat, facts, t), redact), sort_keys=True)
            if con is not None:
                con.out(line, highlight=False)
            else:
                sys.stdout.write(line + "\n")
        sys.stdout.flush()
        return rep
    where = result.get("source") or "log"
    if offline:
        p.line((f"{host}: ", "bold"), f"{where} (offline: frames as the log shows them)")
    elif result.get("release"):
        status = result.get("release_status") or "unknown"
        p.line((f"{host}: ", "bold"), f"release {result['release']} ({status}; {result.get('why', '')}): {where}")
    else:
        p.line((f"{host}: ", "bold"), where)
    if result.get("truncated"):
        p.line(("only the last 16 MiB of the log was read", "dim"))
    if scan.get("newest_first"):
        p.line(("the log lists its newest line first: read oldest first, line numbers count from its last line", "dim"))
    for n, (f, hits, reported, cat, t) in enumerate(zip(findings, all_hits, reports, cats, thens), 1):
        print_finding(p, host, n, len(findings), f, hits, explain, offline, reported, cat, facts, t)
    if scan.get("more"):
        p.line(f"... and {scan['more']} more failure(s) not shown")
    if scan.get("ended") and not rep.matched:
        p.line(("the server ended abnormally: ", "bold"), scan["ended"]["text"], f"  (log line {scan['ended']['line']})")
    sys.stdout.flush()
    return rep


def fleet_groups(reports: Iterable[HostReport]) -> list[dict]:
    """The same failure on several hosts as one row, as Sentry groups events: by the known issue
    named, else by the category and the root's shape (numbers and addresses masked); most hosts
    first. Each: {failure, root, action, hosts}."""
    from .remote.tracebacks import _mask

    groups: dict[tuple, dict] = {}
    for rep in reports:
        if rep.matched:
            key, failure = ("known", rep.matched[0][0]), f"{rep.matched[0][0]} ({rep.matched[0][1]})"
        elif rep.findings or rep.ended:
            name = rep.category.name if rep.category and rep.category.shown else "uncategorised"
            key, failure = (name, _mask(rep.root)), f"no known issue; {'category ' + name if name != 'uncategorised' else name}"
        else:
            key, failure = ("clean",), "no errors found"
        g = groups.setdefault(key, {"failure": failure, "root": rep.root, "action": rep.action or "", "hosts": []})
        g["hosts"].append(rep.host)
    return sorted(groups.values(), key=lambda g: (-len(g["hosts"]), g["failure"]))


def print_fleet(reports: list[HostReport], redact=None, con=None) -> None:
    """Several hosts: one row per distinct failure, with how many hosts show it and which."""
    from .output import print_table, table

    redact = redact or make_redactor(None)
    t = table(f"the same failure on several hosts: {len(reports)} hosts", ["failure", "root", "action", "hosts", "count"])
    for g in fleet_groups(reports):
        t.add_row(redact(g["failure"]), redact(g["root"][:160]), g["action"], ",".join(g["hosts"]), str(len(g["hosts"])))
    print_table(t, con)


def print_verdicts(reports: Iterable[HostReport], as_json: bool = False, redact=None) -> None:
    """The verdict lines, last: one per host."""
    reports = list(reports)
    out = err_console if as_json else console
    p = _Printer(redact or make_redactor(None), out)
    for rep in reports:
        p.line(f"{rep.host}: " if len(reports) > 1 else "", rep.verdict)


def run(*, release: str = "", log: str = "", offline: bool = False, as_json: bool = False, explain: bool = False,
        context: int = 3, allow_outside: bool = False, hosts: str | None = None, inventory: str | None = None) -> int:
    """The diagnose verb. Returns the exit code: 0 the log shows no failure, 1 a failure (a known
    issue explains it or not: the verdict says which), 2 bad input or a host that could not be read."""
    from .cli import HOSTS_ENV, on_hosts, select
    from .output import OK

    ctx = parse_context(context)
    validate_release(release)
    issues = known_issues()
    log_text, log_truncated = None, False
    if log:
        path = Path(log)
        if not path.is_file():
            raise DiagnoseError(f"--log {log!r}: no such local file")
        log_text, log_truncated = read_local_log(path)
    if offline:
        if not log:
            raise DiagnoseError("--offline diagnoses a local file: give it with --log FILE")
        if release:
            raise DiagnoseError("--offline reads --log FILE, not a release on a host")
        redactor = None
        if hosts:
            try:
                _, targets = select(inventory, hosts)
            except ServopsError:
                if hosts != os.environ.get(HOSTS_ENV):  # a typed -H: its mistake is the user's to fix
                    raise
                targets = []  # $SERVOPS_HOSTS names a fleet; a local file needs none of it
            if len(targets) == 1:
                redactor = Redactor.for_host(targets[0])
        redact = make_redactor(redactor)
        rep = report(Path(log).name, scan_local(log_text, log, log_truncated), issues, explain=explain, as_json=as_json, redact=redact)
        print_verdicts([rep], as_json, redact)
        return rep.exit_code

    redactors = {}

    def op(hs):
        redactors[hs.host.name] = hs.redactor
        res = diagnose(hs, release or None, log_text, ctx, allow_outside, Path(log).name if log else None, log_truncated)
        return OK, f"{len(res['scan']['findings'])} failure(s) in {res.get('release') or res.get('source')}", res

    vr = on_hosts(inventory, hosts, op)
    reports = []
    for host, res in vr.each():
        redact = make_redactor(redactors.get(host.name) or Redactor.for_host(host))
        rep = report(host.name, res, issues, explain=explain, as_json=as_json, redact=redact)
        reports.append(rep)
        vr.recap.mark(host.name, OK, rep.verdict)
    if as_json:
        vr.recap.machine_output = True   # stdout carries only the JSON objects
    vr.recap.render()
    if len(reports) > 1 and not as_json:
        print_fleet(reports)
    print_verdicts(reports, as_json)
    if vr.recap.failed:
        return 2
    return max((r.exit_code for r in reports), default=0)
