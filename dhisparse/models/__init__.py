"""The causal LMs and how to get one: our GLM-5.x / DeepSeek-V3.2 model (`dsa.py`) and
DeepSeek-V4 model (`dsv4.py`) over a shared LM head (`base.py`), the checkpoint loaders
(`loader.py`, `v4_loader.py`), tokenizers (`tokenizer.py`), the built-in `tiny` model, the scaled
random-weight benchmark models (`scaled.py`, `v4_scaled.py`), piecewise CUDA graphs of each
layer's pure pieces (`graphs.py`) and `load_model` (`registry.py`). May import `core`, `kernels`,
`kv` and `layers`."""
