"""Agent inputs that could never produce an answer are 400s before the engine queues them, and a
resent turn is spliced back only as ids the client saw.

Each case goes through the live server: the error names the field, and the server keeps serving
with its slot accounting back at idle (the `client` fixture checks after every test).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from live_server import LiveServer
from openai.types.chat import ChatCompletionMessageParam

from radixlm.agents.tools import parse_tools

pytestmark = pytest.mark.timeout(120)

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
SELF_LOOP = {"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}
IM_START = 257  # the tiny chat model's <|im_start|> (byte b is token b; specials follow)


def _post(server: LiveServer, **body: Any) -> Any:
    return server.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body})


def _still_serves(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert response.choices[0].finish_reason in ("stop", "length")


def test_a_tool_name_with_a_trailing_newline_is_refused(
    server: LiveServer, client: openai.OpenAI
) -> None:
    tool = {"type": "function", "function": {"name": "get_weather\n", "parameters": {}}}
    with pytest.raises(ValueError, match=r"function\.name"):
        parse_tools([tool])
    response = _post(server, tools=[tool], tool_choice="required")
    assert response.status_code == 400, response.text
    assert "tools[0].function.name" in response.json()["error"]["message"]
    _still_serves(client)


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_a_schema_whose_ref_loops_on_itself_is_a_400(
    server: LiveServer, client: openai.OpenAI, where: str
) -> None:
    if where == "tools":
        parameters = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}},
                      "required": ["a"], "$defs": SELF_LOOP["$defs"]}  # fmt: skip
        tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
        body: dict[str, Any] = {"tools": [tool], "tool_choice": "required"}
    else:
        schema = {"name": "loop", "schema": SELF_LOOP}
        body = {"response_format": {"type": "json_schema", "json_schema": schema}}
    response = _post(server, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "loops on itself" in error["message"] and error["param"] == where
    _still_serves(client)


def test_a_grammar_whose_first_tokens_min_tokens_bans_is_a_400(
    server: LiveServer, client: openai.OpenAI
) -> None:
    json_mode = {"response_format": {"type": "json_object"}, "min_tokens": 2}
    response = _post(server, stop_token_ids=[ord("{")], **json_mode)  # "{" is the only start
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "min_tokens"
    fine = _post(server, stop_token_ids=[ord("}")], **json_mode)  # "}" only bans the end
    assert fine.status_code == 200, fine.text
    _still_serves(client)


def test_a_turn_holding_a_control_token_is_not_spliced_back(
    server: LiveServer, client: openai.OpenAI
) -> None:
    """Forced by logit_bias, the model writes <|im_start|> ids; the client sees text without
    them, so resending that text must not put those control ids into the next prompt."""
    first = _post(server, logit_bias={str(IM_START): 100}, max_tokens=3, return_token_ids=True)
    assert first.status_code == 200, first.text
    choice = first.json()["choices"][0]
    assert choice["token_ids"] == [IM_START] * 3 and choice["message"]["content"] == ""
    conversation = [*USER, {"role": "assistant", "content": ""}, {"role": "user", "content": "x"}]
    second = server.post("/v1/chat/completions", json={
        "messages": conversation, "max_tokens": 1, "return_token_ids": True})  # fmt: skip
    prompt = second.json()["choices"][0]["prompt_token_ids"]
    assert prompt.count(IM_START) == 4  # the template's own: three turns and the answer's
    _still_serves(client)
