"""pagedllm's benchmarks: the harness (``common``), one module per benchmark with a
``main(argv)``, and the peers that drive vLLM from its own venv (``vllm_peer``,
``vllm_scheduler_peer``, standard library only).

They live in the source checkout, not in the installed package: run them as
``pagedllm bench NAME [ARGS]`` or ``python -m benchmarks.NAME [ARGS]`` from the repository root.
They drive the engine through pagedllm's public API; ``scheduler_overhead`` alone drives the
Scheduler with a FakeRunner, since timing the scheduler is its point.
"""
