"""Structured outputs on the demo model (stories260K, the real ModelRunner): every output of 20
random schemas and 10 regexes validates, greedy and sampled with n = 4, with chunked prefill
(a 16-token budget) and preemption (a small KV cache). Slow on 2 CPU cores: marked slow."""
from __future__ import annotations

import pytest
from so_helpers import REGEXES, check_json, check_regex, random_schemas

from pagedllm import SamplingParams, StructuredOutputsParams

PROMPTS = ["Once upon a time", "The little dog was", "Lily and Tom went to the park to play"]


@pytest.fixture(scope="module")
def llm():
    from pagedllm import LLM

    llm = LLM(max_num_batched_tokens=16, num_gpu_blocks_override=64, block_size=4, max_num_seqs=8, seed=0)
    yield llm
    llm.llm_engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("temperature, n", [(0.0, 1), (1.0, 4)], ids=["greedy", "sampled-n4"])
def test_demo_model_outputs_validate(llm, temperature, n):
    schemas = random_schemas()
    params = [SamplingParams(max_tokens=200, n=n, temperature=temperature, seed=i,
                             structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True))
              for i, s in enumerate(schemas)]
    params += [SamplingParams(max_tokens=64, n=n, temperature=temperature, seed=i,
                              structured_outputs=StructuredOutputsParams(regex=r))
               for i, r in enumerate(REGEXES)]
    prompts = [PROMPTS[i % 3] for i in range(len(params))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    eos = llm.llm_engine.model_info.eos_token_ids  # {1, 2}: generation_config.json's
    for i, out in enumerate(outputs):
        assert len(out.outputs) == n
        for c in out.outputs:
            assert c.finish_reason == "stop" and c.token_ids[-1] in eos, (i, c.text)
            if i < len(schemas):
                check_json(c.text, schemas[i])
            else:
                check_regex(c.text, REGEXES[i - len(schemas)])
    assert llm.get_metrics()["pagedllm:num_preemptions"] > 0
