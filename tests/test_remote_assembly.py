"""A remote program is its libraries and its own file pasted into one module (servops/remote/__init__.py
program): a top-level name two parts both bind is silently the later part's everywhere, as
cache_ledger's CACHE_DISTS once replaced vllm_args' and made vLLM's launch check look up torch's
metadata for vllm's package. No host: the assembled texts are read as Python."""

import ast

import pytest

from servops import remote

# Deliberate: the vLLM launch check is sglang_args' machinery run with vllm_args' parser and prefixes.
OVERRIDES = {("sglang_args", "vllm_args"): {"CACHE_ENV_PREFIXES", "real_parser"}}

pytestmark = pytest.mark.quick


def top_level_names(part: str) -> set[str]:
    tree = ast.parse((remote._HERE / f"{part}.py").read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def parts_of(name: str) -> list[str]:
    """The parts of program(name), in the order program() pastes them (read from its text)."""
    return [line[len("# ---- "):-len(" ----")] for line in remote.program(name).splitlines()
            if line.startswith("# ---- ") and line.endswith(" ----")]


PROGRAMS = sorted(set(remote._INCLUDES) | {"launch_check+deploy_facts", "launch_check_vllm+deploy_facts"})


@pytest.mark.parametrize("name", PROGRAMS)
def test_no_two_parts_of_a_program_bind_the_same_top_level_name(name):
    owner: dict[str, str] = {}
    clashes = []
    for part in parts_of(name):
        for bound in top_level_names(part):
            first = owner.setdefault(bound, part)
            if first != part and bound not in OVERRIDES.get((first, part), ()):
                clashes.append(f"{bound}: {first} and {part}")
    assert not clashes, f"{name}: " + "; ".join(sorted(clashes))
