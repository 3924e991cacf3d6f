"""Typed round events, the event bus, the event log and replay."""
