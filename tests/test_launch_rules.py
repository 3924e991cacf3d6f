"""Every combination rule of the launch configuration rejects a violating launch line with a
pinned one-line message, and the rule table is fully covered by these cases."""

import re

import pytest
from conftest import launch, rejection

from adaspec.config.rules import RULES

ADS = "--speculative_algorithm=MTP --num_speculative_tokens=5 --enable_adaptive_draft_step=true"
ATV = "--speculative_algorithm=DSpark --num_speculative_tokens=7 " \
      "--enable_adaptive_target_verify=true"
ATV_MTP = "--speculative_algorithm=MTP --num_speculative_tokens=5 " \
          "--enable_adaptive_target_verify=true"

# (launch line, the exact message it must produce)
RULE_CASES = [
    (f"{ADS} --enable_adaptive_target_verify=true",
     "--enable_adaptive_target_verify=true: --enable_adaptive_draft_step=true needs "
     "--enable_adaptive_target_verify=false (choose one adaptive control)"),
    ("--speculative_algorithm=DSpark --num_speculative_tokens=5 "
     "--enable_adaptive_draft_step=true",
     "--speculative_algorithm=DSpark: --enable_adaptive_draft_step=true needs "
     "--speculative_algorithm=MTP"),
    (f"{ADS} --enable_unified_mtp_graph=true",
     "--enable_unified_mtp_graph=true: --enable_adaptive_draft_step=true needs "
     "--enable_unified_mtp_graph=false"),
    (f"{ADS} --enable_disagg_pd=true",
     "--enable_disagg_pd=true: --enable_adaptive_draft_step=true needs --enable_disagg_pd=false"),
    (f"{ADS} --enable_graph=false",
     "--enable_graph=false: --enable_adaptive_draft_step=true needs --enable_graph=true"),
    (f"{ADS} --disable_graph_warmup=true",
     "--disable_graph_warmup=true: --enable_adaptive_draft_step=true needs "
     "--disable_graph_warmup=false"),
    (f"{ADS} --enable_schedule_overlap=false",
     "--enable_schedule_overlap=false: --enable_adaptive_draft_step=true needs "
     "--enable_schedule_overlap=true"),
    (f"{ADS} --enable_task_pipeline=false",
     "--enable_task_pipeline=false: --enable_adaptive_draft_step=true needs "
     "--enable_task_pipeline=true"),
    (f"{ADS} --dp_size=2 --nnodes=2",
     "--dp_size=2: --enable_adaptive_draft_step=true needs --dp_size=1"),
    (f"{ADS} --cp_size=2 --nnodes=2",
     "--cp_size=2: --enable_adaptive_draft_step=true needs --cp_size=1"),
    (f"{ATV} --adaptive_draft_step_config=/configs/draft-steps.json",
     "--enable_adaptive_draft_step=false: --adaptive_draft_step_config needs "
     "--enable_adaptive_draft_step=true"),
    ("--enable_adaptive_target_verify=true",
     "--speculative_algorithm=none: --enable_adaptive_target_verify=true needs "
     "--speculative_algorithm=MTP or DSpark"),
    (f"{ATV} --enable_probabilistic_draft=true",
     "--enable_probabilistic_draft=true: --enable_adaptive_target_verify=true needs "
     "--enable_probabilistic_draft=false"),
    ("--speculative_algorithm=DSpark --num_speculative_tokens=6 "
     "--enable_adaptive_target_verify=true",
     "--num_speculative_tokens=6: --enable_adaptive_target_verify=true needs "
     "--num_speculative_tokens=5 or 7"),
    (f"{ATV} --enable_graph=false",
     "--enable_graph=false: --enable_adaptive_target_verify=true needs --enable_graph=true"),
    (f"{ATV} --disable_graph_warmup=true",
     "--disable_graph_warmup=true: --enable_adaptive_target_verify=true needs "
     "--disable_graph_warmup=false"),
    (f"{ATV} --enable_schedule_overlap=false",
     "--enable_schedule_overlap=false: --enable_adaptive_target_verify=true needs "
     "--enable_schedule_overlap=true"),
    (f"{ATV} --enable_task_pipeline=false",
     "--enable_task_pipeline=false: --enable_adaptive_target_verify=true needs "
     "--enable_task_pipeline=true"),
    (f"{ATV} --cp_size=2 --nnodes=2",
     "--cp_size=2: --enable_adaptive_target_verify=true needs --cp_size=1"),
    (f"{ATV_MTP} --dp_size=2 --nnodes=2",
     "--dp_size=2: --enable_adaptive_target_verify=true and --speculative_algorithm=MTP need "
     "--dp_size=1 (data parallelism is supported for DSpark only)"),
    (f"{ATV_MTP} --enable_unified_mtp_graph=true",
     "--enable_unified_mtp_graph=true: --enable_adaptive_target_verify=true and "
     "--speculative_algorithm=MTP need --enable_unified_mtp_graph=false"),
    ("--speculative_algorithm=DSpark --num_speculative_tokens=7 "
     "--adaptive_target_verify_calibration=/configs/dspark.json",
     "--enable_adaptive_target_verify=false: --adaptive_target_verify_calibration needs "
     "--enable_adaptive_target_verify=true"),
    ("--speculative_algorithm=DSpark --num_speculative_tokens=7 "
     "--adaptive_target_verify_cost_table=/results/dspark-costs.json",
     "--enable_adaptive_target_verify=false: --adaptive_target_verify_cost_table needs "
     "--enable_adaptive_target_verify=true"),
    ("--speculative_algorithm=DSpark --num_speculative_tokens=7 "
     "--adaptive_target_verify_cost_table_output=/results/dspark-costs.json",
     "--enable_adaptive_target_verify=false: --adaptive_target_verify_cost_table_output needs "
     "--enable_adaptive_target_verify=true"),
    (f"{ATV} --adaptive_target_verify_cost_table=/r/t.json "
     "--adaptive_target_verify_calibration=/c/d.json",
     "--adaptive_target_verify_calibration=/c/d.json: --adaptive_target_verify_cost_table "
     "needs no --adaptive_target_verify_calibration (a saved table skips calibration)"),
    (f"{ATV} --adaptive_target_verify_cost_table=/r/t.json "
     "--adaptive_target_verify_cost_table_output=/r/new.json",
     "--adaptive_target_verify_cost_table_output=/r/new.json: "
     "--adaptive_target_verify_cost_table needs no --adaptive_target_verify_cost_table_output "
     "(a saved table is not fitted again, so there is nothing to save)"),
    ("--speculative_algorithm=DSpark --num_speculative_tokens=5 --enable_unified_mtp_graph=true "
     "--dp_size=2 --nnodes=2",
     "--dp_size=2: --enable_unified_mtp_graph=true and --speculative_algorithm=DSpark need "
     "--dp_size=1 (use --enable_unified_mtp_graph=false for DP)"),
    ("--enable_unified_mtp_graph=true",
     "--speculative_algorithm=none: --enable_unified_mtp_graph=true needs "
     "--speculative_algorithm=MTP or DSpark"),
    ("--speculative_algorithm=DSpark --num_speculative_tokens=5 --enable_unified_mtp_graph=true "
     "--enable_graph=false",
     "--enable_graph=false: --enable_unified_mtp_graph=true needs --enable_graph=true"),
    ("--speculative_algorithm=DSpark --num_speculative_tokens=5 --enable_unified_mtp_graph=true "
     "--disable_graph_warmup=true",
     "--disable_graph_warmup=true: --enable_unified_mtp_graph=true needs "
     "--disable_graph_warmup=false"),
    # Before, accepted: the round ran as one unit whatever the flag said.
    ("--speculative_algorithm=MTP --num_speculative_tokens=3 --enable_unified_mtp_graph=true "
     "--enable_task_pipeline=false",
     "--enable_task_pipeline=false: --enable_unified_mtp_graph=true needs "
     "--enable_task_pipeline=true (drop --enable_task_pipeline=false or set "
     "--enable_unified_mtp_graph=false)"),
    ("--python_graph_backend=cudagraph",
     "--python_graph_backend=cudagraph: --device=cpu and --enable_graph=true need "
     "--python_graph_backend=eager_buckets (eager_buckets runs on --device=cpu, cudagraph runs on "
     "--device=cuda, aclgraph runs on --device=npu)"),
    ("--device=cuda --python_graph_backend=aclgraph",
     "--python_graph_backend=aclgraph: --device=cuda and --enable_graph=true need "
     "--python_graph_backend=cudagraph (eager_buckets runs on --device=cpu, cudagraph runs on "
     "--device=cuda, aclgraph runs on --device=npu)"),
    ("--device=npu --python_graph_backend=eager_buckets",
     "--python_graph_backend=eager_buckets: --device=npu and --enable_graph=true need "
     "--python_graph_backend=aclgraph (eager_buckets runs on --device=cpu, cudagraph runs on "
     "--device=cuda, aclgraph runs on --device=npu)"),
    ("--enable_graph=false --python_graph_backend=eager_buckets",
     "--python_graph_backend=eager_buckets: --enable_graph=false needs no "
     "--python_graph_backend (drop --python_graph_backend or set --enable_graph=true)"),
    ("--enable_graph=false --acl_graph_decode_batch_size_limit=8",
     "--acl_graph_decode_batch_size_limit=8: --enable_graph=false needs no "
     "--acl_graph_decode_batch_size_limit (drop --acl_graph_decode_batch_size_limit or set "
     "--enable_graph=true)"),
    ("--enable_graph=false --disable_graph_warmup=true",
     "--disable_graph_warmup=true: --enable_graph=false needs --disable_graph_warmup=false "
     "(drop --disable_graph_warmup or set --enable_graph=true)"),
    ("--num_speculative_tokens=3",
     "--num_speculative_tokens=3: --speculative_algorithm=none needs --num_speculative_tokens=0 "
     "(choose --speculative_algorithm=MTP, or DSpark with the built-in models)"),
    ("--draft_model=/models/mtp",
     "--draft_model=/models/mtp: --speculative_algorithm=none needs no --draft_model "
     "(choose --speculative_algorithm=MTP, or DSpark with the built-in models)"),
    # A built-in draft too: no draft is wanted, so none is named as the one that would do.
    ("--draft_model=builtin:mtp",
     "--draft_model=builtin:mtp: --speculative_algorithm=none needs no --draft_model "
     "(choose --speculative_algorithm=MTP, or DSpark with the built-in models)"),
    ("--speculative_algorithm=MTP --num_speculative_tokens=3 --enable_probabilistic_draft=true",
     "--enable_probabilistic_draft=true: expected --enable_probabilistic_draft=false"),
    ("--enable_disagg_pd=true", "--enable_disagg_pd=true: expected --enable_disagg_pd=false"),
    # Refused by the launch itself, so `adaspec config` and every command agree (and serve
    # refuses it before it listens).
    ("--nnodes=2 --cp_size=2",
     "--cp_size=2: expected --cp_size=1 (context parallelism is not implemented; use "
     "--tp_size to split the model across ranks)"),
    # Named first, not as an --nnodes that cannot divide into CP shards.
    ("--cp_size=2",
     "--cp_size=2: expected --cp_size=1 (context parallelism is not implemented; use "
     "--tp_size to split the model across ranks)"),
]

