"""The import direction of DESIGN.md §2: the scheduler and the engine loop never need torch.

1. In a subprocess where torch, numpy and transformers cannot be imported, import the pure-Python
   layers and run a FakeRunner engine loop to completion.
2. Statically: no module under pagedllm/core or pagedllm/engine (nor the runner protocol and the
   FakeRunner) imports torch, numpy or transformers at module level.
3. Statically, on every module of the package: pagedllm's own imports point the way the table of
   DESIGN.md §2 says (lazy imports inside functions count too), and no import circle exists, lazy
   and ``TYPE_CHECKING`` imports counted.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PKG = REPO_ROOT / "pagedllm"
BLOCKED = ("torch", "numpy", "transformers")

_SCRIPT = textwrap.dedent("""
    import sys
    from importlib.abc import MetaPathFinder

    BLOCKED = {blocked!r}

    class Blocker(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked in this test")
            return None

    sys.meta_path.insert(0, Blocker())
    for name in BLOCKED:
        sys.modules.pop(name, None)

    import pagedllm
    import pagedllm.core.scheduler
    import pagedllm.core.kv_cache_manager
    import pagedllm.engine.llm_engine
    import pagedllm.engine.output_processor
    import pagedllm.runner.fake
    from pagedllm import SamplingParams
    from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.model_info import ModelInfo
    from pagedllm.runner.fake import FakeRunner, fake_generate

    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker did not block torch")

    config = EngineConfig(ModelConfig(model="unused", max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks_override=8),
                          SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=3))
    engine = LLMEngine(config, runner=FakeRunner(vocab_size=50),
                       model_info=ModelInfo(vocab_size=50, max_position_embeddings=64,
                                            eos_token_ids=frozenset({{0}})),
                       load_tokenizer=False)
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7], [9] * 9, [4, 4]]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=12, ignore_eos=True, n=1 + i % 2))
    final = {{}}
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = out
    for i, p in enumerate(prompts):
        want = fake_generate(p, 12, 50, frozenset({{0}}), True)
        assert [c.token_ids for c in final[str(i)].outputs] == [want] * (1 + i % 2), i
    assert engine.get_metrics()["pagedllm:kv_cache_usage_perc"] == 0.0
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    print("LAYERING-OK", engine.get_metrics()["pagedllm:num_preemptions"])
""").format(blocked=BLOCKED)


def test_engine_loop_runs_without_torch_numpy_transformers():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LAYERING-OK" in proc.stdout


def _module_level_imports(tree: ast.Module):
    """Import nodes that run at import time: the module body, and inside top-level if/try blocks
    (except ``if TYPE_CHECKING:``), but not inside functions or classes."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "TYPE_CHECKING" not in test:
                stack.extend(node.body)
            stack.extend(node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend(node.body)
            stack.extend(node.orelse)
            stack.extend(node.finalbody)
            for handler in node.handlers:
                stack.extend(handler.body)


def _imported_roots(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    if node.level:  # relative import: inside pagedllm
        return []
    return [(node.module or "").split(".")[0]]


LIGHT_MODULES = sorted(
    [*(PKG / "core").glob("*.py"), *(PKG / "engine").glob("*.py"),
     *(PKG / "structured_output").glob("*.py"),
     # checkpoint/'s torch-free half: opening a model (the weight streams below it need torch)
     *(PKG / "checkpoint" / n for n in ("__init__.py", "hub.py", "source.py", "tokenizer.py")),
     PKG / "runner" / "base.py", PKG / "runner" / "fake.py",
     PKG / "config.py", PKG / "hf_config.py", PKG / "sampling_params.py", PKG / "errors.py", PKG / "envs.py",
     PKG / "utils.py", PKG / "speculative_config.py", PKG / "__init__.py", PKG / "lora" / "__init__.py",
     PKG / "lora" / "request.py"])


@pytest.mark.parametrize("path", LIGHT_MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_no_heavy_import_at_module_level(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [f"line {node.lineno}: {ast.unparse(node)}" for node in _module_level_imports(tree)
           if set(_imported_roots(node)) & set(BLOCKED)]
    assert not bad, f"{path.relative_to(REPO_ROOT)} imports at module level: {bad}"


def test_static_check_sees_core_and_engine():
    names = {str(p.relative_to(PKG)) for p in LIGHT_MODULES}
    assert {"core/scheduler.py", "core/kv_cache_manager.py", "engine/llm_engine.py",
            "runner/fake.py"} <= names


def test_static_check_catches_a_top_level_import():
    tree = ast.parse(textwrap.dedent("""
        import os
        if True:
            import torch
        def f():
            import numpy
        try:
            from transformers import AutoTokenizer
        except ImportError:
            pass
        if TYPE_CHECKING:
            import torch.nn
    """))
    roots = [r for node in _module_level_imports(tree) for r in _imported_roots(node)]
    assert sorted(roots) == ["os", "torch", "transformers"]


# -- pagedllm's own import direction (DESIGN.md §2) ----------------------------------------------
# Layers by module: the plain-data base, then core, the torch-free runner parts, layers and models,
# the torch runner, the executor, the engine, the entry points. A layer may import what its
# entry names: layer names, or single modules (the public API of a layer above).
BASE = {"config", "sampling_params", "errors", "beam_search_params", "outputs", "structured_outputs_params",
        "hf_config", "envs", "utils",
        # pooling models' plain data: their params and outputs, the runner type, the pooler's config
        "pooling_params", "pooling_outputs", "runner_type", "pooler_config",
        "speculative_config"}
RUNNER_LIGHT = {"runner", "runner.base", "runner.fake", "runner.input_batch"}
# Plain data every layer carries (which adapter a request runs with).
BASE_MODULES = {"lora.request"}
ALLOWED = {
    # a .gguf path's runner type and pooling: read from the file's metadata (torch-free)
    "base": {"base", "checkpoint.gguf.pooling"},
    "core": {"base", "core"},
    "runner_light": {"base", "core.outputs", "core.scheduler_stats", "runner_light"},
    # The tensor-parallel group and its collectives (torch), and the torch-free launch data.
    "distributed": {"base", "distributed"},
    # The C++ kernels, their build and the op registry: below the modules that call them.
    "kernels": {"base", "kernels"},
    "layers": {"base", "distributed", "kernels", "layers"},
    # LoRA adapters: wrap the layers' weight formats (pagedllm/lora/).
    "lora": {"base", "distributed", "kernels", "layers", "lora"},
    # The model families know nothing of files: checkpoint/ opens and loads them.
    "models": {"base", "distributed", "kernels", "layers", "models"},
    # core.ngram_proposer: plain Python the runner runs for n-gram drafts under async scheduling.
    "runner": {"base", "core.outputs", "core.scheduler_stats", "core.ngram_proposer", "runner_light", "runner",
               "kernels", "layers", "models", "distributed", "lora", "checkpoint", "weight_plan"},
    # Executors join workers into the group: the torch-free launch data and size checks only
    # (parallel_state is imported in the worker, lazily).
    "executor": {"base", "core", "runner_light", "runner", "executor", "distributed", "checkpoint"},
    "engine": {"base", "core", "runner_light", "executor", "engine", "structured_output", "checkpoint"},
    # Opening a model (a local path or a Hub id; safetensors, GGUF, AWQ/GPTQ) and loading its
    # weights into a model built from models/ (GGUF files live under it: checkpoint/gguf/).
    "checkpoint": {"base", "distributed", "kernels", "layers", "models", "checkpoint", "weight_plan"},
    # The one place a layer's weight format is decided: below the loaders, which ask it which
    # layers keep a checkpoint's blocks, and the runner, which runs it after loading.
    "weight_plan": {"base", "distributed", "kernels", "layers", "weight_plan"},
    # Grammars and matchers for structured outputs (the runner applies the masks on its own).
    "structured_output": {"base", "core", "structured_output", "checkpoint.tokenizer"},
    # The public API only: LLM, AsyncLLM, the tokenizer helpers, the plain-data modules.
    "entrypoints": {"base", "package", "engine.llm", "engine.llm_pooling", "engine.async_engine",
                    "engine.tokenizer", "engine.step_trace", "explain", "entrypoints", "checkpoint.hub",
                    # a bad schema or regex is a 400 at the door; tools' schemas closed there
                    "structured_output.grammar", "structured_output.strict_schema"},
    # pagedllm explain: scenarios on the Scheduler and the FakeRunner, rendered from step traces.
    "explain": {"base", "core", "runner_light", "engine", "explain"},
    "package": {"base", "engine.llm"},  # pagedllm/__init__.py: the public surface
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts) or "package"


def layer_of(module: str) -> str:
    if module == "package":
        return "package"
    if module in RUNNER_LIGHT:
        return "runner_light"
    if module in BASE_MODULES:
        return "base"
    first = module.split(".")[0]
    return "base" if first in BASE else first


def _pagedllm_imports(tree: ast.Module, nodes=None) -> list[tuple[int, str]]:
    """(line, module) of every import of a pagedllm module, as dotted names below pagedllm."""
    found = []
    for node in (nodes if nodes is not None else ast.walk(tree)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == "pagedllm":  # from pagedllm import X: a submodule or the package API
                for alias in node.names:
                    sub = (PKG / alias.name).with_suffix(".py").is_file() or (PKG / alias.name).is_dir()
                    found.append((node.lineno, alias.name if sub else "package"))
            elif node.module.startswith("pagedllm."):
                found.append((node.lineno, node.module[len("pagedllm."):]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name[len("pagedllm."):]) for a in node.names
                      if a.name.startswith("pagedllm.")]
    return found


def _allowed(target: str, allowed: set[str]) -> bool:
    return (target in allowed or layer_of(target) in allowed
            or any(target.startswith(a + ".") for a in allowed))


ALL_MODULES = sorted(PKG.rglob("*.py"))


@pytest.mark.parametrize("path", ALL_MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_import_direction(path):
    module = _module_name(path)
    allowed = ALLOWED[layer_of(module)]
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [f"line {line}: {target}" for line, target in _pagedllm_imports(tree)
           if not _allowed(target, allowed)]
    assert not bad, f"{module} ({layer_of(module)}) imports against the layering: {bad}"


def _import_graph() -> dict[str, set[str]]:
    """module -> the pagedllm modules it imports anywhere: at module level, inside functions
    (lazy) and under ``if TYPE_CHECKING:`` alike. A lazy import still ties the two modules
    together (neither can be understood, moved or tested without the other), and a type-only
    one becomes a real one as soon as someone needs the name at run time."""
    graph = {}
    for path in ALL_MODULES:
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[_module_name(path)] = {t for _, t in _pagedllm_imports(tree)}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """The first import circle found (a path that comes back to its start), or None. A target
    that is not a module is a name imported from a package (``from pagedllm.core import x``):
    the edge goes to that package."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            nxt = nxt if nxt in graph else nxt.rsplit(".", 1)[0]
            if nxt == node:
                continue  # a package's __init__ naming its own submodule's package
            if state.get(nxt) == 1:
                return trail[trail.index(nxt):] + [node, nxt] if nxt in trail else trail + [node, nxt]
            if nxt in graph and not state.get(nxt):
                found = visit(nxt, trail + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if not state.get(node):
            found = visit(node, [])
            if found:
                return found
    return None


def test_no_import_circle():
    circle = find_circle(_import_graph())
    assert circle is None, f"import circle: {' -> '.join(circle)}"


def test_circle_check_sees_lazy_and_type_checking_imports():
    """Today's two circles, as they were: each closes through a lazy or a type-only import."""
    def imports(src: str) -> set[str]:
        return {t for _, t in _pagedllm_imports(ast.parse(textwrap.dedent(src)))}

    graph = {
        "engine.core_client": imports("""
            def make_engine_core():
                from pagedllm.engine.dp_client import DPEngineCoreClient
            """),
        "engine.dp_client": imports("from pagedllm.engine.core_client import MPEngineCoreClient"),
        "layers.attention.backend": imports("""
            if TYPE_CHECKING:
                from pagedllm.layers.attention_metadata import AttentionMetadata
            """),
        "layers.attention_metadata": imports("from pagedllm.layers.attention.backend import AttentionBackend"),
        "core.scheduler": imports("from pagedllm.core.request import Request"),
        "core.request": set(),
    }
    assert find_circle(graph) == ["engine.core_client", "engine.dp_client", "engine.core_client"]
    del graph["engine.core_client"]
    assert find_circle(graph) == ["layers.attention.backend", "layers.attention_metadata",
                                  "layers.attention.backend"]
    del graph["layers.attention.backend"]
    assert find_circle(graph) is None


def test_the_engine_uses_the_executors_public_api():
    """The engine creates executors (the package's create_executor) and starts its own core
    process with the children's toolkit (executor/ipc.py), never an executor's own modules."""
    public = {"executor", "executor.ipc"}
    bad = []
    for path in sorted((PKG / "engine").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        bad += [f"{path.name} line {line}: {target}" for line, target in _pagedllm_imports(tree)
                if layer_of(target) == "executor" and target not in public]
    assert not bad, bad


def test_layering_table_catches_an_upward_import():
    tree = ast.parse("from pagedllm.engine.llm_engine import LLMEngine\nfrom pagedllm import LLM\n")
    targets = [t for _, t in _pagedllm_imports(tree)]
    assert targets == ["engine.llm_engine", "package"]
    assert not _allowed("engine.llm_engine", ALLOWED["entrypoints"])
    assert not _allowed("engine", ALLOWED["core"]) and not _allowed("runner.model_runner", ALLOWED["engine"])
    assert _allowed("core.outputs", ALLOWED["runner"]) and not _allowed("core.scheduler", ALLOWED["runner"])


def test_models_never_open_a_checkpoint():
    """checkpoint/ builds models and streams weights into them; the model families never import
    checkpoint/ back (GGUF included: it lives under checkpoint/), so no folder loop can return."""
    assert _allowed("models.registry", ALLOWED["checkpoint"])
    for target in ("checkpoint.loader", "checkpoint.gguf.weights", "checkpoint.source"):
        assert not _allowed(target, ALLOWED["models"]), target
    bad = [f"{path.name} line {line}: {target}" for path in sorted((PKG / "models").rglob("*.py"))
           for line, target in _pagedllm_imports(ast.parse(path.read_text()))
           if layer_of(target) == "checkpoint"]
    assert not bad, bad
    assert not (PKG / "gguf").exists(), "GGUF files are a checkpoint kind: pagedllm/checkpoint/gguf/"
