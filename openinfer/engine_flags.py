"""The engine's command-line flags (`openinfer serve` and `generate`), and what they become:
the keyword arguments of ``create_engine_config`` (openinfer/engine_args.py), one per flag
(tests/test_cli_flags.py checks every flag reaches the config)."""

from __future__ import annotations

import argparse
import os

from openinfer import units
from openinfer.attention import ATTENTION_BACKENDS
from openinfer.config import KV_CACHE_DTYPES

DEFAULT_MODEL = "smollm2"


def parse_bytes(text: str) -> int:
    """'2147483648', '2GiB', '512MB', '1.5G' -> bytes (argparse's type)."""
    try:
        return units.parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that runs an engine."""
    g = parser.add_argument_group("engine")
    parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                        help="the model, as --model (vLLM's `serve MODEL` form)")
    g.add_argument("--model", help="a Hugging Face checkpoint directory, a .gguf file, a Hub id "
                                   "(Org/Name) or a built-in name (smollm2) "
                                   f"[default: {DEFAULT_MODEL}]")
    g.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")
    g.add_argument("--config", metavar="FILE",
                   help="a YAML file of this command's flags, as vLLM's (openinfer/config_file.py); "
                        "the command line's flags win")
    g.add_argument("--quantization", "-q",
                   help="the checkpoint's own quantization, named (fp8, gguf); openinfer "
                        "quantizes nothing itself: any other method is refused")
    g.add_argument("--trust-remote-code", nargs=0, action=_RefuseRemoteCode,
                   help="refused: no code from a checkpoint runs (vLLM's flag, named so a "
                        "vLLM command line fails with this reason)")
    g.add_argument("--dtype", default="auto",
                   help="auto (on CPU: bfloat16 for a bf16 checkpoint where the CPU has AVX512_BF16 "
                        "or AMX, else float32; on CUDA: the checkpoint's), float32, bfloat16, float16")
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    g.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's)")
    g.add_argument("--kv-cache-memory", type=parse_bytes,
                   help="bytes for the KV block pool, e.g. 4GiB (default: "
                        "$OPENINFER_CPU_KV_CACHE_MEMORY or 2GiB on CPU, 90%% of free memory on CUDA)")
    g.add_argument("--gpu-memory-utilization", type=float,
                   help="CUDA: the fraction of the GPU's memory the instance may use, the KV "
                        "pool taking what the weights leave (vLLM's; unset: 0.9 of the memory "
                        "free after the weights)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="what the KV cache stores: the model's dtype (auto) or float8 (fp8 = "
                        "fp8_e4m3, fp8_e5m2), half a bf16 cache's bytes per token; per-tensor "
                        "scales from the checkpoint's k_scale/v_scale, else 1.0")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of earlier prompts' common prefixes")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)  # the older spelling
    g.add_argument("--kv-host-memory", type=parse_bytes,
                   help="host memory for the L2 KV tier, e.g. 8GiB (off unless given; 512MiB "
                        "when --kv-store-dir is given)")
    g.add_argument("--kv-store-dir", help="directory of the L3 KV file store (local disk or a "
                                          "shared 3FS/NFS mount); survives restarts")
    g.add_argument("--kv-store-bytes", type=parse_bytes, default="16GiB",
                   help="most bytes the file store holds")
    g.add_argument("--kv-pin-memory", type=parse_bytes,
                   help="most KV bytes prompts may pin in all (Anthropic cache_control, OpenAI "
                        "prompt_cache_retention); default: half the host tier, else half the "
                        "device pool")
    g.add_argument("--kv-pin-memory-per-key", type=parse_bytes,
                   help="most KV bytes one API key's prompts may pin (default: a quarter of "
                        "--kv-pin-memory)")
    g.add_argument("--kv-events-endpoint", help="publish KV events (vLLM's schema) on this ZMQ "
                                                "PUB address, e.g. tcp://*:5557 (port *: a "
                                                "free one, shown on GET /kv_events)")
    g.add_argument("--kv-events-replay-endpoint", help="ZMQ ROUTER address for replaying "
                                                       "missed KV event batches")
    g.add_argument("--kv-events-topic", default="", help="ZMQ topic of the KV events")
    # (--swa-bounded-replay and --swa-snapshot-interval: their names before 2026-12-06;
    # DeepInfer's "SWA bounded replay" is another feature, prefill truncation of V4.1's
    # window-only upper layers.)
    g.add_argument("--window-snapshots", "--swa-bounded-replay", dest="window_snapshots",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="sliding-window layers cache their pages only at window snapshots; a "
                        "prefix hit recomputes at most one snapshot interval "
                        "(--no-window-snapshots: cache every window page)")
    g.add_argument("--window-snapshot-interval", "--swa-snapshot-interval",
                   dest="window_snapshot_interval", type=int, default=512,
                   help="tokens between sliding-window snapshots (a multiple of --block-size)")
    d = parser.add_argument_group("disaggregation")
    d.add_argument("--role", dest="kv_role", choices=("both", "prefill", "decode"), default="both",
                   help="prefill: hold prompts' KV for decode instances to pull; decode: pull "
                        "it before decoding; both: colocated")
    d.add_argument("--kv-connector", choices=("tcp", "shm", "file"), default="tcp",
                   help="how a decode instance pulls KV: tcp, shm (same host), file (the "
                        "shared --kv-store-dir)")
    d.add_argument("--kv-transfer-host", default="127.0.0.1",
                   help="address the KV server binds and advertises")
    d.add_argument("--kv-transfer-secret",
                   help="a secret the instances and routers share: the KV server refuses "
                        "pulls without it, and KV events are encrypted (ZMQ CURVE) for its "
                        "holders only (unset: $OPENINFER_KV_TRANSFER_SECRET, else none)")
    d.add_argument("--kv-transfer-port", type=int,
                   help="KV server port (unset: any free port for --role prefill)")
    d.add_argument("--kv-transfer-timeout", type=float, default=10.0,
                   help="seconds a stalled pull waits before falling back")
    d.add_argument("--kv-lease-timeout", type=float, default=30.0,
                   help="seconds a prefill instance holds KV nobody pulls")
    d.add_argument("--kv-load-failure-policy", choices=("recompute", "fail"), default="recompute",
                   help="when a pull fails: recompute locally or fail the request")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split prompts longer than a step's remaining token budget across steps "
                        "(off: such a prompt waits for a step with room for all of it)")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="priority: lower `priority` values of requests run first")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many ranks (worker processes; gloo on CPU, "
                        "NCCL on CUDA); Llama-family dense and MoE models")
    g.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1,
                   help="split long prompt chunks' tokens over this many ranks (worker "
                        "processes, each with the whole model); Llama-family models")
    g.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default="mp",
                   help="how the tensor/context-parallel ranks run: processes on this "
                        "machine (mp) or Ray actors, across a Ray cluster's nodes with "
                        "--ray-address (pip install 'openinfer[ray]')")
    g.add_argument("--nnodes", type=int, default=1,
                   help="machines the tensor/context-parallel ranks span (mp backend; "
                        "torchrun's names): node 0 serves, the others run `serve "
                        "--node-rank I` with the same flags")
    g.add_argument("--master-addr", default="127.0.0.1",
                   help="node 0's address, where the ranks join (with --nnodes > 1)")
    g.add_argument("--master-port", type=int, default=29500,
                   help="the ranks' rendezvous port on --master-addr; the engine's calls "
                        "use the next one ($OPENINFER_NODE_SECRET authenticates them)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: whole experts spread over the tensor-parallel ranks "
                        "(instead of every expert sliced over them)")
    g.add_argument("--enable-eplb", action="store_true",
                   help="with --enable-expert-parallel: move (and replicate) experts to "
                        "balance the ranks' token load as traffic runs")
    g.add_argument("--eplb-config", default=None, metavar="JSON",
                   help='EPLB settings, e.g. \'{"window_size": 1000, "step_interval": 3000, '
                        '"num_redundant_experts": 0}\' (those are the defaults)')
    g.add_argument("--async-scheduling", action="store_true",
                   help="schedule step N+1 while step N computes (the model runs on its own "
                        "thread); off by default: on a CPU it measured no gain (docs/benchmarks.md)")
    g.add_argument("--seed", type=int, help="seed for unseeded sampling")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="torch (reference), cpu (C++ paged kernel), auto (the fastest that "
                        "runs here; $OPENINFER_ATTENTION_BACKEND overrides auto)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly, without CUDA graphs (no effect on a CPU)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="bitwise-identical logits for a request whatever else is in the batch "
                        "(CPU only; slower)")
    g.add_argument("--moe-expert-stats", action="store_true",
                   help="count the tokens routed to each expert of each MoE layer "
                        "(metric moe_expert_tokens; MoE models only)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\'; methods ngram, suffix, draft_model '
                        '(with "model"), mtp; "scheduler": "confidence" verifies only the '
                        'drafts that pay (see README)')


class _RefuseRemoteCode(argparse.Action):
    """vLLM's --trust-remote-code, refused by name: openinfer runs no code from a checkpoint."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error("--trust-remote-code: openinfer runs no code that comes with a checkpoint; "
                     "it serves the architectures it implements itself (docs/models.md), with or "
                     "without the checkpoint's own modeling files")


