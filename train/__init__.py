"""Training-validation pipeline for flamia_cute: a small Llama-style model trained on packed documents.

Run from the repo root: `python -m train.run --help` (see train/README.md).
"""
