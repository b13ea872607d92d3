"""The HTTP API's request and response shapes as pydantic models: the OpenAPI contract.

Requests are strict (a JSON int is accepted for a float, nothing else is coerced) and forbid
unknown fields: every accepted field either takes effect or is rejected with a 400 that names
it (`requests.py` rejects the declared-but-unsupported ones). Fields accepted and ignored,
because they cannot change the output: `user`, `metadata`, `store`, `parallel_tool_calls`.
Response models document what handlers return; handlers build plain dicts (no per-response
validation cost), and the contract is checked by fuzzing the live server (tests/test_fuzz.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WrapValidator


def _clean_text(value: str) -> str:
    """Text a tokenizer can take: no lone surrogates (not encodable as UTF-8), no NUL."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it contains a lone surrogate)") from None
    if "\x00" in value:
        raise ValueError("text must not contain NUL characters")
    return value


Text = Annotated[str, AfterValidator(_clean_text)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def _plain_ids_first(value, handler):
    """A prompt that is one list of non-negative ints (token ids: the common case) is taken as
    it is, without trying the union's other members: checked as a list of texts, each id made
    an error object (a 1,056-id prompt's body took 126 us to validate, 34 with this). Anything
    else goes through the whole union, so the accepted values and every 400 are the same."""
    if type(value) is list and value and all(type(t) is int for t in value) and min(value) >= 0:
        return value
    return handler(value)


Prompts = Annotated[Text | list[Text] | TokenIds | list[TokenIds], WrapValidator(_plain_ids_first)]
IdPrompts = Annotated[TokenIds | list[TokenIds], WrapValidator(_plain_ids_first)]
NOT_YET_SUPPORTED = {  # fields of other engines' structured-output APIs mci does not take
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structural_tag",
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = Field(
        None, description='{"name", "schema", "strict"} with type json_schema'
    )


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions (OpenAI, then vLLM/SGLang extras)."""

    model: str | None = None
    max_tokens: int | None = Field(None, description="tokens to generate (default 16)")
    temperature: float | None = Field(None, description="0 is greedy; default 1")
    top_p: float | None = None
    n: int | None = Field(None, description="samples per prompt (default 1)")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100], added to the logit"
    )
    seed: int | None = None
    user: str | None = Field(None, description="accepted and ignored")
    # extras, named as in vLLM and SGLang
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = Field(None, description="smaller is served first")
    speculative: bool | None = Field(
        None, description="false: no speculative drafts for this request (opt-out; default true)"
    )
    return_token_ids: bool | None = Field(
        None, description="each choice (and each streamed chunk's) carries its token ids"
    )
    resume_output_token_ids: list[int] | None = Field(
        None,
        description="mci router: continue from this output (generated elsewhere); n = 1",
    )
    resume_text_offset: int | None = Field(
        None, description="mci router: characters of that output's text already delivered"
    )
    # structured output: at most one of these (vLLM's guided_* spellings accepted too)
    response_format: ResponseFormat | None = None
    regex: Text | None = Field(None, description="the output fully matches this regex")
    guided_regex: Text | None = Field(None, description="vLLM's name for regex")
    choice: list[Text] | None = Field(None, description="the output is one of these strings")
    guided_choice: list[Text] | None = Field(None, description="vLLM's name for choice")
    ebnf: Text | None = Field(None, description="the output matches this EBNF grammar (root)")
    guided_grammar: Text | None = Field(None, description="vLLM's name for ebnf")
    guided_json: dict[str, Any] | Text | None = Field(
        None, description="vLLM's: the output is JSON valid against this schema"
    )


class CompletionRequest(_SamplingFields):
    prompt: Prompts
    echo: bool | None = False
    logprobs: int | None = Field(None, description="top alternatives per token, 0-20")
    suffix: str | None = Field(None, description="not supported: must be absent or empty")
    best_of: int | None = Field(None, description="only equal to n is supported")
    token_healing: bool | None = Field(
        None, description="back off the prompt's last token(s) and regenerate them (opt-in)"
    )


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(_Strict):
    name: Text
    arguments: Text  # JSON text of an object, as the API returned it


class ToolCall(_Strict):
    id: Text
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant: calls it made")
    tool_call_id: Text | None = Field(None, description="tool: the call this result answers")


class FunctionDefinition(_Strict):
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = Field(None, description="accepted and ignored")
    metadata: dict[str, str] | None = Field(None, description="accepted and ignored")
    store: bool | None = Field(None, description="accepted and ignored")


class NativeSamplingParams(_Strict):
    """SGLang's `sampling_params` object."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    speculative: bool | None = None
    n: int | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    json_schema: Text | None = Field(None, description="the output is JSON valid against it")
    regex: Text | None = None
    ebnf: Text | None = None
    token_healing: bool | None = None


class GenerateRequest(_Strict):
    """SGLang's native `/generate`: exactly one of `text` or `input_ids`."""

    text: Text | list[Text] | None = None
    input_ids: IdPrompts | None = None
    sampling_params: NativeSamplingParams | None = None
    stream: bool | None = False
    priority: int | None = None


# ---- responses --------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


FinishReason = Literal["stop", "length"] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class NativeFinish(BaseModel):
    type: Literal["stop", "length"]
    matched: str | int | None = None


class NativeMetaInfo(BaseModel):
    id: str
    finish_reason: NativeFinish | None = None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_details: dict[str, int] | None = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: NativeMetaInfo


class HealthResponse(BaseModel):
    status: str
