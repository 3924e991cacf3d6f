"""Shipped reference weights and model card (data only)."""
