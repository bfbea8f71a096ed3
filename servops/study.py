"""A campaign's Optuna study (search: random / tpe), in Optuna's RDB storage.

By default an SQLite file beside the campaign's trials.jsonl (`study.db`); `--storage URL`
(postgresql://..., mysql://...) shares one study between several controllers. The study is the
campaign's search state: --resume asks it for the next point, and a trial a controller was
running when it died is failed and its point enqueued again under the same trial id (reclaimed):
never lost, never counted twice. A trial this host was running is reclaimed at once on --resume
(a host runs one trial at a time); another controller's, once its heartbeat is older than
GRACE_S (Optuna's stale-trial check).
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from .errors import ServopsError
from .redact import MASK, remember

HEARTBEAT_S = 20
GRACE_S = 120
URL = re.compile(r"(sqlite|postgresql|postgresql\+psycopg2|mysql|mysql\+pymysql)://\S*")


class StudyError(ServopsError):
    pass


# A URL's query keys that carry a credential (libpq's password, sslpassword; MySQL's passwd; a
# token): their values are masked wherever the URL is shown.
_SECRET_QUERY = re.compile(r"([?&;][^=&;#]*(?:pass|pwd|secret|token)[^=&;#]*=)[^&;#]*", re.IGNORECASE)
# Variables the database clients read a password from when the URL has none.
PASSWORD_ENV = ("PGPASSWORD", "MYSQL_PWD")


def check_url(url: str) -> str:
    """--storage URL: one of the database kinds Optuna's RDB storage takes (a bad one: one line)."""
    if not URL.fullmatch(url or ""):
        raise StudyError(f"--storage {_shown(url)!r}: expected a database URL like postgresql://user@host/db or "
                         "sqlite:///path/study.db")
    userinfo = url[url.index("://") + 3:max(_userinfo_end(url), 0)]
    if "@" in userinfo.partition(":")[2]:
        # SQLAlchemy ends the password at its first @ and would send the rest to a host named by its tail
        raise StudyError(f"--storage {_shown(url)!r}: the password holds a raw '@': write it as %40")
    return url


def _userinfo_end(url: str) -> int:
    """Where a URL's userinfo ends: its LAST @ (a raw @ in a password must not show the tail)."""
    start = url.find("://")
    return url.rfind("@") if start >= 0 and url.rfind("@") > start else -1


def _shown(url: str) -> str:
    """The URL with every credential masked: the userinfo's password (up to the last @) and the
    query's password-like values."""
    url = url or ""
    end = _userinfo_end(url)
    if end >= 0:
        start = url.index("://") + 3
        user, sep, _password = url[start:end].partition(":")
        url = url[:start] + user + (":***" if sep else "") + url[end:]
    return _SECRET_QUERY.sub(r"\1***", url)


def url_secrets(url: str) -> set[str]:
    """The credentials a URL carries (as written and percent-decoded), and the password variables
    its client would read: what every printed line and written file masks."""
    from urllib.parse import unquote

    found = set()
    end = _userinfo_end(url or "")
    if end >= 0:
        _user, sep, password = url[url.index("://") + 3:end].partition(":")
        if sep and password:
            found |= {password, unquote(password)}
    for m in _SECRET_QUERY.finditer(url or ""):
        value = url[m.end(1):m.end()]
        if value:
            found |= {value, unquote(value)}
    found |= {os.environ[k] for k in PASSWORD_ENV if os.environ.get(k)}
    return found


def mask(url: str, text: str) -> str:
    """`text` (a library's error, a status line) with the URL shown masked and its secrets gone."""
    text = text.replace(url, _shown(url)) if url else text
    for secret in sorted((s for s in url_secrets(url) if len(s) >= 4), key=len, reverse=True):  # as Redactor
        text = text.replace(secret, MASK)
    return text


def refuse_symlink(url: str) -> None:
    """An SQLite study file that is a symlink is refused, as trials.jsonl's is: SQLite would
    create or write the file it points to, wherever that is."""
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///"):].split("?", 1)[0]
        if path and os.path.islink(path):
            raise StudyError(f"{path} is a symlink (to {os.readlink(path)}); servops does not write through it: "
                             f"remove it")


