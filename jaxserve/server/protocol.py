"""The wire format: OpenAI's request and response shapes (plus vLLM's sampling extras) as pydantic models.

The request models are strict (no "1" for 1, no 1.5 for an int, no NaN) and carry every range the engine
enforces, so the OpenAPI schema FastAPI derives from them is what the server accepts. What a schema cannot say
(a prompt longer than the context, a token id past the vocabulary, an unknown model) is a 400/404 from the
handlers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from jaxserve.sampling_params import MAX_LOGPROBS, SEED_RANGE

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


class _Strict(BaseModel):
    # Extra keys are ignored, as OpenAI does (clients send fields we have no use for, e.g. "user").
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


class _SamplingRequest(_Strict):
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
    user: str | None = None
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


class CompletionRequest(_SamplingRequest):
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_BATCH_PROMPTS)])
    max_tokens: Int(1) | None = Field(16, description="default 16; null = up to the context length")
    logprobs: Int(0, MAX_LOGPROBS) | None = None
    echo: bool | None = False
    add_special_tokens: bool | None = True


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int(1) | None = Field(None, description="default: up to the context length")
    max_completion_tokens: Int(1) | None = Field(None, description="OpenAI's newer name of max_tokens")
    logprobs: bool | None = False
    top_logprobs: Int(0, MAX_LOGPROBS) | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = Field(None, description="only plain text is supported")


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
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


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
