"""Models by name: a local path, or a Hugging Face Hub id resolved to a folder (or GGUF file) in
huggingface_hub's standard cache, downloaded once.

Spellings: ``user/repo`` (a safetensors folder, or the repository's one GGUF file),
``user/repo:Q4_K_M`` (llama.cpp's: the GGUF file of that quantization) and ``gguf_file`` (a file
named exactly). Only the files the engine reads are fetched. The environment is read at each
call, not at import: ``HF_ENDPOINT``, ``HF_HOME``/``HF_HUB_CACHE``, ``HF_TOKEN``, and
``HF_HUB_OFFLINE=1``, which serves the cache and never opens a connection.
"""
from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any

from pagedllm import envs
from pagedllm.checkpoint.source import is_gguf_path
from pagedllm.errors import ModelLoadError, ValidationError

# ``owner/name`` with an optional ``:TAG``; a path that exists on disk is never taken for one.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<tag>[\w.-]+))?$")
# What the engine reads besides weights: config, generation defaults, tokenizer, chat template,
# the quantization descriptions of AWQ/GPTQ folders, a LoRA adapter's description.
_ENGINE_FILES = ("config.json", "adapter_config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
                 "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
                 "quantize_config.json", "quant_config.json")
_TOKENIZER_FILES = tuple(f for f in _ENGINE_FILES
                         if f not in ("adapter_config.json", "quantize_config.json", "quant_config.json"))
# llama.cpp's quantization names inside GGUF file names (Q4_K_M, IQ2_XXS, F16, BF16, MXFP4, ...).
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d_[A-Z0-9_]*?|Q\d_\d|[BF]F?16|F32|MXFP4)(?=[-.]|$)", re.IGNORECASE)
_INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
HUB_ENGINE_ARGS = ("revision", "tokenizer_revision", "gguf_file")


def parse_hub_id(model: str) -> tuple[str, str | None] | None:
    """(repo id, quantization tag) if ``model`` is spelled like a Hub id and is no local path."""
    match = _HUB_ID.match(model)
    if match is None or Path(model).exists():
        return None
    return match["repo"], match["tag"]


