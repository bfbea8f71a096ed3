"""The campaign's record (servops.campaignrecord) is the lowest of the campaign modules: tune,
tunefleet and tunereport each depend downward only (issue 39.2: they imported one another in a
circle). Read from the source's imports, function-local ones included."""

from __future__ import annotations

import ast

from conftest import REPO

CAMPAIGN_MODULES = ("campaignrecord", "tunereport", "tune", "tunefleet")  # lowest first


def servops_imports(module: str) -> set[str]:
    """The servops modules `module` imports anywhere in its file (top level or in a function)."""
    tree = ast.parse((REPO / "servops" / f"{module}.py").read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
    return out


def test_the_campaign_modules_depend_downward_only():
    for i, module in enumerate(CAMPAIGN_MODULES):
        above = set(CAMPAIGN_MODULES[i:])
        assert not servops_imports(module) & above, f"{module} imports {servops_imports(module) & above}"
    assert {"campaignrecord"} <= servops_imports("tunereport") and "tunereport" in servops_imports("tune")
