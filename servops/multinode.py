"""A multi-node variant (`nnodes: N`): the server args each node of one server launches with.
Shared by deploy (which groups the selected hosts into servers) and the launch check (which
checks each node's own launch), so both give a node the same rank flags."""

from __future__ import annotations

from .errors import ServopsError
from .inventory import Host


def node_args(variant: dict, hosts: list[Host]) -> list[dict]:
    """Per-node server_args, rank 0 first: --nnodes, --node-rank, --dist-init-addr ([{}]: one node)."""
    nnodes = int(variant.get("nnodes") or 1)
    if nnodes == 1:
        return [{}]
    if len(hosts) != nnodes:
        raise ServopsError(f"variant {variant['name']} needs {nnodes} nodes per server; got {len(hosts)}")
    rank0 = hosts[0]
    addr = f"{rank0.get('dist_init_host') or rank0.ssh_host}:{int(rank0.get('dist_init_port', 5000))}"
    return [{"nnodes": nnodes, "node-rank": rank, "dist-init-addr": addr} for rank in range(nnodes)]


def with_args(variant: dict, extra: dict) -> dict:
    if not extra:
        return variant
    return dict(variant, server_args=dict(variant["server_args"], **extra))


def server_groups(variant: dict, targets: list[Host]) -> list[list[Host]]:
    """The selected hosts as servers of this variant: N at a time, rank 0 first."""
    nnodes = int(variant.get("nnodes") or 1)
    if len(targets) % nnodes:
        raise ServopsError(f"variant {variant['name']} runs on {nnodes} nodes per server; select a multiple of "
                           f"{nnodes} hosts (got {len(targets)}), rank 0 first")
    return [targets[i:i + nnodes] for i in range(0, len(targets), nnodes)]


def variants_per_host(variant: dict, targets: list[Host]) -> dict[str, dict]:
    """host name -> the variant as that host launches it (a node of a multi-node server: with
    its rank flags, as deploy sets them)."""
    return {host.name: with_args(variant, extra) for group in server_groups(variant, targets)
            for host, extra in zip(group, node_args(variant, group))}
