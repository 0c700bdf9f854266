"""The bodies serve.py reads and writes, as pydantic models, and what a request may ask beyond
their types (`check_fields`): serve.py validates each request with them and /openapi.json
describes every body by them (what an SDK generator or a fuzzer reads).

The request models follow OpenAI's API where this engine honours a field, with vLLM's extensions
`ignore_eos`, `min_tokens` and `stream_options.continuous_usage_stats`. Every optional field may be
null (meaning: left out). An integer field takes a whole-number float (15.0, as OpenAI does), not
a string or a boolean; NaN and infinities are refused. An unknown field is an error (never
silently ignored), and so are the fields in NEUTRAL at any value but the one that changes
nothing: `check_fields` checks those, and what the types cannot say, after these models; `invalid`
names the field of a body they refused. Bodies are parsed by pydantic's own JSON parser
(model_validate_json), which reads integers of any length and refuses, as invalid JSON, a lone
surrogate ("\\ud800", which no tokenizer encodes) and nesting deeper than 200 levels.
"""
from typing import Annotated, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints,
                      Strict, ValidationError)


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
    # OpenAI's fields that the engine honours only at their neutral value (NEUTRAL, below)
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


# -- what a request may ask beyond its types (serve.py turns a BadRequest into OpenAI's error)

# OpenAI's fields the engine honours only at the value that changes nothing (null, or one of
# these); any other value is a 400 naming it, never silently ignored
NEUTRAL = {"n": (1,), "top_p": (1,), "presence_penalty": (0,), "frequency_penalty": (0,),
           "logprobs": (False,), "echo": (False,), "best_of": (1,), "logit_bias": ({},),
           "top_logprobs": (), "suffix": ()}


class BadRequest(Exception):
    """A request refused: a 400 naming the field (404: an unknown model; 413: too large)."""

    def __init__(self, message, param=None, code=None, status=400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def check_fields(body: CompletionRequest | ChatRequest, model_id: str, defaults) -> dict:
    """The request's settings from its validated body (its prompts are serve.py's to encode), or
    a BadRequest naming the field. defaults: the server's (max_new_tokens)."""
    for name, neutral in NEUTRAL.items():
        value = getattr(body, name, None)
        # a bool matches a bool only: 0 == False, yet a completion's logprobs=0 asks for logprobs
        if value is not None and not any(
                value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
            raise BadRequest(f"{name}={value!r} is not supported: this engine samples one answer "
                             f"per prompt from the model's own law; leave {name} out", name,
                             "unsupported_parameter")
    if body.model is not None and body.model != model_id:
        raise BadRequest(f"the model {body.model!r} does not exist: this server serves "
                         f"{model_id!r}", "model", "model_not_found", status=404)
    given = body.max_completion_tokens if isinstance(body, ChatRequest) else None
    param = "max_completion_tokens" if given is not None else "max_tokens"
    max_tokens = given or body.max_tokens or defaults.max_new_tokens
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        raise BadRequest(f"min_tokens={min_tokens} is more than {param}={max_tokens}",
                         "min_tokens", "invalid_value")
    options = body.stream_options
    if options is not None and not body.stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options",
                         "invalid_value")
    include_usage = bool(options and options.include_usage)
    return {"max_tokens": max_tokens, "max_tokens_param": param, "min_tokens": min_tokens,
            "ignore_eos": bool(body.ignore_eos), "stream": bool(body.stream),
            "stop": [body.stop] if isinstance(body.stop, str) else body.stop or [],
            "temperature": body.temperature, "seed": body.seed, "usage": include_usage,
            # vLLM's: usage on every chunk, only with include_usage
            "continuous": include_usage and bool(options.continuous_usage_stats)}


def message_text(content, i: int) -> str:
    """A message's content: a string, or text parts (joined by newlines, as vLLM does)."""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            what = ("a text part without text" if part.type == "text" else
                    f"a part of type {part.type!r}")
            raise BadRequest(f"messages[{i}].content[{j}] is {what}: this server reads text "
                             f"only", f"messages[{i}].content[{j}]", "unsupported_content")
    return "\n".join(part.text for part in content)


def invalid(e: ValidationError) -> BadRequest:
    """A body these models refused -> a 400 naming the field of the first error."""
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        why = first["msg"].removeprefix("Invalid JSON: ")
        return BadRequest(f"malformed JSON: {why}", code="invalid_json")
    if first["type"] == "extra_forbidden":
        param = ".".join(filter(None, [field_path(first["loc"][:-1]), str(first["loc"][-1])]))
        return BadRequest(f"unknown or unsupported field {param!r}: leave it out", param,
                          "unsupported_parameter")
    param = field_path(first["loc"])
    if param is None:
        return BadRequest("the request body must be a JSON object", code="invalid_type")
    why = "; or ".join(dict.fromkeys(x["msg"] for x in errors if field_path(x["loc"]) == param))
    return BadRequest(f"{param}: {why}", param, "invalid_value")


def field_path(loc) -> str | None:
    """pydantic's error location as OpenAI's param ("messages[0].role"), up to the tag pydantic
    puts after a field of several types ("list[int]", "str")."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool"):
            path += f".{part}" if path else part
        else:
            break
    return path or None


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


def openapi_schema(app, bodies: dict) -> dict:
    """serve.py's /openapi.json: FastAPI's, with the request bodies (`bodies`: path -> model)
    that the handlers parse themselves by the models above, and without the 422 that the server
    never sends (a bad body is a 400)."""
    from fastapi.openapi.utils import get_openapi  # serve.py's dependency, imported there first
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in bodies.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    for operations in schema["paths"].values():
        for op in operations.values():
            op["responses"].pop("422", None)
    for unused in ("HTTPValidationError", "ValidationError"):  # (the 422's body)
        components.pop(unused, None)
    return schema
