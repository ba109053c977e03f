"""The ``pagedllm`` command.

    pagedllm serve [MODEL] [--host H --port P --api-key K --chat-template T ...] [engine flags]
                                       (vLLM's flag spellings: see serve_args.py)
    pagedllm generate PROMPT... [--model M --max-tokens N --temperature T ...] [engine flags]
    pagedllm bench NAME [ARGS...]      (runs benchmarks/NAME.py:main(ARGS) of the source checkout)

Engine flags are generated from the config dataclasses (ModelConfig, CacheConfig,
SchedulerConfig): one flag per field, its help from the field's metadata, booleans as
--flag/--no-flag. Flags left out keep the config's defaults.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import pkgutil
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedllm import config as _config
from pagedllm.config import CacheConfig, LoRAConfig, ModelConfig, ObservabilityConfig, SchedulerConfig
from pagedllm.errors import PagedLLMError

# ParallelConfig joins when the engine has one (its executors are being built alongside).
ENGINE_CONFIGS = tuple(c for c in (ModelConfig, CacheConfig, SchedulerConfig,
                                   getattr(_config, "ParallelConfig", None), ObservabilityConfig,
                                   LoRAConfig)
                       if c is not None)
# vLLM's short spellings of engine flags
_SHORT_FLAGS = {"tensor_parallel_size": "-tp", "data_parallel_size": "-dp", "quantization": "-q"}


def engine_field_names() -> set[str]:
    return {f.name for cls in ENGINE_CONFIGS for f in dataclasses.fields(cls)}


class FlexibleArgumentParser(argparse.ArgumentParser):
    """Accepts vLLM's spellings: ``--max_model_len`` as well as ``--max-model-len`` (like vLLM's
    parser, underscores in a long flag's name become dashes before parsing)."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        if args is None:
            args = sys.argv[1:]
        return super().parse_known_args([_dashed(a) for a in args], namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--") or arg == "--":
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def add_hub_args(p: argparse.ArgumentParser) -> None:
    """A model (or --tokenizer) may be a Hub id: user/repo, or user/repo:Q4_K_M for a GGUF file."""
    hub = p.add_argument_group("models by name (Hugging Face Hub ids; HF_TOKEN, HF_HOME, HF_HUB_OFFLINE=1)")
    hub.add_argument("--revision", default=argparse.SUPPRESS, help="the model's branch, tag or commit (default: main)")
    hub.add_argument("--tokenizer-revision", default=argparse.SUPPRESS, help="the tokenizer's (default: --revision)")
    hub.add_argument("--gguf-file", default=argparse.SUPPRESS, help="the repository's GGUF file to load, by name")


def _flag_type(annotation: Any) -> Any:
    """The argparse type of a field annotation: ``int | None`` -> int."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def _json_dict(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return parsed


def add_engine_args(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """One flag per engine config field (``model`` and the names in ``skip`` excepted)."""
    group = parser.add_argument_group("engine", "how the engine runs (defaults: the config's)")
    for cls in ENGINE_CONFIGS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name == "model" or f.name in skip:
                continue  # model: a positional argument or --model, per subcommand
            flags = ["--" + f.name.replace("_", "-")]
            if f.name in _SHORT_FLAGS:
                flags.append(_SHORT_FLAGS[f.name])
            default = f.default if f.default is not dataclasses.MISSING else None
            help_text = f"{f.metadata.get('help', '')} (default: {default})"
            kind = _flag_type(hints[f.name])
            if kind is bool:
                group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_text)
            else:
                group.add_argument(*flags, dest=f.name, type=kind, default=argparse.SUPPRESS,
                                   metavar=kind.__name__.upper(), help=help_text)
    group.add_argument("--speculative-config", dest="speculative_config", type=_json_dict,
                       default=argparse.SUPPRESS,
                       help="Speculative decoding as a JSON object: {\"method\": \"ngram\", \"draft_model\", "
                            "\"eagle3\" or \"mtp\", "
                            "\"model\": PATH, \"num_speculative_tokens\": K, ...} (docs/speculative.md).")
    group.add_argument("--structured-outputs-config", dest="structured_outputs_config",
                       type=_json_dict, default=argparse.SUPPRESS,
                       help='Structured outputs defaults as a JSON object (vLLM\'s), e.g. '
                            '\'{"disable_any_whitespace": true}\' for compact JSON; unset: at '
                            'most one space between JSON tokens.')
    group.add_argument("--pooler-config", dest="pooler_config", type=_json_dict, default=argparse.SUPPRESS,
                       help='A pooling model\'s pooler as a JSON object (vLLM\'s), e.g. '
                            '\'{"pooling_type": "MEAN", "normalize": true}\'; unset: the checkpoint\'s. '
                            'On a generator: serve embeddings too, in the same steps (\'{}\': its '
                            'default pooling; docs/pooling.md).')


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = engine_field_names() - {"model"}
    names.update(("speculative_config", "structured_outputs_config", "revision", "tokenizer_revision", "gguf_file",
                  "pooler_config"))
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


# -- serve ---------------------------------------------------------------------------------------
def _add_serve(sub: Any) -> None:
    from pagedllm.entrypoints.openai.model_specs import add_multi_model_args
    from pagedllm.entrypoints.serve_args import add_serve_args

    p = sub.add_parser("serve", help="serve the OpenAI-compatible API",
                       description="Serve a model over the OpenAI-compatible HTTP API. Flags take "
                                   "vLLM's spellings, with dashes or underscores.")
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="model folder, GGUF file or Hub id (user/repo[:QUANT]; default: the demo model)")
    p.add_argument("--model", action="append", default=None,
                   help="same as MODEL; given again (--model A --model B, or ID=PATH), "
                        "several models behind one server")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported (default: the model "
                        "folder's name, then MODEL as given)")
    p.add_argument("--chat-template", default=None,
                   help="chat template (a file or the Jinja text) for models without one")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM (default: 5)")
    add_serve_args(p, engine_field_names())
    add_multi_model_args(p)
    add_engine_args(p)
    add_hub_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedllm.checkpoint.hub import parse_hub_id
    from pagedllm.config import default_model
    from pagedllm.engine.async_engine import AsyncLLM, multiprocessing_enabled
    from pagedllm.engine.llm import default_chat_template
    from pagedllm.entrypoints.openai.server import build_app, load_chat_template, run_server
    from pagedllm.entrypoints.serve_args import check_compat_flags, server_options, uvicorn_kwargs

    models = list(dict.fromkeys(([args.model_tag] if args.model_tag else []) + (args.model or [])))
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    check_compat_flags(args, engine_field_names())
    if len(models) > 1 or args.models_file:  # several models behind one router
        from pagedllm.entrypoints.openai.model_router import serve_models

        return serve_models(args, models, engine_kwargs(args), load_chat_template(args.chat_template))
    model = models[0] if models else default_model()
    options = server_options(args)
    listen = uvicorn_kwargs(args)
    chat_template = load_chat_template(args.chat_template) or default_chat_template(model)
    # The engine core (scheduler + executor) in its own process, as vLLM V1 serves: HTTP,
    # tokenization and detokenization here never hold the model up.
    # PAGEDLLM_ENABLE_MULTIPROCESSING=0 keeps it in this process.
    llm = AsyncLLM.from_engine_args(model, multiprocess=multiprocessing_enabled(default=True),
                                    **engine_kwargs(args))
    # A Hub id is served under its own name, not the cache folder's.
    names = args.served_model_name or ([model] if parse_hub_id(model) else None)
    app = build_app(llm, names, chat_template, options=options)
    run_server(app, args.host, args.port, args.uvicorn_log_level or args.log_level,
               args.shutdown_timeout, **listen)
    return 0


# -- generate ------------------------------------------------------------------------------------
def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts and print them",
                       description="Generate a completion for each prompt and print it.")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--model", default=None,
                   help="model folder, GGUF file or Hub id (default: the demo model, or $PAGEDLLM_MODEL)")
    s = p.add_argument_group("sampling (defaults: the model's generation_config, then vLLM's)")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float)
    s.add_argument("--top-p", type=float)
    s.add_argument("--top-k", type=int)
    s.add_argument("--min-p", type=float)
    s.add_argument("--repetition-penalty", type=float)
    s.add_argument("--seed", type=int, help="seeds the requests and the engine")
    s.add_argument("--n", type=int)
    s.add_argument("--min-tokens", type=int)
    s.add_argument("--stop", action="append", help="a stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", default=None)
    add_engine_args(p, skip=frozenset({"seed"}))
    add_hub_args(p)
    p.set_defaults(func=cmd_generate)


_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "seed", "n", "min_tokens", "stop", "ignore_eos")


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm.engine.llm import LLM

    kwargs = engine_kwargs(args)
    kwargs.pop("seed", None)  # --seed here is the sampling flag; it seeds the engine too
    if args.seed is not None:
        kwargs["seed"] = args.seed
    llm = LLM(args.model, **kwargs)
    changes = {k: getattr(args, k) for k in _SAMPLING_FLAGS if getattr(args, k) is not None}
    params = llm.get_default_sampling_params().clone(**changes)
    for out in llm.generate(args.prompts, params, use_tqdm=False):
        for c in out.outputs:
            tag = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{tag}{out.prompt}{c.text}", flush=True)
        print()
    return 0


# -- bench ---------------------------------------------------------------------------------------
def _add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="run a benchmark: benchmarks/NAME.py of the source checkout",
                       description="Run main(ARGS) of benchmarks/NAME.py, the top-level folder of "
                                   "the source checkout (the harness is not installed with the package).")
    p.add_argument("name", metavar="NAME", help="throughput, latency, prefix, memory, scheduler, ...")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="ARGS")
    p.set_defaults(func=cmd_bench)


def _benchmarks_dir() -> Path:
    """The checkout's ``benchmarks/`` folder: beside the ``pagedllm`` package directory, so it
    exists only when pagedllm runs from a source checkout (``pip install -e``)."""
    import pagedllm

    folder = Path(pagedllm.__file__).resolve().parent.parent / "benchmarks"
    if not (folder / "__init__.py").is_file():
        raise PagedLLMError(f"benchmarks live in the source checkout: no {folder}; clone the "
                            "repository and install it with `pip install -e .` to run them")
    return folder


def _benchmark_names(folder: Path) -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([str(folder)]) if not m.name.startswith("_"))


def _import_benchmark(name: str) -> types.ModuleType:
    """benchmarks.NAME of the checkout, imported lazily; a unique NAME_* module also answers
    (``scheduler`` finds ``scheduler_overhead``)."""
    folder = _benchmarks_dir()
    root = str(folder.parent)
    if root not in sys.path:
        sys.path.insert(0, root)  # benchmarks import each other as ``benchmarks.common``
    loaded = sys.modules.get("benchmarks")
    if loaded is not None and getattr(loaded, "__file__", None) and \
            Path(loaded.__file__).resolve().parent != folder:
        raise PagedLLMError(f"another 'benchmarks' package is imported ({loaded.__file__}), "
                            f"not the checkout's {folder}")
    name = name.replace("-", "_")
    available = _benchmark_names(folder)
    if name not in available:
        matches = [m for m in available if m.startswith(name + "_")]
        if len(matches) != 1:
            raise PagedLLMError(f"no benchmark {name!r} (no {folder / (name + '.py')}); "
                                f"available: {', '.join(available) or 'none'}")
        name = matches[0]
    return importlib.import_module(f"benchmarks.{name}")


def cmd_bench(args: argparse.Namespace) -> int:
    module = _import_benchmark(args.name)
    if not callable(getattr(module, "main", None)):
        raise PagedLLMError(f"{module.__name__} has no main(argv) function")
    result = module.main(list(args.bench_args))
    return result if isinstance(result, int) else 0


# -- explain, trace (the step trace: pagedllm/explain/, docs/trace_schema.md) ---------------------
def _add_explain(sub: Any) -> None:
    from pagedllm.explain.command import add_explain_parser

    add_explain_parser(sub)


def _add_trace(sub: Any) -> None:
    from pagedllm.explain.command import add_trace_parser

    add_trace_parser(sub)


# -- main ----------------------------------------------------------------------------------------
def make_parser() -> argparse.ArgumentParser:
    parser = FlexibleArgumentParser(prog="pagedllm", description="pagedllm: a compact vLLM-class engine")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_generate(sub)
    _add_bench(sub)
    _add_explain(sub)
    _add_trace(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except PagedLLMError as e:  # user mistakes: one clear line, no traceback
        print(f"pagedllm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
