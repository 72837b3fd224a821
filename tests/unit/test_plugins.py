from __future__ import annotations

import pytest

from intermission.agent.loop import AgentLoop
from intermission.agent.plugins import ExecutorSettingError, load_executor
from intermission.fleet.settings import Settings


def test_the_default_executor_is_the_agent_loop() -> None:
    assert isinstance(load_executor(Settings().executor), AgentLoop)


@pytest.mark.parametrize(
    "spec", ["fleet.agent", "no.such.module:make", "fleet.agent:SYSTEM_PROMPT", "fleet.tools:Echo"]
)
def test_a_bad_executor_setting_is_named(spec: str) -> None:
    with pytest.raises(ExecutorSettingError) as caught:
        load_executor(spec)
    assert "INTERMISSION_EXECUTOR" in caught.value.detail


def test_a_bad_setting_stops_the_process_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INTERMISSION_LEASE_SECONDS", "5")
    monkeypatch.setenv("INTERMISSION_LEASE_RENEW_SECONDS", "10")
    with pytest.raises(ValueError, match="INTERMISSION_LEASE_RENEW_SECONDS"):
        Settings()
