"""adaspec: an embeddable runtime for adaptive speculative decoding.

Each decode round is an explicit state machine (draft, consensus, pack, verify, sample,
commit, retire) over two pipeline slots; policies choose the draft depth or the verification
budget from feedback lagged to round n-2 and from costs calibrated at startup.
"""

__version__ = "0.1.0"
