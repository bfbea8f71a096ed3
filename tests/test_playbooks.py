import pytest

from servops.inventory import parse_inventory
from servops.playbooks import VariantError, load_variant
from servops.redact import Redactor
from servops.render import RenderError, render_launch, server_argv

HOST = parse_inventory("""
all:
  hosts:
    h1: {venv: /opt/v, server_port: 30000, model_path: "/models/My Model", tp: 8,
         env: {CUDA_HOME: /usr/local/cuda}, secret_vars: [HF_TOKEN]}
""", "inv.yml").hosts["h1"]


def books(tmp_path, **files):
    for name, text in files.items():
        (tmp_path / f"{name}.yml").write_text(text)
    return tmp_path


def test_shipped_piecewise_extends_baseline():
    v = load_variant("piecewise")
    assert v["chain"] == ["baseline", "piecewise"]
    assert v["server_args"]["enable-piecewise-cuda-graph"] is True
    assert v["server_args"]["tp-size"] == "{{ tp }}" and v["patches"] == ["cuda-version-no-subprocess"]
    assert r"torch\._dynamo\.exc\.Unsupported" in v["crash_signatures"]


def test_merge_rules(tmp_path):
    root = books(tmp_path,
                 a="server_args: {x: 1, y: 2}\nenv: {A: '1'}\npatches: [p1]\nhealth: {timeout: 5}\n",
                 b="extends: a\nserver_args: {y: null, z: true}\nenv: {B: '2'}\npatches: [p2, p1]\nhealth: {interval: 1}\n")
    v = load_variant("b", root)
    assert v["server_args"] == {"x": 1, "z": True}
    assert v["env"] == {"A": "1", "B": "2"} and v["patches"] == ["p1", "p2"]
    assert v["health"]["timeout"] == 5 and v["health"]["interval"] == 1


def test_cycle_and_unknown_variants(tmp_path):
    root = books(tmp_path, a="extends: b\n", b="extends: c\n", c="extends: a\n", d="extends: nope\n")
    with pytest.raises(VariantError, match="cyclic extends.*a -> b -> c -> a"):
        load_variant("a", root)
    with pytest.raises(VariantError, match="unknown variant 'nope'.*known: a, b, c, d"):
        load_variant("d", root)
    with pytest.raises(VariantError, match="unknown key 'sever_args'"):
        load_variant("e", books(tmp_path, e="sever_args: {}\n"))
    with pytest.raises(VariantError, match="not a valid regex"):
        load_variant("f", books(tmp_path, f="crash_signatures: ['(']\n"))


def test_render_quotes_every_value_and_fails_on_missing_vars(tmp_path):
    v = load_variant("piecewise")
    text = render_launch(HOST, v).script
    assert "--model-path '/models/My Model'" in text and "--tp-size 8" in text
    assert "export CUDA_HOME=/usr/local/cuda" in text
    root = books(tmp_path, m="server_args: {model-path: '{{ model_pth }}'}\n")
    with pytest.raises(RenderError, match="server_args.model-path: 'model_pth' is undefined"):
        render_launch(HOST, load_variant("m", root)).script


def test_injection_in_values_stays_one_word(tmp_path):
    import shlex
    root = books(tmp_path, x="env: {EVIL: '$(touch /tmp/pwned); x'}\nserver_args: {served-model-name: 'a b; rm -rf /'}\n")
    text = render_launch(HOST, load_variant("x", root)).script
    line = next(l for l in text.splitlines() if l.startswith("exec "))
    assert shlex.split(line)[-2:] == ["--served-model-name", "a b; rm -rf /"]
    assert "export EVIL='$(touch /tmp/pwned); x'" in text


def test_server_argv():
    assert server_argv({"tp": 8, "flag": True, "off": False, "none": None, "many": [1, 2]}) == \
        ["--tp", "8", "--flag", "--many", "1", "2"]


def test_secrets_go_to_a_file_never_into_the_script(tmp_path):
    host = parse_inventory("all: {hosts: {h: {venv: /v, server_port: 1, model_path: m, tp: 1, "
                           "env: {HF_TOKEN: hf_secretvalue123}}}}", "i.yml").hosts["h"]
    launch = render_launch(host, load_variant("baseline"))
    # the host needs it, from the 0600 secrets file the script sources; never inline in the script
    assert "hf_secretvalue123" not in launch.script and "set -a; . ./secrets.env; set +a" in launch.script
    assert launch.secrets_file() == "HF_TOKEN=hf_secretvalue123\n" and "HF_TOKEN" not in launch.env
    assert "hf_secretvalue123" not in Redactor.for_host(host)(launch.secrets_file())


def test_home_relative_venv_still_expands_on_the_host(tmp_path):
    import subprocess
    host = parse_inventory("all: {hosts: {h: {venv: '~/lab venv', server_port: 1, model_path: m, tp: 1}}}",
                           "i.yml").hosts["h"]
    text = render_launch(host, load_variant("baseline")).script
    line = next(l for l in text.splitlines() if l.startswith("exec "))
    assert line.startswith("exec \"$HOME\"/'lab venv/bin/python' -m sglang.launch_server")
    interpreter = line[len("exec "):].split(" -m ")[0]
    argv0 = subprocess.run(["bash", "-c", f'set -- {interpreter}; printf %s "$1"'],
                           capture_output=True, text=True).stdout
    assert argv0.endswith("/lab venv/bin/python") and not argv0.startswith("~")
