"""The environment variables the engine reads (docs/RUNTIME.md's table), in one place. Each is read when it is needed,
so a process that sets one before it loads a model is served."""
from __future__ import annotations

import os


def cuda_graphs() -> bool:
    """KUIPER_CUDA_GRAPHS=0: the decode step as eager launches and no prefill graphs (debugging)."""
    return os.environ.get("KUIPER_CUDA_GRAPHS", "1") != "0"


def pdl() -> bool:
    """KUIPER_PDL=0: no programmatic dependent launch, even where the GPU has it."""
    return os.environ.get("KUIPER_PDL", "1") != "0"


def build_threads() -> int:
    """KUIPER_BUILD_THREADS: the most worker threads that build kernel modules side by side (default 16)."""
    return max(1, int(os.environ.get("KUIPER_BUILD_THREADS", "16")))
