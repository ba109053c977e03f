"""Adapters that train the embedding and the head (PEFT's ``modules_to_save``) against PEFT's
model, on an untied Llama base and a tied Qwen2 base: each alone, and mixed in one batch with an
adapter that trains neither and with base rows; an adapter that adds vocabulary is refused."""
from __future__ import annotations

import pytest
import torch
from lora_helpers import build_adapter, build_base
from safetensors.torch import load_file, save_file
from test_lora_generate import _check, _params, _prompts

from pagedllm import LLM, LoRARequest
from pagedllm.errors import ValidationError


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora_mts_{request.param}")
    base = build_base(request.param, root / "base")
    adapters = [
        build_adapter(base, root / "both", 8, 16, ["q_proj", "v_proj"], seed=1,
                      modules_to_save=["embed_tokens", "lm_head"]),
        build_adapter(base, root / "head", 4, 8, ["o_proj"], seed=2, modules_to_save=["lm_head"]),
        build_adapter(base, root / "plain", 4, 8, ["up_proj"], seed=3),
    ]
    llm = LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              max_num_batched_tokens=64, block_size=8)
    requests = [LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(("both", "head", "plain"))]
    yield request.param, root, llm, list(zip(requests, adapters))
    del llm


def test_trained_embedding_and_head_alone_and_mixed(family):
    arch, _, llm, adapters = family
    prompts = _prompts(4, [11, 14, 9, 12, 10])
    for request, peft_model in adapters:
        out = llm.generate([{"prompt_token_ids": prompts[0]}], _params(), use_tqdm=False, lora_request=request)[0]
        _check(out, prompts[0], peft_model, False, f"{arch} {request.lora_name} alone")
    loras = [adapters[0][0], None, adapters[1][0], adapters[2][0], adapters[0][0]]
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False, lora_request=loras)
    peft_of = {r.lora_int_id: m for r, m in adapters}
    for prompt, lora, out in zip(prompts, loras, mixed):
        peft_model = peft_of[lora.lora_int_id] if lora else adapters[2][1]
        _check(out, prompt, peft_model, lora is None, f"{arch} mixed {lora}")


def test_trained_vocabulary_changes_the_output(family):
    """The embedding and head are applied, not only the low-rank pairs: PEFT with the saved
    modules swapped back to the base's gives other logprobs (so _check above could fail)."""
    arch, _, llm, adapters = family
    request, peft_model = adapters[0]
    prompt = _prompts(5, [12])[0]
    out = llm.generate([{"prompt_token_ids": prompt}], _params(), use_tqdm=False, lora_request=request)[0]
    with torch.no_grad():
        for module in (peft_model.base_model.model.model.embed_tokens, peft_model.base_model.model.lm_head):
            module.enable_adapters(False)  # ModulesToSaveWrapper: the base's copy
        logits = peft_model(torch.tensor([prompt])).logits[0]
        for module in (peft_model.base_model.model.model.embed_tokens, peft_model.base_model.model.lm_head):
            module.enable_adapters(True)
    rows = torch.log_softmax(logits.double(), dim=-1)
    gaps = [abs(out.prompt_logprobs[p][prompt[p]].logprob - float(rows[p - 1, prompt[p]]))
            for p in range(1, len(prompt))]
    assert max(gaps) > 1e-3, arch


def test_added_vocabulary_is_refused(family, tmp_path):
    arch, root, llm, _ = family
    import shutil
    shutil.copytree(root / "both", tmp_path / "wide")
    path = tmp_path / "wide" / "adapter_model.safetensors"
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith("embed_tokens.weight"))
    tensors[key] = torch.cat([tensors[key], torch.zeros(8, tensors[key].shape[1])])
    save_file(tensors, path)
    manager = llm.llm_engine.executor.runner.lora_manager
    before = list(manager.requests)
    with pytest.raises(ValidationError, match=r"embed_tokens: 520 vocabulary rows against the base's 512; "
                                              r"adapters that change the vocabulary"):
        llm.llm_engine.add_lora(LoRARequest("wide", 9, str(tmp_path / "wide")))
    assert list(manager.requests) == before


def test_adapter_memory_in_the_weight_table(family):
    """The runner's weight table (the memory report's source) counts every adapter tensor: the
    loaded adapters, their trained vocabulary matrices and the slots' stacked copies."""
    _, _, llm, adapters = family
    runner = llm.llm_engine.executor.runner
    llm.generate([{"prompt_token_ids": [1, 5, 9]}] * 3, _params(2), use_tqdm=False,
                 lora_request=[r for r, _ in adapters])  # every adapter resident

    def lora_bytes():
        return sum(row.nbytes for row in runner.weight_table if row.format == "lora")

    loaded = sum(m.nbytes for m in runner.lora_manager.loaded.values())
    vocab = 3 * 512 * 64 * 4  # "both": embedding and head, "head": head; float32
    assert loaded >= vocab and lora_bytes() >= loaded
    runner.lora_manager.remove_lora(adapters[0][0].lora_int_id)
    assert lora_bytes() <= loaded - 2 * 512 * 64 * 4  # its matrices, loaded and in its slot, freed
    runner.lora_manager.add_lora(adapters[0][0])


@pytest.mark.slow  # two worker processes, each loading the model
def test_trained_vocabulary_on_two_ranks(family, monkeypatch):
    """Each rank holds its vocabulary rows of the trained embedding and head."""
    arch, root, _, adapters = family
    if arch != "llama":
        pytest.skip("one family suffices for the sharding")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    llm = LLM(str(root / "base"), device="cpu", dtype="float32", enable_lora=True, max_loras=3,
              max_lora_rank=16, tensor_parallel_size=2)
    try:
        loras = [adapters[0][0], None, adapters[1][0]]
        prompts = _prompts(8, [10, 12, 9])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False,
                            lora_request=loras)
        peft_of = {r.lora_int_id: m for r, m in adapters}
        for prompt, lora, out in zip(prompts, loras, outs):
            _check(out, prompt, peft_of[lora.lora_int_id] if lora else adapters[2][1], lora is None,
                   f"tp=2 {lora}")
    finally:
        llm.llm_engine.shutdown()
