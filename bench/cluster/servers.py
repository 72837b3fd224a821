"""The cluster harness's servers, on one machine beside the servers already running and without touching
them: a RabbitMQ cluster of three nodes and a PostgreSQL primary with a synchronous streaming standby.

RabbitMQ: each node is ``/usr/lib/rabbitmq/bin/rabbitmq-server`` (not the system wrapper, which would start
the machine's own node) with its own node name, AMQP and distribution ports, data and log directories, an
empty plugin list (the machine's node has the management UI's port) and a config file, and every node
shares an Erlang cookie of its own, in a HOME of the harness's (the machine node's cookie is not ours to
read). Nodes two and three join the first.

PostgreSQL: ``initdb`` a primary with ``synchronous_standby_names`` naming the standby and
``synchronous_commit=on``, ``pg_basebackup -R`` a standby from it (``primary_conninfo`` with that
``application_name``), both started with ``pg_ctl`` and every setting on the command line. As root, the
tools run as the ``postgres`` user, since PostgreSQL refuses root.

Everything lives under one directory, named in a marker file, so ``cleanup`` finds and stops it even after
the harness itself was killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.pg_cluster import binaries as test_binaries

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
MARKER = Path(
    os.environ.get("INTERMISSION_CLUSTER_STATE") or Path(tempfile.gettempdir()) / "intermission-cluster.state"
)
CTL_SECONDS = 120.0
# The application_name every standby streams under, and the primary's synchronous_standby_names.
STANDBY_NAME = "standby"
# Network namespaces of the partition fault are named so (bench/cluster/partition.py).
NETNS_PREFIX = "im-part-"


def binaries() -> Path | None:
    """PostgreSQL's server tools, pg_basebackup among them (a PATH may hold only some of them)."""
    found = test_binaries()
    if found is not None and (found / "pg_basebackup").exists():
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_basebackup"))
    return versions[-1].parent if versions else None


async def _run(*command: str, env: dict[str, str] | None = None, within: float = CTL_SECONDS) -> str:
    process = await asyncio.create_subprocess_exec(
        *command, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    async with asyncio.timeout(within):
        out, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}): {out.decode()[-2000:]}")
    return out.decode()


