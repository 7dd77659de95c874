"""Turn an exception from the engine or the installer into one sentence and an action. No Qt."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class Action(str, Enum):
    SMALLER_CACHE = "smaller_cache"   # halve the experts cached per layer and retry
    REVERIFY = "reverify"             # re-hash the store and name the bad files
    REDOWNLOAD = "redownload"         # open the set-up wizard at the model choice
    CHOOSE_MODEL = "choose_model"     # no model yet: open the set-up wizard
    NONE = "none"


ACTION_LABELS = {
    Action.SMALLER_CACHE: "Use a smaller cache",
    Action.REVERIFY: "Re-verify the model",
    Action.REDOWNLOAD: "Download again",
    Action.CHOOSE_MODEL: "Set up a model",
}


@dataclass(frozen=True)
class ErrorInfo:
    title: str
    message: str  # one sentence for the user
    action: Action = Action.NONE
    detail: str = ""  # the technical text, shown under "Details"


# The engine's sentences are written for the command line; in the app a flag means nothing.
_CLI_WORDS = [
    (re.compile(r" \((?:[A-Z][A-Za-z]*(?:Error|Exception|Timeout))\)"), ""),  # "(ConnectError)"
    (re.compile(r"check your network connection or --endpoint"), "check the internet connection and try again"),
    (re.compile(r"(?:,? (?:or|and) | \(?or )--endpoint\)?"), ""),
    (re.compile(r"check --endpoint"), "check the hub address (HF_ENDPOINT)"),
    (re.compile(r"--endpoint"), "the hub address (HF_ENDPOINT)"),
]


def app_words(text: str) -> str:
    """An engine sentence without command-line options or exception class names."""
    for pattern, words in _CLI_WORDS:
        text = pattern.sub(words, text)
    return text


def _is_oom(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return "OutOfMemoryError" in names or "out of memory" in str(exc).lower()


def describe_error(exc: BaseException) -> ErrorInfo:
    detail = f"{type(exc).__name__}: {exc}"
    if _is_oom(exc):
        return ErrorInfo("Out of GPU memory",
                         "The GPU ran out of memory; keep fewer experts on the GPU and try again.",
                         Action.SMALLER_CACHE, detail)
    text = app_words(str(exc).strip())
    lowered = text.lower()
    is_user_error = any(cls.__name__ == "UserError" for cls in type(exc).__mro__)
    if is_user_error and any(w in lowered for w in ("hash", "corrupt", "checksum", "sha256", "verify", "damaged")):
        return ErrorInfo("The model files are damaged", text, Action.REVERIFY, detail)
    if isinstance(exc, FileNotFoundError) or (is_user_error and ("not found" in lowered or "no such" in lowered
                                                                 or "missing" in lowered)):
        message = text if is_user_error else "The model files were not found; set up the model again."
        return ErrorInfo("Model not found", message, Action.REDOWNLOAD, detail)
    if is_user_error:
        return ErrorInfo("Cannot continue", text, Action.NONE, detail)
    if any(w in lowered for w in ("safetensors", "header", "invalid load key", "deserializ", "unexpected eof")):
        return ErrorInfo("The model files are damaged",
                         "The model files could not be read; re-verify them to find the damaged ones.",
                         Action.REVERIFY, detail)
    return ErrorInfo("Something went wrong",
                     "The engine stopped with an unexpected error; the details below can help a bug report.",
                     Action.NONE, detail)
