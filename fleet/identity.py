"""Lease owners name one process incarnation, never a reused name."""

from __future__ import annotations

import os
import secrets
import socket


def incarnation(prefix: str = "worker") -> str:
    # Host and pid say where; the random part makes a restarted process with a recycled pid a different
    # owner, so it can never mistake a dead predecessor's lease for its own.
    return f"{prefix}@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(6)}"
