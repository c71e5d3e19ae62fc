"""Error types that the CLI turns into one line and an exit code."""


class KuiperError(Exception):
    """Bad input or usage: a file, a flag or a checkpoint we refuse (exit 2)."""

    exit_code = 2


class ResourceError(KuiperError):
    """Out of GPU or host memory, or disk (exit 3)."""

    exit_code = 3
