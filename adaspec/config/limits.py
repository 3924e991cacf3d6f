"""The fixed limits and names of a launch: the built-in models, the graph backend of each
device, the ranges of the integer flags. A leaf: the launch config and its combination rules
both read it, and it imports nothing of ours."""

from typing import Literal

GraphBackend = Literal["aclgraph", "cudagraph", "eager_buckets"]

BUILTIN_TARGET = "builtin:target"
BUILTIN_TARGETS: dict[str, str] = {BUILTIN_TARGET: "small", "builtin:target-large": "large"}
"""Built-in targets and the reference family each loads (the drafts come from the same one)."""
BUILTIN_DRAFTS: dict[str, str] = {"MTP": "builtin:mtp", "DSpark": "builtin:dspark"}

# Which graph backend each device can replay. On the CPU there is no graph capture; the
# equivalent is a set of fixed shapes prewarmed eagerly, so padded costs stay step functions.
GRAPH_BACKEND_FOR_DEVICE: dict[str, GraphBackend] = {
    "cpu": "eager_buckets",
    "cuda": "cudagraph",
    "npu": "aclgraph",
}
GRAPH_BACKEND_MEANING: dict[str, str] = {
    "eager_buckets": "prewarmed fixed-shape eager buckets (no graph capture on cpu)",
    "cudagraph": "CUDA graphs captured per bucket",
    "aclgraph": "Ascend ACL graphs captured per bucket",
}

MAX_SPECULATIVE_TOKENS = 16
MAX_PARALLEL_SIZE = 1024
MAX_SEQS = 65536

# Inclusive ranges of the integer flags that have a fixed range; ranges that depend on other
# flags (node_rank, the graph batch limit) are checked with the combination rules.
INT_RANGES: dict[str, tuple[int, int]] = {
    "nnodes": (1, 65536),
    "node_rank": (0, 65535),
    "collective_timeout_s": (1, 86400),
    "port": (1, 65535),
    "num_speculative_tokens": (0, MAX_SPECULATIVE_TOKENS),
    "dp_size": (1, MAX_PARALLEL_SIZE),
    "cp_size": (1, MAX_PARALLEL_SIZE),
    "tp_size": (1, MAX_PARALLEL_SIZE),
    "max_seqs_per_batch": (1, MAX_SEQS),
    "acl_graph_decode_batch_size_limit": (1, MAX_SEQS),
}
