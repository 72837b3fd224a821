"""Lease owners name one process incarnation, never a reused name."""

from __future__ import annotations

import os
import secrets
import socket


def incarnation(prefix: str = "worker") -> str:
    # Host and pid say where; the random part makes a restarted process with a recycled pid a different
    # owner, so it can never mistake a dead predecessor's lease for its own.
    return f"{prefix}@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(6)}"


def session_name(kind: str, owner: str) -> str:
    """The ``application_name`` of a process's database sessions, as ``pg_stat_activity`` shows it: the
    kind and pid first, since PostgreSQL cuts the name at 63 bytes, then the owner. An operator (and the
    cluster harness, after a failover) tells from it which process every session on a server belongs to."""
    return f"intermission-{kind} pid={os.getpid()} {owner}"[:63]
