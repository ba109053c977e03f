"""See the scheduler work, in the terminal: ``pagedllm explain SCENARIO`` replays small
scenarios step by step on the Scheduler and the torch-free FakeRunner (scenarios.py), renders
each step's trace record as rich tables (render.py), and converts traces for Perfetto
(chrome_trace.py). No model, no torch."""
