"""Network namespaces, a bridge and nftables rules for the cluster's hosts.

Every name made here starts with ``rlkc`` (namespaces ``rlkc-<host>``, the bridge
``rlkc-br``, host-side veths ``rlkv-<host>``, ``/etc/netns/rlkc-<host>/``), so a
run killed before its teardown is cleaned up by the next one. The subnet is the
first of ``CANDIDATE_SUBNETS`` that no address or route of the machine overlaps.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from loadtests.cluster import topology

PREFIX = "rlkc"
BRIDGE = f"{PREFIX}-br"
NETNS_ETC = Path("/etc/netns")
CANDIDATE_SUBNETS = [f"10.{a}.{b}.0/24" for a in (213, 214, 215) for b in (7, 77, 177)]
NFT_TABLE = "nemesis"


class NetError(RuntimeError):
    """A command of the network setup failed (its output says why)."""


def run(*args: str, check: bool = True) -> str:
    result = subprocess.run(args, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetError(f"{' '.join(args)}: {result.stderr.strip() or result.stdout}")
    return result.stdout


def ns(name: str) -> str:
    return f"{PREFIX}-{name}"


def in_ns(host: str, *command: str) -> list[str]:
    """The command line running ``command`` in ``host``'s namespace."""
    return ["ip", "netns", "exec", ns(host), *command]


def pick_subnet() -> ipaddress.IPv4Network:
    """The first candidate /24 that overlaps no address or route in use."""
    used = []
    for kind in ("addr", "route"):
        with contextlib.suppress(NetError, ValueError):
            for entry in json.loads(run("ip", "-j", "-4", kind, "show") or "[]"):
                if kind == "addr":
                    for info in entry.get("addr_info", []):
                        used.append(
                            ipaddress.ip_network(
                                f"{info['local']}/{info['prefixlen']}", strict=False
                            )
                        )
                elif entry.get("dst") not in (None, "default"):
                    used.append(ipaddress.ip_network(entry["dst"], strict=False))
    for candidate in CANDIDATE_SUBNETS:
        network = ipaddress.IPv4Network(candidate)
        if not any(network.overlaps(other) for other in used):
            return network
    raise NetError(f"every candidate subnet is in use: {CANDIDATE_SUBNETS}")


def stale_namespaces() -> list[str]:
    names = []
    for line in run("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"{PREFIX}-"):
            names.append(name)
    return names


def kill_namespace_processes(name: str) -> None:
    """SIGKILL every process still running in namespace ``name``."""
    for _ in range(3):
        pids = [int(p) for p in run("ip", "netns", "pids", name, check=False).split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def teardown() -> list[str]:
    """Remove every namespace, link and /etc/netns entry of this tool; say which."""
    removed = []
    for name in stale_namespaces():
        kill_namespace_processes(name)
        run("ip", "netns", "del", name, check=False)  # its veth end and nft go too
        removed.append(name)
    if run("ip", "link", "show", BRIDGE, check=False):
        run("ip", "link", "del", BRIDGE, check=False)
        removed.append(BRIDGE)
    for line in run("ip", "-o", "link", "show", check=False).splitlines():
        parts = line.split(":")
        if len(parts) > 1 and parts[1].strip().startswith("rlkv-"):
            link = parts[1].strip().split("@")[0]
            run("ip", "link", "del", link, check=False)
            removed.append(link)
    if NETNS_ETC.is_dir():
        for entry in NETNS_ETC.glob(f"{PREFIX}-*"):
            shutil.rmtree(entry, ignore_errors=True)
    return removed


def setup(subnet: ipaddress.IPv4Network) -> dict[str, str]:
    """Make the bridge and one namespace per host; return {host: address}."""
    prefix = str(subnet.network_address).rsplit(".", 1)[0]
    run("ip", "link", "add", BRIDGE, "type", "bridge")
    run(
        "ip", "addr", "add", f"{prefix}.{topology.ORCHESTRATOR_OCTET}/24", "dev", BRIDGE
    )
    run("ip", "link", "set", BRIDGE, "up")
    hosts_text = topology.hosts_file(prefix)
    addresses = {}
    for host in topology.HOSTS:
        name, veth = ns(host.name), f"rlkv-{host.name}"[:15]
        run("ip", "netns", "add", name)
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
            "netns", name)  # fmt: skip
        run("ip", "link", "set", veth, "master", BRIDGE, "up")
        address = f"{prefix}.{host.octet}"
        run("ip", "-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
        run("ip", "-n", name, "link", "set", "lo", "up")
        run("ip", "-n", name, "link", "set", "eth0", "up")
        etc = NETNS_ETC / name
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts_text)
        nft(host.name, f"add table inet {NFT_TABLE}")
        for chain in ("input", "output"):
            nft(
                host.name,
                f"add chain inet {NFT_TABLE} {chain} "
                f"{{ type filter hook {chain} priority 0 ; policy accept ; }}",
            )
        addresses[host.name] = address
    return addresses


def nft(host: str, rule: str) -> None:
    """Run one nft command in ``host``'s namespace."""
    run("ip", "netns", "exec", ns(host), "nft", rule)


def heal(host: str) -> None:
    """Drop every nemesis rule of ``host`` (both chains)."""
    for chain in ("input", "output"):
        nft(host, f"flush chain inet {NFT_TABLE} {chain}")
