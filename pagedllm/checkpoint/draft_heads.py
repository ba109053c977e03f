"""Load the draft heads that read a target's hidden states: an EAGLE-3 head folder, and the MTP
layers a target checkpoint ships (MiMo)."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedllm.checkpoint.source import open_checkpoint
from pagedllm.checkpoint.weights import load_weights
from pagedllm.errors import ModelLoadError
from pagedllm.models.eagle3 import EAGLE3_ARCHITECTURES, Eagle3Head, is_eagle3_config
from pagedllm.models.mimo import MiMoForCausalLM
from pagedllm.models.mimo_mtp import MiMoMTPHead


def load_eagle3_head(path: str, target: nn.Module, dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    """Build the head of the checkpoint folder ``path`` for ``target`` and load its weights."""
    folder = Path(path)
    config = open_checkpoint(folder).config
    if not is_eagle3_config(config):
        raise ModelLoadError(f"{path} is not an EAGLE-3 head: its config.json names neither an "
                             f"architecture of {list(EAGLE3_ARCHITECTURES)} nor draft_vocab_size")
    files = open_checkpoint(folder).weight_files()
    names = {n for f in files for n in _tensor_names(f)}
    own_embedding = any(n.endswith("embed_tokens.weight") for n in names)
    with torch.device("meta"):
        head = Eagle3Head(config, target.hidden_size, own_embedding)
    if head.vocab_size != target.vocab_size:
        raise ModelLoadError(f"the EAGLE-3 head {path} maps to a vocabulary of {head.vocab_size} tokens and "
                             f"the target has {target.vocab_size}: a head must be trained for its target")
    head = head.to(dtype=dtype).to_empty(device=device)
    load_weights(head, files)
    d2t = next((_read(f, n) for f in files for n in _tensor_names(f) if n.endswith("d2t")), None)
    if d2t is not None:
        if d2t.shape != (head.draft_vocab_size,):
            raise ModelLoadError(f"{path}: d2t has shape {tuple(d2t.shape)}, expected ({head.draft_vocab_size},)")
        head.draft_to_target = (torch.arange(head.draft_vocab_size) + d2t.long()).to(device)
    elif head.draft_vocab_size != head.vocab_size:
        raise ModelLoadError(f"{path}: a draft vocabulary of {head.draft_vocab_size} tokens needs d2t")
    else:
        head.draft_to_target = torch.arange(head.draft_vocab_size, device=device)
    if int(head.draft_to_target.min()) < 0 or int(head.draft_to_target.max()) >= head.vocab_size:
        raise ModelLoadError(f"{path}: d2t maps draft ids outside the target's vocabulary")
    head._target_embed = (target.decoder,)
    head.requires_grad_(False)
    return head.eval()


def load_mtp_head(target_path: str, target: nn.Module, dtype: torch.dtype, device: torch.device) -> MiMoMTPHead:
    """The MTP layers of the target's own checkpoint folder as a draft head."""
    folder = Path(target_path)
    config = open_checkpoint(folder).config if folder.is_dir() else {}
    if not isinstance(target, MiMoForCausalLM) or not config.get("num_nextn_predict_layers"):
        raise ModelLoadError(f"speculative method 'mtp' needs a checkpoint that ships MTP layers (MiMo: "
                             f"num_nextn_predict_layers in config.json); {target_path} has none")
    with torch.device("meta"):
        head = MiMoMTPHead(config)
    head = head.to(dtype=dtype).to_empty(device=device)
    load_weights(head, open_checkpoint(folder).weight_files())
    head._target = (target,)
    head.requires_grad_(False)
    return head.eval()


def _tensor_names(file) -> list[str]:
    with safe_open(str(file), framework="pt", device="cpu") as f:
        return list(f.keys())


def _read(file, name: str) -> torch.Tensor:
    with safe_open(str(file), framework="pt", device="cpu") as f:
        return f.get_tensor(name)
