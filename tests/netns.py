"""Two "hosts" on one machine: network namespaces joined by a veth pair (needs root and `ip`).

Addresses come from 198.18.0.0/15, the range reserved for network benchmarks, and exist only
inside the two namespaces, so no traffic leaves them."""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class Hosts:
    target_ns: str  # the engine's namespace
    draft_ns: str  # the draft worker's
    target_ip: str
    draft_ip: str
    target_veth: str

    def command(self, namespace: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", namespace, *argv]

    def target_veth_bytes(self) -> int:
        """Bytes received plus sent by the target's end of the veth pair."""
        out = subprocess.run(["ip", "-n", self.target_ns, "-s", "-j", "link", "show", "dev", self.target_veth],
                             check=True, capture_output=True, text=True).stdout
        stats = json.loads(out)[0]["stats64"]
        return stats["rx"]["bytes"] + stats["tx"]["bytes"]


def available() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command is missing"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts(subnet: int = 0) -> Iterator[Hosts]:
    """Namespaces sag-t-PID / sag-d-PID with 198.18.<subnet>.1 and .2, removed on exit."""
    tag = f"{os.getpid()}-{subnet}"
    veth = (f"st{tag}"[:15], f"sd{tag}"[:15])
    hosts = Hosts(f"sag-t-{tag}", f"sag-d-{tag}", f"198.18.{subnet}.1", f"198.18.{subnet}.2", veth[0])
    try:
        for ns in (hosts.target_ns, hosts.draft_ns):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for end, ns, ip in zip(veth, (hosts.target_ns, hosts.draft_ns), (hosts.target_ip, hosts.draft_ip)):
            _ip("link", "set", end, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ip}/30", "dev", end)
            _ip("-n", ns, "link", "set", end, "up")
        yield hosts
    finally:
        for ns in (hosts.target_ns, hosts.draft_ns):  # deleting a namespace deletes its veth end
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def listening_addresses(pid: int) -> set[str]:
    """The addresses this process's listening TCP sockets are bound to (IPv4 and IPv6), read
    from /proc: its socket inodes, matched against the namespace's tables."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(cols[1].split(":")[0])
                # /proc writes each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                found.add(str(ipaddress.ip_address(raw)))
    return found
