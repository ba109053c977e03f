"""The flags of ``pagedllm serve`` beyond the engine's own: the HTTP surface, vLLM's spellings,
and the vLLM flags that pagedllm accepts for launch-line compatibility.

A vLLM flag does what vLLM's does, or, where pagedllm has no such thing, either is accepted and
ignored with a log line (it changes nothing a client can see: ``--trust-remote-code``,
``--disable-log-stats``) or fails with one line that says so (it would change results).
Engine flags (``-tp``, ``-q``/``--quantization``, ``--kv-cache-dtype``, ``--enforce-eager``,
...) come from the engine's config fields (cli.py).
"""
from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from pagedllm import envs
from pagedllm.errors import PagedLLMError

logger = logging.getLogger("pagedllm.entrypoints.serve")

_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def _str_list(value: str) -> list[str]:
    """vLLM passes lists as JSON (``'["http://a", "http://b"]'``); a plain string is one item."""
    value = value.strip()
    if value.startswith("["):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from e
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise argparse.ArgumentTypeError("must be a JSON list of strings")
        return parsed
    return [value]


def add_serve_args(p: argparse.ArgumentParser, engine_fields: set[str]) -> None:
    """``engine_fields``: the engine config's field names (a flag for one of them is generated
    from the config, so the compatibility flag below is added only while the field is absent)."""
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (any of the keys given) on every "
                        "route except /health, /ping, /version, /metrics and the API docs "
                        "(default: $VLLM_API_KEY, as vLLM)")
    p.add_argument("--cache-salt-per-key", action="store_true",
                   help="give each API key's requests their own prefix-cache namespace, so one "
                        "client cannot probe another's prompts through cached_tokens or timing")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs / top_logprobs / prompt_logprobs a request may ask for "
                        "(default and most: 20)")
    p.add_argument("--max-seqs-per-request", type=int, default=None,
                   help="most sequences one request may run (n x prompts, or the beam width); "
                        "default: max_num_seqs // 2, at most 64")
    p.add_argument("--max-num-stop-strings", type=int, default=64,
                   help="most stop strings one request may give (each is matched on every new "
                        "token; default: 64)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (a Jinja program the server "
                        "runs); refused by default, as in vLLM")
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="larger request bodies get 413 (default: 8 MiB)")
    p.add_argument("--request-header-timeout", type=float, default=30.0,
                   help="seconds a client has to send the request line and headers (default: 30)")
    p.add_argument("--request-body-timeout", type=float, default=30.0,
                   help="seconds a request body may stall between chunks before a 408 (default: 30)")
    p.add_argument("--timeout-keep-alive", type=int, default=5,
                   help="seconds an idle keep-alive connection stays open (default: 5)")
    p.add_argument("--uvicorn-log-level", choices=_LOG_LEVELS, default=None,
                   help="uvicorn's log level (default: --log-level)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log every request's prompts and parameters")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="characters of each prompt in a request log line (default: all)")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve no /docs, /redoc or /openapi.json")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument("--disable-log-requests", action="store_true", help=argparse.SUPPRESS)  # older vLLM
    p.add_argument("--disable-log-stats", action="store_true",
                   help="accepted for vLLM compatibility (pagedllm logs no periodic stats)")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults: auto (the model's generation_config.json), vllm "
                        "(none: vLLM's defaults), or a folder holding a generation_config.json")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM compatibility (pagedllm never runs a model's own code)")
    cors = p.add_argument_group("CORS (off unless --allowed-origins is given)")
    cors.add_argument("--allowed-origins", type=_str_list, default=None, help='e.g. \'["*"]\'')
    cors.add_argument("--allow-credentials", action="store_true")
    cors.add_argument("--allowed-methods", type=_str_list, default=["*"])
    cors.add_argument("--allowed-headers", type=_str_list, default=["*"])
    http = p.add_argument_group("HTTP server (uvicorn)")
    http.add_argument("--root-path", default=None, help="the path prefix a proxy serves the app under")
    http.add_argument("--ssl-keyfile", default=None)
    http.add_argument("--ssl-certfile", default=None)
    http.add_argument("--ssl-ca-certs", default=None)
    http.add_argument("--ssl-cert-reqs", type=int, default=0,
                      help="whether client certificates are required (see Python's ssl module)")
    lora = p.add_argument_group("LoRA adapters (with --enable-lora; docs/lora.md)")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                      help="adapters served from the start, each by its name (a request's model)")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the "
                           "API key), off by default as in vLLM")
    tools = p.add_argument_group("tool calling (tool_choice required / a named function need no flag)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto": the model decides, and --tool-call-parser '
                            "reads its calls out of the text")
    tools.add_argument("--tool-call-parser", default=None,
                       help="the model family's tool-call format: hermes, llama3_json, llama4_json")


