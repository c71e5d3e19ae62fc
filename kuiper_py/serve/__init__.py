"""`kuiper serve`: an OpenAI-compatible HTTP server over one engine thread."""
