"""The AMQP node list: parsing, the order a connect tries the nodes in, and the setting that refuses a
malformed list at start."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from yarl import URL

from intermission.fleet.settings import Settings
from intermission.publishers.amqp import (
    AmqpUrlError,
    NodeTransportFactory,
    amqp_nodes,
    safe_url,
    with_credentials,
    with_vhost,
)


def test_a_single_url_is_one_node_as_before() -> None:
    assert amqp_nodes("amqp://guest:guest@localhost:5672/") == [URL("amqp://guest:guest@localhost:5672/")]
    # No port: the scheme's default, as aiormq would pick.
    assert amqp_nodes("amqp://u:p@rabbit/v") == [URL("amqp://u:p@rabbit:5672/v")]
    assert amqp_nodes("amqps://u:p@rabbit/v") == [URL("amqps://u:p@rabbit:5671/v")]


def test_nodes_share_credentials_vhost_and_query() -> None:
    nodes = amqp_nodes("amqp://user:s%40cret@h1:5672,h2:5673,h3/prod?heartbeat=10&name=x")
    assert [(n.host, n.port) for n in nodes] == [("h1", 5672), ("h2", 5673), ("h3", 5672)]
    for node in nodes:
        assert node.user == "user"
        assert node.password == "s@cret"  # noqa: S105 (a test URL)
        assert node.path == "/prod"
        assert node.query["heartbeat"] == "10"


def test_ipv6_nodes() -> None:
    nodes = amqp_nodes("amqp://u:p@[::1]:5700,[fe80::1]/")
    assert [(n.host, n.port) for n in nodes] == [("::1", 5700), ("fe80::1", 5672)]


@pytest.mark.parametrize(
    "url",
    [
        "amqp://u:p@h1:5672,,h2/",
        "amqp://u:p@h1:5672,h2:notaport/",
        "amqp://u:p@h1:0/",
        "amqp://u:p@h1:70000/",
        "amqp://u:p@h1:/",
        "http://u:p@h1/",
        "rabbit1,rabbit2",
    ],
)
def test_malformed_lists_are_refused(url: str) -> None:
    with pytest.raises(AmqpUrlError):
        amqp_nodes(url)


def test_the_setting_refuses_a_malformed_list_naming_itself() -> None:
    with pytest.raises(ValidationError, match="INTERMISSION_AMQP_URL"):
        Settings(amqp_url="amqp://u:p@h1:5672,h2:x/")
    assert Settings(amqp_url="amqp://u:p@h1:5672,h2/").amqp_url == "amqp://u:p@h1:5672,h2/"


def test_safe_url_hides_the_password_of_a_list() -> None:
    assert safe_url("amqp://u:secret@h1:1,h2:2/v") == "amqp://u:***@h1:1,h2:2/v"
    assert "secret" not in safe_url(URL("amqp://u:secret@h1:1/v"))
    assert safe_url("amqp://h1/") == "amqp://h1/"


def test_processes_start_at_their_offset_and_the_order_wraps() -> None:
    nodes = amqp_nodes("amqp://u:p@a:1,b:2,c:3/")
    starts = {NodeTransportFactory(nodes, connect_timeout=1, offset=o).order()[0].host for o in range(3)}
    assert starts == {"a", "b", "c"}
    assert [n.host for n in NodeTransportFactory(nodes, connect_timeout=1, offset=4).order()] == ["b", "c", "a"]


def test_credentials_are_replaced_for_every_node_and_nothing_else_changes() -> None:
    listed = "amqp://guest:guest@h1:5672,h2:5673/vh%2F1?heartbeat=10"
    moved = with_credentials(listed, "demo host", "p@ss/word")
    assert moved == "amqp://demo%20host:p%40ss%2Fword@h1:5672,h2:5673/vh%2F1?heartbeat=10"
    assert [(n.host, n.port, n.user, n.password, n.path) for n in amqp_nodes(moved)] == [
        ("h1", 5672, "demo host", "p@ss/word", "/vh/1"),
        ("h2", 5673, "demo host", "p@ss/word", "/vh/1"),
    ]
    assert with_credentials("amqp://localhost/", "u", "p") == "amqp://u:p@localhost/"


def test_the_vhost_is_replaced_for_every_node_and_nothing_else_changes() -> None:
    listed = "amqp://guest:secret@h1:5672,h2:5673/old?heartbeat=5"
    moved = with_vhost(listed, "soak/1")
    assert moved == "amqp://guest:secret@h1:5672,h2:5673/soak%2F1?heartbeat=5"
    assert [(n.host, n.port, n.user, n.path, n.query.get("heartbeat")) for n in amqp_nodes(moved)] == [
        ("h1", 5672, "guest", "/soak/1", "5"),
        ("h2", 5673, "guest", "/soak/1", "5"),
    ]
    assert with_vhost("amqp://localhost", "v") == "amqp://localhost/v"


def test_the_first_node_setting_is_an_index_into_the_list() -> None:
    assert Settings().amqp_first_node is None
    assert Settings(amqp_first_node=2).amqp_first_node == 2
    with pytest.raises(ValidationError):
        Settings(amqp_first_node=-1)
    nodes = amqp_nodes("amqp://u:p@a:1,b:2,c:3/")
    assert NodeTransportFactory(nodes, connect_timeout=1, offset=2).order()[0].host == "c"
