"""Structured outputs: grammars compiled off the step loop, one matcher per sequence, bitmasks.

``grammar.py`` turns a StructuredOutputsParams into an llguidance grammar and checks it (a 400 at
add time); ``backend.py`` holds the library (its tokenizer, compiled grammars, the batched mask
fill); ``manager.py`` is what the engine core calls: hold requests until their grammar is ready,
build each step's bitmask, advance matchers with the tokens each step appended, check drafts.
The library is imported on the first structured request, so an engine without one never loads
it. Applying the mask to the logits is the runner's (pagedllm/runner/grammar_bitmask.py).
"""
