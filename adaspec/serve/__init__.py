"""``adaspec serve``: an OpenAI-compatible HTTP server over the runtime (a client of it)."""
