"""Packaged data: the prompt set and a held-out excerpt (see README.md here)."""
