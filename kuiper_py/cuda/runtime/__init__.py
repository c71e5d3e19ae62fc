"""The CUDA runtime layer: device queries, launches, the kernel registry and its builds."""
