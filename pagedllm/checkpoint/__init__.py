"""Opening a model and loading it: where its files are (hub.py), the checkpoint opened once
(source.py: a safetensors folder, an AWQ/GPTQ folder, a GGUF file), and the one loader
(loader.py) over the weight sources (weights.py, quantized_checkpoint.py, gguf/weights.py).
This package file and hub.py, source.py, tokenizer.py import no torch: the engine opens a
checkpoint before any model is built."""
