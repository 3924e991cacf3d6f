"""Reference target and draft models, the model protocols, and shipped weights."""
