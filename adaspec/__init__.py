"""adaspec: an embeddable runtime for adaptive speculative decoding.

A decode round moves through seven declared states (draft, consensus, pack, verify, sample,
commit, retire), two rounds in flight over two pipeline slots; policies choose the draft depth
or the verification budget from feedback lagged to round n-2 and from costs calibrated at
startup.
"""

__version__ = "0.1.0"
