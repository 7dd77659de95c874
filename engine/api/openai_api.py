"""The OpenAI API's request validation and response shapes, with no server library in them.

`parse_request` turns a `/v1/chat/completions` or `/v1/completions` body into an
`ApiRequest` or raises `ApiError`, which the server sends as OpenAI's error object
`{"error": {"message", "type", "param", "code"}}` with a 4xx status. Fields the API defines
but MoE Ferry does not do (tools, n > 1, logprobs) are refused rather than ignored; fields it
does not know are ignored, as OpenAI's own server does with new client fields.

Responses follow OpenAI's shapes (`chat.completion`, `chat.completion.chunk`,
`text_completion`, `list` of `model`); streams are Server-Sent Events, one `data: {json}\n\n`
per chunk and `data: [DONE]\n\n` at the end. MoE Ferry's own numbers ride along under a
`moeferry` key, which clients that do not know it ignore.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from moeferry.engine.contract import MAX_SEED

ROLES = ("system", "user", "assistant")
MAX_STOPS = 4  # as OpenAI allows


class ApiError(Exception):
    """A request the server refuses, as an OpenAI error object with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class ApiRequest:
    chat: bool                    # /v1/chat/completions (messages) or /v1/completions (prompt)
    prompt: str | list[dict]      # the completion's text, or the chat's messages
    stream: bool = False
    include_usage: bool = False   # stream_options.include_usage: a last chunk with the usage
    max_tokens: int | None = None  # None: as many as the context has room for
    temperature: float = 1.0      # OpenAI's defaults
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Requests


def parse_request(raw: bytes, chat: bool, model_id: str, max_context: int) -> ApiRequest:
    """Validate one request body; raise ApiError naming the first field that is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "The request body is not valid JSON; send a JSON object.") from None
    except RecursionError:
        raise ApiError(400, "The request body nests too deeply; send a flat JSON object.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' is required and must be a string; GET /v1/models lists the ids.", "model")
    if model != model_id:
        raise ApiError(404, f"The model '{shown(model)}' does not exist here; this server has '{model_id}'.",
                       "model", "model_not_found")
    prompt = parse_messages(body.get("messages")) if chat else parse_prompt(body.get("prompt"))
    refuse_unsupported(body)
    req = ApiRequest(chat=chat, prompt=prompt)
    req.stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, None)
    req.include_usage = bool(options) and _get(options, "include_usage", bool, False, "stream_options.")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    req.max_tokens = _get(body, name, int, None)
    if req.max_tokens is not None and not 1 <= req.max_tokens < max_context:
        raise ApiError(400, f"'{name}' must be between 1 and {max_context - 1} (this model's context is "
                            f"{max_context} tokens, prompt included); got {shown(req.max_tokens)}.",
                       name, "context_length_exceeded" if req.max_tokens >= max_context else None)
    req.temperature = _get(body, "temperature", float, 1.0)
    if not 0 <= req.temperature <= 2:
        raise ApiError(400, f"'temperature' must be between 0 and 2; got {req.temperature}.", "temperature")
    req.top_p = _get(body, "top_p", float, 1.0)
    if not 0 < req.top_p <= 1:
        raise ApiError(400, f"'top_p' must be more than 0 and at most 1; got {req.top_p}.", "top_p")
    req.seed = _get(body, "seed", int, None)
    if req.seed == -1:  # llama.cpp's server and others read -1 as "no seed"
        req.seed = None
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise ApiError(400, f"'seed' must be an integer from 0 to {MAX_SEED} (or -1 for none); got "
                            f"{shown(req.seed)}.", "seed")
    req.stop = parse_stop(body.get("stop"))
    return req


def _get(body: dict, name: str, kind: type, default, prefix: str = ""):
    """body[name] as `kind` (int accepted for float; bool never counts as a number)."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = int_as_float(value), True
    if not ok:
        words = {bool: "true or false", int: "an integer", float: "a number", dict: "an object"}[kind]
        raise ApiError(400, f"'{prefix}{name}' must be {words}; got {shown(json.dumps(value))}.", prefix + name)
    return value


def shown(value, limit: int = 40) -> str:
    """A client's value as an error message repeats it: cut to limit characters."""
    text = str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def int_as_float(value: int) -> float:
    """A JSON integer as a float; one beyond any float (1 followed by 400 zeros) is infinite."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def parse_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects.", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"'{where}' must be an object with 'role' and 'content'.", where)
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"'{where}.role' must be one of {', '.join(ROLES)}; got "
                                f"{shown(json.dumps(m.get('role')))}.", f"{where}.role")
        out.append({"role": role, "content": message_text(m.get("content"), f"{where}.content")})
    return out


def message_text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts joined (no images here)."""
    if isinstance(content, str):
        return unicode_text(content, where)
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return unicode_text("".join(p["text"] for p in content), where)
    raise ApiError(400, f"'{where}' must be a string or a list of text parts; this model reads text only.", where)


