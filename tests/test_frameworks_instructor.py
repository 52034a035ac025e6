"""instructor, unchanged, against radixlm: `response_model` extraction in its TOOLS mode (a forced
call with a non-strict schema) and JSON_SCHEMA mode (a response format without
additionalProperties), over two turns of one conversation (the first answer resent as the
client returned it); and a streamed partial. From the second turn the cached prefix is
everything the first computed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from framework_helpers import StepRecorder, check_cached_steps, check_idle, framework_server
from live_server import LiveServer
from pydantic import BaseModel, Field

instructor = pytest.importorskip("instructor")

pytestmark = pytest.mark.timeout(180)


class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
    celsius: int = Field(ge=-9, le=9)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, StepRecorder]]:
    with framework_server(tmp_path_factory.mktemp("tiny-instructor")) as served:
        yield served


def _returned(completion: Any) -> list[dict[str, Any]]:
    """The assistant message as the client got it (and a result for each call)."""
    message = completion.choices[0].message
    out: list[dict[str, Any]] = [{"role": "assistant", "content": message.content}]
    if message.tool_calls:
        out[0]["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        out += [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in message.tool_calls]
    return out


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_two_extractions_in_one_conversation(
    served: tuple[LiveServer, StepRecorder], mode: str
) -> None:
    server, steps = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    extract = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    kwargs = {"model": "tiny", "response_model": Weather, "temperature": 0, "max_tokens": 200,
              "max_retries": 0}  # fmt: skip
    messages = [{"role": "system", "content": "Extract the weather."},
                {"role": "user", "content": f"Oslo is at 3 degrees ({mode})."}]  # fmt: skip
    first, completion = extract.chat.completions.create_with_completion(messages=messages, **kwargs)
    assert isinstance(first, Weather)
    messages += [*_returned(completion), {"role": "user", "content": "And Paris is at 5."}]
    assert isinstance(extract.chat.completions.create(messages=messages, **kwargs), Weather)
    check_cached_steps(steps.taken())
    check_idle(server)


def test_a_streamed_partial(served: tuple[LiveServer, StepRecorder]) -> None:
    """Calls stream whole (never half a call), so the last partial is the whole object."""
    server, steps = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    extract = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    partials = list(extract.chat.completions.create_partial(
        model="tiny", response_model=Weather, temperature=0, max_tokens=200,
        messages=[{"role": "user", "content": "Oslo, 4 degrees, streamed."}]))  # fmt: skip
    assert partials and Weather.model_validate(partials[-1].model_dump())
    assert [s.status for s in steps.taken()] == [200]
    check_idle(server)
