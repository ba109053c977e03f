"""pagedllm's C++ CPU kernels: the sources (csrc/), their build per x86 level
(cpu_extension.py) and the registry of the engine's own torch ops (op_registry.py).

This package sits below layers/: it knows nothing of modules or models. Which kernel a layer
runs is decided at startup by the runner (weight_plan/linear_choice.py, runner/attention_choice.py),
which measures them on the model's shapes.
"""
