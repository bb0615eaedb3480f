"""ServeConfig: what `dtrt serve` serves and how it guards itself, as plain values (its flags are generated from the
fields, without importing the runtime)."""

from dataclasses import dataclass, field

from dtrt.errors import DtrtError
from dtrt.frontend.requests import Request

MAX_BODY = 32 * 2**20


@dataclass
class ServeConfig:
    """What `dtrt serve` serves and how it guards itself (the command's flags for these are generated from the
    fields; the model name and the request defaults are filled in by the command)."""

    model_name: str
    """The model id clients send and /v1/models lists."""
    defaults: Request = field(default_factory=Request)
    """What a request leaves out."""
    queue_limit: int = 64
    """Requests waiting behind the one generating (per replica); more are answered 429."""
    request_timeout: float = 600.0
    """Seconds a request may take, waiting included; then it is cancelled (504)."""
    shutdown_grace: float = 30.0
    """Seconds the generations in flight may finish after SIGINT/SIGTERM before they are cancelled."""
    truncate: bool = False
    """Keep the prompt's tail when it does not fit the context, instead of answering 400."""
    api_key: str | None = None
    """Requests must send 'Authorization: Bearer KEY' (else 401); /health stays open."""
    max_request_bytes: int = MAX_BODY
    """Largest request body; a larger one is answered 413."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens, chat template included; a longer one is answered 400 (default: what fits the
    context)."""

    def __post_init__(self):
        for flag, value, ok, need in (
            ("--queue-limit", self.queue_limit, self.queue_limit >= 0, ">= 0"),
            ("--request-timeout", self.request_timeout, self.request_timeout > 0, "> 0"),
            ("--shutdown-grace", self.shutdown_grace, self.shutdown_grace >= 0, ">= 0"),
            ("--max-request-bytes", self.max_request_bytes, self.max_request_bytes >= 1024, ">= 1024"),
            (
                "--max-prompt-tokens",
                self.max_prompt_tokens,
                self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
                ">= 1",
            ),
        ):
            if not ok:
                raise DtrtError(f"{flag} {value}: must be {need}")
        if self.api_key is not None and not self.api_key.strip():
            raise DtrtError("--api-key: empty; give a key, or leave it out to serve without one")
