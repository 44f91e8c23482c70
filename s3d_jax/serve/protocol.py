"""OpenAI's HTTP protocol, the parts this server speaks: request bodies (checked by pydantic), response
and stream-chunk bodies, and error bodies `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

# Unknown fields (logit_bias, user, tools, ...) are ignored, as OpenAI's own clients send many.
_LAX = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _LAX
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = _LAX
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = _LAX
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class Sampling(BaseModel):
    """The fields every completion request shares. None: the server's default."""

    model_config = _LAX
    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: StrictInt | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in stops):
            raise ValueError("a stop string must not be empty")
        return stop

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # the newer name of max_tokens


class CompletionRequest(Sampling):
    prompt: StrictStr | Annotated[list[StrictInt], Field(min_length=1)] | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(last) -> dict:
    """OpenAI's usage of a finished request (its last engine Delta), and how many of its loop iterations
    verified drafts and how many were plain steps, under a key of this server's own."""
    tokens = {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
              "total_tokens": last.prompt_tokens + last.completion_tokens}
    return {**tokens, "s3d": {"drafted_iterations": last.drafted_iterations, "plain_iterations": last.plain_iterations}}


class Reply:
    """The bodies of one completion's response, non-streamed or as stream chunks."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _body(self, choice: dict, chunk: bool, **extra) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "system_fingerprint": None,
                "choices": [{"index": 0, "logprobs": None, **choice}], **extra}

    def whole(self, text: str, last) -> dict:
        choice = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return self._body({**choice, "finish_reason": last.finish_reason}, chunk=False, usage=usage(last))

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return self._body({"delta": delta, "finish_reason": finish_reason}, chunk=True)
        return self._body({"text": text, "finish_reason": finish_reason}, chunk=True)

    def usage_chunk(self, last) -> dict:
        body = self._body({}, chunk=True, usage=usage(last))
        body["choices"] = []
        return body
