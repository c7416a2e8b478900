"""The wire format: OpenAI's request and response shapes (plus vLLM's sampling extras) as pydantic models.

The request models are strict (no "1" for 1, no 1.5 for an int, no NaN) and carry every range the engine
enforces, so the OpenAPI schema FastAPI derives from them is what the server accepts. What a schema cannot say
(a prompt longer than the context, a token id past the vocabulary, an unknown model) is a 400/404 from the
handlers. A key no model declares is a 400 naming it (nothing is silently ignored), unless its value is null, []
or {}, or it is one of the ``IGNORED_FIELDS`` (metadata that cannot change the output).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator

from jaxserve.core.sampling_params import MAX_LOGPROBS, SEED_RANGE

MAX_N = 16  # choices per prompt
MAX_STOP = 16  # stop strings per request
MAX_BATCH_PROMPTS = 64  # prompts in one /v1/completions request
INT32_MAX = 2**31 - 1  # the engine keeps some fields in int32


def _integral(v):
    return int(v) if isinstance(v, float) and v.is_integer() else v


def Int(lo: int | None = None, hi: int | None = None):
    """An int in [lo, hi]. JSON Schema's "integer" is any number without a fraction (2.0 too), and the schema is
    the contract, so 2.0 is accepted as 2 (the range is applied first, so the schema shows it)."""
    return Annotated[int, Field(ge=lo, le=hi), BeforeValidator(_integral)]


NonEmptyStr = Annotated[str, Field(min_length=1)]
# Token ids: the app writes the vocabulary's bound into the schema where it finds the "x-token-id" mark.
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-token-id": True}), BeforeValidator(_integral)]
TokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,8})$", json_schema_extra={"x-token-id": True})]


# Request fields that cannot change what is generated (who is asking, what to store, billing and cache hints):
# accepted with any value in every request body and ignored. Any other field a model does not declare is refused
# (400 naming it), unless its value is null, [] or {} (nothing asked for: clients send those for unset options).
IGNORED_FIELDS = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "parallel_tool_calls",
)

_UNSET_SCHEMA = {
    "anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}, {"type": "object", "maxProperties": 0}],
    "description": "fields not listed here are refused unless null, [] or {}",
}


def _is_unset(value) -> bool:
    return value is None or (isinstance(value, (list, dict)) and not value)


@functools.cache
def _known_keys(model: type[BaseModel]) -> frozenset[str]:
    """The keys a model reads: its fields' names and aliases (``schema`` for ``schema_``)."""
    return frozenset(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


class _Strict(BaseModel):
    """A JSON object of the API: undeclared keys are refused (``extra_forbidden``, answered 400 naming the key),
    except those whose value asks for nothing (null, [], {})."""

    model_config = ConfigDict(
        strict=True,
        allow_inf_nan=False,
        extra="forbid",
        json_schema_extra=lambda schema, cls: cls._schema_extra(schema),
    )

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data):
        if isinstance(data, dict):
            known = cls._known_keys()
            drop = [k for k, v in data.items() if k not in known and cls._ignored(k, v)]
            if drop:
                data = {k: v for k, v in data.items() if k not in drop}
        return data

    @classmethod
    def _known_keys(cls) -> frozenset[str]:
        return _known_keys(cls)

    @classmethod
    def _ignored(cls, key: str, value) -> bool:
        return _is_unset(value)

    @classmethod
    def _schema_extra(cls, schema: dict) -> None:
        schema["additionalProperties"] = _UNSET_SCHEMA


class _Request(_Strict):
    """A request body: besides the nested objects' rule, the ``IGNORED_FIELDS`` are accepted with any value."""

    @classmethod
    def _ignored(cls, key: str, value) -> bool:
        return key in IGNORED_FIELDS or _is_unset(value)

    @classmethod
    def _schema_extra(cls, schema: dict) -> None:
        super()._schema_extra(schema)
        props = schema.setdefault("properties", {})
        for name in IGNORED_FIELDS:
            props.setdefault(name, {"description": "accepted and ignored"})


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk
    include_obfuscation: bool | None = Field(None, description="accepted; events carry no obfuscation padding")


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema; omitted: any object")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema")


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs``: exactly one constraint on what is generated."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema")
    regex: str | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    grammar: str | None = Field(None, description="Lark (llguidance's dialect) or GBNF (root ::= ...)")
    json_object: bool | None = None
    disable_any_whitespace: bool | None = False


class _SamplingRequest(_Request):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str | None = Field(None, description="a served model name; omitted = the served model")
    n: Int(1, MAX_N) | None = 1
    best_of: Int(1, MAX_N) | None = Field(None, description="only best_of = n is served (candidates are not ranked)")
    temperature: float | None = Field(None, ge=0.0, le=100.0, description="default 1.0; 0 = greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: Int(*SEED_RANGE) | None = Field(None, description="a 64-bit signed int, as vLLM takes")
    # vLLM's extras
    top_k: Int(-1, INT32_MAX) | None = Field(None, description="0 or -1 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    min_tokens: Int(0, INT32_MAX) | None = 0
    ignore_eos: bool | None = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=256)] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    priority: Int(-INT32_MAX - 1, INT32_MAX) | None = Field(0, description="lower runs first (priority policy)")
    prompt_logprobs: Int(0, MAX_LOGPROBS) | None = None
    # constraints on what is generated: at most one of these
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema")
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="older name of structured_outputs.json")
    guided_regex: str | None = Field(None, description="older name of structured_outputs.regex")
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    guided_grammar: str | None = Field(None, description="older name of structured_outputs.grammar")
    guided_decoding_backend: Literal["auto", "llguidance"] | None = Field(None, description="the one backend")


