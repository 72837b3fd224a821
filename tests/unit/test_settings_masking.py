"""The settings' repr never shows a password: its URLs carry them (fleet/settings.py)."""

from __future__ import annotations

from pydantic import SecretStr

from intermission.fleet.settings import Settings


def test_the_settings_repr_masks_every_url_s_password() -> None:
    settings = Settings(
        database_url="postgresql://intermission:db-pw-1@pg1:5432,pg2:5432/intermission",
        amqp_url="amqp://worker:amqp-pw-2@rabbit1:5672,rabbit2/prod",
        management_url="http://admin:mgmt-pw-3@rabbit1:15672",
        management_password=SecretStr("mgmt-pw-4"),
    )
    shown = repr(settings) + str(settings)
    for password in ("db-pw-1", "amqp-pw-2", "mgmt-pw-3", "mgmt-pw-4"):
        assert password not in shown
    assert "amqp://worker:***@rabbit1:5672,rabbit2/prod" in shown
    assert "http://admin:***@rabbit1:15672" in shown
    # Masked only where it is shown: the processes still connect with the password.
    assert settings.amqp_url == "amqp://worker:amqp-pw-2@rabbit1:5672,rabbit2/prod"
