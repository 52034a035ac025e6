"""openai-agents, unchanged, against radixlm: `Agent(tools=..., output_type=...)` through both of
its models (Chat Completions and the Responses API), run and streamed. The first step is forced
(`tool_choice="required"`, reset to auto after the call, the SDK's default); from step 2 the
cached prefix is everything the previous step computed.

The tiny random model would call the tool forever under auto; a logit_bias on "{" lets it take
the answer's JSON branch instead (the grammar offers both: item 3 of the agent rules).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from framework_helpers import StepRecorder, check_cached_steps, check_idle, framework_server
from live_server import LiveServer
from pydantic import BaseModel

agents = pytest.importorskip("agents")

pytestmark = pytest.mark.timeout(180)


class Answer(BaseModel):
    sunny: bool


@agents.function_tool
def get_weather(city: Literal["Paris", "Oslo"]) -> str:
    """Current weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, StepRecorder]]:
    agents.set_tracing_disabled(True)
    with framework_server(tmp_path_factory.mktemp("tiny-agents")) as served:
        yield served


@pytest.mark.parametrize("stream", [False, True], ids=["run", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_tools_then_structured_output(
    served: tuple[LiveServer, StepRecorder], api: str, stream: bool
) -> None:
    server, steps = served
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    model = (
        agents.OpenAIChatCompletionsModel("tiny", client)
        if api == "chat"
        else agents.OpenAIResponsesModel("tiny", client)
    )
    settings = agents.ModelSettings(
        tool_choice="required", temperature=0, max_tokens=200, include_usage=True,
        extra_body={"logit_bias": {str(ord("{")): 30}},
    )  # fmt: skip
    agent = agents.Agent(name="weather", instructions="Use the tool, then answer.",
                         tools=[get_weather], model=model, model_settings=settings,
                         output_type=Answer)  # fmt: skip
    question = f"Is it sunny in Oslo? ({api}, {stream})"

    async def run() -> object:
        if not stream:
            return (await agents.Runner.run(agent, question, max_turns=4)).final_output
        result = agents.Runner.run_streamed(agent, question, max_turns=4)
        async for _ in result.stream_events():
            pass
        return result.final_output

    assert isinstance(asyncio.run(run()), Answer)
    taken = steps.taken()
    assert taken[0].request["tool_choice"] == "required" and "tool_choice" not in taken[1].request
    check_cached_steps(taken)
    check_idle(server)
