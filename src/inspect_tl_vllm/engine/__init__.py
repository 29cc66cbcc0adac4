"""vLLM layer: the general plugin, the worker extension and ``construct_instrumented_llm``."""
