"""How many trials each search strategy needs, on the SGLang double's response surface.

The surface is the double's own speed model (servops/lab/sglang_double.py `Pacer`: admission by
--max-running-requests and the KV cache from --mem-fraction-static, decode steps slower above
--cuda-graph-max-bs or with --disable-cuda-graph), built from the same server args a launch
passes it, and run as the double runs it -- the same scheduler, in simulated time instead of
asyncio sleeps (a closed-loop bench: CONCURRENCY clients, REQUESTS requests). Output tok/s at
that concurrency is the objective.

The space is a campaign's (servops.search: its axes, sampled through servops.study's samplers,
Optuna TPE and random). For each strategy: the trials (distinct points; a point asked again is
not run again, as tune does) until one is within 2% of the grid's best. Grid: the points in the
order `search: grid` runs them (as written); also shown shuffled. Median over 10 seeds.

    .venv/bin/python bench/tune_search.py        # last line: TPE/grid ratio (goal <= 1/3)
"""

from __future__ import annotations

import heapq
import itertools
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the double's knobs, as the lab campaigns set them (a paced, batched model)
ENV = {"SGLANG_DOUBLE_TOKEN_DELAY": "0.004", "SGLANG_DOUBLE_STEP_PER_SEQ": "0.0005",
       "SGLANG_DOUBLE_EAGER_FACTOR": "3", "SGLANG_DOUBLE_PREFILL_PER_TOKEN": "0.00002",
       "SGLANG_DOUBLE_GPU_TOKENS": "400000", "SGLANG_DOUBLE_TTFT": "0.02"}
os.environ.update(ENV)

from servops import search  # noqa: E402
from servops import study as studymod  # noqa: E402
from servops.lab.sglang_double import Pacer  # noqa: E402

CONCURRENCY, REQUESTS, PROMPT, OUTPUT = 256, 384, 256, 256
SPACE = {  # a 4-flag grid, written as a campaign would: 4 x 4 x 4 x 2 = 128 points
    "mem-fraction-static": [0.75, 0.8, 0.85, 0.9],
    "cuda-graph-max-bs": [32, 64, 128, 256],
    "max-running-requests": [64, 128, 192, 256],
    "disable-cuda-graph": [False, True],
}
SEEDS = range(10)
WITHIN = 0.02


def throughput(args: dict) -> float:
    """Output tok/s of a closed-loop bench against the double's Pacer with these server args."""
    ns = SimpleNamespace(**{k.replace("-", "_"): v for k, v in args.items()})
    if not ns.disable_cuda_graph:
        ns.disable_cuda_graph = None  # the flag absent
    p = Pacer(ns, float(ENV["SGLANG_DOUBLE_TTFT"]), float(ENV["SGLANG_DOUBLE_TOKEN_DELAY"]))
    need = PROMPT + OUTPUT
    now, submitted, finished = 0.0, 0, 0
    waiting, running, decoding, prefills = [], 0, [], []   # decoding: tokens left per sequence
    kv = 0

    def admit():
        nonlocal running, kv
        while waiting:
            if p.max_running and running >= p.max_running:
                return
            if running and kv + need > p.kv_capacity:
                return
            waiting.pop()
            running += 1
            kv += need
            heapq.heappush(prefills, now + (p.ttft + p.prefill_per_token * PROMPT) * p.speed)

    for _ in range(min(CONCURRENCY, REQUESTS)):
        waiting.append(1)
        submitted += 1
    admit()
    while finished < REQUESTS:
        if not decoding:
            now = heapq.heappop(prefills)
            decoding.append(OUTPUT - 1)          # the first token came with the prefill
            continue
        end = now + p.step_time(len(decoding))
        joining = []
        while prefills and prefills[0] <= end:    # join the next step, as in the double's loop
            heapq.heappop(prefills)
            joining.append(OUTPUT - 1)
        now = end
        left = [n - 1 for n in decoding]
        done = sum(1 for n in left if n <= 0)
        decoding = [n for n in left if n > 0] + joining
        finished += done
        running -= done
        kv -= done * need
        new = min(done, REQUESTS - submitted)
        waiting.extend([1] * new)
        submitted += new
        admit()
    return REQUESTS * OUTPUT / now


def spaces() -> list:
    axes = [search.parse_axis("server_args", k, v) for k, v in SPACE.items()]
    return [search.Space("knobs", "baseline", {}, {}, axes)]


_cache: dict = {}


def value(point: dict) -> float:
    key = tuple(sorted(point.items()))
    if key not in _cache:
        _cache[key] = throughput({k: v for (_s, k), v in point.items()})
    return _cache[key]


def grid_points() -> list[dict]:
    keys = list(SPACE)
    return [{("server_args", k): v for k, v in zip(keys, combo)} for combo in itertools.product(*SPACE.values())]


def trials_to_reach(order, target: float) -> int:
    for i, point in enumerate(order, 1):
        if value(point) >= target:
            return i
    return len(grid_points()) + 1


def sampled(strategy: str, seed: int, target: float, budget: int) -> int:
    """Distinct points a sampler runs until one reaches the target (ask-and-tell, as tune does)."""
    import optuna

    sp = spaces()
    study = optuna.create_study(direction="maximize", sampler=studymod.make_sampler(strategy, seed, budget))
    seen: set = set()
    for _ in range(20 * budget):
        ot = study.ask()
        _space, point = search.suggest(sp, ot)
        key = tuple(sorted(point.items()))
        v = value(point)
        studymod.set_constraints(ot, [0.0])
        study.tell(ot, v)
        if key not in seen:
            seen.add(key)
            if v >= target:
                return len(seen)
        if len(seen) >= len(grid_points()):
            break
    return len(seen) + 1


def main() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t0 = time.monotonic()
    points = grid_points()
    best = max(value(p) for p in points)
    worst = min(value(p) for p in points)
    target = best * (1 - WITHIN)
    near = sum(1 for p in points if value(p) >= target)
    print(f"surface: {len(points)} grid points ({' x '.join(str(len(v)) for v in SPACE.values())}: "
          f"{', '.join(SPACE)}), output tok/s at concurrency {CONCURRENCY}: {worst:,.0f} .. {best:,.0f}; "
          f"{near} point(s) within {WITHIN:.0%} of the best ({time.monotonic() - t0:.1f}s to evaluate)")
    grid = trials_to_reach(points, target)
    shuffled = statistics.median(trials_to_reach(random.Random(s).sample(points, len(points)), target) for s in SEEDS)
    budget = 40  # the max_trials a campaign would give: TPE's random start-up is a quarter of it
    rnd = [sampled("random", s, target, budget) for s in SEEDS]
    tpe = [sampled("tpe", s, target, budget) for s in SEEDS]
    print(f"grid (as written):     {grid} trials")
    print(f"grid (shuffled):       median {shuffled:g} trials over {len(SEEDS)} seeds")
    print(f"random:                median {statistics.median(rnd):g} trials ({sorted(rnd)})")
    print(f"tpe:                   median {statistics.median(tpe):g} trials ({sorted(tpe)})")
    print(f"({time.monotonic() - t0:.1f}s)")
    print(f"TPE/grid = {statistics.median(tpe) / grid:.3f} (goal <= 0.333)")


if __name__ == "__main__":
    main()
