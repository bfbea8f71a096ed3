import pytest

from servops.errors import InventoryError
from servops.inventory import load_inventory, parse_inventory

INV = """
all:
  vars: {ssh_user: ops, tp: 4, venv: /opt/venv}
  hosts:
    bastion: {ssh_host: 10.1.1.1}
  children:
    blackwell:
      vars: {tp: 8, proxy_jump: bastion}
      children:
        rack1:
          vars: {server_port: 31000}
          hosts:
            b1: {ansible_host: 10.0.0.1, ansible_port: "2200"}
            b2: {tp: 2}
    other:
      hosts:
        b2:
        x1:
"""


def test_precedence_and_aliases():
    inv = parse_inventory(INV, "inv.yml")
    b1, b2 = inv.hosts["b1"], inv.hosts["b2"]
    assert (b1.ssh_host, b1.ssh_port, b1.ssh_user) == ("10.0.0.1", 2200, "ops")
    assert b1.get("tp") == 8 and b2.get("tp") == 2  # group beats all, host beats group
    assert b1.get("server_port") == 31000 and b1.get("proxy_jump") == "bastion"
    assert b1.python == "/opt/venv/bin/python"
    assert set(b2.groups) >= {"all", "blackwell", "rack1", "other"}


def test_select_groups_hosts_and_lists():
    inv = parse_inventory(INV, "inv.yml")
    assert [h.name for h in inv.select("blackwell")] == ["b1", "b2"]
    assert [h.name for h in inv.select("rack1,x1,b1")] == ["b1", "b2", "x1"]
    assert len(inv.select(None)) == 4


@pytest.mark.parametrize("text,message", [
    ("all: [1, 2", "inv.yml: invalid YAML at line"),
    ("hosts: {}", "inv.yml: top-level key 'all' is missing"),
    ("all: {hosts: {a: {ssh_port: abc}}}", "inv.yml: all.hosts.a.ssh_port: expected a port 1-65535, got 'abc'"),
    ("all: {children: {g: {hostz: {}}}}", "inv.yml: unknown key 'all.children.g.hostz'"),
    ("all: {hosts: [a, b]}", "inv.yml: 'all.hosts' must be a mapping"),
    ("all: {hosts: {a: {accept_new_host_keys: maybe}}}", "all.hosts.a.accept_new_host_keys: expected true or false, got 'maybe'"),
])
def test_bad_inventory_is_one_line_naming_file_and_key(text, message):
    with pytest.raises(InventoryError) as err:
        parse_inventory(text, "inv.yml")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unknown_pattern_names_known_ones():
    inv = parse_inventory(INV, "inv.yml")
    with pytest.raises(InventoryError, match=r"inv.yml: no host or group named 'rack9'; did you mean rack1\? \(known: .*rack1"):
        inv.select("rack9")


def test_missing_var_is_named():
    inv = parse_inventory("all: {hosts: {h: {}}}", "inv.yml")
    with pytest.raises(InventoryError, match="host 'h' has no 'venv' var"):
        inv.hosts["h"].venv


def test_shipped_inventories_parse():
    lab = load_inventory("inventory/lab.yml")
    assert [h.name for h in lab.select("lab")] == ["lab1", "lab2", "lab3", "lab4"]
    assert lab.hosts["lab1"].get("tp") == 8
    ex = load_inventory("inventory/blackwell.example.yml")
    assert ex.hosts["b200-01"].get("proxy_jump") == "bastion"
    assert ex.hosts["b200-01"].get("model_path") == "/models/GLM-5-NVFP4"


def test_missing_file(tmp_path):
    with pytest.raises(InventoryError, match="nope.yml: inventory file not found"):
        load_inventory(tmp_path / "nope.yml")
