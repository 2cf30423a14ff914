"""Training the built-in model (issue 29), stage by stage: `corpus.py` (the CPython standard
library, split by file) and `tokenizer.py` (byte-level BPE) so far; `python -m dhisparse.train`
runs a stage and writes a JSON record of it. Above models (it reads model configs), a peer of
server and bench."""
