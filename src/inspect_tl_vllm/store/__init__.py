"""Activations on disk beside the eval log: writing and linking files (``disk``) and reading
them back joined to samples, epochs and scores (``activations``)."""