# Checks across numbers, and the ranges of single flags.
CROSS_CASES = [
    ("--nnodes=3 --dp_size=2",
     "--nnodes=3: expected a multiple of dp_size*cp_size=2 (one TP group per DP/CP shard)"),
    ("--nnodes=4 --tp_size=2",
     "--tp_size=2: expected tp_size*dp_size*cp_size == nnodes=4, that is tp_size=4"),
    ("--nnodes=2 --node_rank=2", "--node_rank=2: expected a rank in 0..1 (--nnodes=2)"),
    ("--nnodes=4 --dp_size=4 --max_seqs_per_batch=2",
     "--max_seqs_per_batch=2: expected at least --dp_size=4 (one sequence per DP shard)"),
    ("--max_seqs_per_batch=8 --acl_graph_decode_batch_size_limit=16",
     "--acl_graph_decode_batch_size_limit=16: expected at most --max_seqs_per_batch=8 "
     "(a larger bucket can never be filled)"),
    ("--speculative_algorithm=MTP",
     "--num_speculative_tokens=0: --speculative_algorithm=MTP needs a width in 1..16"),
    ("--num_speculative_tokens=17", "--num_speculative_tokens=17: expected an integer in 0..16"),
    ("--port=0", "--port=0: expected an integer in 1..65535"),
    ("--port=70000", "--port=70000: expected an integer in 1..65535"),
    ("--dp_size=0", "--dp_size=0: expected an integer in 1..1024"),
    ("--cp_size=-1", "--cp_size=-1: expected an integer in 1..1024"),
    ("--max_seqs_per_batch=0", "--max_seqs_per_batch=0: expected an integer in 1..65536"),
    ("--nnodes=0", "--nnodes=0: expected an integer in 1..65536"),
    ("--master_node_addr=localhost",
     "--master_node_addr=localhost: expected host:port with a port in 1..65535"),
    ("--master_node_addr=10.0.0.1:0",
     "--master_node_addr=10.0.0.1:0: expected host:port with a port in 1..65535"),
    # Digits int() cannot read (a superscript) or that no port is spelled in (Arabic-Indic).
    ("--master_node_addr=10.0.0.1:²",
     "--master_node_addr=10.0.0.1:²: expected host:port with a port in 1..65535"),
    ("--master_node_addr=10.0.0.1:٣٠٠٠",
     "--master_node_addr=10.0.0.1:٣٠٠٠: expected host:port with a port in 1..65535"),
    ("--master_node_addr='a b:29500'",
     "--master_node_addr=a b:29500: expected host:port whose host is a hostname (letters, "
     "digits, '-', '_' and '.'-separated labels of at most 63 characters) or an IP address, "
     "without spaces or control characters (an IPv6 address in brackets)"),
    ("--master_node_addr=::1:29500",
     "--master_node_addr=::1:29500: expected host:port whose host is a hostname (letters, "
     "digits, '-', '_' and '.'-separated labels of at most 63 characters) or an IP address, "
     "without spaces or control characters (an IPv6 address in brackets)"),
    ("--model=builtin:gpt",
     "--model=builtin:gpt: expected a path or one of builtin:target, builtin:target-large"),
    ("--speculative_algorithm=DSpark --num_speculative_tokens=7 --draft_model=builtin:mtp",
     "--draft_model=builtin:mtp: expected a path or builtin:dspark for "
     "--speculative_algorithm=DSpark (built-in drafts: builtin:dspark, builtin:mtp)"),
    # A checkpoint target is never paired with a built-in draft, named or implied.
    ("--model=/models/t --speculative_algorithm=DSpark --num_speculative_tokens=5",
     "--draft_model: required with --model=/models/t (the built-in drafts draft for "
     "builtin:target and builtin:target-large only); give your draft's path"),
    ("--model=/models/t --speculative_algorithm=MTP --num_speculative_tokens=5 "
     "--draft_model=builtin:mtp",
     "--draft_model=builtin:mtp: expected your draft's path with --model=/models/t (the "
     "built-in drafts draft for builtin:target and builtin:target-large only)"),
]


