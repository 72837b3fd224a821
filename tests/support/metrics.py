"""Reading a worker's Prometheus endpoint the way Prometheus does: over HTTP, parsed by its own parser."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        body: bytes = response.read()
        return body.decode()


def get(port: int, path: str) -> tuple[int, str]:
    """The status and body of ``GET path`` on the metrics port, a 503 included (urllib raises it)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status), bytes(response.read()).decode()
    except urllib.error.HTTPError as error:
        return error.code, bytes(error.read()).decode()


def readiness(port: int) -> tuple[int, dict[str, Any]]:
    """``/readyz``: its status and its JSON; (0, {}) while nothing listens yet."""
    try:
        status, body = get(port, "/readyz")
    except OSError:
        return 0, {}
    found: dict[str, Any] = json.loads(body)
    return status, found


def listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses a socket of this machine listens on at ``port`` (Linux's /proc/net/tcp)."""
    found: set[str] = set()
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found
