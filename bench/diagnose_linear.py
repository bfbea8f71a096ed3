"""diagnose's time against the size of a hostile log (issue 48.1): 1 MB and 10 MB of each shape of
servops/lab/hostile_logs.py, parsed and reported here (the work the host program and the
client do between them), CPU seconds and the 10 MB / 1 MB ratio measured in one run. Linear time
gives a ratio near 10; the quadratic patterns of before gave 45 s for one 100 kB line.

    .venv/bin/python bench/diagnose_linear.py [--sizes 1,10] [--shape mixed]
"""

from __future__ import annotations

import argparse
import sys
import time
from io import StringIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402

from servops.diagnose import known_issues, report, scan_local  # noqa: E402
from servops.lab import hostile_logs  # noqa: E402

SHAPES = ("long_failing_lines", "repeated_bus_error", "long_words", "mixed", "one_huge_line", "table_cell_continued")


def cpu_seconds(text: str, issues: list[dict]) -> tuple[float, str]:
    start = time.process_time()
    rep = report("bench", scan_local(text, "bench.log"), issues, con=Console(file=StringIO()))
    return time.process_time() - start, rep.verdict


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,10", help="sizes in MB, comma-separated (default 1,10)")
    ap.add_argument("--shape", choices=SHAPES, action="append", help="one shape (default: every one)")
    args = ap.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    issues = known_issues()
    for shape in args.shape or SHAPES:
        times = []
        for mb in sizes:
            text = getattr(hostile_logs, shape)(int(mb * 1_000_000))
            seconds, verdict = cpu_seconds(text, issues)
            times.append(seconds)
            print(f"{shape:20s} {mb:6.1f} MB  {seconds:7.2f} s CPU  {verdict[:70]}")
        if len(times) > 1 and times[0] > 0:
            print(f"{shape:20s} ratio {sizes[-1] / sizes[0]:.0f}x the size: {times[-1] / times[0]:.1f}x the time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
