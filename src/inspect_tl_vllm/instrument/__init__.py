"""Torch-level instrumentation: hook points per architecture, the in-graph hook math, and
the host-side routing that tells each token row what to do.  No vLLM imports here."""