def default_url(directory: Path) -> str:
    # absolute, not resolved: a symlink at study.db must be seen (and refused), not followed
    return f"sqlite:///{directory.absolute() / 'study.db'}"


def quiet() -> None:
    """Optuna's experimental-feature and ask-and-tell heartbeat notes are not the operator's concern."""
    import warnings

    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


def set_constraints(trial, values: list[float]) -> None:
    """The campaign's constraints as the trial's one Optuna constraint: how many are violated
    (<= 0: feasible); one key for every trial, pruned ones included."""
    trial.set_constraint("violated", float(sum(1 for v in values if v > 0)))


def reclaim(study, trial) -> None:
    """A dead controller's trial (failed): its point is asked again, under the same trial id."""
    if trial.user_attrs.get("reclaimed_as") or not trial.params:
        return
    _ask_again(study, trial)


def _ask_again(study, trial) -> None:
    """trial's point, enqueued under its trial id, host and label."""
    attrs = {k: v for k, v in trial.user_attrs.items() if k in ("tid", "host", "label")}
    study.enqueue_trial(trial.params, user_attrs=dict(attrs, reclaims=trial.number))


def make_sampler(strategy: str, seed: int | None, n_trials_hint: int | None = None):
    """TPE (multivariate, its random start-up a quarter of the budget, 3 to 10 trials) or random.
    The campaign's constraints reach TPE through Trial.set_constraint (tune's _tell), Optuna 5's
    replacement for constraints_func."""
    import optuna

    quiet()
    if strategy == "tpe":
        startup = max(3, min(10, (n_trials_hint or 30) // 4))
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True, group=True)
    return optuna.samplers.RandomSampler(seed=seed)


def open_study(name: str, url: str, strategy: str, direction: str, seed: int | None, n_trials_hint: int | None):
    """(study, storage); a storage that cannot be opened is one StudyError line."""
    import optuna

    optuna.logging.set_verbosity(logging.WARNING)
    quiet()
    refuse_symlink(url)
    remember(url_secrets(url))  # whatever servops prints from here on masks them
    engine_url = url
    if url.startswith("postgresql://"):  # SQLAlchemy 2.1 defaults to psycopg 3; the dependency is psycopg2
        engine_url = "postgresql+psycopg2://" + url[len("postgresql://"):]
    for attempt in range(4):
        try:
            storage = optuna.storages.RDBStorage(engine_url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                                                 heartbeat_stale_trial_callback=reclaim)
            break
        except ImportError as exc:
            raise StudyError(f"storage {_shown(url)}: {mask(url, str(exc))}") from None
        except Exception as exc:  # a refused connection, a bad path -- or two controllers creating the tables at once
            if attempt == 3:
                raise StudyError(f"storage {_shown(url)}: {mask(url, str(exc).splitlines()[0])[:200]}") from None
            time.sleep(1 + attempt)
    sampler = make_sampler(strategy, seed, n_trials_hint)
    try:
        study = optuna.create_study(study_name=name, storage=storage, sampler=sampler, direction=direction,
                                    load_if_exists=True)
    except Exception as exc:
        raise StudyError(f"study {name} in {_shown(url)}: {mask(url, str(exc).splitlines()[0])[:200]}") from None
    if study.direction.name.lower() != direction:
        raise StudyError(f"study {name} in {_shown(url)} is to {study.direction.name.lower()}, the campaign's "
                         f"objective to {direction}: give another --storage, or --restart")
    return study, storage


def ask_owned(study, owner: dict):
    """study.ask() for a trial that is its owner's (`host`) from the write that creates it.

    A plain ask() creates the trial RUNNING and nobody's, then samples its point (TPE: tens to
    hundreds of ms); a controller killed in that window left a trial no --resume could tell was
    its own, RUNNING for ever. So the owner is enqueued as a trial of no fixed params, which
    ask() then pops (and samples as usual). A waiting trial already queued (a reclaimed point)
    is popped first instead: it carries its own host from its enqueue."""
    from optuna.trial import TrialState

    if not study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        study.enqueue_trial({}, user_attrs=owner)
    ot = study.ask()
    for key, value in owner.items():
        if ot.user_attrs.get(key) != value:
            ot.set_user_attr(key, value)
    return ot


def reclaim_own(study, storage, host: str, ownerless_after_s: float = GRACE_S) -> list[int]:
    """--resume: this host's trials still RUNNING were cut off (a host runs one at a time): failed
    and their points enqueued again (one cut off before its point was drawn: failed, uncounted,
    nothing to ask again). A RUNNING trial of no host older than ownerless_after_s (an
    ask() cut off before ask_owned, or by another controller's race for a queued trial) never
    ran anywhere: failed, not counted, nothing to ask again. Then Optuna's stale check for the
    other controllers'."""
    import datetime

    import optuna
    from optuna.trial import TrialState

    numbers = []
    now = datetime.datetime.now()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.user_attrs.get("host")
        if owner == host:
            why = "enqueued" if t.params else "never ran"  # (never ran: cut off before its point was drawn)
        elif not owner and t.datetime_start is not None \
                and (now - t.datetime_start).total_seconds() >= ownerless_after_s:
            why = "never owned"
        else:
            continue
        storage.set_trial_user_attr(t._trial_id, "reclaimed_as", why)
        storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        if why == "enqueued":
            _ask_again(study, t)
            numbers.append(t.number)
    optuna.storages.fail_stale_trials(study)
    return numbers


def counted(study) -> int:
    """Trials the budget counts: every one asked, less those reclaimed (their retry counts), those
    waiting in the queue, duplicates and points not deployed because they would crash."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    reclaimed = {t.user_attrs.get("reclaims") for t in trials if t.user_attrs.get("reclaims") is not None}
    return sum(1 for t in trials if t.state != TrialState.WAITING and t.number not in reclaimed
               and not t.user_attrs.get("reclaimed_as") and not t.user_attrs.get("same_as")
               and not t.user_attrs.get("predicted"))


def worst_value(study, direction: str) -> float:
    """The worst objective among the study's finished trials (0.0 before any)."""
    from optuna.trial import TrialState

    values = [t.value for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    if not values:
        return 0.0
    return min(values) if direction == "maximize" else max(values)


def tell_outcome(study, ot, outcome: str | None, objective: float | None = None, constraint_lines: list[str] = (),
                 reason: str = "", crash_teaches: bool = True) -> None:
    """A trial's outcome, told to the study. A value with its constraints (a line per condition,
    "pass..." or "FAIL..."); a pruned trial PRUNED, its constraints violated; a crash (what
    auto_patch could not mend) a violated constraint at the worst value seen, with its diagnosis
    as the reason: TPE then ranks its neighbourhood below every feasible point and stops
    proposing it (a FAIL teaches TPE nothing); anything else (a host that failed, a refusal)
    FAIL. crash_teaches=False: a crash is a FAIL (before issue 40; bench/tune_crashes.py)."""
    from optuna.trial import TrialState

    ot.set_user_attr("outcome", outcome or "failed")
    if outcome in ("ok", "infeasible") and objective is not None:
        values = [0.0 if line.startswith("pass") else 1.0 for line in constraint_lines] or [
            0.0 if outcome == "ok" else 1.0]
        ot.set_user_attr("constraints", values)
        set_constraints(ot, values)
        study.tell(ot, float(objective))
    elif outcome == "pruned":
        ot.set_user_attr("constraints", [1.0])
        set_constraints(ot, [1.0])
        ot.set_user_attr("pruned", reason)
        study.tell(ot, state=TrialState.PRUNED)
    elif outcome == "crashed" and crash_teaches:
        ot.set_user_attr("constraints", [1.0])
        ot.set_user_attr("reason", str(reason or "crashed")[:500])
        set_constraints(ot, [1.0])
        study.tell(ot, worst_value(study, study.direction.name.lower()))
    else:
        ot.set_user_attr("reason", str(reason or outcome or "no result")[:500])
        study.tell(ot, state=TrialState.FAIL)
