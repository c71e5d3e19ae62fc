"""Token draws on the device: which sampling kernel form a draw takes."""
from __future__ import annotations

from ..sampling import SamplingParams
from . import settings as cfg

try:
    import cupy as cp
except ImportError:  # pragma: no cover - CPU-only installs
    cp = None




# sampling.cu: a block's threads, the candidates its shared memory holds, and the logits each block of
# sample_token_mb scans. sample_mb=0 draws in one block (sample_token) always
SMP_THREADS, SMP_CAND, SMP_CHUNK, SMP_MAX_BLOCKS = 1024, 4096, 16384, 256


def draw_plan(n_valid: int, p: SamplingParams) -> tuple[int, int] | None:
    """(blocks, candidates per block) of sample_token_mb for a draw over n_valid logits, or None for the
    one-block sample_token: top-k off or past the union's room (blocks x candidates <= SMP_CAND), or a
    vocabulary one block covers."""
    G = -(-n_valid // SMP_CHUNK)
    if not cfg.SETTINGS.sample_mb or G < 2:
        return None
    assert G <= SMP_MAX_BLOCKS, f"{n_valid} logits: more than {SMP_MAX_BLOCKS} sampling blocks"
    cap = min(SMP_CAND // G, SMP_THREADS)
    if p.temperature == 0 or 0 < p.top_k <= cap and p.top_k < n_valid:
        return G, cap
    return None