class CompletionRequest(_SamplingRequest):
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)
        ]
    )
    max_tokens: Int(0) | None = Field(
        16,
        description="default 16; null = up to the context length; 0 (with echo) = only the prompt, with its logprobs",
    )
    logprobs: Int(0, MAX_LOGPROBS) | None = None
    echo: bool | None = False
    add_special_tokens: bool | None = True


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Strict):
    """A call in an assistant message sent back in the conversation."""

    name: str
    arguments: str | dict[str, Any] = Field(description="the arguments as JSON text (OpenAI's) or an object")


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="an assistant's calls, sent back")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")
    function_call: FunctionCallIn | None = Field(None, description="an assistant's call (legacy functions)")


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = Field(None, description="accepted; calls forced by tool_choice always follow the schema")


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int(1) | None = Field(None, description="default: up to the context length")
    max_completion_tokens: Int(1) | None = Field(None, description="OpenAI's newer name of max_tokens")
    logprobs: bool | None = False
    top_logprobs: Int(0, MAX_LOGPROBS) | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without"
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call")
    functions: list[FunctionDefinition] | None = Field(None, description="older form of tools")
    function_call: Literal["none", "auto"] | NamedFunction | None = Field(None, description="older tool_choice")


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


def _tokenize_kind(body) -> str:
    return "chat" if isinstance(body, dict) and not _is_unset(body.get("messages")) else "text"


# POST /tokenize: a chat (with "messages") or a text; told apart first, so errors are those of the one meant
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("text")] | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class ResponseInputText(_Strict):
    """A text part of a Responses input message (``output_text``: an earlier answer, sent back as it came)."""

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = Field(None, description="of an output_text sent back; not read")


class ResponseInputMessage(_Strict):
    """A message of a Responses ``input`` list (an ``EasyInputMessage``, or an earlier output message)."""

    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ResponseInputText], Field(min_length=1)]
    id: str | None = Field(None, description="of an output message sent back; not read")
    status: Literal["in_progress", "completed", "incomplete"] | None = Field(None, description="not read")


class ResponseTextFormat(_Strict):
    """The Responses API's output format: plain text, any JSON object, or JSON valid under ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = Field(None, description="with json_schema")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="with json_schema: the JSON schema")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseTextConfig(_Strict):
    format: ResponseTextFormat | None = Field(None, description="text (default), json_object or json_schema")


class ResponsesRequest(_SamplingRequest):
    """POST /v1/responses: OpenAI's Responses API, one assistant message per request, nothing stored.

    Of the fields shared with the completions endpoints, those ``RESPONSES_SAMPLING_FIELDS`` lists are served;
    any other (``n``, ``prompt_logprobs``, ...) set to something else than its default is answered 400."""

    input: NonEmptyStr | Annotated[list[ResponseInputMessage], Field(min_length=1)] = Field(
        description="a user message, or the conversation"
    )
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: Int(1) | None = Field(None, description="default: up to the context length")
    text: ResponseTextConfig | None = None
    truncation: Literal["disabled"] | None = Field(None, description="a prompt too long for the context is a 400")


# The fields of _SamplingRequest that /v1/responses serves.
RESPONSES_SAMPLING_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "stop",
    "stream",
    "stream_options",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "priority",
)


# ---------------------------------------------------------------------------------------------------- responses
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # per prompt position, token id -> logprob (vLLM's shape)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object, as text")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = Field(None, description="the calls the answer made (with tools)")
    function_call: FunctionCallOut | None = Field(None, description="the call made (legacy functions)")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls", "function_call"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """GET /tokenizer_info (vLLM's): the tokenizer's configuration in the keys of HF's ``tokenizer_config.json``."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    add_bos_token: bool
    add_eos_token: bool
    model_max_length: int
    chat_template: str | None = None
    added_tokens_decoder: dict[str, dict[str, Any]]


# ---------------------------------------------------------------------------------------------------- stream chunks
class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(BaseModel):
    """One ``data:`` event of a streamed completion (the last, with ``stream_options.include_usage``, has no
    choices and the usage)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = Field(None, description="the next piece of the arguments' JSON text")


class DeltaToolCall(BaseModel):
    """A piece of call ``index``: its first carries id, type and the function's name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunctionCall | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls", "function_call"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------------------------------------- /v1/responses
class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ResponseOutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[ResponseOutputText]


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """A /v1/responses answer (and the ``response`` of its lifecycle events)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[ResponseOutputMessage]
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str = "auto"
    tools: list[Any] = []
    text: dict[str, Any] = {"format": {"type": "text"}}
    truncation: Literal["disabled"] = "disabled"
    store: bool = False
    metadata: dict[str, str] = {}
    usage: ResponseUsage | None = None


class ResponseStreamEvent(BaseModel):
    """One event of a streamed /v1/responses answer (``response.created`` ... ``response.completed``); the SSE
    ``event`` field repeats ``type``."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int
