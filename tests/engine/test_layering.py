"""The import direction of DESIGN.md §2: the scheduler and the engine loop never need torch.

1. In a subprocess where torch, numpy and transformers cannot be imported, import the pure-Python
   layers and run a FakeRunner engine loop to completion.
2. Statically: no module under pagedllm/core or pagedllm/engine (nor the runner protocol and the
   FakeRunner) imports torch, numpy or transformers at module level.
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
     PKG / "runner" / "base.py", PKG / "runner" / "fake.py",
     PKG / "config.py", PKG / "sampling_params.py", PKG / "errors.py", PKG / "__init__.py"])


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
