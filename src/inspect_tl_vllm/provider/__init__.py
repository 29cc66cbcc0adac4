"""The Inspect provider ``tl-vllm``: model args, the shared engine pool and the ModelAPI."""
