"""The specification's own launch lines are accepted and resolve as it describes."""

from pathlib import Path

import pytest
from conftest import launch

from adaspec.config import EffectiveConfig

CLUSTER = ("--model=/models/target --backend=llm --model_impl=python --npu_kernel_backend=TORCH "
           "--nnodes=16 --node_rank=0 --host=127.0.0.1 --port=8000 "
           "--master_node_addr=127.0.0.1:27000")

MTP_ADAPTIVE_DRAFT_STEPS = (
    f"{CLUSTER} --draft_model=/models/mtp "
    "--speculative_algorithm=MTP --num_speculative_tokens=5 "
    "--enable_adaptive_draft_step=true --enable_graph=true "
    "--python_graph_backend=aclgraph --disable_graph_warmup=false "
    "--enable_unified_mtp_graph=false --enable_schedule_overlap=true "
    "--enable_task_pipeline=true --dp_size=1 --cp_size=1 "
    "--max_seqs_per_batch=16 --acl_graph_decode_batch_size_limit=16")

MTP_ADAPTIVE_VERIFY = MTP_ADAPTIVE_DRAFT_STEPS.replace(
    "--enable_adaptive_draft_step=true",
    "--enable_adaptive_draft_step=false --enable_adaptive_target_verify=true "
    "--enable_probabilistic_draft=false")


def dspark_line(width: int, output: Path, dp_size: int = 1) -> str:
    return (f"{CLUSTER} --draft_model=/models/dspark "
            f"--speculative_algorithm=DSpark --num_speculative_tokens={width} "
            "--enable_adaptive_target_verify=true "
            "--enable_graph=true --python_graph_backend=aclgraph "
            "--disable_graph_warmup=false --enable_schedule_overlap=true "
            "--enable_task_pipeline=true --enable_unified_mtp_graph=false "
            f"--dp_size={dp_size} --cp_size=1 --max_seqs_per_batch=16 "
            "--acl_graph_decode_batch_size_limit=16 "
            f"--adaptive_target_verify_cost_table_output={output}")


def on_npu(line: str) -> EffectiveConfig:
    return launch(f"{line} --device=npu")


def test_mtp_adaptive_draft_steps_launch_is_accepted_with_spec_defaults() -> None:
    config = on_npu(MTP_ADAPTIVE_DRAFT_STEPS)
    draft_step = config.as_dict()["adaptive_draft_step"]
    assert draft_step["policy"] == {"source": "default", "window_size": 20,  # type: ignore[index]
                                    "update_interval": 5, "switch_min_gain": 0.05}
    assert draft_step["calibration"]["model"] == "additive"  # type: ignore[index]
    assert config.launch.resolved.tp_size == 16
    assert config.as_dict()["adaptive_target_verify"] == {"enabled": False}


def test_mtp_adaptive_verify_launch_uses_the_probability_proxy() -> None:
    section = on_npu(MTP_ADAPTIVE_VERIFY).as_dict()["adaptive_target_verify"]
    assert section["enabled"] is True  # type: ignore[index]
    assert section["confidence"].startswith("MTP selected-token probability")  # type: ignore[index]


@pytest.mark.parametrize("width", [7, 5])
def test_dspark_launch_is_accepted_for_draft7_and_draft5(width: int, tmp_path: Path) -> None:
    output = tmp_path / f"dspark-costs-draft{width}.json"
    config = on_npu(dspark_line(width, output))
    section = config.as_dict()["adaptive_target_verify"]
    assert section["calibration"]["draft_width"] == width  # type: ignore[index]
    assert section["calibration"]["source"] == "default"  # type: ignore[index]
    assert section["cost_table_output"] == str(output)  # type: ignore[index]
    assert not output.exists(), "checking a launch must not create the output file"


def test_dspark_dp2_launch_is_accepted_with_per_shard_capacity(tmp_path: Path) -> None:
    config = on_npu(dspark_line(7, tmp_path / "dp2.json", dp_size=2))
    assert (config.launch.dp_size, config.launch.resolved.tp_size) == (2, 8)
    assert config.launch.seqs_per_shard == 8


def test_spec_launch_lines_port_to_cpu_by_dropping_the_npu_backend(tmp_path: Path) -> None:
    line = dspark_line(7, tmp_path / "cpu.json").replace("--python_graph_backend=aclgraph", "")
    config = launch(line)
    assert config.launch.resolved.python_graph_backend == "eager_buckets"


def test_sources_say_which_settings_came_from_flags(tmp_path: Path) -> None:
    config = on_npu(dspark_line(7, tmp_path / "s.json"))
    assert config.sources["num_speculative_tokens"] == "flag"
    assert config.sources["enable_probabilistic_draft"] == "default"
