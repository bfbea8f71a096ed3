"""Verdicts from few, noisy bench runs: intervals, when to bench again, and the winner.

Pure (no host, no files). Every run of one trial is a value of the objective; the campaign's
noise is the pooled relative spread of every trial benched more than once (the base first), so
one noisy GPU is measured once per campaign and shared by all its comparisons.

- `interval`: a trial's mean and its 95% interval (Student t on the pooled noise).
- `compare`: a contender against the incumbent: the gain and the 95% interval of the gain;
  "better"/"worse" once that interval leaves zero, "unsure" while it holds it.
- `next_step`: sequential: bench the contender again only while the comparison is unsure and
  the gain could still matter (its interval reaches above `negligible`), up to `max_repeats`
  runs; then say why it stopped.
- `choose`: among the finalists, the best lower bound of the interval (for a minimised
  objective: the best upper bound), not the best single value.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from dataclasses import dataclass

LEVEL = 0.95

def t_quantile(level: float, df: int) -> float:
    """Student t's two-sided `level` quantile (exact for 1 and 2 df; Cornish-Fisher above, within 4%
    of the table at 3 df and 1% from 5 df on, erring narrow)."""
    if df < 1:
        return math.inf
    p = (1 + level) / 2
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = NormalDist().inv_cdf(p)
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


@dataclass(frozen=True)
class Noise:
    """The campaign's run-to-run noise: relative standard deviation of one run, its degrees of
    freedom (runs minus trials, pooled) and where it comes from."""
    sd: float
    df: int
    how: str

    def t(self, level: float = LEVEL) -> float:
        return t_quantile(level, self.df)


def pooled_noise(runs: dict) -> Noise | None:
    """The pooled relative standard deviation of the trials benched more than once (None: none was);
    a key is a trial, or a fleet's (host, trial)."""
    ss, df, names = 0.0, 0, []
    for name, values in runs.items():
        values = [v for v in values if v]
        if len(values) < 2:
            continue
        m = math.fsum(values) / len(values)
        ss += math.fsum(((v - m) / m) ** 2 for v in values)
        df += len(values) - 1
        names.append(f"{name[1]}@{name[0]} x{len(values)}" if isinstance(name, tuple) else f"{name} x{len(values)}")
    if df == 0:
        return None
    sd = math.sqrt(ss / df)
    return Noise(sd, df, f"{sd * 100:.1f}% per run, pooled over {', '.join(names)} ({df} df)")


def interval(values: list[float], noise: Noise | None, level: float = LEVEL) -> tuple[float, float, float]:
    """(mean, low, high): the `level` interval of the mean of `values` (zero width without noise)."""
    m = math.fsum(values) / len(values)
    if noise is None:
        return m, m, m
    half = noise.t(level) * noise.sd * abs(m) / math.sqrt(len(values))
    return m, m - half, m + half


@dataclass(frozen=True)
class Comparison:
    gain: float       # the contender's mean against the incumbent's, as a share (positive: better)
    low: float        # the gain's 95% interval
    high: float
    state: str        # better / worse / unsure

    def text(self) -> str:
        return f"{self.gain * 100:+.1f}% [{self.low * 100:+.1f}%, {self.high * 100:+.1f}%]"


def compare(incumbent: list[float], contender: list[float], noise: Noise | None, sense: str = "maximize",
            level: float = LEVEL) -> Comparison:
    a, b = math.fsum(incumbent) / len(incumbent), math.fsum(contender) / len(contender)
    gain = (b - a) / abs(a) if a else 0.0
    if sense != "maximize":
        gain = -gain
    if noise is None:
        return Comparison(gain, gain, gain, "unsure")
    half = noise.t(level) * noise.sd * math.sqrt(1 / len(incumbent) + 1 / len(contender))
    low, high = gain - half, gain + half
    return Comparison(gain, low, high, "better" if low > 0 else "worse" if high < 0 else "unsure")


def next_step(incumbent: list[float], contender: list[float], noise: Noise | None, sense: str,
              max_repeats: int, negligible: float = 0.0, level: float = LEVEL) -> tuple[bool, str]:
    """(bench the contender again?, why it stops or goes on)."""
    c = compare(incumbent, contender, noise, sense, level)
    runs = f"{len(contender)} run{'s' if len(contender) > 1 else ''} vs {len(incumbent)}"
    if noise is None:
        return False, f"{c.gain * 100:+.1f}% ({runs}; no noise measured yet)"
    if c.state == "better":
        return False, f"better: {c.text()} ({runs}): the intervals separate"
    if c.state == "worse":
        return False, f"worse: {c.text()} ({runs}): the intervals separate"
    if c.high <= negligible:
        return False, f"cannot matter: {c.text()} ({runs}): at best {c.high * 100:+.1f}%"
    if len(contender) >= max_repeats:
        return False, f"tie within noise: {c.text()} ({runs}; max_repeats {max_repeats})"
    return True, f"unsure: {c.text()} ({runs}): benching again"


def lower_bound(values: list[float], noise: Noise | None, sense: str = "maximize", level: float = LEVEL) -> float:
    """The pessimistic end of the interval: low for a maximised objective, high (negated) otherwise."""
    _m, lo, hi = interval(values, noise, level)
    return lo if sense == "maximize" else -hi


def choose(runs: dict[str, list[float]], noise: Noise | None, sense: str = "maximize",
           level: float = LEVEL) -> str | None:
    """The trial with the best lower bound (in `runs`' order on a tie)."""
    best = None
    for name, values in runs.items():
        if values and (best is None or lower_bound(values, noise, sense, level)
                       > lower_bound(runs[best], noise, sense, level)):
            best = name
    return best


def final_rounds(top: int) -> list[int]:
    """The end re-bench, one run per finalist a round: the top `top`, then the top two twice
    (each round keeps only finalists not yet separated below the leader)."""
    return [top, 2, 2]


def finalists(runs: dict[str, list[float]], noise: Noise | None, sense: str, top: int,
              level: float = LEVEL) -> list[str]:
    """The best `top` trials by mean, leaving out any separated below the leader's interval."""
    sign = 1 if sense == "maximize" else -1
    order = sorted((n for n in runs if runs[n]), key=lambda n: -sign * math.fsum(runs[n]) / len(runs[n]))
    if not order:
        return []
    lead = order[0]
    return [n for n in order if n == lead or compare(runs[lead], runs[n], noise, sense, level).state != "worse"][:top]
