"""The peers for ``bench.resume``: their own venv, one run of a peer script, and what it printed.

The peer scripts (``bench/peers/``) import DBOS, LangGraph and psycopg, which must never enter the project's
venv. They run in a venv of their own, ``bench/.peers-venv`` (ignored by git; ``--peers-venv`` or
INTERMISSION_BENCH_PEERS_VENV put it elsewhere), which :func:`ensure_venv` makes on first use with
``python -m venv`` and pins (:data:`REQUIREMENTS`), and reuses while it has those versions. Each run is a
subprocess of that venv's python, in a database of its own on the benchmark's PostgreSQL server, with
``PEERS_RESULTS`` a temporary folder; it prints one JSON line last on stdout, which
:func:`parse_peer_output` reads. A peer that fails (a non-zero exit, no JSON line, a timeout, a venv that
could not be made) is an outcome like any other: ``ok`` is false and it carries the tail of the peer's
stderr, so the benchmark reports it and goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PEERS_DIR = HERE / "peers"
DEFAULT_VENV = HERE / ".peers-venv"

# What the peers' venv holds: the versions are pinned, so every run measures the same peers.
PINS: dict[str, str] = {
    "dbos": "3.4.0",
    "langgraph": "1.2.24",
    "langgraph-checkpoint-postgres": "3.2.0",
    "psycopg": "3.3.9",
}
REQUIREMENTS = [
    "dbos==3.4.0",
    "langgraph==1.2.24",
    "langgraph-checkpoint-postgres==3.2.0",
    "psycopg[binary,pool]==3.3.9",
    "psutil",
]
# Present at any version (what the extras and psutil bring).
PRESENT = ("psycopg-binary", "psycopg-pool", "psutil", "langgraph-checkpoint")
STDERR_TAIL_LINES = 20

_VERSIONS_SCRIPT = """
import json, sys
from importlib.metadata import PackageNotFoundError, version
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = version(name)
    except PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Peer:
    """One peer: its script in ``bench/peers`` and the arguments of the run ``bench.resume`` measures."""

    name: str
    script: str
    arguments: tuple[str, ...]

    def argv(self, python: Path, runs: int, database: str) -> list[str]:
        return [str(python), str(PEERS_DIR / self.script), "one", "--n", str(runs), *self.arguments, "--db", database]


PEERS: dict[str, Peer] = {
    "langgraph": Peer("langgraph", "bench_langgraph.py", ("--lock", "semaphore")),
    "dbos": Peer("dbos", "bench_dbos.py", ("--sender", "proc")),
}


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def wrong_versions(found: Mapping[str, str | None]) -> list[str]:
    """What the venv lacks: each pin that is missing or at another version, and each package absent."""
    wrong = [f"{name}=={pin} (has {found.get(name) or 'none'})" for name, pin in PINS.items() if found.get(name) != pin]
    wrong += [f"{name} (none)" for name in PRESENT if not found.get(name)]
    return wrong


async def _run(argv: list[str], *, capture: bool = True) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE if capture else None,
        stderr=asyncio.subprocess.STDOUT if capture else None,
        env=peer_environment(),
    )
    out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, (out or b"").decode(errors="replace")


async def installed(python: Path) -> dict[str, str | None]:
    """The versions of the pinned and the required packages in the venv of ``python``."""
    code, out = await _run([str(python), "-c", _VERSIONS_SCRIPT, *PINS, *PRESENT])
    if code != 0:
        raise RuntimeError(f"{python} could not list its packages: {out[-2000:]}")
    found: dict[str, str | None] = json.loads(out.strip().splitlines()[-1])
    return found


class VenvError(RuntimeError):
    pass


