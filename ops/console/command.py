"""``intermission console``: serve the web console with uvicorn until SIGTERM or SIGINT."""

from __future__ import annotations

import click
import uvicorn

from intermission.fleet.logs import configure as configure_logs

# Open live-update streams never end by themselves: a stopping console gives them this long, then closes them.
SHUTDOWN_SECONDS = 3


@click.command("console")
@click.option("--host", default="127.0.0.1", show_default=True, help="the address to listen on")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True, help="the port to listen on")
def console_command(host: str, port: int) -> None:
    """Serve the web console: people log in with their RabbitMQ user and see, and decide, the pauses waiting
    on them in the scopes the broker grants them."""
    from intermission.ops.cli.app import load_settings
    from intermission.ops.console.app import build_app

    settings = load_settings()
    configure_logs(settings.log_level)
    config = uvicorn.Config(
        build_app(settings),
        host=host,
        port=port,
        # The access log names paths only (never a form's body), in the fleet's JSON log format.
        log_config=None,
        proxy_headers=False,
        server_header=False,
        timeout_graceful_shutdown=SHUTDOWN_SECONDS,
    )
    uvicorn.Server(config).run()
