"""Tensor parallelism over torch.distributed: forming the group, and its collectives.

``launch.py`` (torch-free: the executors import it) says how a rank joins: the master's address
and port, the world size, the device. ``parallel_state.py`` (torch) forms the group in each
worker before the runner builds the model, and holds the collectives the tensor-parallel layers
call (identities at world size 1, so the same model code runs unsharded). ``tp_sizes.py``
(torch-free) checks that a tensor-parallel size divides the model's heads, naming the sizes that do.
"""
