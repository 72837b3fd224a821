"""A PostgreSQL server of a test's own, to stop and start: outages are real, and nobody else's tests lose
their database.

Made with the server's own tools (``initdb``, ``pg_ctl``) in a temporary directory, on a free port, with
trust authentication and ``fsync`` off (it is thrown away). When the process runs as root, the tools run
as the ``postgres`` user, since PostgreSQL refuses to run as root. Where the tools are not installed
(a machine that tests against a container), ``binaries()`` is None and the tests that need a stoppable
server say so and skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg

from intermission.store.migrate import migrate

CTL_SECONDS = 60.0
DATABASE = "intermission"


def binaries() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: ``INTERMISSION_TEST_PG_BIN``, else PATH, else Debian's."""
    explicit = os.environ.get("INTERMISSION_TEST_PG_BIN")
    if explicit:
        return Path(explicit)
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PrivateCluster:
    def __init__(self, bin_dir: Path, folder: Path, port: int) -> None:
        self.bin_dir = bin_dir
        self.folder = folder
        self.data = folder / "data"
        self.port = port

    @property
    def server_dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{DATABASE}"

    async def _tool(self, name: str, *args: str) -> None:
        command = [str(self.bin_dir / name), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        process = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        async with asyncio.timeout(CTL_SECONDS):
            out, _ = await process.communicate()
        if process.returncode != 0:
            log = (self.folder / "server.log").read_text() if (self.folder / "server.log").exists() else ""
            raise RuntimeError(f"{name} {' '.join(args)} failed: {out.decode()}\n{log[-2000:]}")

    async def init(self) -> None:
        await self._tool("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")

    async def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off"
        await self._tool(
            "pg_ctl", "-D", str(self.data), "-l", str(self.folder / "server.log"), "-o", options, "-w", "start"
        )

    async def stop(self) -> None:
        """A fast shutdown: every session is terminated (57P01), as a failover or restart does."""
        await self._tool("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    async def create_database(self) -> None:
        con = await asyncpg.connect(self.server_dsn)
        try:
            await con.execute(f'CREATE DATABASE "{DATABASE}"')
        finally:
            await con.close()
        await migrate(self.dsn)


@asynccontextmanager
async def private_cluster() -> AsyncIterator[PrivateCluster]:
    """A started, migrated server of its own; stopped and deleted on leaving."""
    bin_dir = binaries()
    if bin_dir is None:
        raise RuntimeError("no initdb/pg_ctl: set INTERMISSION_TEST_PG_BIN")
    folder = Path(tempfile.mkdtemp(prefix="intermission-pg-"))
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres", "postgres")
    cluster = PrivateCluster(bin_dir, folder, _free_port())
    try:
        await cluster.init()
        await cluster.start()
        await cluster.create_database()
        yield cluster
    finally:
        with contextlib.suppress(RuntimeError):  # it was stopped already
            await cluster._tool("pg_ctl", "-D", str(cluster.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(folder, ignore_errors=True)