@pytest.mark.parametrize(("line", "message"), RULE_CASES + CROSS_CASES)
def test_violating_launch_line_is_rejected_with_pinned_message(line: str, message: str) -> None:
    assert str(rejection(line)) == message


def test_every_rule_in_the_table_has_a_violating_case() -> None:
    fired = {rejection(line).rule for line, _ in RULE_CASES}
    sources = [rule.source for rule in RULES]
    assert len(set(sources)) == len(sources), "each rule needs its own source text"
    assert set(sources) - fired == set()


def test_rule_errors_name_the_flag_that_must_change() -> None:
    error = rejection(f"{ADS} --dp_size=2 --nnodes=2")
    assert (error.setting, error.value) == ("--dp_size", 2)
    assert re.search("one DP shard", error.rule or "")


def test_disagg_pd_rejected_with_adaptive_draft_steps_cites_that_rule() -> None:
    error = rejection(f"{ADS} --enable_disagg_pd=true")
    assert error.rule == "Adaptive draft steps: no support for prefill/decode disaggregation"


def test_a_checkpoint_target_keeps_its_own_draft_and_needs_none_without_speculation() -> None:
    own = launch("--model=/models/t --speculative_algorithm=DSpark --num_speculative_tokens=5 "
                 "--draft_model=/models/d")
    assert own.launch.resolved.draft_model == "/models/d"
    assert launch("--model=/models/t").launch.resolved.draft_model is None


