"""The round state machine (declared once on transitions) and its state handlers."""
