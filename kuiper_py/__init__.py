"""kuiper: a standalone inference engine for Qwen3 AWQ models."""
__version__ = "0.1.0"
