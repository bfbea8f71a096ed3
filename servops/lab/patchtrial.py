"""A patch (or a release's fix set) tried on a temporary copy of the one file it edits, as the
release sweeps in bench/ check each released wheel: it applies with real patch(1) and no fuzz,
it fixes what it is for, a second application is refused, and -R gives back the exact bytes."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path


def run_patch(tree: Path, text: str, *extra: str) -> bool:
    return subprocess.run(["patch", "-p1", "-F0", "-N", "-s", "-d", str(tree), *extra], input=text.encode(),
                          capture_output=True).returncode == 0


def try_on_copy(rel_path: str, original: bytes, texts: list[str], fixed: Callable[[str], bool]) -> dict:
    """Apply `texts` in order to a copy of `rel_path` holding `original`; `fixed(source)` judges the
    result. Keys: applies, and when it applied: fixed, reapply_refused (each patch), reverts_exactly
    (reversed in reverse order, byte for byte)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        target = tree / rel_path
        target.parent.mkdir(parents=True)
        target.write_bytes(original)
        row = {"applies": all(run_patch(tree, t) for t in texts)}
        if row["applies"]:
            row["fixed"] = fixed(target.read_text())
            row["reapply_refused"] = not any(run_patch(tree, t, "--dry-run") for t in texts)
            row["reverts_exactly"] = (all(run_patch(tree, t, "-R") for t in reversed(texts))
                                      and target.read_bytes() == original)
        return row
