"""What every ``intermission`` command shares: the group, the settings, how a command ends, and how it speaks.

Exit codes, the same for every command:

- 0: done, and all is well;
- 1: the command did what it could, and something is wrong (a run that is not there, a refusal, a check
  that failed), said on stderr in one line;
- 2: a server could not be reached (PostgreSQL, RabbitMQ, or its management API), said on stderr in one line
  naming which and where (password masked); click also uses 2 for a command line it could not parse, with
  its usage message.

What is for scripts goes to stdout as ONE JSON document (``--json``) and nothing else; what is for people
goes to stdout as rich tables, and every message about how it went goes to stderr.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import asdict, is_dataclass
from datetime import datetime
from enum import Enum
from typing import Any, Final, NoReturn, TypeVar

import aiormq
import click
import httpx
from aio_pika.abc import AbstractRobustConnection
from pydantic import BaseModel, ValidationError
from rich.console import Console

from intermission.fleet.settings import Settings
from intermission.ops.durations import parse_duration
from intermission.publishers.amqp import connect, safe_url
from intermission.schemas.errors import IntermissionError, StoreUnavailable
from intermission.schemas.scope import Scope
from intermission.store import Stores
from intermission.wire import TopologyOutdated

T = TypeVar("T")

EXIT_OK: Final = 0
EXIT_PROBLEM: Final = 1
EXIT_SERVER_DOWN: Final = 2

POSTGRESQL: Final = "PostgreSQL"
RABBITMQ: Final = "RabbitMQ"
MANAGEMENT_API: Final = "the RabbitMQ management API"


class ServerDown(Exception):
    """A server the command needs could not be reached."""

    def __init__(self, server: str, where: str, reason: BaseException | str) -> None:
        self.server = server
        self.where = where
        self.reason = reason if isinstance(reason, str) else f"{type(reason).__name__}: {reason}"
        super().__init__(f"cannot reach {server} at {where} ({self.reason})")


class Problem(Exception):
    """What a command reports as wrong (exit 1), in one line for people."""


@click.group()
def main() -> None:
    """Intermission: durable pauses and exactly-once resumes for AI agent runs."""
    # A command for people says what went wrong in one line of its own; the libraries' warnings on the way
    # (a node that refused a connection) would otherwise reach stderr through logging's last resort. The
    # worker and the sweeper configure real logging (JSON to stderr) over this.
    logging.getLogger().addHandler(logging.NullHandler())


def load_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        lines = [
            f"  INTERMISSION_{'_'.join(str(p) for p in err['loc']).upper()}: {err['msg']}"
            if err["loc"]
            else f"  {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        ]
        raise click.ClickException("bad settings:\n" + "\n".join(lines)) from exc


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed, else asyncio's own (None).

    A worker's time goes into many small socket reads and writes (a few PostgreSQL round trips and AMQP
    frames per command); uvloop does that bookkeeping in C, which measurably lowers the CPU a command costs
    (bench/resume.py). It is optional: everything works on asyncio's loop, which the tests use.
    """
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _server_down(exc: BaseException, settings: Settings | None) -> ServerDown | None:
    """The unreachable server behind ``exc``, when that is what it is. A long-running command (a worker)
    connects by itself, so its first failure to reach a server arrives as the driver's error."""
    if isinstance(exc, ServerDown):
        return exc
    if settings is None:
        return None
    if isinstance(exc, StoreUnavailable):
        return ServerDown(POSTGRESQL, safe_url(settings.database_url), exc.__cause__ or exc.detail)
    if isinstance(exc, aiormq.exceptions.AMQPConnectionError):
        return ServerDown(RABBITMQ, safe_url(settings.amqp_url), exc)
    if isinstance(exc, httpx.TransportError):
        return ServerDown(MANAGEMENT_API, safe_url(settings.management().url), exc)
    return None


def fail(what: str, message: str, code: int = EXIT_PROBLEM, *, error_code: str | None = None) -> NoReturn:
    """End the command: ``<what> failed[ (<error code>)]: <message>`` on stderr, and ``code``."""
    named = f" ({error_code})" if error_code else ""
    click.echo(f"{what} failed{named}: {message}", err=True)
    sys.exit(code)


