"""Launch preflight without a host: `when:` rules, sglang's parser read from source, argv verdicts."""

import textwrap

import pytest

from conftest import REPO
from servops.inventory import parse_inventory
from servops.launchcheck import LaunchCheck, LaunchRefused, _problem_lines, raise_if_refused
from servops.playbooks import VariantError, load_variant, resolve, when_branches
from servops.remote import sglang_args as sa
from servops.render import render_launch

HOST = parse_inventory("all: {hosts: {h1: {venv: /opt/v, server_port: 30000, model_path: /m, tp: 8}}}",
                       "inv.yml").hosts["h1"]


def books(tmp_path, **files):
    for name, text in files.items():
        (tmp_path / f"{name}.yml").write_text(textwrap.dedent(text))
    return tmp_path


# ------------------------------------------------------------------------------------ when:

def test_shipped_variants_map_intent_per_release():
    base, pw = load_variant("baseline"), load_variant("piecewise")
    argv = lambda v, ver: render_launch(HOST, resolve(v, ver)[0]).argv  # noqa: E731
    assert "--cuda-graph-max-bs" in argv(base, "0.5.9") and "--cuda-graph-backend-prefill" not in argv(base, "0.5.9")
    a = argv(base, "0.5.23")
    assert "--cuda-graph-max-bs" not in a and a[a.index("--cuda-graph-max-bs-decode") + 1] == "256"
    assert a[a.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    assert "--disable-piecewise-cuda-graph" in argv(base, "0.5.12")
    assert "--enable-piecewise-cuda-graph" in argv(pw, "0.5.9")
    assert "--enforce-piecewise-cuda-graph" in argv(pw, "0.5.12") and "--disable-piecewise-cuda-graph" not in argv(pw, "0.5.12")
    for ver, backend in (("0.5.15", "tc_piecewise"), ("0.5.21", "tc_piecewise"), ("0.5.23", "breakable")):
        a = argv(pw, ver)
        assert "--enable-piecewise-cuda-graph" not in a and a[a.index("--cuda-graph-backend-prefill") + 1] == backend
    # no sglang on the host (the lab's double): the variant as written
    resolved, rules = resolve(pw, None)
    assert rules == [] and resolved["server_args"]["enable-piecewise-cuda-graph"] is True
    _, rules = resolve(pw, "0.5.23")
    assert rules == ["baseline.yml when sglang >=0.5.14: cuda-graph-max-bs->cuda-graph-max-bs-decode "
                     "+cuda-graph-backend-prefill=disabled (per-phase CUDA graph flags; prefill graph off as on 0.5.9)",
                     "piecewise.yml when sglang >=0.5.22: -enable-piecewise-cuda-graph "
                     "+cuda-graph-backend-prefill=breakable (tc_piecewise removed; the breakable prefill graph replaces it)"]


def test_a_renamed_flag_keeps_the_value_a_child_or_trial_gave_it(tmp_path):
    """cuda-graph-max-bs: 128 in a child of baseline is --cuda-graph-max-bs-decode 128 on 0.5.23,
    not the parent's 256."""
    root = tmp_path / "books"
    root.mkdir()
    for f in (REPO / "playbooks").glob("*.yml"):
        (root / f.name).write_text(f.read_text())
    (root / "small.yml").write_text("extends: baseline\nserver_args: {cuda-graph-max-bs: 128}\n")
    a = render_launch(HOST, resolve(load_variant("small", root), "0.5.23")[0]).argv
    assert "--cuda-graph-max-bs" not in a and a[a.index("--cuda-graph-max-bs-decode") + 1] == "128"
    a = render_launch(HOST, resolve(load_variant("small", root), "0.5.9")[0]).argv
    assert a[a.index("--cuda-graph-max-bs") + 1] == "128"


def test_rules_merge_like_extends_in_order_child_last(tmp_path):
    root = books(tmp_path, a="""
        server_args: {x: 1, y: 2}
        env: {A: '1'}
        when:
          - sglang: ">=1.0"
            server_args: {y: null, z: 3}
            env: {B: '2'}
        """, b="""
        extends: a
        when:
          - sglang: ">=1.0,<2"
            note: child wins
            server_args: {z: 4}
            health: {timeout: 5}
        """)
    v = load_variant("b", root)
    assert [r["source"] for r in v["when"]] == ["a", "b"]
    r, rules = resolve(v, "1.5")
    assert r["server_args"] == {"x": 1, "z": 4} and r["env"] == {"A": "1", "B": "2"}
    assert r["health"]["timeout"] == 5 and r["when"] == []
    assert rules[1] == "b.yml when sglang >=1.0,<2: +z=4 +health.timeout=5 (child wins)"
    assert resolve(v, "2.0")[0]["server_args"] == {"x": 1, "z": 3}
    assert resolve(v, "0.9")[0]["server_args"] == {"x": 1, "y": 2}
    assert resolve(r, "1.5")[0] == r  # resolving twice changes nothing
    # prereleases of the host's sglang match like any version
    assert resolve(v, "1.0.1rc1")[0]["server_args"]["z"] == 4


def test_branches_cover_every_combination_a_version_can_select():
    v = load_variant("piecewise")
    keys = {k for k, _ex in when_branches(v)}
    wanted = set()
    for ver in ("0.5.9", "0.5.10", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.21", "0.5.22rc0", "0.5.22", "0.5.23",
                "0.6.0", "1.0", "0.5.14.dev0", "0.4.0"):
        from servops.playbooks import matching_rules
        wanted.add(tuple(matching_rules(v, ver)))
    assert wanted <= keys and ((), None) in when_branches(v)


@pytest.mark.parametrize("text,msg", [
    ("when: {sglang: '>=1'}\n", r"'when' must be a list"),
    ("when: [{sglang: '>=0.5.x', server_args: {a: 1}}]\n",
     r"when\[0\]\.sglang: '>=0\.5\.x' is not a PEP 440 version specifier"),
    ("when: [{server_args: {a: 1}}]\n", r"when\[0\]\.sglang \(or \.vllm\): give a PEP 440 version specifier"),
    ("when: [{sglang: '>=1', server_arg: {a: 1}}]\n", r"when\[0\]: unknown key 'server_arg'"),
    ("when: [{sglang: '>=1'}]\n", r"when\[0\]: sets nothing"),
    ("when: [{sglang: '>=1', server_args: [a]}]\n", r"when\[0\]\.server_args: must be a mapping"),
])
def test_bad_rules_are_one_line_naming_file_and_key(tmp_path, text, msg):
    root = books(tmp_path, bad=text)
    with pytest.raises(VariantError, match=msg) as err:
        load_variant("bad", root)
    assert "bad.yml" in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------- sglang's parser, from source

FAKE = {
    "sglang/__init__.py": "",
    "sglang/version.py": "__version__ = '9.9.9'\n",
    "sglang/srt/__init__.py": "",
    "sglang/srt/choices.py": """
        BACKENDS = ["auto", "flashinfer"]

        class Backend:
            FULL = "full"
            BREAKABLE = "breakable"
            DISABLED = "disabled"
            ALL = (FULL, BREAKABLE, DISABLED)
        """,
    "sglang/srt/actions.py": """
        import argparse

        class DeprecatedStoreTrueAction(argparse.Action):
            def __init__(self, option_strings, dest, new_flag=None, nargs=0, const=True, default=False, **kw):
                super().__init__(option_strings, dest, nargs=nargs, const=const, default=default, **kw)

        class DeprecatedAliasStoreAction(argparse.Action):
            def __init__(self, option_strings, dest, new_flag=None, **kw):
                super().__init__(option_strings, dest, **kw)
        """,
    "sglang/srt/fields.py": """
        import msgspec
        from sglang.srt.arg_utils import A, Arg

        class Graph(msgspec.Struct):
            _NS_PATH = "exec.graph"
            cuda_graph_max_bs_decode: A[Optional[int], "decode max bs"] = None
            cuda_graph_max_bs_prefill: A[Optional[int], "prefill max bs"] = None
            bs_list: A[Optional[List[int]], "sizes"] = None
        """,
    "sglang/srt/server_args.py": """
        import argparse
        from sglang.srt.arg_utils import A, Arg, add_cli_args_from_dataclass
        from sglang.srt.choices import BACKENDS, Backend
        from sglang.srt.actions import DeprecatedAliasStoreAction, DeprecatedStoreTrueAction
        from sglang.srt.fields import Graph

        EXTRA = ["x", "y"]

        class ServerArgs:
            model_path: A[str, Arg(help="p", aliases=["--model"])]
            tp_size: A[int, Arg(help="tp", cli_name="--tensor-parallel-size", aliases=["--tp-size"])] = 1
            backend: A[Optional[Literal["full", "breakable"]], Arg(help="b", choices=Backend.ALL)] = None
            flag: A[bool, "f"] = False
            hidden: A[bool, Arg(no_cli=True)] = False
            mode: A[str, Arg(help="m", choices=BACKENDS + EXTRA)] = "auto"
            ratio: A[float, "r"] = 0.5
            plain: int = 3

            @staticmethod
            def add_cli_args(parser):
                add_cli_args_from_dataclass(parser, ServerArgs)
                parser.add_argument("--old-flag", action=DeprecatedStoreTrueAction, new_flag="--flag")
                parser.add_argument("--old-max-bs", type=int, action=DeprecatedAliasStoreAction,
                                    dest="cuda_graph_max_bs_decode", new_flag="--cuda-graph-max-bs-decode")
                parser.add_argument("--port", type=int, default=30000)
                parser.add_argument("--dyn", choices=compute_choices())

        _INPUT_NAMESPACES = [Graph]

        def prepare_server_args(argv):
            parser = argparse.ArgumentParser(prog="sglang serve")
            ServerArgs.add_cli_args(parser)
            return parser.parse_args(argv)
        """,
}


def sglang_tree(root, files: dict) -> str:
    """A source tree of sglang files (path -> text) under `root`; the package directory."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(root / "sglang")


@pytest.fixture
def fake_sglang(tmp_path):
    return sglang_tree(tmp_path, FAKE)


def test_static_parser_reads_fields_add_argument_calls_and_constants(fake_sglang):
    p = sa.static_parser(fake_sglang)
    assert p.prog == "sglang serve" and sa.launcher_prog(fake_sglang) == "sglang serve"
    table = p._option_string_actions
    assert {"--model-path", "--model", "--tensor-parallel-size", "--tp-size", "--backend", "--flag", "--mode",
            "--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill", "--bs-list", "--old-flag", "--old-max-bs",
            "--port", "--dyn", "--ratio"} <= set(table)
    assert "--hidden" not in table and "--plain" not in table
    assert table["--tp-size"].dest == "tp_size" and table["--model"].required
    assert list(table["--backend"].choices) == ["full", "breakable", "disabled"]  # Backend.ALL, through the import
    assert list(table["--mode"].choices) == ["auto", "flashinfer", "x", "y"]
    assert table["--bs-list"].nargs == "+" and table["--old-flag"].nargs == 0 and table["--flag"].nargs == 0
    assert table["--dyn"].choices is None and "--dyn" in p.servops_unchecked


def test_verdicts_name_the_flag_and_the_closest_valid_ones(fake_sglang):
    p = sa.static_parser(fake_sglang)
    ok = sa.validate(p, ["--model-path", "/m", "--tp-size", "8", "--cuda-graph-max-bs-decode", "256"], "9.9.9")
    assert ok["ok"] and ok["values"]["tp_size"] == 8 and ok["problems"] == []
    res = sa.validate(p, ["--model-path", "/m", "--cuda-graph-max-bz", "256", "--cuda-graph-max-bs", "8",
                          "--backend", "tc_piecewise", "--ratio", "x", "--old-flag", "--tp", "8"], "9.9.9")
    assert not res["ok"]
    by_flag = {q["flag"]: q for q in res["problems"]}
    assert by_flag["--cuda-graph-max-bz"]["kind"] == "unrecognized"
    assert by_flag["--cuda-graph-max-bz"]["suggestions"][:2] == ["--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill"]
    assert by_flag["--cuda-graph-max-bs"]["kind"] == "ambiguous"
    assert by_flag["--backend"]["kind"] == "value" and "invalid choice: 'tc_piecewise'" in by_flag["--backend"]["message"]
    assert by_flag["--ratio"]["message"] == "invalid float value: 'x'"
    warn = {w["flag"]: w for w in res["warnings"]}
    assert warn["--old-flag"]["kind"] == "deprecated" and "--flag" in warn["--old-flag"]["message"]
    assert warn["--tp"]["kind"] == "abbreviation" and "--tp-size" in warn["--tp"]["message"]
    missing = sa.validate(p, ["--tp-size", "2"], "9.9.9")
    assert [(q["flag"], q["kind"]) for q in missing["problems"]] == [("--model-path", "required")]
    lines = _problem_lines(res, "9.9.9", static=True)
    assert lines == [
        "--cuda-graph-max-bz: unrecognized on sglang 9.9.9 (static check); did you mean --cuda-graph-max-bs-decode, "
        "--cuda-graph-max-bs-prefill?",
        "--cuda-graph-max-bs: ambiguous on sglang 9.9.9 (static check); it could be --cuda-graph-max-bs-decode, "
        "--cuda-graph-max-bs-prefill: spell the one you mean",
        "--backend: invalid choice: 'tc_piecewise' (choose from 'full', 'breakable', 'disabled') on sglang 9.9.9 "
        "(static check)",
        "--ratio: invalid float value: 'x' on sglang 9.9.9 (static check)"]


def test_refusal_is_one_line():
    check = LaunchCheck(host="h1", variant_name="typo", sglang_version="0.5.23", static=False, parser="real",
                        rules=[], variant={}, argv=[], ok=False,
                        problems=["--cuda-graph-max-bz: unrecognized on sglang 0.5.23; did you mean x?", "second"])
    with pytest.raises(LaunchRefused) as err:
        raise_if_refused(check, "h1")
    text = str(err.value)
    assert "\n" not in text and text.startswith("h1: launch of typo refused: --cuda-graph-max-bz: unrecognized on sglang 0.5.23")
    assert "(+1 more: invoke check --variant typo -H h1)" in text
    check.ok, check.problems = True, []
    raise_if_refused(check, "h1")


# ------------------------------------- static read: what the 0.4.0-0.5.23 sweep needed it to read

OLD_STYLE = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/utils/__init__.py": "from sglang.srt.utils.common import *\n",
    "sglang/srt/utils/common.py": "LORA_MODULES = ['q_proj', 'k_proj']\nLORA_ALL = 'all'\n",
    "sglang/srt/base.py": """
        from sglang.srt.arg_utils import A, Arg

        class Base:
            inherited: A[int, "from a base class"] = 1
        """,
    "sglang/srt/server_args.py": """
        from sglang.srt.arg_utils import A, Arg, add_cli_args_from_dataclass
        from sglang.srt.utils import LORA_ALL, LORA_MODULES
        from sglang.srt.base import Base

        class ServerArgs(Base):
            dcp_size: A[int, Arg(help="first", aliases=["--decode-cp-size"])] = 1
            checksum: A[Optional[str], Arg(help="c", nargs="?", const="")] = None
            dcp_size: A[int, Arg(help="declared twice", aliases=["--decode-cp-size"])] = 1

            @staticmethod
            def add_cli_args(parser):
                add_cli_args_from_dataclass(parser, ServerArgs)
                ATTN = ["triton", "fa3"]
                parser.add_argument("--attention-backend", choices=ATTN)
                grown = ["a"]
                if something():
                    grown.append("b")
                parser.add_argument("--grown", choices=grown)
                parser.add_argument("--lora-target-modules", nargs="*", choices=LORA_MODULES + [LORA_ALL])
                parser.add_argument("--ratio", type=float, nargs="?", const=0.5)
        """,
}


@pytest.fixture
def old_style(tmp_path):
    return sglang_tree(tmp_path, OLD_STYLE)


def test_static_read_of_locals_star_imports_bases_and_twice_declared_fields(old_style):
    p = sa.static_parser(old_style)
    assert p.servops_skipped == []  # 0.5.15's dcp_size declared twice is one flag, as dataclasses make it
    acts = p._option_string_actions
    assert acts["--dcp-size"] is acts["--decode-cp-size"] and "--inherited" in acts
    assert acts["--attention-backend"].choices == ["triton", "fa3"]  # a constant local of add_cli_args
    assert acts["--grown"].choices is None and "--grown" in p.servops_unchecked  # mutated: run time
    assert acts["--lora-target-modules"].choices == ["q_proj", "k_proj", "all"]  # through utils' `import *`
    assert acts["--checksum"].const == "" and acts["--ratio"].const == 0.5
    assert not sa.validate(p, ["--attention-backend", "fa4"])["ok"]
    values = sa.validate(p, ["--ratio", "--checksum"])["values"]
    assert values["ratio"] == 0.5 and values["checksum"] == ""  # a bare flag stores its const, as in sglang


def test_a_reordered_flag_is_the_first_suggestion(old_style):
    p = sa.static_parser(old_style)
    assert sa.suggestions(p, "--backend-attention")[0] == "--attention-backend"


def test_a_rule_can_refuse_a_release_in_one_line(tmp_path):
    root = books(tmp_path, a="""
        server_args: {x: 1}
        when:
          - sglang: "<0.5"
            refuse: "no x before sglang 0.5"
        """, b="""
        extends: a
        when:
          - sglang: "<0.6"
            refuse: "no y before sglang 0.6"
            server_args: {y: 2}
        """)
    resolved, rules = resolve(load_variant("b", root), "0.4.9")
    assert resolved["refuse"] == "no y before sglang 0.6" and "REFUSE: no x before sglang 0.5" in rules[0]
    assert not resolve(load_variant("b", root), "0.6")[0].get("refuse")
    from servops.launchcheck import refusal_line
    assert refusal_line("b", "0.4.9", resolved) == "b cannot run on sglang 0.4.9: no y before sglang 0.6"
    with pytest.raises(VariantError, match=r"when\[0\]\.refuse: one line"):
        load_variant("c", books(tmp_path, c="when: [{sglang: '<1', refuse: 3}]\n"))
    # the shipped variants: refused where their intent does not exist, in their own words
    assert resolve(load_variant("piecewise"), "0.5.2")[0]["refuse"].startswith("no piecewise CUDA graph before")
    assert resolve(load_variant("baseline"), "0.4.10")[0]["refuse"].startswith("no --moe-runner-backend before")
    assert not resolve(load_variant("piecewise"), "0.5.3.post2")[0].get("refuse")


HELPERS = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/extra_args.py": """
        def add_lora_args(parser, prefix="lora"):
            group = parser.add_argument_group("LoRA")
            group.add_argument(f"--{prefix}-paths", nargs="*")
        """,
    "sglang/srt/server_args.py": """
        import argparse
        from sglang.srt import extra_args
        from sglang.srt.extra_args import add_lora_args

        PHASES = ("decode", "prefill")

        def _add_deprecated(parser, old, new):
            parser.add_argument(old, dest=new.lstrip("-").replace("-", "_"), type=int)

        class ServerArgs:
            @staticmethod
            def add_cli_args(parser: argparse.ArgumentParser):
                for phase in PHASES:
                    parser.add_argument(f"--cuda-graph-max-bs-{phase}", type=int)
                for old, new in [("--max-bs", "--cuda-graph-max-bs-decode")]:
                    _add_deprecated(parser, old, new)
                ServerArgs._add_more(parser)
                add_lora_args(parser)
                extra_args.add_lora_args(parser, prefix="adapter")
                plugins.register(parser)

            @staticmethod
            def _add_more(parser):
                parser.add_argument("--more", action=argparse.BooleanOptionalAction)
        """,
}


def test_static_read_follows_loops_fstrings_and_helper_functions(tmp_path):
    """Flags a future release may register in a loop or through helpers are read; what cannot be
    followed (a plugin hook) is listed as skipped, not silently missing."""
    for rel, text in HELPERS.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    p = sa.static_parser(str(tmp_path / "sglang"))
    acts = p._option_string_actions
    for flag in ("--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill", "--max-bs", "--more", "--no-more",
                 "--lora-paths", "--adapter-paths"):
        assert flag in acts, flag
    assert acts["--max-bs"].dest == "cuda_graph_max_bs_decode" and acts["--max-bs"].type is int
    assert len(p.servops_skipped) == 1 and p.servops_skipped[0].startswith("flags that plugins.register(parser)")
    res = sa.validate(p, ["--cuda-graph-max-bs", "8"])
    assert res["problems"][0]["kind"] == "ambiguous"
