import json
import shlex
import subprocess

import pytest

from servops import shell
from servops.inspect import parse_range
from servops.errors import ServopsError
from servops.redact import Redactor, secret_values


def sh(cmd: str) -> str:
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True).stdout


def test_remote_path_keeps_home_but_quotes_the_rest(tmp_path):
    assert sh("echo " + shell.remote_path("~/a b;touch x")).strip().endswith("/a b;touch x")
    assert shell.remote_path("/opt/x y") == "'/opt/x y'"
    assert sh("echo " + shell.remote_path("~")).strip() == sh("echo $HOME").strip()


def test_program_args_travel_verbatim_on_stdin():
    from servops import remote

    nasty = {"file": "; touch /tmp/pwned $(id) `id` 'q' \"d\" \\ \u2028 \n", "n": 1}
    assert shlex.split(shell.python_stdin("python3")) == ["python3", "-"]
    src = remote.with_args("inspect_file", nasty).split("\n", 1)[0]
    scope = {}
    exec(src, scope)
    assert json.loads(scope["_SERVOPS_ARGS"]) == nasty


def test_program_environment_travels_on_stdin_not_the_command_line():
    """A secret in a program's environment reaches the program, never argv (ps)."""
    from servops import remote

    program = remote.with_env("import os\nprint(os.environ['HF_TOKEN'] + '|' + os.environ['A'])\n",
                              {"HF_TOKEN": "hf_secret value; $(id)", "A": "1"})
    out = subprocess.run(["python3", "-"], input=program, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "hf_secret value; $(id)|1"
    assert "hf_secret" not in shell.python_stdin("python3")


@pytest.mark.parametrize("spec,expected", [
    ("60:90", (60, 90)), ("60,90", (60, 90)), ("60:", (60, None)), (":90", (None, 90)),
    ("60", (60, 60)), ("60:+10", (60, 70)),
])
def test_parse_range(spec, expected):
    assert parse_range(spec) == expected


@pytest.mark.parametrize("spec", ["", "a:b", "90:60", "0:5", ":+3", "1:2:3"])
def test_parse_range_rejects(spec):
    with pytest.raises(ServopsError, match="--lines"):
        parse_range(spec)


def test_redactor_masks_secret_named_values():
    secrets = secret_values({"HF_TOKEN": "hf_abcdef123", "env": {"API_KEY": "k-999999"}, "tp": 8})
    r = Redactor(secrets)
    assert r("token hf_abcdef123 key k-999999 tp 8") == "token *** key *** tp 8"
