"""`openinfer serve | generate | router | bench | cache | demo-model` (also `python -m openinfer`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import openinfer
from openinfer.config_file import expand_config_file
from openinfer.engine_flags import (
    add_engine_args,
    engine_kwargs,
    parse_bytes,
    resolve_model_arg,
)
from openinfer.env_flags import apply_env_defaults
from openinfer.logger import configure_logging
from openinfer.model_source import resolve_model
from openinfer.server.chat_content import CONTENT_FORMATS
from openinfer.server.listener import KEEP_ALIVE_S
from openinfer.server.reasoning import REASONING_PARSERS as REASONING_PARSER_NAMES
from openinfer.server.tool_parsers import TOOL_PARSERS as TOOL_PARSER_NAMES

logger = logging.getLogger(__name__)
HelpFormatter = argparse.ArgumentDefaultsHelpFormatter

def cmd_generate(args: argparse.Namespace) -> int:
    resolve_model(args.model)  # a bad --model fails here, before seconds of imports
    from openinfer import LLM, SamplingParams

    warn_if_demo_model(args.model)
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.sample_seed, ignore_eos=args.ignore_eos,
        stop=args.stop or None,
    )
    llm = LLM(args.model, **engine_kwargs(args))
    start = time.perf_counter()
    outputs = llm.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for out in outputs:
        print(f"=== prompt ({len(out.prompt_token_ids)} tokens): {out.prompt!r}")
        for c in out.outputs:
            num_tokens += len(c.token_ids)
            print(f"--- output {c.index} ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
            print(c.text)
    print(f"=== {num_tokens} tokens in {elapsed:.2f}s ({num_tokens / elapsed:.1f} tokens/s)",
          file=sys.stderr)
    return 0


def warn_if_demo_model(model: str) -> None:
    if (Path(model) / "demo_spec.json").is_file():
        logger.warning("%s is openinfer's demo model. ITS WEIGHTS ARE RANDOM: the text is "
                       "gibberish. For real text, serve the default model (smollm2).", model)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser")
    args.api_key = args.api_key or [
        key for key in os.environ.get("OPENINFER_API_KEY", "").split(",") if key]
    args.admin_api_key = args.admin_api_key or os.environ.get("OPENINFER_ADMIN_API_KEY") or None
    if args.cache_salt_per_api_key and not args.api_key:
        raise SystemExit("--cache-salt-per-api-key needs --api-key (the keys it salts by)")
    if args.headless or args.node_rank > 0:
        from openinfer.config import NodesConfig
        from openinfer.executor.nodes import serve_headless

        if args.node_rank == 0:
            raise SystemExit("--headless is for the nodes other than 0 (--node-rank I)")
        nodes = NodesConfig(args.nnodes, args.node_rank, args.master_addr, args.master_port)
        return serve_headless(nodes, args.tensor_parallel_size
                              * args.prefill_context_parallel_size)
    one_rank = args.data_parallel_rank is not None
    if (args.data_parallel_size > 1 and not one_rank) or args.backend == "ray" or args.disaggregate:
        from openinfer.router.launch import serve_data_parallel

        return serve_data_parallel(args, args.argv)

    from openinfer.engine.core_launch import CoreLaunch
    from openinfer.server.listener import base_url, bind_socket, inherited_socket, serve

    # A port in use fails now, not after the load. A replica of serve_data_parallel is
    # handed the socket its launcher bound (no window between picking a port and binding it).
    sock = (bind_socket(args.host, args.port) if args.listen_fd is None
            else inherited_socket(args.listen_fd))
    # The engine core's interpreter imports the engine while this one imports the server.
    core_launch = CoreLaunch()

    from openinfer.engine.async_llm import AsyncLLM
    from openinfer.server.app import build_app
    from openinfer.server.limits import ServerLimits
    from openinfer.server.response_store import ResponseStore, default_path
    from openinfer.server.sampling_defaults import load_chat_template, sampling_defaults

    warn_if_demo_model(args.model)
    restarts = args.max_engine_restarts if args.restart_on_engine_failure else 0
    llm = AsyncLLM(args.model, max_engine_restarts=restarts, request_timeout_s=args.request_timeout,
                   core_launch=core_launch, **engine_kwargs(args))
    if args.chat_template is not None and llm.tokenizer is not None:
        llm.tokenizer.chat_template = load_chat_template(args.chat_template)
    name = args.served_model_name or llm.config.model.served_name
    limits = ServerLimits(api_keys=tuple(args.api_key), admin_api_key=args.admin_api_key,
                          max_body_bytes=args.max_body_bytes,
                          max_waiting_requests=args.max_waiting_requests,
                          cache_salt_per_api_key=args.cache_salt_per_api_key)
    url = base_url(sock)
    app = build_app(llm, name, limits,
                    sampling_defaults=sampling_defaults(llm.config.model.path,
                                                        args.generation_config),
                    on_ready=lambda: logger.info("serving %s as %r on %s", llm.config.model.path,
                                                 name, url),
                    metrics_prefix=args.metrics_prefix,
                    metrics_engine=str(args.metrics_engine_index),
                    tool_call_parser=args.tool_call_parser,
                    enable_auto_tool_choice=args.enable_auto_tool_choice,
                    reasoning_parser=args.reasoning_parser,
                    answer_ids_cache_tokens=args.answer_ids_cache_tokens,
                    tool_call_kv_retention_s=args.tool_call_kv_retention,
                    chat_template_content_format=args.chat_template_content_format,
                    response_store=None if args.responses_store == "none" else ResponseStore(
                        args.responses_store or default_path(), args.responses_store_max))
    # SIGINT/SIGTERM: uvicorn stops accepting, waits for in-flight requests (bounded), then
    # the app's lifespan shuts the engine-core process down.
    serve(app, sock, log_level=args.log_level, access_log=not args.disable_uvicorn_access_log,
          timeout_graceful_shutdown=args.shutdown_timeout,
          timeout_keep_alive=args.timeout_keep_alive)
    return 0


def cmd_cache_inspect(args: argparse.Namespace) -> int:
    import datetime as dt

    from openinfer.transfer.file_store import inspect_store

    if not Path(args.dir).is_dir():
        print(f"openinfer: {args.dir} is not a directory", file=sys.stderr)
        return 2
    entries = inspect_store(args.dir)
    if not entries:
        print(f"{args.dir}: empty KV store")
    for e in entries:
        print(f"model {e['fingerprint']}: {e['blocks']} blocks, {e['bytes'] / 2**20:.1f} MiB")
        if e["layout"]:
            print("  layout: " + ", ".join(f"{k}={v}" for k, v in e["layout"].items()))
        if e["blocks"]:
            when = lambda t: dt.datetime.fromtimestamp(t).isoformat(timespec="seconds")
            print(f"  used: {when(e['oldest_mtime'])} .. {when(e['newest_mtime'])}")
        if e["bad_headers"]:
            print(f"  {e['bad_headers']} sampled file(s) with unreadable headers")
    return 0


def cmd_demo_model(args: argparse.Namespace) -> int:
    from openinfer.demo import build_demo_model, get_demo_spec

    path = build_demo_model(args.out_dir, get_demo_spec(args.preset))
    print(f"Wrote the demo model ({args.preset}) to {path}.")
    print("ITS WEIGHTS ARE RANDOM: it exercises the engine; its output is gibberish.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from openinfer.router.launch import add_router_args, cmd_router

    parser = argparse.ArgumentParser(prog="openinfer", description="An open LLM inference engine.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"openinfer {openinfer.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline for one or more prompts",
                         formatter_class=HelpFormatter)
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    gen.add_argument("--top-k", type=int, default=0, help="0 disables")
    gen.add_argument("--n", type=int, default=1, help="samples per prompt")
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--sample-seed", type=int, help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true", help="generate past EOS")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API",
                           formatter_class=HelpFormatter)
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000,
                       help="port to listen on (0: a free one, printed at start)")
    serve.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)  # see serve_data_parallel
    serve.add_argument("--served-model-name",
                       help="model name clients use (unset: the model's, e.g. smollm2-135m-instruct)")
    serve.add_argument("--api-key", nargs="+", default=[], metavar="KEY",
                       help="require one of these keys (Authorization: Bearer KEY); unset: "
                            "$OPENINFER_API_KEY (comma-separated), else no key")
    serve.add_argument("--admin-api-key", help="key of the admin endpoints (/v1/cache/reset); unset: "
                                               "$OPENINFER_ADMIN_API_KEY, else the --api-key "
                                               "when there is one, else they are refused")
    serve.add_argument("--cache-salt-per-api-key", action="store_true",
                       help="salt each request's prefix cache by its API key: tenants never "
                            "hit (or time) each other's cached prompts")
    serve.add_argument("--chat-template", help="a Jinja chat template, or a file holding one, "
                                               "instead of the model's")
    serve.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                       help="how a message's list of text parts reaches the chat template: "
                            "string (joined), openai (the parts), auto (openai when the "
                            "template loops over a message's content)")
    serve.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSER_NAMES),
                       help="how tool calls are read from the model's output under tool_choice "
                            "auto (vLLM's names): hermes (Qwen), deepseek_v3, deepseek_v31, "
                            "llama3_json, mistral")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let the model decide when to call tools (tool_choice auto); "
                            "needs --tool-call-parser")
    serve.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSER_NAMES),
                       help="split <think>...</think> into reasoning_content: deepseek_r1, "
                            "qwen3; structured outputs then apply after the reasoning")
    serve.add_argument("--answer-ids-cache-tokens", type=int, default=1 << 20, metavar="N",
                       help="keep the token ids of recent chat answers (up to N ids) so a "
                            "conversation that resends an answer runs the ids the model "
                            "generated and hits the prefix cache through it; 0: encode the "
                            "resent text again")
    serve.add_argument("--tool-call-kv-retention", type=float, default=300.0, metavar="SECONDS",
                       help="an answer that ends in a tool call pins its conversation's KV for "
                            "this long (kept in the host and file tiers while the client runs "
                            "the tool; under --kv-pin-memory); 0: off")
    serve.add_argument("--responses-store", metavar="PATH",
                       help="the SQLite file where the Responses API keeps stored responses "
                            "(previous_response_id; they outlive a restart); default "
                            "~/.cache/openinfer/responses.sqlite3; none: store nothing")
    serve.add_argument("--responses-store-max", type=int, default=10_000, metavar="N",
                       help="keep at most N stored responses (the oldest go first)")
    serve.add_argument("--generation-config", default="auto",
                       help="sampling defaults for fields a request leaves unset: auto (the "
                            "model's generation_config.json), vllm (none: OpenAI's), or a folder "
                            "holding a generation_config.json")
    serve.add_argument("--max-body-bytes", type=parse_bytes, default="8MiB",
                       help="larger request bodies get 413")
    serve.add_argument("--max-waiting-requests", type=int,
                       help="answer 503 + Retry-After while more requests than this wait")
    serve.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"),
                       help="openinfer's and uvicorn's log level")
    serve.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="no log line per HTTP request")
    serve.add_argument("--request-timeout", type=float,
                       help="seconds a request may run: past them it is aborted (its KV freed) "
                            "and answered 504, or its stream ends with an error event")
    serve.add_argument("--restart-on-engine-failure", action="store_true",
                       help="start the engine process again when it dies (requests in flight "
                            "fail; /health answers 503 until it is back), after 1, 2, 4, ... s")
    serve.add_argument("--max-engine-restarts", type=int, default=5,
                       help="with --restart-on-engine-failure: restarts within 10 minutes "
                            "before the engine is left dead")
    serve.add_argument("--shutdown-timeout", type=int, default=30,
                       help="seconds to let in-flight requests finish on SIGTERM/Ctrl-C")
    serve.add_argument("--timeout-keep-alive", type=int, default=KEEP_ALIVE_S,
                       help="seconds an idle client connection stays open (longer than clients' "
                            "own idle expiry, so that they close first)")
    serve.add_argument("--metrics-prefix", default="openinfer",
                       help="/metrics names its series PREFIX:name; 'vllm' gives vLLM's names, so "
                            "vLLM's Grafana dashboards and alerts work unchanged")
    serve.add_argument("--metrics-engine-index", type=int, default=0,
                       help="the 'engine' label of this server's metrics (its data-parallel "
                            "rank; --data-parallel-size numbers its replicas)")
    serve.add_argument("--node-rank", type=int, default=0,
                       help="this machine's node of --nnodes: 0 serves; any other runs its "
                            "share of the ranks headless, for node 0's engine")
    serve.add_argument("--headless", action="store_true",
                       help="run this node's ranks only (implied by --node-rank > 0)")
    serve.add_argument("--data-parallel-size", type=int, default=1,
                       help="run N engine replicas behind a router on --port; with "
                            "--enable-expert-parallel they are one group: attention data "
                            "parallel, experts spread over all N")
    serve.add_argument("--data-parallel-rank", type=int,
                       help="serve only this rank of a --data-parallel-size group of "
                            "expert-parallel engines (the others started likewise, e.g. on "
                            "other nodes); no router")
    serve.add_argument("--data-parallel-address", default="127.0.0.1",
                       help="where rank 0 of the group listens for the others")
    serve.add_argument("--data-parallel-rpc-port", type=int,
                       help="the port on --data-parallel-address the group joins at")
    add_router_args(serve, data_parallel=True)
    serve.set_defaults(func=cmd_serve)

    router = sub.add_parser("router", help="route the OpenAI/Anthropic API over replicas",
                            formatter_class=HelpFormatter)
    router.add_argument("--worker", "--decode", dest="worker", action="append", default=[],
                        help="replica URL (repeatable); with --prefill, the decode instances")
    router.add_argument("--prefill", action="append", default=[],
                        help="prefill instance URL (repeatable): disaggregate long prompts")
    router.add_argument("--tokenizer", required=True,
                        help="the replicas' tokenizer (so prompt hashes match theirs)")
    router.add_argument("--block-size", type=int, default=16, help="the replicas' KV block size")
    router.add_argument("--chat-template", help="the replicas' --chat-template, if they have one "
                                                "(so chat prompt hashes match theirs)")
    router.add_argument("--host", default="127.0.0.1", help="address to listen on")
    router.add_argument("--port", type=int, default=8000,
                        help="port to listen on (0: a free one, printed at start)")
    router.add_argument("--timeout-keep-alive", type=int, default=KEEP_ALIVE_S,
                        help="seconds an idle client connection stays open")
    router.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"),
                        help="openinfer's and uvicorn's log level")
    router.add_argument("--admin-api-key", help="key of /admin/*; unset: "
                                                "$OPENINFER_ADMIN_API_KEY, else /admin/* is refused")
    router.add_argument("--kv-transfer-secret",
                        help="the replicas' --kv-transfer-secret, to read their KV events "
                             "(unset: $OPENINFER_KV_TRANSFER_SECRET, else none)")
    router.add_argument("--cache-salt-per-api-key", action="store_true",
                        help="the replicas run with --cache-salt-per-api-key: hash prompts "
                             "salted by each request's API key, as they do")
    add_router_args(router)
    router.set_defaults(func=cmd_router)

    from openinfer.bench.cli import add_bench_parser, run_bench

    add_bench_parser(sub)
    sub.choices["bench"].set_defaults(func=run_bench)

    cache = sub.add_parser("cache", help="KV-cache tools", formatter_class=HelpFormatter)
    cache_commands = cache.add_subparsers(dest="cache_command", required=True)
    inspect = cache_commands.add_parser("inspect", help="what a KV file store holds")
    inspect.add_argument("dir", help="the --kv-store-dir of a server")
    inspect.set_defaults(func=cmd_cache_inspect)

    demo = sub.add_parser("demo-model", help="build the random-weight demo checkpoint (for tests "
                                             "and benchmarks: its text is gibberish)",
                          formatter_class=HelpFormatter)
    demo.add_argument("out_dir")
    demo.add_argument("--preset", default="tiny", help="tiny (default) or bench-0.3b")
    demo.set_defaults(func=cmd_demo_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        apply_env_defaults(parser)
        argv = expand_config_file(parser, argv)
    except ValueError as e:
        parser.error(str(e))
    args = parser.parse_args(argv)
    args.argv = argv
    if getattr(args, "log_level", None):
        configure_logging(args.log_level)
    try:
        if hasattr(args, "model_tag"):
            resolve_model_arg(args)
        return args.func(args)
    except ValueError as e:  # bad input: a clear message, not a traceback
        print(f"openinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