def unicode_text(text: str, where: str) -> str:
    """text, refused when it holds a lone surrogate (JSON lets "\\ud800" through), which the tokenizer cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{where}' holds an unpaired surrogate (such as \\ud800); send valid Unicode text.",
                       where) from None
    return text


def parse_prompt(prompt) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be a non-empty string (one prompt per request).", "prompt")
    return unicode_text(prompt, "prompt")


def parse_stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them.", "stop")
    return stops


def refuse_unsupported(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, "'n' must be 1: MoE Ferry generates one reply per request.", "n")
    if body.get("tools") or body.get("functions"):
        raise ApiError(400, "Tools and function calling are not supported by this server.", "tools")
    if body.get("logprobs") or body.get("echo"):
        name = "logprobs" if body.get("logprobs") else "echo"
        raise ApiError(400, f"'{name}' is not supported by this server; leave it out.", name)


def fold_system(messages: list[dict]) -> list[dict]:
    """The messages for a chat template without a system role (Mixtral's insists on
    user/assistant turns): the system text goes in front of the first user message."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system").strip()
    rest = [dict(m) for m in messages if m["role"] != "system"]
    if system and rest and rest[0]["role"] == "user":
        rest[0]["content"] = f"{system}\n\n{rest[0]['content']}"
    return rest


# ---------------------------------------------------------------------------------------------
# Generation helpers


class StopMatcher:
    """Cuts the text at the first stop sequence, holding back text that may start one.

    feed(piece) returns (text safe to send, whether a stop sequence was reached); the stop
    sequence itself is never sent, as OpenAI does. Each stop is followed by Knuth-Morris-Pratt
    matching, so a piece costs its own length whatever is held back: searching the held-back
    text afresh for every piece took minutes for a client whose long stop the reply kept
    matching (cubic in the reply's length).
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.borders = [border_table(s) for s in stops]
        self.matched = [0] * len(stops)  # per stop, how many of its first characters the text ends with
        self.held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        text = self.held + piece
        cut = None  # where the earliest stop sequence starts in text
        for i, (stop, border) in enumerate(zip(self.stops, self.borders)):
            n = self.matched[i]
            for pos, char in enumerate(piece):
                while n and stop[n] != char:
                    n = border[n - 1]
                if stop[n] == char:
                    n += 1
                if n == len(stop):
                    start = len(self.held) + pos + 1 - n
                    cut = start if cut is None else min(cut, start)
                    break
            self.matched[i] = n
        if cut is not None:
            self.flush()
            return text[:cut], True
        keep = max(self.matched, default=0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        self.matched = [0] * len(self.stops)
        return held


def border_table(s: str) -> list[int]:
    """border[i]: the length of the longest proper prefix of s[:i + 1] that also ends it."""
    border = [0] * len(s)
    n = 0
    for i in range(1, len(s)):
        while n and s[i] != s[n]:
            n = border[n - 1]
        if s[i] == s[n]:
            n += 1
        border[i] = n
    return border


# ---------------------------------------------------------------------------------------------
# Responses


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def moeferry_extra(stats) -> dict:
    """MoE Ferry's numbers for one generation (a GenerationStats)."""
    lookups = stats.cache_hits + stats.cache_misses
    extra = {"tokens_per_s": round(stats.tokens_per_s, 3),
             "cache_hit_rate": round(stats.cache_hits / lookups, 4) if lookups else None,
             "bytes_h2d": stats.bytes_h2d, "prefill_s": round(stats.prefill_s, 4),
             "decode_s": round(stats.decode_s, 4), "reused_prompt_tokens": stats.reused_prompt_tokens,
             "cpu_expert_runs": stats.cpu_expert_runs, "misses_on_cpu": stats.misses_cpu}
    return extra


def response_body(req: ApiRequest, rid: str, model: str, text: str, finish: str, usage: dict,
                  extra: dict) -> dict:
    choice = {"index": 0, "finish_reason": finish, "logprobs": None}
    if req.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": usage,
            "moeferry": extra}


def chunk_body(req: ApiRequest, rid: str, model: str, text: str | None = None, finish: str | None = None,
               first: bool = False) -> dict:
    """One streamed chunk: the first carries the role, the last the finish reason."""
    choice: dict = {"index": 0, "finish_reason": finish, "logprobs": None}
    if req.chat:
        delta: dict = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def models_body(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [model_body(model_id, created)]}


def model_body(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "moeferry"}


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
