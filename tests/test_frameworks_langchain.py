"""langchain-openai and LangGraph, unchanged, against radixlm: a LangGraph agent loop (the
prebuilt `ToolNode` and `tools_condition`) with `bind_tools`' default non-strict schemas, its
first call forced, through Chat Completions and LangChain's Responses mode, invoked and
streamed; and `with_structured_output`. From step 2 the cached prefix is everything the previous
step computed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import pytest
from framework_helpers import StepRecorder, check_cached_steps, check_idle, framework_server
from live_server import LiveServer
from pydantic import BaseModel

langchain_openai = pytest.importorskip("langchain_openai")
graph = pytest.importorskip("langgraph.graph")
prebuilt = pytest.importorskip("langgraph.prebuilt")
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

pytestmark = pytest.mark.timeout(180)


class Answer(BaseModel):
    sunny: bool
    city: Literal["Paris", "Oslo"]


@tool
def get_weather(city: Literal["Paris", "Oslo"]) -> str:
    """Current weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, StepRecorder]]:
    with framework_server(tmp_path_factory.mktemp("tiny-langchain")) as served:
        yield served


def _llm(server: LiveServer, **kwargs: Any) -> Any:
    return langchain_openai.ChatOpenAI(
        model="tiny", base_url=server.url + "/v1", api_key="none", temperature=0,
        max_tokens=120, max_retries=0, stream_usage=True, **kwargs,
    )  # fmt: skip


def _agent_graph(llm: Any) -> Any:
    """The LangGraph tool loop: the model (its first call forced), then tools, until no call."""

    def agent(state: Any) -> dict[str, Any]:
        first = not any(m.type == "ai" for m in state["messages"])
        bound = llm.bind_tools([get_weather], tool_choice="required" if first else "auto")
        return {"messages": [bound.invoke(state["messages"])]}

    builder = graph.StateGraph(graph.MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", prebuilt.ToolNode([get_weather]))
    builder.add_edge(graph.START, "agent")
    builder.add_conditional_edges("agent", prebuilt.tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile()


@pytest.mark.parametrize("streaming", [False, True], ids=["invoke", "streamed"])
@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_a_langgraph_tool_loop(
    served: tuple[LiveServer, StepRecorder], responses: bool, streaming: bool
) -> None:
    server, steps = served
    app = _agent_graph(_llm(server, use_responses_api=responses, streaming=streaming))
    question = f"Weather in Oslo? ({responses}, {streaming})"
    messages = [SystemMessage("Use the tools."), HumanMessage(question)]
    out = app.invoke({"messages": messages}, {"recursion_limit": 8})
    kinds = [m.type for m in out["messages"]]
    assert kinds == ["system", "human", "ai", "tool", "ai"]  # a call, its result, an answer
    assert out["messages"][2].tool_calls[0]["name"] == "get_weather"
    taken = steps.taken()
    assert taken[0].request["tool_choice"] == "required" and "strict" not in str(taken[0].request)
    check_cached_steps(taken)
    check_idle(server)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(served: tuple[LiveServer, StepRecorder], method: str) -> None:
    server, steps = served
    structured = _llm(server).with_structured_output(Answer, method=method)
    answer = structured.invoke(f"Is it sunny, and where? ({method})")
    assert isinstance(answer, Answer)
    assert [s.status for s in steps.taken()] == [200]
    check_idle(server)
