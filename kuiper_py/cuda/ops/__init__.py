"""The CUDA backend's op families, one module each."""
