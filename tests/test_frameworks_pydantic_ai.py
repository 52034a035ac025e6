"""pydantic-ai, unchanged, against radixlm: an `Agent` with a tool and a structured output type,
through `OpenAIChatModel` and `OpenAIResponsesModel`, run and streamed. Its per-step settings
force the tool on the first step and the output tool after it (pydantic-ai's own way to vary
`tool_choice` by step). pydantic-ai re-serializes the arguments it sends back; from step 2 the
cached prefix is still everything the previous step computed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from framework_helpers import StepRecorder, check_cached_steps, check_idle, framework_server
from live_server import LiveServer
from pydantic import BaseModel

pydantic_ai = pytest.importorskip("pydantic_ai")
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402

pytestmark = pytest.mark.timeout(180)


class Answer(BaseModel):
    sunny: bool


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, StepRecorder]]:
    with framework_server(tmp_path_factory.mktemp("tiny-pydantic-ai")) as served:
        yield served


def _settings(ctx: Any) -> dict[str, Any]:
    """The tool on the first step, then the output tool: the run ends with an Answer."""
    choice = "required" if ctx.run_step <= 1 else ["final_result"]
    return {"temperature": 0, "max_tokens": 200, "tool_choice": choice}


@pytest.mark.parametrize("stream", [False, True], ids=["run", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_tool_then_output(served: tuple[LiveServer, StepRecorder], api: str, stream: bool) -> None:
    server, steps = served
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    provider = OpenAIProvider(openai_client=client)
    model_class = OpenAIChatModel if api == "chat" else OpenAIResponsesModel
    agent = pydantic_ai.Agent(model_class("tiny", provider=provider), output_type=Answer,
                              instructions="Use the tool, then answer.",
                              model_settings=_settings)  # fmt: skip

    @agent.tool_plain
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    question = f"Is it sunny in Oslo? ({api}, {stream})"

    async def run() -> Answer:
        if not stream:
            return (await agent.run(question)).output
        async with agent.run_stream(question) as result:
            return await result.get_output()

    assert isinstance(asyncio.run(run()), Answer)
    taken = steps.taken()
    assert len(taken) == 2 and taken[0].request["tool_choice"] == "required"
    check_cached_steps(taken)
    check_idle(server)