@dataclass(frozen=True)
class RabbitNode:
    index: int
    folder: Path
    home: Path

    @property
    def name(self) -> str:
        return f"intermission-c{self.index}@localhost"

    @property
    def port(self) -> int:
        return 5700 + self.index

    @property
    def pid_file(self) -> Path:
        return self.folder / "pid"

    def env(self) -> dict[str, str]:
        return {
            **{k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")},
            "HOME": str(self.home),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(25700 + self.index),
            "RABBITMQ_MNESIA_BASE": str(self.folder / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.folder / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.folder / "rabbitmq"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.folder / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(self.pid_file),
        }

    async def ctl(self, *args: str) -> str:
        return await _run(str(RABBIT_BIN / "rabbitmqctl"), "-n", self.name, *args, env=self.env())

    async def start(self) -> None:
        for sub in ("mnesia", "log"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        (self.folder / "enabled_plugins").write_text("[].\n")
        # guest may connect over 127.0.0.1 only, which is all these nodes listen on anyway.
        (self.folder / "rabbitmq.conf").write_text(f"listeners.tcp.1 = 127.0.0.1:{self.port}\n")
        await _run(str(RABBIT_BIN / "rabbitmq-server"), "-detached", env=self.env())
        # -detached returns before the VM has registered its name, and await_startup gives up at once on a
        # node epmd does not know yet: wait for the name first.
        deadline = time.monotonic() + CTL_SECONDS
        while True:
            try:
                await self.ctl("ping")
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        await self.ctl("await_startup", "--timeout", str(int(CTL_SECONDS)))

    def kill(self) -> int | None:
        """SIGKILL the node's Erlang VM (a node lost, not stopped); its pid, if it was running."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return pid


@dataclass(frozen=True)
class PgServer:
    name: str
    folder: Path
    port: int

    @property
    def data(self) -> Path:
        return self.folder / self.name

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    async def tool(self, bin_dir: Path, name: str, *args: str) -> str:
        command = [str(bin_dir / name), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        return await _run(*command)

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        pid = self.postmaster_pid()
        if pid is None:
            return False
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        # A killed postmaster is a zombie until whoever adopted it reaps it (a container's init may not).
        return stat.rsplit(")", 1)[-1].split()[0] != "Z"

    def kill_group(self) -> int | None:
        """SIGKILL the postmaster's whole process group (the postmaster and every backend: a machine lost,
        not a server stopped); the group, if the server was running. ``pg_ctl`` starts the postmaster in a
        session of its own, so its group is its own."""
        pid = self.postmaster_pid()
        if pid is None or not self.running():
            return None
        group = os.getpgid(pid)
        if group == os.getpgrp():
            raise RuntimeError(f"the postmaster {pid} shares the harness's process group")
        os.killpg(group, signal.SIGKILL)
        return group

    async def promote(self, bin_dir: Path) -> None:
        await self.tool(bin_dir, "pg_ctl", "-D", str(self.data), "-w", "promote")

    async def follow(self, bin_dir: Path, primary: PgServer, hba: Path) -> None:
        """Become a streaming standby of ``primary`` (``pg_basebackup -R`` into an empty data directory,
        named ``standby`` in the primary's ``synchronous_standby_names``) and start."""
        await asyncio.to_thread(shutil.rmtree, self.data, True)
        await self.tool(
            bin_dir,
            "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(primary.port),
            "-U",
            "postgres",
            "-D",
            str(self.data),
            "-R",
            "-X",
            "stream",
            # At once, not at the primary's next scheduled checkpoint (minutes away under a light load).
            "--checkpoint=fast",
            "-d",
            f"host=127.0.0.1 port={primary.port} user=postgres application_name={STANDBY_NAME}",
        )
        await self.start(bin_dir, "hba_file=" + str(hba), "hot_standby=on")

    async def start(self, bin_dir: Path, *settings: str) -> None:
        options = " ".join(
            [f"-p {self.port}", f"-k {self.folder}", "-c listen_addresses=127.0.0.1", *(f"-c {s}" for s in settings)]
        )
        log = str(self.folder / f"{self.name}.log")
        await self.tool(bin_dir, "pg_ctl", "-D", str(self.data), "-l", log, "-o", options, "-w", "start")


class Servers:
    """Three RabbitMQ nodes in one cluster and a PostgreSQL primary with a synchronous standby."""

    def __init__(self, folder: Path, nodes: int = 3, pg_ports: tuple[int, int] = (5801, 5802)) -> None:
        self.folder = folder
        self.home = folder / "home"
        self.rabbits = [RabbitNode(i, folder / f"rabbit-{i}", self.home) for i in range(1, nodes + 1)]
        self.primary = PgServer("primary", folder / "pg", pg_ports[0])
        self.standby = PgServer("standby", folder / "pg", pg_ports[1])

    @property
    def amqp_url(self) -> str:
        """The node list every process of the harness is given."""
        return "amqp://guest:guest@" + ",".join(f"127.0.0.1:{n.port}" for n in self.rabbits) + "/"

    @property
    def database_url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in (self.primary, self.standby))
        return f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"

    def _prepare(self) -> None:
        MARKER.write_text(str(self.folder))
        self.home.mkdir(parents=True, exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(20).upper())
        cookie.chmod(0o400)

    async def start(self) -> None:
        await asyncio.to_thread(self._prepare)
        await self._start_rabbits()
        await self._start_postgres()

    async def _start_rabbits(self) -> None:
        first, *others = self.rabbits
        await first.start()
        for node in others:
            await node.start()
            await node.ctl("stop_app")
            await node.ctl("join_cluster", first.name)
            await node.ctl("start_app")
            await node.ctl("await_startup", "--timeout", str(int(CTL_SECONDS)))

    async def _start_postgres(self) -> None:
        bin_dir = binaries()
        if bin_dir is None:
            raise RuntimeError("no initdb/pg_ctl found (INTERMISSION_TEST_PG_BIN)")
        pg = self.primary.folder
        pg.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            # The servers run as postgres: they must reach their folder through the harness's own.
            self.folder.chmod(0o711)
            shutil.chown(pg, "postgres", "postgres")
        p = self.primary
        await p.tool(bin_dir, "initdb", "-D", str(p.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        # A commit is acknowledged only once the standby has it: a primary lost after acknowledging a claim
        # must not take the claim with it.
        await p.start(
            bin_dir,
            "wal_level=replica",
            "max_wal_senders=5",
            "synchronous_commit=on",
            f"synchronous_standby_names={STANDBY_NAME}",
            "hba_file=" + str(self._hba(pg)),
        )
        await self.standby.follow(bin_dir, p, self._hba(pg))

    def hba(self) -> Path:
        return self.primary.folder / "pg_hba.conf"

    def _hba(self, folder: Path) -> Path:
        hba = folder / "pg_hba.conf"
        hba.write_text(
            "local all all trust\nhost all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n"
        )
        if os.geteuid() == 0:
            shutil.chown(hba, "postgres", "postgres")
        return hba

    async def cluster_status(self) -> str:
        return await self.rabbits[0].ctl("cluster_status")


async def cleanup(folder: Path | None = None) -> list[str]:
    """Stop whatever a harness started (the marker's folder unless given) and remove it; what could not be."""
    if folder is None:
        marked = await asyncio.to_thread(_marked)
        if marked is None:
            return []
        folder = marked
    problems: list[str] = []
    servers = Servers(folder)
    for node in servers.rabbits:
        if node.pid_file.exists():
            node.kill()
    bin_dir = binaries()
    for pg in (servers.standby, servers.primary):
        if bin_dir is not None and pg.data.exists() and pg.running():
            try:
                await pg.tool(bin_dir, "pg_ctl", "-D", str(pg.data), "-m", "immediate", "-w", "stop")
            except RuntimeError as exc:
                if "Is server running?" not in str(exc):
                    problems.append(str(exc)[:300])
    for netns in await asyncio.to_thread(_namespaces):
        try:
            await _run("ip", "netns", "del", netns)
        except RuntimeError as exc:
            problems.append(str(exc)[:300])
    await asyncio.to_thread(_remove, folder)
    return problems


def _namespaces() -> list[str]:
    return [p.name for p in Path("/run/netns").glob(NETNS_PREFIX + "*")]


def _marked() -> Path | None:
    return Path(MARKER.read_text().strip()) if MARKER.exists() else None


def _remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        MARKER.unlink()