def resolve_model_arg(args: argparse.Namespace) -> None:
    """`serve MODEL` and `--model MODEL` are one option; neither means the built-in model."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"model given twice: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model or args.model_tag or DEFAULT_MODEL


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        tokenizer=args.tokenizer, quantization=args.quantization, dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_host_memory=args.kv_host_memory, kv_store_dir=args.kv_store_dir,
        kv_store_bytes=args.kv_store_bytes, kv_events_endpoint=args.kv_events_endpoint,
        kv_pin_memory=args.kv_pin_memory, kv_pin_memory_per_key=args.kv_pin_memory_per_key,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic, window_snapshots=args.window_snapshots,
        window_snapshot_interval=args.window_snapshot_interval,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, scheduling_policy=args.scheduling_policy, seed=args.seed,
        enable_chunked_prefill=args.enable_chunked_prefill,
        async_scheduling=args.async_scheduling, tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, enable_eplb=args.enable_eplb,
        prefill_context_parallel_size=args.prefill_context_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        ray_address=getattr(args, "ray_address", None),
        nnodes=args.nnodes, master_addr=args.master_addr, master_port=args.master_port,
        eplb_config=args.eplb_config,
        **(dict(data_parallel_size=args.data_parallel_size, data_parallel_rank=args.data_parallel_rank,
                data_parallel_address=args.data_parallel_address,
                data_parallel_rpc_port=args.data_parallel_rpc_port)
           if getattr(args, "data_parallel_rank", None) is not None else {}),
        kv_role=args.kv_role, kv_connector=args.kv_connector,
        kv_transfer_host=args.kv_transfer_host, kv_transfer_port=args.kv_transfer_port,
        kv_transfer_secret=(args.kv_transfer_secret
                            or os.environ.get("OPENINFER_KV_TRANSFER_SECRET") or None),
        kv_transfer_timeout=args.kv_transfer_timeout, kv_lease_s=args.kv_lease_timeout,
        kv_load_failure_policy=args.kv_load_failure_policy,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant,
        moe_expert_stats=args.moe_expert_stats,
        speculative_config=args.speculative_config,
    )
