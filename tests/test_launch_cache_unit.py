"""The launch preflight's parser cache without a host: a parser as a flag table and back
(servops/remote/argtable.py) gives the real parser's verdicts or says it cannot decide, and the
cache file (servops/remote/launch_cache.py) is keyed, atomic, private, bounded and safe."""

import argparse
import json
import os
import stat

import pytest

from servops.remote import argtable as at
from servops.remote import launch_cache as lc
from servops.remote import sglang_args as sa


def human_int(text):
    """A custom type like sglang's human_readable_int ('32k' -> 32000)."""
    if text.endswith("k"):
        return int(float(text[:-1]) * 1000)
    return int(text)


class DeprecatedStoreTrueAction(argparse.Action):
    def __init__(self, option_strings, dest, new_flag=None, nargs=0, default=False, **kw):
        self.new_flag = new_flag
        super().__init__(option_strings, dest, nargs=nargs, default=default, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)


def engine_parser():
    """A parser shaped like sglang's: int/float/str types, choices, a custom type, json.loads,
    booleans (store_true, BooleanOptionalAction), nargs '+', aliases, a required flag, a
    deprecated flag with an action class of its own."""
    p = argparse.ArgumentParser(prog="sglang serve")
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--tp-size", "--tp", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--attention-backend", choices=["triton", "fa3", "flashinfer"])
    p.add_argument("--sampling-backend", choices={"pytorch", "flashinfer"})
    p.add_argument("--context-length", type=human_int)
    p.add_argument("--max-prefill-tokens", type=human_int, default="16k")
    p.add_argument("--extra-metric-labels", type=json.loads)
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--cuda-graph-max-bs-decode", type=int)
    p.add_argument("--cuda-graph-max-bs-prefill", type=int)
    p.add_argument("--log-requests", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--disable-cuda-graph", action=DeprecatedStoreTrueAction, new_flag="--cuda-graph-backend")
    return p


def through_json(parser, memo=None):
    table = at.table_of(parser, memo)
    return at.parser_of(json.loads(json.dumps(table)))


ARGVS = [
    ["--model-path", "/m", "--tp", "8", "--cuda-graph-max-bz", "128"],      # typo: did-you-mean
    ["--model-path", "/m", "--attention-backend", "nosuch"],               # bad choice
    ["--model-path", "/m", "--sampling-backend", "cuda"],                  # bad choice of a set
    ["--model-path", "/m", "--tp-size", "x", "--mem-fraction-static", "y"],  # bad types, both found
    ["--model-path", "/m", "--cuda-graph-max-bs", "8"],                    # ambiguous abbreviation
    ["--model", "/m", "--enable-metrics", "--no-log-requests", "--served-model-name", "a", "b"],  # valid
    ["--tp", "2"],                                                         # required missing
    ["--model-path", "/m", "--tp-size"],                                   # expected one argument
    ["--model-path", "/m", "stray"],                                       # a stray value
]


@pytest.mark.parametrize("argv", ARGVS, ids=range(len(ARGVS)))
def test_a_table_gives_the_real_parsers_verdict(argv):
    real = sa.validate(engine_parser(), argv, "0.5.23", keep=None)
    cached = sa.validate(through_json(engine_parser()), argv, "0.5.23", keep=None)
    for key in ("ok", "problems", "warnings", "values"):
        assert cached[key] == real[key], key
    assert real["problems"] or real["ok"]


def test_the_verdicts_are_the_ones_a_user_sees():
    cached = through_json(engine_parser())
    typo = sa.validate(cached, ARGVS[0], "0.5.23")["problems"]
    assert typo == [{"flag": "--cuda-graph-max-bz", "kind": "unrecognized", "message": "unrecognized",
                     "suggestions": ["--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill",
                                                                "--disable-cuda-graph"]}]
    choice = sa.validate(cached, ARGVS[1], "0.5.23")["problems"]
    assert choice[0]["flag"] == "--attention-backend" and choice[0]["message"].startswith("invalid choice: 'nosuch'")
    types = [p["message"] for p in sa.validate(cached, ARGVS[3], "0.5.23")["problems"]]
    assert types == ["invalid int value: 'x'", "invalid float value: 'y'"]
    ok = sa.validate(cached, ARGVS[5], "0.5.23", keep={"model_path", "tp_size", "served_model_name"})
    assert ok["ok"] and ok["values"] == {"model_path": "/m", "tp_size": 1, "served_model_name": ["a", "b"]}


def test_a_custom_type_is_decided_only_for_a_value_the_real_parser_converted():
    argv = ["--model-path", "/m", "--context-length", "32k"]
    bad = ["--model-path", "/m", "--context-length", "lots"]
    with pytest.raises(at.Undecidable, match="--context-length 32k"):
        sa.validate(through_json(engine_parser()), argv, "0.5.23")
    memo = {}
    real = at.record_values(engine_parser(), memo)
    want = sa.validate(real, argv, "0.5.23", keep={"context_length", "max_prefill_tokens"})
    want_bad = sa.validate(real, bad, "0.5.23")
    assert want["values"] == {"context_length": 32000, "max_prefill_tokens": 16000}
    cached = through_json(engine_parser(), memo)
    got = sa.validate(cached, argv, "0.5.23", keep={"context_length", "max_prefill_tokens"})
    got_bad = sa.validate(cached, bad, "0.5.23")
    assert got["values"] == want["values"] and got["ok"]
    assert got_bad["problems"] == want_bad["problems"] == [
        {"flag": "--context-length", "kind": "value", "message": "invalid human_int value: 'lots'", "suggestions": []}]
    with pytest.raises(at.Undecidable):  # another value: not seen, not decided
        sa.validate(cached, ["--model-path", "/m", "--context-length", "64k"], "0.5.23")


def test_an_action_class_of_the_engines_own_is_left_to_the_real_parser():
    cached = through_json(engine_parser())
    with pytest.raises(at.Undecidable, match="--disable-cuda-graph"):
        sa.validate(cached, ["--model-path", "/m", "--disable-cuda-graph"], "0.5.23")
    with pytest.raises(at.Undecidable):  # an abbreviation of it too
        sa.validate(cached, ["--model-path", "/m", "--disable-cuda"], "0.5.23")
    # not used: the table decides, its default stands
    res = sa.validate(cached, ["--model-path", "/m", "--disable-cuda-graphs"], "0.5.23", keep={"disable_cuda_graph"})
    assert res["problems"] == [{"flag": "--disable-cuda-graphs", "kind": "unrecognized", "message": "unrecognized",
                                "suggestions": ["--disable-cuda-graph"]}]
    assert res["values"] == {"disable_cuda_graph": False}


def test_a_parser_a_table_cannot_stand_for_gives_none():
    class Own(argparse.ArgumentParser):
        pass
    assert at.table_of(Own()) is None
    p = argparse.ArgumentParser()
    g = p.add_mutually_exclusive_group()
    g.add_argument("--a", action="store_true")
    g.add_argument("--b", action="store_true")
    assert at.table_of(p) is None
    assert at.table_of(argparse.ArgumentParser(fromfile_prefix_chars="@")) is None
    for broken in ({}, {"schema": 99}, {"schema": at.SCHEMA, "prog": "x"}, "text", None):
        with pytest.raises((ValueError, KeyError, TypeError)):
            at.parser_of(broken)


def test_the_static_sglang_parser_round_trips(sglang_src_023):
    """sglang 0.5.23's own parser (read from its source): every flag survives the table."""
    parser = sa.static_parser(sglang_src_023)
    rebuilt = through_json(parser)
    assert len(rebuilt._actions) == len(parser._actions) > 400
    assert sorted(rebuilt._option_string_actions) == sorted(parser._option_string_actions)
    argv = ["--model-path", "/m", "--tp", "8", "--cuda-graph-max-bz", "128", "--attention-backend", "nosuch"]
    want = sa.validate(parser, argv, "0.5.23")
    assert sa.validate(rebuilt, argv, "0.5.23")["problems"] == want["problems"] and len(want["problems"]) == 2


@pytest.fixture
def sglang_src_023():
    from servops.lab import venvs
    venv = venvs.build_sglang_venv("0.5.23")
    return str(venvs.site_packages(venv) / "sglang")


# ---------------------------------------------------------------------------- the cache file

def key(**over):
    k = {"schema": lc.CACHE_SCHEMA, "engine": "sglang", "record_sha256": "a" * 64, "python": "3.11",
         "executable": "/v/bin/python", "venv": "/v", "package": "/v/sglang", "sources": [],
         "installed_sha256": "b", "env_sha256": "c"}
    k.update(over)
    return k


TABLE = {"schema": at.SCHEMA, "actions": []}


def test_store_then_load_private_and_atomic(tmp_path):
    path = lc.cache_path(str(tmp_path), key())
    assert lc.load(path, key()) == (None, "missing")
    assert lc.store(path, key(), TABLE) is None
    assert lc.load(path, key()) == (TABLE, "hit")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no temp file left


def test_a_host_without_a_deploy_root_is_left_as_it_was(tmp_path):
    root = tmp_path / "never-deployed"
    path = lc.cache_path(str(root), key())
    assert "no deploy root" in lc.store(path, key(), TABLE)
    assert not root.exists() and lc.load(path, key()) == (None, "missing")


def test_a_changed_key_is_stale_and_says_what_changed(tmp_path):
    path = lc.cache_path(str(tmp_path), key())
    lc.store(path, key(), TABLE)
    newer = key(record_sha256="f" * 64)
    assert lc.cache_path(str(tmp_path), newer) == path  # the same venv: the same file, rewritten
    assert lc.load(path, newer) == (None, "stale: record_sha256 changed")
    assert lc.load(path, key(python="3.12"))[1] == "stale: python changed"
    assert lc.cache_path(str(tmp_path), key(venv="/w")) != path


@pytest.mark.parametrize("content", [b"garbage\x00\xff", b"[]", b'{"schema": 99, "table": {}}', b'{"schema": 1}',
                                     b"[" * 100000])
def test_a_damaged_file_is_ignored_then_rewritten(tmp_path, content):
    path = lc.cache_path(str(tmp_path), key())
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as fh:
        fh.write(content)
    table, state = lc.load(path, key())
    assert table is None and state.startswith("damaged: ")
    assert lc.store(path, key(), TABLE) is None and lc.load(path, key()) == (TABLE, "hit")


def test_a_symlink_is_never_followed_and_a_big_file_never_read(tmp_path):
    path = lc.cache_path(str(tmp_path), key())
    os.makedirs(os.path.dirname(path))
    victim = tmp_path / "victim"
    victim.write_text(json.dumps({"schema": lc.CACHE_SCHEMA, "key": key(), "table": TABLE}))
    os.symlink(victim, path)
    assert lc.load(path, key()) == (None, "damaged: a symlink in the cache file's place (not followed)")
    assert lc.store(path, key(), {"schema": at.SCHEMA, "actions": [], "new": 1}) is None
    assert not os.path.islink(path) and json.loads(victim.read_text())["table"] == TABLE  # victim untouched
    with open(path, "wb") as fh:
        fh.truncate(lc.MAX_BYTES + 1)
    assert lc.load(path, key())[1].startswith("damaged: %d bytes" % (lc.MAX_BYTES + 1))
    too_big = {"schema": at.SCHEMA, "blob": "x" * lc.MAX_BYTES}
    assert "over the cache's" in lc.store(path, key(), too_big)


def test_a_symlinked_cache_folder_is_not_written_through(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(elsewhere, root / lc.CACHE_DIR)
    path = lc.cache_path(str(root), key())
    assert "not a folder servops owns" in lc.store(path, key(), TABLE)
    assert os.listdir(elsewhere) == []


def test_the_folder_holds_at_most_max_files(tmp_path):
    for i in range(lc.MAX_FILES + 5):
        k = key(venv="/v%d" % i)
        assert lc.store(lc.cache_path(str(tmp_path), k), k, TABLE) is None
    assert len(os.listdir(tmp_path / lc.CACHE_DIR)) == lc.MAX_FILES


def test_the_engine_record_names_the_distribution_that_imports(tmp_path):
    sha, why = lc.engine_record("pytest", os.path.dirname(os.path.realpath(pytest.__file__)))
    assert why is None and len(sha) == 64
    sha, why = lc.engine_record("pytest", str(tmp_path))
    assert sha is None and "is not the installed distribution's" in why
    sha, why = lc.engine_record("no-such-dist-servops", str(tmp_path))
    assert sha is None and why.startswith("no no-such-dist-servops distribution metadata")
