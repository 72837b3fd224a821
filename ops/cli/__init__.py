"""The ``intermission`` command: one module per group of commands, all on the group of ``app.py``, which also
says how every command ends (its exit codes) and how it speaks (tables for people, ``--json`` for scripts)."""

from intermission.ops.cli import (  # noqa: F401 - each module adds its commands to ``main``
    access,
    dead_letters,
    doctor,
    outbox,
    pauses,  # and notices
    processes,
    quotas,
    runs,
)
from intermission.ops.cli.app import main
from intermission.ops.console.command import console_command

main.add_command(console_command)

__all__ = ["main"]
