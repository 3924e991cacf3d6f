"""Depth and budget policies, acceptance estimators and cost models (numpy/scipy only)."""
