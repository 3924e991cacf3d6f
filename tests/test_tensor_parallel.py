"""The reference models split across TP ranks (Megatron layout) compute what the whole models
compute: two real gloo ranks, each holding half of every transformer block."""

from pathlib import Path

import pytest
import torch
from gloo_job import GlooJob

from adaspec.errors import ConfigError
from adaspec.models import load_reference_models
from adaspec.models.parallel import split_blocks

# A row-parallel sum adds the same products in another order: float32 rounding, no more.
ATOL = 1e-4


def test_two_tp_ranks_compute_what_the_whole_models_compute(tmp_path: Path) -> None:
    with GlooJob(tmp_path, tp_size=2) as job:
        peers = [job.start("tp_models", rank) for rank in range(2)]
        reports = [job.report(peer) for peer in peers]
    for report in reports:
        assert "error" not in report
        for name, (whole, split) in report["sizes"].items():
            assert split * 2 == whole, name
        assert report["cache_heads"] == 2  # the shipped target has 4 heads
        for output, difference in report["max_diff"].items():
            assert difference <= ATOL, output
    # Every rank drafted the same block, equal to the whole drafter's.
    assert reports[0]["tokens"] == reports[1]["tokens"]
    assert reports[0]["max_diff"]["dspark_tokens"] == 0


def test_a_tp_size_that_does_not_divide_the_heads_is_refused_before_any_change() -> None:
    models = load_reference_models()
    before = {k: v.clone() for k, v in models.target.state_dict().items()}

    def never_called(tensor: torch.Tensor) -> None:  # the refusal comes before any forward
        raise AssertionError("no all-reduce expected")

    with pytest.raises(ConfigError, match=r"^--tp_size=3: expected a divisor of the model's "
                                          r"attention heads \(4\)"):
        split_blocks(models.target, 0, 3, never_called)
    after = models.target.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_one_tp_rank_keeps_the_model_whole() -> None:
    models = load_reference_models()
    weight = models.target.blocks[0].attn.qkv.weight
    split_blocks(models.target, 0, 1, lambda tensor: None)
    assert models.target.blocks[0].attn.qkv.weight is weight
