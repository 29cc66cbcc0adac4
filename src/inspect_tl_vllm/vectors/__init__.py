"""Steering vectors as files: pickle-free reading and writing (``files``) and import from other
tools' formats (``importers``).  Kept out of ``instrument/``, whose sources key vLLM's compile cache."""
