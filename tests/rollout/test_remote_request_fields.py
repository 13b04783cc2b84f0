"""The RolloutRequest parser accepts the later revisions' ``metadata``/``tool_server_url``."""

from __future__ import annotations

import pytest

from workers.rollout.remote_request import parse_rollout_request

BASE = {"rollout_id": "r1", "server_url": "http://127.0.0.1:1",
        "messages": [{"role": "user", "content": "hi"}], "tokenizer_name": "qwen3"}


def test_metadata_and_tool_server_url_are_accepted() -> None:
    request = parse_rollout_request(BASE | {"metadata": {"task": "x"},
                                            "tool_server_url": "http://127.0.0.1:2"})
    assert request.rollout_id == "r1"


@pytest.mark.parametrize("field,value", [("metadata", [1]), ("tool_server_url", 3)])
def test_wrong_types_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        parse_rollout_request(BASE | {field: value})


def test_unknown_fields_are_still_refused() -> None:
    with pytest.raises(ValueError, match="bogus"):
        parse_rollout_request(BASE | {"bogus": 1})
