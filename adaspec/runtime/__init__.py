"""The round runtime: state machine, events, device backends, and the two-slot pipeline."""