async def ensure_venv(venv: Path, say: Callable[[str], None] = print) -> dict[str, str | None]:
    """The peers' venv at ``venv``, made or mended when it lacks a pin, reused when it has them all;
    returns its packages' versions. Says what it does through ``say``."""
    python = venv_python(venv)
    if python.exists():
        found = await installed(python)
        wrong = wrong_versions(found)
        if not wrong:
            say(f"peers' venv: {venv} has {', '.join(f'{n} {found[n]}' for n in PINS)} (reused)")
            return found
        say(f"peers' venv: {venv} lacks {', '.join(wrong)}: installing the pins")
    else:
        say(f"peers' venv: creating {venv} (python -m venv)")
        code, out = await _run([sys.executable, "-m", "venv", str(venv)])
        if code != 0:
            raise VenvError(f"python -m venv {venv} exited {code}: {out[-2000:]}")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--quiet", *REQUIREMENTS]
    say("peers' venv: " + " ".join(pip))
    code, out = await _run(pip)
    if code != 0:
        raise VenvError(f"pip install exited {code}: {out[-2000:]}")
    found = await installed(python)
    wrong = wrong_versions(found)
    if wrong:
        raise VenvError(f"after pip install, {venv} still lacks {', '.join(wrong)}")
    say(f"peers' venv: ready, {', '.join(f'{n} {found[n]}' for n in PINS)}")
    return found


def peer_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a peers' venv process: the benchmark's, without what points Python at the
    project (PYTHONPATH would put the repository's packages before the peers' own), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}
    env.update(extra or {})
    return env


# --- one run --------------------------------------------------------------------------------------------


def tail(text: str, lines: int = STDERR_TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def failed(name: str, error: str, stderr: str) -> dict[str, Any]:
    return {"peer": name, "ok": False, "error": error, "stderr_tail": tail(stderr)}


def parse_peer_output(name: str, returncode: int | None, stdout: str, stderr: str) -> dict[str, Any]:
    """The outcome of one peer run from its exit status and output: ``{"peer", "ok": True, "result"}``
    with the JSON of its last stdout line, or ``{"peer", "ok": False, "error", "stderr_tail"}``."""
    if returncode is None:
        return failed(name, "did not finish", stderr)
    if returncode != 0:
        return failed(name, f"exited {returncode}", stderr)
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return failed(name, "printed no result on stdout", stderr)
    try:
        result = json.loads(lines[-1])
    except ValueError:
        return failed(name, f"its last stdout line is not JSON: {lines[-1][:200]!r}", stderr)
    if not isinstance(result, dict):
        return failed(name, f"its result is not a JSON object: {lines[-1][:200]!r}", stderr)
    if result.get("peer") != name:
        return failed(name, f"its result is another peer's ({result.get('peer')!r})", stderr)
    rate = result.get("resumes_per_s")
    if not isinstance(rate, int | float) or isinstance(rate, bool) or rate <= 0:
        return failed(name, f"its result has no resumes/s ({rate!r})", stderr)
    return {"peer": name, "ok": True, "result": result}


async def run_peer(
    peer: Peer, python: Path, runs: int, server_dsn: str, database: str, limit_s: float
) -> dict[str, Any]:
    """Run ``peer`` for ``runs`` resumes in ``database`` (which it creates and drops) on the server of
    ``server_dsn``; its outcome (see :func:`parse_peer_output`). The run has a process group of its own
    (DBOS's sender is a child of the script), killed whole when it overruns ``limit_s`` seconds."""
    with tempfile.TemporaryDirectory(prefix=f"bench-peer-{peer.name}-") as results:
        env = peer_environment({"PEERS_DATABASE_URL": server_dsn, "PEERS_RESULTS": results})
        proc = await asyncio.create_subprocess_exec(
            *peer.argv(python, runs, database),
            cwd=PEERS_DIR,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        reading = asyncio.ensure_future(proc.communicate())
        try:
            async with asyncio.timeout(limit_s):
                out, err = await asyncio.shield(reading)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = await reading
            return failed(peer.name, f"timed out after {limit_s:.0f} s", err.decode(errors="replace"))
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        return parse_peer_output(peer.name, proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))