def run_or_exit(what: str, work: Coroutine[Any, Any, T], settings: Settings | None = None) -> T:
    """Run ``work``; a server out of reach, a typed error or a problem ends the process with a one-line
    reason and the exit code of the module docstring, never a traceback."""
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(work)
    except Problem as exc:
        fail(what, str(exc))
    except (IntermissionError, aiormq.exceptions.AMQPConnectionError, httpx.TransportError) as exc:
        down = _server_down(exc, settings)
        if down is not None:
            fail(what, str(down), EXIT_SERVER_DOWN)
        if isinstance(exc, IntermissionError):
            fail(what, exc.detail, error_code=exc.code)
        fail(what, f"{type(exc).__name__}: {exc}")
    except ServerDown as exc:
        fail(what, str(exc), EXIT_SERVER_DOWN)
    except TopologyOutdated as exc:
        fail(what, str(exc))
    except (OSError, ConnectionError) as exc:
        fail(what, f"cannot reach a server ({type(exc).__name__}: {exc})", EXIT_SERVER_DOWN)


# --- connections, each naming its server when it cannot be reached -----------------------------------


@asynccontextmanager
async def database(settings: Settings, *, max_size: int = 2) -> AsyncIterator[Stores]:
    """The store over a small pool of the CLI's own, closed afterwards."""
    try:
        stores = await Stores.connect(
            settings.database_url,
            min_size=1,
            max_size=max_size,
            connect_timeout=settings.database_connect_timeout_seconds,
            application_name="intermission-cli",
        )
    except IntermissionError as exc:
        raise ServerDown(POSTGRESQL, safe_url(settings.database_url), exc.__cause__ or exc.detail) from exc
    try:
        yield stores
    finally:
        await stores.close()


@asynccontextmanager
async def broker(settings: Settings) -> AsyncIterator[AbstractRobustConnection]:
    """A connection of the CLI's own to the broker, as the user of ``INTERMISSION_AMQP_URL``."""
    try:
        connection = await connect(
            settings.amqp_url,
            "intermission-cli",
            reconnect_interval=settings.amqp_reconnect_seconds,
            offset=settings.amqp_first_node,
            connect_timeout=settings.amqp_connect_timeout_seconds,
        )
    except (aiormq.exceptions.AMQPConnectionError, OSError, TimeoutError) as exc:
        raise ServerDown(RABBITMQ, safe_url(settings.amqp_url), exc) from exc
    try:
        yield connection
    finally:
        await connection.close()


async def on_broker(settings: Settings, use: Callable[[AbstractRobustConnection], Awaitable[T]]) -> T:
    """``use`` a connection of the CLI's own to the broker, closed afterwards."""
    async with broker(settings) as connection:
        return await use(connection)


# --- options -------------------------------------------------------------------------------------------


class Duration(click.ParamType[float]):
    """``30m``, ``2h``, ``1d``, ``1h30m``: seconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION: Final = Duration()


def scope_of(app: str | None, tenant: str | None) -> Scope | None:
    """The scope ``--app``/``--tenant`` name (both or neither), validated."""
    if (app is None) != (tenant is None):
        raise click.UsageError("give --app and --tenant together, or neither")
    if app is None or tenant is None:
        return None
    try:
        return Scope(app=app, tenant=tenant)
    except ValidationError as exc:
        raise click.BadParameter("app and tenant must match [A-Za-z0-9_-]{1,64}") from exc


def scope_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--tenant", default=None, help="the run's tenant (with --app)")(f)
    return click.option("--app", default=None, help="the run's app (not needed when the run id is unique)")(f)


json_option = click.option("--json", "as_json", is_flag=True, help="one JSON document on stdout, for scripts")


# --- output ------------------------------------------------------------------------------------------


def people() -> Console:
    """Where tables for people go: stdout, as it is when the command runs (a test's runner replaces it)."""
    # Piped into a file or a pager, a table keeps its lines whole rather than folding them at 80 columns.
    wide = None if sys.stdout.isatty() else 200
    return Console(file=sys.stdout, highlight=False, width=wide)


def say(message: str) -> None:
    """A message for people: stderr, so that stdout stays what was asked for."""
    click.echo(message, err=True)


def plain(value: Any) -> Any:
    """``value`` as JSON can hold it: dataclasses and models as objects, times as RFC 3339, enums by value,
    UUIDs as text."""
    if isinstance(value, BaseModel):
        return plain(value.model_dump(mode="json"))
    if is_dataclass(value) and not isinstance(value, type):
        return plain(asdict(value))
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def emit_json(document: Any) -> None:
    click.echo(json.dumps(plain(document), indent=2, sort_keys=True))


def when(moment: datetime | None) -> str:
    return f"{moment:%Y-%m-%d %H:%M:%S}" if moment is not None else "-"
