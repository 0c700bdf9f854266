"""The bodies serve.py reads and writes, as pydantic models: serve.py validates each request
with them and /openapi.json describes every body by them (what an SDK generator or a fuzzer reads).

The request models follow OpenAI's API where this engine honours a field, with vLLM's extensions
`ignore_eos`, `min_tokens` and `stream_options.continuous_usage_stats`. Every optional field may be
null (meaning: left out). An integer field takes a whole-number float (15.0, as OpenAI does), not
a string or a boolean; NaN and infinities are refused. An unknown field is an error (never
silently ignored), and so are the fields in serve.NEUTRAL at any value but the one that changes
nothing: serve.py checks those after these models. Bodies are parsed by pydantic's own JSON parser
(model_validate_json), which reads integers of any length and refuses, as invalid JSON, a lone
surrogate ("\\ud800", which no tokenizer encodes) and nesting deeper than 200 levels.
"""
from typing import Annotated, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints,
                      Strict)


def whole_number(x):
    """15.0 -> 15 (OpenAI takes it where an integer is expected); anything else as given."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


Int = Annotated[int, BeforeValidator(whole_number), Strict()]
Number = Annotated[float, Strict()]  # an int or a float, not a string or a boolean
Bool = Annotated[bool, Strict()]  # true or false, not "yes" or 1
Text = Annotated[str, Strict()]
NonEmpty = Annotated[str, Strict(), StringConstraints(min_length=1)]
Seed = Annotated[Int, Field(ge=-2**63, le=2**63 - 1)]  # int64, as vLLM's


class Body(BaseModel):
    """A request body: an unknown field is an error."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(Body):
    include_usage: Bool | None = Field(
        None, description="after the last choice's chunks, one chunk with `choices: []` and "
                          "the request's usage; every other chunk has `usage: null`")
    continuous_usage_stats: Bool | None = Field(
        None, description="vLLM's: every chunk carries its choice's usage so far")


class Sampling(Body):
    """The fields both endpoints share."""
    model: Text | None = Field(None, description="the served model's id (GET /v1/models)")
    max_tokens: Annotated[Int, Field(ge=1)] | None = Field(
        None, description="tokens to generate at most (default: the server's --max-new-tokens)")
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = Field(
        None, description="0: greedy; default: the server's --temperature")
    seed: Seed | None = Field(None, description="the request's own generators: the same seed, "
                                                "the same text whatever else is in the batch")
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=4)] | None = Field(
        None, description="up to 4 strings; the text ends before the first one found")
    stream: Bool | None = Field(None, description="server-sent events of chunks")
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    user: Text | None = Field(None, description="the end user's id (not used)")
    ignore_eos: Bool | None = Field(
        None, description="vLLM's: EOS does not end the request (max_tokens or a stop string "
                          "does); the tokens are the model's, EOS included (not in the text)")
    min_tokens: Annotated[Int, Field(ge=0)] | None = Field(
        None, description="vLLM's: EOS and stop strings end the request only after this many "
                          "tokens (an earlier EOS is kept, not masked: docs/design.md, Serving)")
    # OpenAI's fields that the engine honours only at their neutral value (serve.NEUTRAL)
    n: Int | None = Field(None, description="1 only: one choice per prompt")
    top_p: Number | None = Field(None, description="1 only (the model's whole law)")
    presence_penalty: Number | None = Field(None, description="0 only")
    frequency_penalty: Number | None = Field(None, description="0 only")
    logit_bias: dict[str, Number] | None = Field(None, description="empty only")


class CompletionRequest(Sampling):
    prompt: (NonEmpty | Annotated[list[Annotated[Int, Field(ge=0)]], Field(min_length=1)]
             | Annotated[list[NonEmpty], Field(min_length=1)]
             | Annotated[list[Annotated[list[Annotated[Int, Field(ge=0)]], Field(min_length=1)]],
                         Field(min_length=1)]) = Field(
        description="a string, token ids, or a list of either: one choice each (its `index`)")
    logprobs: Int | None = Field(None, description="not served: null only")
    echo: Bool | None = Field(None, description="false only")
    best_of: Int | None = Field(None, description="1 only")
    suffix: Text | None = Field(None, description="not served: null only")


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are served (serve.py names any other)."""
    model_config = ConfigDict(extra="allow")
    type: Text = Field(description="'text' only")
    text: Text | None = None


class Message(Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[ContentPart] = Field(description="a string or a list of text parts")


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = Field(
        None, description="max_tokens' newer name; wins when both are given")
    logprobs: Bool | None = Field(None, description="false only")
    top_logprobs: Int | None = Field(None, description="not served: null only")


# -- responses

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    """A /v1/completions answer; a stream's chunks have this shape too (finish_reason null until
    a choice's last chunk, `choices: []` in the usage chunk, usage null in the others)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok", "down", "restarting the speculator"]
    mode: str
    error: str | None
    restarts: int


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error's body, OpenAI's shape."""
    error: ErrorBody
