"""Where the Ray workers meet: a host on the node Ray placed rank 0 on and a free port there,
chosen by rank 0 and broadcast through Ray."""

from __future__ import annotations

import ipaddress
import socket
import sys

from megatron_lite.launch.ray_spec import WorkerSpec
from megatron_lite.logging.console import emit_line


def free_port() -> int:
    """A port free on every interface of this machine (the first rank's store listens on all)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _node_address() -> str:
    """The address this worker's Ray node registered with the cluster (loopback for a local
    cluster started on it; the node's cluster interface on a real one)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node["NodeManagerAddress"]
    raise RuntimeError(f"this worker's Ray node {node_id} is not in the cluster's node list")


def _resolved(host: str) -> list[tuple[int, str]]:
    """(family, address) of every address ``host`` names; none when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return [(family, sockaddr[0]) for family, _, _, _, sockaddr in infos]


def on_this_machine(host: str) -> bool:
    """Whether ``host`` is an address of this machine: a socket binds to an address only where
    an interface has it, the check that the first rank's store can listen there."""
    for family, address in _resolved(host):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((address, 0))
                return True
            except OSError:
                continue
    return False


def rendezvous_host(configured: str | None, source: str, node_address: str,
                    whole_job_here: bool) -> tuple[str, str | None]:
    """The host every rank meets at, chosen on rank 0's machine, and a warning when the
    configured one cannot be it. Default: loopback when every worker runs on this node (it
    reaches nothing outside), else the address this node registered with Ray. A configured host
    is kept when it is an address of this machine (an interface of rank 0's node, picked by
    the user) and, for loopback, when no worker runs on another node."""
    own = "127.0.0.1" if whole_job_here else node_address
    if not configured:
        return own, None
    addresses = _resolved(configured)
    loopback = bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback
                                       for _, a in addresses)
    if on_this_machine(configured) and (whole_job_here or not loopback):
        return configured, None
    if loopback:
        why = "is loopback but the workers run on several nodes"
    elif not addresses:
        why = "does not resolve on the node Ray placed rank 0 on"
    else:
        why = f"is not an address of the node Ray placed rank 0 on ({node_address})"
    return own, (f"warning: {source}={configured} {why}; the ranks meet at {own} instead (Ray "
                 f"chooses rank 0's node: leave {source} unset, or name an interface of that node)")


def rendezvous(spec: WorkerSpec, rank: int, whole_job_here: bool) -> tuple[str, int]:
    """(host, port) agreed by every worker: the first worker's choice on its own node, broadcast
    through Ray."""
    from ray.train.collective import broadcast_from_rank_zero

    chosen = None
    if rank == 0:
        host, warning = rendezvous_host(spec.master_addr, spec.master_addr_source, _node_address(),
                                        whole_job_here)
        if warning:
            emit_line(warning, sys.stderr)
        chosen = (host, free_port())
    return broadcast_from_rank_zero(chosen)
