"""What `/openapi.json` says `POST /v1/responses` answers: models of the dicts that
`labkit.serve.responses_wire` builds. They only document the answers (what is sent is built
there); `tests/test_serve_openapi.py` validates built answers against them, and
`tests/test_serve_responses_wire.py` validates the same answers against OpenAI's own schemas.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OutputTextPart(Closed):
    type: Literal["output_text"]
    text: str
    annotations: list[dict]
    logprobs: list[dict]


class OutputMessage(Closed):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputTextPart]


class InputTokensDetails(Closed):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(Closed):
    reasoning_tokens: int


class ResponseUsage(Closed):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Closed):
    reason: Literal["max_output_tokens"]


class ResponseError(Closed):
    code: str
    message: str


class TextFormatText(Closed):
    type: Literal["text"]


class FunctionCallOutput(Closed):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InvalidToolCallEntry(Closed):
    """labkit's extension on every route that reads tool calls (labkit/serve/README.md, "Tool
    calling"): a block that is not a valid call, never passed on as one."""

    id: str
    name: Optional[str]
    arguments: Optional[str]
    error: str


class TextFormatJsonObject(Closed):
    type: Literal["json_object"]


class TextFormatJsonSchema(Closed):
    type: Literal["json_schema"]
    name: str
    schema_: dict = Field(alias="schema")
    strict: bool
    description: str = None  # absent unless the request gave one


class TextSettings(Closed):
    format: Union[TextFormatText, TextFormatJsonObject, TextFormatJsonSchema]


class ResponseObject(Closed):
    """A whole answer; also the `response` of the lifecycle events of a stream."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    completed_at: Optional[int]
    background: Literal[False]
    error: Optional[ResponseError]
    incomplete_details: Optional[IncompleteDetails]
    instructions: Optional[str]
    max_output_tokens: Optional[int]
    max_tool_calls: None
    model: str
    output: list[Union[OutputMessage, FunctionCallOutput]]
    parallel_tool_calls: bool
    previous_response_id: None
    reasoning: None
    service_tier: Literal["default"]
    store: Literal[False]
    temperature: float
    text: TextSettings
    tool_choice: Union[Literal["none", "auto", "required"], dict]
    tools: list[dict]
    top_logprobs: int
    top_p: float
    truncation: Literal["disabled"]
    usage: ResponseUsage = None   # absent until the answer ends
    user: str = None              # absent unless the request gave one
    metadata: dict[str, str]
    invalid_function_calls: list[InvalidToolCallEntry] = None   # labkit's; absent when none


class ResponseStreamEvent(Closed):
    """One event of a stream; which fields it has depends on its `type`."""

    type: Literal["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                  "response.content_part.done", "response.output_item.done", "response.completed",
                  "response.incomplete", "response.failed", "error", "response.function_call_arguments.delta",
                  "response.function_call_arguments.done"]
    sequence_number: int
    response: ResponseObject = None
    output_index: int = None
    content_index: int = None
    item_id: str = None
    item: Union[OutputMessage, FunctionCallOutput] = None
    part: OutputTextPart = None
    delta: str = None
    text: str = None
    name: str = None
    arguments: str = None
    logprobs: list[dict] = None
    code: str = None
    message: str = None
    param: Optional[str] = None