def test_tp_size_is_derived_from_ranks_and_shards() -> None:
    config = launch("--nnodes=16 --dp_size=2 --max_seqs_per_batch=16")
    assert config.launch.resolved.tp_size == 8
    assert config.sources["tp_size"] == "derived"
    assert launch("--nnodes=4 --tp_size=4").launch.tp_size == 4


@pytest.mark.parametrize(("device", "backend"),
                         [("cpu", "eager_buckets"), ("cuda", "cudagraph"), ("npu", "aclgraph")])
def test_graph_backend_defaults_to_the_one_that_fits_the_device(device: str,
                                                                backend: str) -> None:
    config = launch(f"--device={device}")
    assert config.launch.resolved.python_graph_backend == backend
    assert config.sources["python_graph_backend"] == "derived"


def test_graphs_off_leave_no_backend() -> None:
    config = launch("--enable_graph=false")
    assert config.launch.resolved.python_graph_backend is None
    assert config.as_dict()["execution"]["graph"] == "off: eager, unpadded shapes"  # type: ignore[index]


def test_unified_dspark_with_one_shard_is_accepted() -> None:
    config = launch("--speculative_algorithm=DSpark --num_speculative_tokens=7 "
                    "--enable_adaptive_target_verify=true --enable_unified_mtp_graph=true")
    assert config.as_dict()["requests"] == {
        "temperature": "required on every request",
        "positive_temperature": "rejected: unified graphs decode greedily",
    }


def test_graph_limit_defaults_to_max_seqs_and_sets_prepared_buckets() -> None:
    config = launch("--max_seqs_per_batch=12")
    assert config.launch.resolved.acl_graph_decode_batch_size_limit == 12
    assert config.launch.prepared_request_buckets() == (1, 2, 4, 8, 12)


@pytest.mark.parametrize("address", ["127.0.0.1:27000", "[::1]:27000", "node-0.cluster:29500",
                                     "localhost:1"])
def test_a_rendezvous_address_with_a_hostname_or_ip_address_is_taken(address: str) -> None:
    assert launch(f"--master_node_addr={address}").launch.master_node_addr == address
