"""ServerOptions: what the HTTP layer enforces and how uvicorn listens, built once from the CLI
(or by a test) and read by build_app / create_server. The engine's own settings live in
pagedllm.config; these are the serving surface's."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.errors import ValidationError
from pagedllm.sampling_params import generation_defaults

# Most sequences one request may put in the batch (n x prompts, or the beam width), unless
# --max-seqs-per-request says otherwise: half the batch (max_num_seqs // 2), and at most 64 (a
# quarter of the default batch of 256). A request can then never hold every slot, so a request
# that arrives behind it is admitted at the next step instead of waiting for all of its
# sequences to finish (issue 15: n=256 = max_num_seqs made an 8-token request wait 25.8 s).
DEFAULT_MAX_SEQS_PER_REQUEST = 64
# Larger than any prompt a 128k-token context holds as JSON text or token ids, times a batch of
# a few prompts; a 50 MB body is refused before it is parsed.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ServerOptions:
    api_keys: tuple[str, ...] = ()
    cache_salt_per_key: bool = False
    max_logprobs: int = 20  # vLLM's --max-logprobs default
    max_seqs_per_request: int | None = None  # None: see seqs_per_request_cap
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    request_body_timeout: float = 30.0  # seconds a body may pause between chunks
    request_header_timeout: float = 30.0  # seconds for the request line and headers
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    enable_log_requests: bool = False
    max_log_len: int | None = None  # characters of each prompt in a request log line (None: all)
    disable_fastapi_docs: bool = False  # no /docs, /redoc, /openapi.json
    generation_config: str = "auto"  # auto (the model's), vllm (none), or a folder
    enable_auto_tool_choice: bool = False
    # A request's own chat_template is code the server runs: refused unless the operator says so.
    trust_request_chat_template: bool = False
    max_num_stop_strings: int = 64  # stop strings are matched per token: their number is bounded
    tool_call_parser: str | None = None
    lora_modules: tuple[str, ...] = ()  # --lora-modules: NAME=PATH each
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if self.max_logprobs < 0:
            raise ValidationError("--max-logprobs must be >= 0", "max_logprobs")
        if self.max_num_stop_strings < 0:
            raise ValidationError("--max-num-stop-strings must be >= 0", "max_num_stop_strings")
        if self.max_seqs_per_request is not None and self.max_seqs_per_request < 1:
            raise ValidationError("--max-seqs-per-request must be >= 1", "max_seqs_per_request")
        if self.max_request_body_bytes < 1:
            raise ValidationError("--max-request-body-bytes must be >= 1", "max_request_body_bytes")
        for name in ("request_body_timeout", "request_header_timeout"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValidationError(f"--{name.replace('_', '-')} must be > 0 seconds", name)
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).is_dir():
            raise ValidationError(f"--generation-config must be auto, vllm or a folder with "
                                  f"generation_config.json; got {self.generation_config!r}",
                                  "generation_config")

    def seqs_per_request_cap(self, max_num_seqs: int) -> int:
        if self.max_seqs_per_request is not None:
            return self.max_seqs_per_request
        return max(1, min(max_num_seqs // 2, DEFAULT_MAX_SEQS_PER_REQUEST))

    def generation_defaults(self, model_defaults: dict[str, Any]) -> dict[str, Any]:
        """The sampling defaults requests inherit (vLLM's --generation-config)."""
        if self.generation_config == "auto":
            return dict(model_defaults)
        if self.generation_config == "vllm":
            return {}
        path = Path(self.generation_config) / "generation_config.json"
        try:
            values = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError) as e:
            raise ValidationError(f"cannot read {path}: {e}", "generation_config") from e
        return generation_defaults(values)