def resolve_engine_args(model: str | None, engine_args: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """``LLM(model, **engine_args)``'s model and tokenizer as local paths; takes the Hub's own
    arguments (revision, tokenizer_revision, gguf_file) out of ``engine_args``."""
    args = dict(engine_args)
    revision, tokenizer_revision, gguf_file = (args.pop(name, None) for name in HUB_ENGINE_ARGS)
    if model is not None:
        model = resolve_model(str(model), revision, gguf_file)
    elif revision is not None or gguf_file is not None:
        raise ValidationError("revision and gguf_file need a model", "model")
    draft = args.get("speculative_config")
    if isinstance(draft, dict) and isinstance(draft.get("model"), str):  # a draft model by Hub id too
        args["speculative_config"] = {**draft, "model": resolve_model(draft["model"])}
    if args.get("tokenizer") is not None:
        args["tokenizer"] = resolve_model(str(args["tokenizer"]), tokenizer_revision or revision,
                                          tokenizer_only=True)
    return model, args


def resolve_model(model: str, revision: str | None = None, gguf_file: str | None = None,
                  tokenizer_only: bool = False) -> str:
    """A local path as given (``gguf_file`` joined to a folder); a Hub id as the cached folder,
    or the GGUF file in it, downloaded first unless it is cached and the revision pinned."""
    hub = parse_hub_id(model)
    if hub is None:
        if gguf_file is not None and Path(model).is_dir():
            return str(Path(model) / gguf_file)
        return model
    repo_id, tag = hub
    if tag is not None and gguf_file is not None:
        raise ValidationError(f"{model!r} names a quantization and gguf_file names a file: give one", "gguf_file")
    choice = (repo_id, revision, tag, gguf_file, tokenizer_only)
    if envs.hf_hub_offline():
        folder, wanted = _from_cache(*choice, "HF_HUB_OFFLINE=1", "run once online or unset HF_HUB_OFFLINE")
    else:
        try:
            folder, wanted = _download(*choice)
        except Exception as e:  # the Hub unreachable: the cache serves what it holds, as transformers does
            if not _unreachable(e):
                raise
            folder, wanted = _from_cache(*choice, f"the Hub cannot be reached ({type(e).__name__}: {e})",
                                         "check the network and HF_ENDPOINT, or set HF_HUB_OFFLINE=1")
    gguf = sorted(n for n in wanted if is_gguf_path(n))
    return str(Path(folder) / gguf[0]) if gguf else folder


def select_files(repo_id: str, names: list[str], tag: str | None, gguf_file: str | None,
                 tokenizer_only: bool = False) -> list[str]:
    """The files of a repository listing the engine needs (raises when none fit)."""
    top = [n for n in names if "/" not in n]
    if tokenizer_only:
        return [n for n in top if n in _TOKENIZER_FILES]
    extras = [n for n in top if n in _ENGINE_FILES]
    if gguf_file is not None:
        if gguf_file not in names:
            raise ValidationError(f"{repo_id} has no file {gguf_file!r}; its GGUF files: "
                                  f"{', '.join(_ggufs(names)) or 'none'}", "gguf_file")
        return [*extras, gguf_file, *_other_shards(gguf_file, names)]
    weights = [n for n in top if fnmatch.fnmatch(n, "*.safetensors") or n == _INDEX]
    if tag is None and weights:
        # The loader reads the index's shards, or model.safetensors: Mistral's repositories also
        # hold consolidated.safetensors, the same weights again in another layout.
        if "model.safetensors" in weights and _INDEX not in weights:
            return [*extras, "model.safetensors"]
        return extras + weights  # with an index: cut to its shards once it is read
    ggufs = _ggufs(names)
    if tag is None and len(ggufs) > 1 and any("Q4_K_M" in _quants(n) for n in ggufs):
        tag = "Q4_K_M"  # llama.cpp's (and Ollama's) default quantization of a repository
    if tag is not None:
        matches = [n for n in ggufs if tag.upper() in _quants(n)]
        if not matches:
            quants = sorted(set().union(*map(_quants, ggufs)))
            raise ValidationError(f"{repo_id} has no GGUF file of quantization {tag}; it has: "
                                  f"{', '.join(quants) or 'no GGUF files'}", "model")
        first = sorted(matches)[0]
        return [*extras, first, *_other_shards(first, matches)]
    if len(ggufs) == 1 or (ggufs and all(_SHARD.search(n) for n in ggufs)):
        return extras + ggufs
    if ggufs:
        raise ValidationError(f"{repo_id} holds several GGUF files: name one as {repo_id}:QUANT or with "
                              f"--gguf-file ({', '.join(ggufs)})", "model")
    raise ModelLoadError(f"{repo_id} holds neither safetensors weights nor a GGUF file")


def indexed_shards(wanted: list[str], index: Path) -> list[str]:
    """``wanted`` with only the safetensors files the index's weight_map names."""
    try:
        named = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return wanted  # the loader reports a broken index in its own words
    return [n for n in wanted if not n.endswith(".safetensors") or n in named]


def _quants(name: str) -> set[str]:
    return {q.upper() for q in _QUANT.findall(Path(name).name)}


def _ggufs(names: list[str]) -> list[str]:
    # mmproj files are vision projectors that ship beside the language model's GGUF.
    return sorted(n for n in names if is_gguf_path(n) and "mmproj" not in n.lower())


def _other_shards(first: str, names: list[str]) -> list[str]:
    match = _SHARD.search(first)
    if match is None:
        return []
    stem = first[:match.start()]
    return sorted(n for n in names if n != first and n.startswith(stem) and _SHARD.search(n))


def _hub_kwargs() -> dict[str, Any]:
    return {"endpoint": envs.hf_endpoint(), "token": envs.hf_token()}


def _unreachable(e: Exception) -> bool:
    """A connection that failed (huggingface_hub's HTTP client names its errors TransportError,
    whichever httpx it ships) or a download that found neither the Hub nor the cache."""
    return isinstance(e, OSError) or any(c.__name__ == "TransportError" for c in type(e).__mro__)


def _from_cache(repo_id: str, revision: str | None, tag: str | None, gguf_file: str | None,
                tokenizer_only: bool, why: str, fix: str) -> tuple[str, list[str]]:
    """The cached snapshot and the files of it the engine needs, without a network call."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=envs.hf_hub_cache(), local_files_only=True)
    except LocalEntryNotFoundError:
        raise ModelLoadError(f"{why} and {repo_id}{'@' + revision if revision else ''} is not in the cache "
                             f"({envs.hf_hub_cache() or 'the default HF_HOME'}): {fix}") from None
    names = [str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file()]
    try:
        wanted = select_files(repo_id, names, tag, gguf_file, tokenizer_only)
    except ValidationError as e:  # what the cache holds, not what the Hub has
        raise ModelLoadError(f"{why}, and in the cache: {e.message}: {fix}") from None
    if (Path(folder) / _INDEX).is_file():
        wanted = indexed_shards(wanted, Path(folder) / _INDEX)
    missing = [n for n in wanted if not (Path(folder) / n).is_file()]
    if missing:
        raise ModelLoadError(f"{why} and {repo_id} is cached without {', '.join(missing)}: {fix}")
    return folder, wanted


def _download(repo_id: str, revision: str | None, tag: str | None, gguf_file: str | None,
              tokenizer_only: bool) -> tuple[str, list[str]]:
    """Look the repository up, then fetch the files it needs (hf_hub_download's progress bar
    per file; a file already in the cache is not fetched again)."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    kwargs = _hub_kwargs()
    try:
        info = HfApi(**kwargs).model_info(repo_id, revision=revision)
        wanted = select_files(repo_id, [s.rfilename for s in info.siblings or []], tag, gguf_file,
                              tokenizer_only)
        if _INDEX in wanted:
            index = hf_hub_download(repo_id, _INDEX, revision=revision, cache_dir=envs.hf_hub_cache(), **kwargs)
            wanted = indexed_shards(wanted, Path(index))
        path = None
        for name in wanted:  # by the name asked for, so the cache records it (offline use)
            path = hf_hub_download(repo_id, name, revision=revision, cache_dir=envs.hf_hub_cache(), **kwargs)
    except GatedRepoError:  # the listing of a gated repository is public; its files are not
        raise ModelLoadError(f"{repo_id} is gated: accept its terms on the Hub and set HF_TOKEN to a "
                             "token with access") from None
    except RevisionNotFoundError:
        raise ValidationError(f"{repo_id} has no revision {revision!r}", "revision") from None
    except RepositoryNotFoundError:
        raise ValidationError(f"{repo_id} is neither a local path nor a Hub repository "
                              "(private ones need HF_TOKEN)", "model") from None
    if path is None:
        raise ModelLoadError(f"{repo_id} holds none of the files the engine reads")
    folder = Path(path).parent
    for _ in Path(wanted[-1]).parts[1:]:  # a file in a subfolder: climb to the snapshot's root
        folder = folder.parent
    return str(folder), wanted
