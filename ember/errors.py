"""The one error type ember raises for anything a user can fix; each dialect renders it."""

from __future__ import annotations


class EmberError(Exception):
    """An error with an HTTP status, an OpenAI-style type and code, and the field at fault."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type


class InvalidRequest(EmberError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    def __init__(self, max_model_len: int, num_prompt_tokens: int, extra: str = "") -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens; your request has "
            f"{num_prompt_tokens} prompt tokens{extra}. Shorten the prompt or the conversation.",
            param="messages", code="context_length_exceeded")
        self.max_model_len = max_model_len
        self.num_prompt_tokens = num_prompt_tokens


class ModelLoadError(EmberError):
    """The model could not be loaded: a missing path, an unsupported architecture, a bad file."""

    status = 500
    type = "model_load_error"


class EngineUnavailable(EmberError):
    """The engine does not run (a fault it could not recover from)."""

    status = 503
    type = "server_error"


class EngineRestarted(EmberError):
    """The engine worker running a request died, and the request could not run again."""

    status = 500
    type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="engine_restarted")
