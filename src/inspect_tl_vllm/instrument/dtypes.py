"""The torch dtype of each capture dtype name (``specs.CAPTURE_DTYPES``).

The one map from a name to a dtype: the worker keeps and packs captured rows in it
(``host_copies``, ``engine/packing.py``) and the hand-off files are written in it
(``engine/handoff.py``).  ``specs.py`` holds the names only, since it must not import torch.
"""

from __future__ import annotations

import torch

from inspect_tl_vllm.specs import CAPTURE_DTYPES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in CAPTURE_DTYPES}
