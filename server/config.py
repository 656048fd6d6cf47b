"""The server section of the configuration: what `pagoda serve` adds on top of the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ServerConfig:
    served_model_name: str | None = None
    """The name clients put in `model`; default: the model folder's name."""
    api_key: str | None = None
    """With a key, every route except /health, /metrics and /version needs `Authorization: Bearer KEY`."""
    api_keys_file: str | None = None
    """YAML or JSON file of named API keys, each with optional requests_per_minute, tokens_per_minute, max_concurrent_requests (counted in samples: prompts x n) and priority (server/tenants.py; configs/api-keys/example.yaml); re-read on SIGHUP (a malformed file then keeps the keys in force). Beside --api-key, which stays valid."""
    max_body_bytes: int = 4 * 2**20
    """Largest request body; 4 MiB holds 64 prompts of 8k token ids as JSON."""
    max_header_bytes: int = 64 * 2**10
    """Largest request head (request line and headers); past it the request gets 431 and the connection closes, before any API-key check."""
    max_header_count: int = 100
    """Most header lines in one request; more get 431 and the connection closes."""
    client_read_timeout_s: float = 30.0
    """Seconds a client has to send a complete request head (from connecting, or from the first byte of its next request), and again its body (from the end of the head); then the connection is closed."""
    max_n: int = 16
    """Largest `n` (samples per prompt)."""
    health_stall_timeout_s: float = 30.0
    """/health answers 503 when work is pending and no step finished for this long."""
    tokenizer_threads: int = 2
    """Worker threads (each with its own tokenizer copy) for tokenization and chat templates."""
    max_queue_time_s: float | None = None
    """Seconds a request may wait before it is first scheduled; then it ends with 503
    `queue_timeout` + Retry-After (an error event in a stream; none: no limit)."""
    request_timeout_s: float | None = None
    """Seconds a request may take from arrival to its last token; then it is aborted with 504
    `request_timeout` (an error event in a stream; none: no limit)."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM: seconds in-flight requests get to finish (new ones get 503) before the rest
    end with finish_reason "abort"."""
    grammar_compile_timeout_s: float = 10.0
    """Seconds a request's JSON schema / regex / grammar may take to compile before the request gets 400 (the compile is cached for the next identical one)."""
    tool_call_parser: str = "hermes"
    """How tool calls are read from the model's text: hermes (`<tool_call>{"name", "arguments"}</tool_call>`, the bundled model's server-side tool prompt) or llama3_json."""
    max_parallel_tool_calls: int = 16
    """Most tool calls in one reply (with `parallel_tool_calls`; without it, one): the next call ends the list, as does a call that repeats an earlier call of the same reply exactly (name and arguments). Either way generation stops there and the reply finishes with "tool_calls"."""
    chat_template: str | None = None
    """A Jinja chat-template file that replaces the model's own (e.g. one with a tools branch)."""
    reasoning_parser: str = "auto"
    """How a reasoning model's thinking is told from its answer (`reasoning_content`, Responses reasoning items): qwen3 (the model writes `<think>`...`</think>` first) or deepseek_r1 (the thinking is open from the start, up to `</think>`); auto: the chat template's form when it is unambiguous (logged at start-up), else none; none: the thinking stays in the content."""
    responses_store_size: int = 1024
    """Responses kept for `previous_response_id` and `GET /v1/responses/{id}` (with `store`, OpenAI's default); past it the least recently used goes first (0: keep none)."""
    responses_store_ttl_s: float = 3600.0
    """Seconds a stored response is kept after its last use (creation, lookup or continuation)."""
    responses_store_bytes: int = 256 * 2**20
    """Most bytes (as JSON) the stored responses may hold together; past it the least recently used go first. A response larger than this alone is not stored."""
    max_logprobs: int = 20
    """Most logprobs per token a request may ask for (`logprobs`, `top_logprobs`, vLLM's `prompt_logprobs`); more is a 400 naming the field. vLLM's `-1` in a request means the whole vocabulary, so it needs at least the vocabulary's size here (-1: no cap)."""
    return_tokens_as_token_ids: bool = False
    """Spell logprob tokens `token_id:N` (vLLM's flag; a request's `return_tokens_as_token_ids` overrides it): tokens whose bytes are not valid UTF-8 stay identifiable."""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.health_stall_timeout_s <= 0:
            raise ValueError(f"health_stall_timeout_s must be > 0, got {self.health_stall_timeout_s}")
        if self.tokenizer_threads < 1:
            raise ValueError(f"tokenizer_threads must be >= 1, got {self.tokenizer_threads}")
        for name in ("max_queue_time_s", "request_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (or none), got {value}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if self.max_parallel_tool_calls < 1:
            raise ValueError(f"max_parallel_tool_calls must be >= 1, got {self.max_parallel_tool_calls}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0 (or -1: no cap), got {self.max_logprobs}")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        if self.responses_store_bytes < 0:
            raise ValueError(f"responses_store_bytes must be >= 0, got {self.responses_store_bytes}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if self.max_header_count < 8:
            raise ValueError(f"max_header_count must be >= 8, got {self.max_header_count}")
        if not self.client_read_timeout_s > 0:
            raise ValueError(f"client_read_timeout_s must be > 0, got {self.client_read_timeout_s}")
        if not self.responses_store_ttl_s > 0:
            raise ValueError(f"responses_store_ttl_s must be > 0, got {self.responses_store_ttl_s}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