def check_compat_flags(args: argparse.Namespace, engine_fields: set[str]) -> None:
    """Fail in one line for what pagedllm cannot do; log what it ignores."""
    if not 0 <= args.max_logprobs <= 20:
        raise PagedLLMError(f"--max-logprobs {args.max_logprobs}: pagedllm returns 0 to 20 "
                            "logprobs per token")
    if args.trust_remote_code:
        logger.info("--trust-remote-code: accepted; pagedllm never runs a model's own code")
    if args.disable_log_stats:
        logger.info("--disable-log-stats: accepted; pagedllm logs no periodic stats")
    _check_tool_flags(args)


def _check_tool_flags(args: argparse.Namespace) -> None:
    """vLLM's rules: auto needs a parser, and the parser must be one this build has."""
    from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager  # pure Python, no torch

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise PagedLLMError("--enable-auto-tool-choice requires --tool-call-parser")
    if args.tool_call_parser and args.tool_call_parser not in ToolParserManager.tool_parsers:
        raise PagedLLMError(f"invalid tool call parser: {args.tool_call_parser} (choose from "
                            f"{{ {','.join(sorted(ToolParserManager.tool_parsers))} }})")
    if args.tool_call_parser and not args.enable_auto_tool_choice:
        logger.warning("--tool-call-parser %s has no effect without --enable-auto-tool-choice",
                       args.tool_call_parser)


def server_options(args: argparse.Namespace) -> Any:
    from pagedllm.entrypoints.openai.server_options import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerOptions

    env_key = envs.vllm_api_key()
    return ServerOptions(
        api_keys=tuple(args.api_key or ([env_key] if env_key else [])),
        cache_salt_per_key=args.cache_salt_per_key,
        max_logprobs=args.max_logprobs, max_seqs_per_request=args.max_seqs_per_request,
        max_num_stop_strings=args.max_num_stop_strings,
        trust_request_chat_template=args.trust_request_chat_template,
        max_request_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES,
        request_body_timeout=args.request_body_timeout, request_header_timeout=args.request_header_timeout,
        allowed_origins=tuple(args.allowed_origins or ()), allow_credentials=args.allow_credentials,
        allowed_methods=tuple(args.allowed_methods), allowed_headers=tuple(args.allowed_headers),
        enable_log_requests=args.enable_log_requests and not args.disable_log_requests,
        max_log_len=args.max_log_len, disable_fastapi_docs=args.disable_fastapi_docs,
        generation_config=args.generation_config,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        lora_modules=tuple(args.lora_modules or ()),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating)


def uvicorn_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"timeout_keep_alive": args.timeout_keep_alive,
                              "access_log": not args.disable_uvicorn_access_log}
    if args.root_path:
        kwargs["root_path"] = args.root_path
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise PagedLLMError("TLS needs both --ssl-keyfile and --ssl-certfile")
    if args.ssl_keyfile:
        kwargs.update(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                      ssl_cert_reqs=args.ssl_cert_reqs)
        if args.ssl_ca_certs:
            kwargs["ssl_ca_certs"] = args.ssl_ca_certs
    return kwargs
