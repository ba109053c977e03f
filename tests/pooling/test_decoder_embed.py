"""A decoder family as an embedder (runner="pooling"): the demo model, mean and last-token
pooling, against transformers' hidden states (the final norm's output)."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.config import DEFAULT_MODEL_DIR
from pagedllm.errors import ValidationError

TEXTS = ["Once upon a time", "The little dog ran to the park and played with a red ball.", "Hi"]

pytestmark = pytest.mark.skipif(not DEFAULT_MODEL_DIR.is_dir(), reason="demo model not present")


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0]
    return hidden


@pytest.mark.parametrize("pooling_type", ["MEAN", "LAST"])
def test_demo_model_as_embedder(reference, pooling_type):
    llm = LLM(str(DEFAULT_MODEL_DIR), runner="pooling", max_num_batched_tokens=256,
              pooler_config={"pooling_type": pooling_type, "normalize": pooling_type == "LAST"})
    for out in llm.embed(TEXTS):
        h = reference(out.prompt_token_ids)
        want = h.mean(dim=0) if pooling_type == "MEAN" else torch.nn.functional.normalize(h[-1], dim=0)
        got = torch.tensor(out.outputs.embedding)
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) >= 0.99999
        assert torch.allclose(got, want, atol=1e-4)


def test_generator_refuses_to_embed_and_pooling_model_refuses_to_generate():
    llm = LLM(str(DEFAULT_MODEL_DIR))
    with pytest.raises(ValidationError, match="generates text.*/v1/completions"):
        llm.embed("Once")
    pooling = LLM(str(DEFAULT_MODEL_DIR), runner="pooling")
    with pytest.raises(ValidationError, match="pooling model.*/v1/embeddings"):
        pooling.generate("Once")
