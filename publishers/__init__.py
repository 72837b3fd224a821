"""Publishers: the outbox relay, the expiry sweeper, and the clients hosts and the bus use.

They may import ``schemas`` and ``store`` only (docs/architecture.md).
"""
