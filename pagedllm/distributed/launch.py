"""How a worker joins the tensor-parallel group: plain data the executor builds and sends along.

Torch-free on purpose: the executors (and the engine core that builds them) never import torch.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class DistributedInit:
    """Everything ``parallel_state.init_distributed`` needs; pickles (the mp executor and Ray send it)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    # ModelConfig.device: "cuda..." (or "auto" on a machine with CUDA) forms an NCCL group, any
    # other a gloo one; the same collectives run over either.
    device: str = "auto"
    # Ranks on this rank's machine, and this rank's index among them (its CUDA device; the share
    # of the CPU cores its torch threads take).
    local_rank: int = 0
    local_world_size: int = 1
    # How long forming the group may take before the rank gives up with a message.
    timeout_s: float = 120.0

    @property
    def init_method(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it). Another process may take it before rank 0
    binds it; rank 0 then fails with "address already in use", which the executor reports."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
