"""Every engine flag of `openinfer serve` reaches the engine's config.

A flag that parses but never reaches EngineConfig is silently ignored, which the ground rules
forbid. Each row gives a flag a value other than its default, builds the config the way
`serve` and `generate` do (``engine_kwargs`` into ``create_engine_config``) and reads the value
back. ``test_every_engine_flag_has_a_row`` makes a new flag without a row fail.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from openinfer.cli import build_parser, engine_kwargs, main, resolve_model_arg
from openinfer.config import EngineConfig
from openinfer.engine_args import create_engine_config

# (flags, attribute path in EngineConfig, expected value)
ROWS: list[tuple[tuple[str, ...], str, object]] = [
    (("--tokenizer", "/some/tokenizer"), "tokenizer", "/some/tokenizer"),
    (("--dtype", "bfloat16"), "model.dtype", torch.bfloat16),
    (("--device", "cuda:1"), "device", "cuda:1"),  # the config only; nothing runs there
    (("--max-model-len", "96"), "model.max_model_len", 96),
    (("--kv-cache-memory", "3MiB"), "cache.kv_cache_memory", 3 * 2**20),
    (("--block-size", "32"), "cache.block_size", 32),
    (("--kv-cache-dtype", "fp8_e5m2"), "cache.kv_cache_dtype", "fp8_e5m2"),
    (("--no-enable-prefix-caching",), "cache.enable_prefix_caching", False),
    (("--no-prefix-caching",), "cache.enable_prefix_caching", False),
    (("--kv-host-memory", "5MiB"), "cache.kv_host_memory", 5 * 2**20),
    (("--kv-store-dir", "/tmp/store"), "cache.kv_store_dir", "/tmp/store"),
    (("--kv-store-bytes", "7MiB"), "cache.kv_store_bytes", 7 * 2**20),
    (("--kv-pin-memory", "6MiB"), "cache.kv_pin_memory", 6 * 2**20),
    (("--kv-pin-memory-per-key", "2MiB"), "cache.kv_pin_memory_per_key", 2 * 2**20),
    (("--kv-events-endpoint", "tcp://127.0.0.1:5999"), "cache.kv_events_endpoint",
     "tcp://127.0.0.1:5999"),
    (("--kv-events-replay-endpoint", "tcp://127.0.0.1:5998"), "cache.kv_events_replay_endpoint",
     "tcp://127.0.0.1:5998"),
    (("--kv-events-topic", "tenant-a"), "cache.kv_events_topic", "tenant-a"),
    (("--no-window-snapshots",), "cache.window_snapshots", False),
    (("--window-snapshot-interval", "256"), "cache.window_snapshot_interval", 256),
    # The names before window snapshots were renamed (DeepInfer's "SWA bounded replay" is
    # another feature), kept as aliases.
    (("--no-swa-bounded-replay",), "cache.window_snapshots", False),
    (("--swa-snapshot-interval", "256"), "cache.window_snapshot_interval", 256),
    (("--role", "decode"), "kv_transfer.role", "decode"),
    (("--kv-connector", "shm"), "kv_transfer.connector", "shm"),
    (("--kv-transfer-host", "10.1.2.3"), "kv_transfer.host", "10.1.2.3"),
    (("--kv-transfer-secret", "s3cret"), "kv_transfer.secret", "s3cret"),
    (("--kv-transfer-port", "7100"), "kv_transfer.port", 7100),
    (("--kv-transfer-timeout", "2.5"), "kv_transfer.timeout_s", 2.5),
    (("--kv-lease-timeout", "4.5"), "kv_transfer.lease_s", 4.5),
    (("--kv-load-failure-policy", "fail"), "kv_transfer.load_failure_policy", "fail"),
    (("--max-num-batched-tokens", "512"), "scheduler.max_num_batched_tokens", 512),
    (("--max-num-seqs", "9"), "scheduler.max_num_seqs", 9),
    (("--no-enable-chunked-prefill",), "scheduler.enable_chunked_prefill", False),
    (("--scheduling-policy", "priority"), "scheduler.policy", "priority"),
    (("--tensor-parallel-size", "2"), "tensor_parallel_size", 2),
    (("-tp", "2"), "tensor_parallel_size", 2),
    (("--prefill-context-parallel-size", "2"), "prefill_context_parallel_size", 2),
    (("-pcp", "2"), "prefill_context_parallel_size", 2),
    (("--distributed-executor-backend", "ray", "--ray-address", "10.0.0.1:6379"),
     "ray_address", "10.0.0.1:6379"),
    (("--distributed-executor-backend", "ray"), "distributed_executor_backend", "ray"),
    (("-tp", "2", "--nnodes", "2"), "nodes.nnodes", 2),
    (("--master-addr", "10.0.0.2"), "nodes.master_addr", "10.0.0.2"),
    (("--master-port", "29611"), "nodes.master_port", 29611),
    (("--enable-expert-parallel",), "enable_expert_parallel", True),
    (("--enable-expert-parallel", "--enable-eplb"), "eplb.window_size", 1000),
    (("--enable-expert-parallel", "--enable-eplb", "--eplb-config", '{"window_size": 8}'),
     "eplb.window_size", 8),
    (("--async-scheduling",), "scheduler.async_scheduling", True),
    (("--seed", "17"), "seed", 17),
    (("--attention-backend", "torch"), "attention_backend", "torch"),
    (("--enforce-eager",), "enforce_eager", True),
    (("--batch-invariant",), "model.batch_invariant", True),
    (("--moe-expert-stats",), "moe_expert_stats", True),
    (("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'),
     "speculative.num_speculative_tokens", 3),
]
NOT_IN_CONFIG = {  # engine-group flags checked elsewhere
    "--model": "every test (resolve_model_arg)",
    "--enable-prefix-caching": "the default (its --no- form has a row)",
    "--window-snapshots": "the default (its --no- form has a row)",
    "--swa-bounded-replay": "the default (the old name of --window-snapshots)",
    "--enable-chunked-prefill": "the default (its --no- form has a row)",
    "--trust-remote-code": "refused (test_remote_code_is_refused_by_name)",
    "--quantization": "checked, not kept (test_quantization_names_the_checkpoints_own)",
    "-q": "--quantization",
    "--gpu-memory-utilization": "CUDA only (test_gpu_memory_utilization_is_vllms_and_cuda_only)",
    "--config": "read before parsing (test_a_config_file_gives_flags_the_command_line_overrides)",
}


def _config(checkpoint, *flags: str) -> EngineConfig:
    args = build_parser().parse_args(["serve", "--model", str(checkpoint), *flags])
    resolve_model_arg(args)
    return create_engine_config(args.model, **engine_kwargs(args))


def _read(config: object, path: str) -> object:
    for name in path.split("."):
        config = getattr(config, name) if config is not None else None
    return config


@pytest.mark.parametrize("flags,path,expected", ROWS, ids=[" ".join(r[0]) for r in ROWS])
def test_engine_flag_reaches_the_config(qwen3_checkpoint, flags, path, expected):
    default = _read(_config(qwen3_checkpoint), path)
    assert default != expected, f"{flags}: the expected value is the default; pick another"
    assert _read(_config(qwen3_checkpoint, *flags), path) == expected


def test_chunked_prefill_off_needs_a_budget_for_the_longest_prompt(qwen3_checkpoint):
    """Unchunked, a prompt longer than a step's budget would wait forever (and every request
    behind it): refused at start-up, as vLLM does."""
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens \(64\) is below max_model_len "
                                         r"\(512\) with chunked prefill off"):
        _config(qwen3_checkpoint, "--no-enable-chunked-prefill", "--max-num-batched-tokens", "64")
    config = _config(qwen3_checkpoint, "--no-enable-chunked-prefill", "--max-model-len", "64",
                     "--max-num-batched-tokens", "64")
    assert not config.scheduler.enable_chunked_prefill


def test_the_data_parallel_rank_flags_reach_the_config(qwen3_checkpoint):
    config = _config(qwen3_checkpoint, "--enable-expert-parallel", "--data-parallel-size", "2",
                     "--data-parallel-rank", "1", "--data-parallel-address", "10.0.0.3",
                     "--data-parallel-rpc-port", "13345")
    assert dataclasses.astuple(config.data_parallel) == (2, 1, "10.0.0.3", 13345)


def _engine_option_strings() -> set[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    groups = [g for g in serve._action_groups if g.title in ("engine", "disaggregation")]
    return {s for g in groups for a in g._group_actions if a.help != argparse.SUPPRESS
            or a.dest == "enable_prefix_caching" for s in a.option_strings}


def test_every_engine_flag_has_a_row():
    covered = {s for flags, _, _ in ROWS for s in flags if s.startswith("-")}
    missing = _engine_option_strings() - covered - set(NOT_IN_CONFIG)
    assert not missing, f"engine flags no row of ROWS checks: {sorted(missing)}"


def test_headless_is_refused_on_node_zero(qwen3_checkpoint):
    """--headless runs another node's ranks: on node 0 (the default) it would leave the
    server unstarted, so it is refused by name before anything loads. With --node-rank 1 it
    runs in tests/e2e/test_tensor_parallel_server.py."""
    with pytest.raises(SystemExit, match="--headless is for the nodes other than 0"):
        main(["serve", "--model", str(qwen3_checkpoint), "--headless"])


def test_remote_code_is_refused_by_name(qwen3_checkpoint, capsys):
    """vLLM's --trust-remote-code: a vLLM command line fails with the reason, before
    anything loads."""
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", str(qwen3_checkpoint), "--trust-remote-code"])
    assert exited.value.code == 2
    assert "--trust-remote-code: openinfer runs no code that comes with a checkpoint" in \
        capsys.readouterr().err


def test_quantization_names_the_checkpoints_own(qwen3_checkpoint, tmp_path):
    """vLLM's --quantization: the checkpoint's own method passes, anything else (a method
    openinfer would have to apply itself) is refused by name."""
    from conftest import fp8_checkpoint

    with pytest.raises(ValueError, match=r"quantization 'awq' \(--quantization\).*has none"):
        create_engine_config(str(qwen3_checkpoint), quantization="awq")
    with pytest.raises(ValueError, match="quantization 'fp8'"):
        create_engine_config(str(qwen3_checkpoint), quantization="fp8")
    fp8 = fp8_checkpoint(qwen3_checkpoint, tmp_path / "fp8", 16)
    assert create_engine_config(str(fp8), quantization="fp8").model.path == str(fp8)
    with pytest.raises(ValueError, match="this one has 'fp8'"):
        create_engine_config(str(fp8), quantization="gptq")
    args = build_parser().parse_args(["serve", "--model", str(fp8), "-q", "fp8"])
    resolve_model_arg(args)
    assert engine_kwargs(args)["quantization"] == "fp8"


def test_a_config_file_gives_flags_the_command_line_overrides(qwen3_checkpoint, tmp_path,
                                                              capsys):
    """vLLM's --config FILE: a YAML mapping of flags (dashes or underscores), switches on and
    off, lists and JSON mappings; the command line wins; a key the command lacks, or a file
    that is not a mapping, is refused by name."""
    from openinfer.config_file import expand_config_file

    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {qwen3_checkpoint}\nport: 8123\nmax_num_seqs: 7\n"
                      "enable-prefix-caching: false\nasync-scheduling: true\nbatch-invariant: false\n"
                      "api-key: [key-a, key-b]\n"
                      "speculative-config: {method: ngram, num_speculative_tokens: 3}\n")
    parser = build_parser()
    args = parser.parse_args(expand_config_file(parser, ["serve", "--config", str(config),
                                                         "--port", "9000"]))
    assert (args.model, args.port, args.max_num_seqs) == (str(qwen3_checkpoint), 9000, 7)
    assert not args.enable_prefix_caching and args.async_scheduling and not args.batch_invariant
    assert args.api_key == ["key-a", "key-b"]
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}
    resolve_model_arg(args)
    assert create_engine_config(args.model, **engine_kwargs(args)).scheduler.max_num_seqs == 7
    config.write_text("no-such-flag: 1\n")
    with pytest.raises(SystemExit):
        main(["serve", f"--config={config}"])
    assert "'no-such-flag' is not a flag of this command" in capsys.readouterr().err
    config.write_text("- serve\n")
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(config)])
    assert "want a mapping of flags to values, got list" in capsys.readouterr().err


def test_gpu_memory_utilization_is_vllms_and_cuda_only(qwen3_checkpoint):
    """vLLM's --gpu-memory-utilization u: the KV pool is what u x the GPU's memory leaves
    after what the instance already holds; on the CPU, or beside --kv-cache-memory, it is
    refused with the reason. (The CUDA path itself runs only where a GPU is lent.)"""
    from openinfer.config import cuda_kv_cache_bytes

    gib = 2**30
    # 80 GiB, 20 GiB in use (weights): 0.9 x 80 = 72 GiB, of which 52 GiB for the KV pool.
    assert cuda_kv_cache_bytes(60 * gib, 80 * gib, 0.9) == int(0.9 * 80 * gib) - 20 * gib
    assert cuda_kv_cache_bytes(60 * gib, 80 * gib, None) == int(0.9 * 60 * gib)
    with pytest.raises(ValueError, match="leaves nothing for the KV cache"):
        cuda_kv_cache_bytes(60 * gib, 80 * gib, 0.2)
    model = str(qwen3_checkpoint)
    with pytest.raises(ValueError, match="on the CPU size the KV pool with kv_cache_memory"):
        create_engine_config(model, device="cpu", gpu_memory_utilization=0.8)
    with pytest.raises(ValueError, match="not both"):
        create_engine_config(model, gpu_memory_utilization=0.8, kv_cache_memory=2**20)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        create_engine_config(model, gpu_memory_utilization=1.5)
    args = build_parser().parse_args(["serve", "--model", model, "--gpu-memory-utilization", "0.8"])
    assert engine_kwargs(args)["gpu_memory_utilization"] == 0.8


def test_flags_have_environment_mirrors_the_command_line_overrides(qwen3_checkpoint):
    from openinfer.env_flags import apply_env_defaults

    def parse(environ: dict[str, str], *argv: str) -> argparse.Namespace:
        parser = build_parser()
        apply_env_defaults(parser, environ)
        return parser.parse_args(list(argv))

    environ = {"OPENINFER_MAX_MODEL_LEN": "96", "OPENINFER_ENABLE_PREFIX_CACHING": "false",
               "OPENINFER_PORT": "9123", "OPENINFER_TOOL_CALL_PARSER": "hermes",
               "OPENINFER_ENABLE_AUTO_TOOL_CHOICE": "yes", "OPENINFER_KV_CACHE_MEMORY": "3MiB",
               "OPENINFER_POLICY": "round_robin", "OPENINFER_WORKER": "http://a:1",
               "OPENINFER_API_KEY": "k1,k2"}
    args = parse(environ, "serve", "--model", str(qwen3_checkpoint))
    assert (args.max_model_len, args.enable_prefix_caching, args.port) == (96, False, 9123)
    assert args.tool_call_parser == "hermes" and args.enable_auto_tool_choice
    assert args.kv_cache_memory == 3 * 2**20 and args.api_key == []  # (read when serving)
    assert parse(environ, "serve", "--model", "m", "--max-model-len", "64",
                 "--enable-prefix-caching").max_model_len == 64  # the command line wins
    router = parse(environ, "router", "--tokenizer", "t")
    assert router.policy == "round_robin"
    assert router.worker == []  # repeatable: not mirrored (argparse would add the flag's to it)
    # What the flag would refuse is refused naming the variable.
    for bad in ({"OPENINFER_PORT": "high"}, {"OPENINFER_POLICY": "random"},
                {"OPENINFER_ENABLE_PREFIX_CACHING": "maybe"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            parse(bad, "serve")
    with pytest.raises(SystemExit):  # a refused switch is refused from its variable too
        parse({"OPENINFER_TRUST_REMOTE_CODE": "1"}, "serve")
    # A launcher's own flags and the secrets are not mirrored (replicas inherit the
    # environment: a mirrored --data-parallel-size would make each launch replicas again).
    args = parse({"OPENINFER_DATA_PARALLEL_SIZE": "4", "OPENINFER_ADMIN_API_KEY": "s"},
                 "serve", "--model", "m")
    assert args.data_parallel_size == 1 and args.admin_api_key is None
