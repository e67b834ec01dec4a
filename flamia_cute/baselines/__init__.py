"""Attention implementations the benchmark compares against, each importable or reported absent."""
