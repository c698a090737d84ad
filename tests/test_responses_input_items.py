"""GET /v1/responses/{id}/input_items on a tiny random-weight model: a stored continuation lists the
whole conversation it answered (earlier output included) in OpenAI's list shape, pages by `after`
and `limit` in either order, and refuses bad queries and unknown ids in OpenAI's error shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from mlxkv.engine.local_engine import LocalEngine
from mlxkv_serve import ServeConfig, build_app
from tests.factories import TINY_VOCAB, make_tiny_binding


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    engine = LocalEngine(make_tiny_binding("qwen3", seed=1), None)
    with TestClient(build_app(engine, ServeConfig(vocab_size=TINY_VOCAB)), raise_server_exceptions=False) as c:
        yield c
    engine.close(30)


@pytest.fixture(scope="module")
def continued(client: TestClient) -> tuple[dict[str, Any], dict[str, Any]]:
    """A stored response and its stored continuation."""
    first = client.post("/v1/responses", json={"input": [{"role": "developer", "content": "Be brief."},
                                                         {"role": "user", "content": "Hi"}], "max_output_tokens": 2}).json()
    second = client.post("/v1/responses", json={"input": "More", "previous_response_id": first["id"], "max_output_tokens": 2}).json()
    return first, second


def listed(client: TestClient, response_id: str, **query: Any) -> dict[str, Any]:
    got = client.get(f"/v1/responses/{response_id}/input_items", params=query)
    assert got.status_code == 200, got.text
    body: dict[str, Any] = got.json()
    return body


def test_a_continuation_lists_the_whole_conversation_newest_first(client: TestClient,
                                                                  continued: tuple[dict[str, Any], dict[str, Any]]) -> None:
    first, second = continued
    page = listed(client, second["id"])
    answer = first["output"][0]
    expected = [
        ("message", "user", [{"type": "input_text", "text": "More"}]),
        ("message", "assistant", [{"type": "output_text", "text": answer["content"][0]["text"]}]),
        ("message", "user", [{"type": "input_text", "text": "Hi"}]),
        ("message", "developer", [{"type": "input_text", "text": "Be brief."}]),
    ]
    assert [(e["type"], e["role"], e["content"]) for e in page["data"]] == expected
    assert len({e["id"] for e in page["data"]}) == 4 and all(e["status"] == "completed" for e in page["data"])
    assert (page["object"], page["first_id"], page["last_id"], page["has_more"]) \
        == ("list", page["data"][0]["id"], page["data"][-1]["id"], False)
    assert [e["role"] for e in listed(client, first["id"])["data"]] == ["user", "developer"]  # its own inputs only


def test_pages_follow_after_and_limit_in_either_order(client: TestClient, continued: tuple[dict[str, Any], dict[str, Any]]) -> None:
    response_id = continued[1]["id"]
    ascending = [e["id"] for e in listed(client, response_id, order="asc")["data"]]
    head = listed(client, response_id, order="asc", limit=3)
    assert [e["id"] for e in head["data"]] == ascending[:3] and head["has_more"] is True
    tail = listed(client, response_id, order="asc", limit=3, after=head["last_id"])
    assert [e["id"] for e in tail["data"]] == ascending[3:] and tail["has_more"] is False
    newest = listed(client, response_id, limit=1, after=ascending[-1])
    assert [e["id"] for e in newest["data"]] == [ascending[-2]] and newest["has_more"] is True


@pytest.mark.parametrize(("query", "param"), [({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "x"}, "limit"),
                                              ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")])
def test_a_bad_query_is_a_400_in_openais_shape(client: TestClient, continued: tuple[dict[str, Any], dict[str, Any]],
                                               query: dict[str, str], param: str) -> None:
    got = client.get(f"/v1/responses/{continued[1]['id']}/input_items", params=query)
    assert got.status_code == 400 and got.json()["error"]["param"] == param


@pytest.mark.parametrize("response_id", ["resp_" + "e" * 32, "resp_x", "..."])
def test_an_unknown_response_is_a_404_in_openais_shape(client: TestClient, response_id: str) -> None:
    got = client.get(f"/v1/responses/{response_id}/input_items")
    assert got.status_code == 404
    error = got.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "response_not_found"
