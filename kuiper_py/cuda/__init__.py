"""The CUDA backend's parts."""
