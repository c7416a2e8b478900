"""``jaxserve serve`` and ``jaxserve bench serve``: registered on the main parser by ``jaxserve.cli``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

logger = logging.getLogger("jaxserve.server")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``jaxserve serve``."""
    from jaxserve.cli import add_model_args
    from jaxserve.server import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_PROMPT_CHARS
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, "
                                          "/v1/responses).")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $JAXSERVE_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients send as 'model' (default: the model's name)")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests queued without a first token beyond which new ones get 503 + Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger request bodies get 413")
    p.add_argument("--max-prompt-chars", type=int, default=DEFAULT_MAX_PROMPT_CHARS,
                   help="longer prompts (chat: all messages' content together) get 400 before they are tokenized; "
                        "0: no limit (default: %(default)s)")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                   help="seconds a client may take to send a request's line and headers; then 408 and the "
                        "connection is closed (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish before they are aborted")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json", "mistral"],
                   help="the format the model writes tool calls in (<tool_call>{...}</tool_call>, Llama 3.1's JSON, "
                        "[TOOL_CALLS][...]); auto: the one the chat template uses (default: %(default)s)")
    p.add_argument("--no-warmup", action="store_true", help="skip compiling every shape bucket before serving")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    m = p.add_argument_group("several hosts (one command per host; process 0 serves HTTP, the others follow)")
    m.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address for jax.distributed (with --num-processes and --process-id)")
    m.add_argument("--num-processes", type=int, default=None)
    m.add_argument("--process-id", type=int, default=None)
    m.add_argument("--distributed-auto", action="store_true",
                   help="let jax.distributed.initialize() find the group itself (Cloud TPU VMs of a multi-host slice)")
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args) -> int:
    from jaxserve import LLMEngine
    from jaxserve.config import EngineConfig
    from jaxserve.server.app import build_app
    from jaxserve.server.launch import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.distributed_auto or args.coordinator or args.num_processes is not None or args.process_id is not None:
        from jaxserve.distributed import initialize

        initialize(args.coordinator, args.num_processes, args.process_id)
    t0 = time.perf_counter()
    engine = LLMEngine(args.model, EngineConfig.from_cli_args(args))
    if not args.no_warmup:
        n = engine.warmup()
        logger.info("compiled %d step buckets", n)
    if engine.is_follower:
        return _follow(engine)
    logger.info("model %s ready in %.1fs (max_model_len %d, %d KV pages)", engine.model_name,
                time.perf_counter() - t0, engine.scheduler_config.max_model_len, engine.runner.num_pages)
    app = build_app(engine, served_model_names=args.served_model_name, api_key=args.api_key,
                    max_body_bytes=args.max_body_bytes, max_waiting=args.max_waiting_requests,
                    shutdown_timeout=args.shutdown_timeout, max_prompt_chars=args.max_prompt_chars or None,
                    tool_call_parser=None if args.tool_call_parser == "auto" else args.tool_call_parser)
    try:
        return serve(app, args.host, args.port, log_level=args.log_level, shutdown_timeout=args.shutdown_timeout,
                     header_timeout=args.header_timeout)
    finally:
        engine.release_followers()


def _follow(engine) -> int:
    """Processes other than 0 run process 0's steps until it shuts down (0) or is lost (1, with the cause)."""
    from jaxserve.distributed import FollowerLost

    logger.info("following process 0's steps")
    try:
        engine.follow()
    except FollowerLost as e:
        logger.error("%s; exiting", e)
        return 1
    logger.info("process 0 shut down; exiting")
    return 0


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``jaxserve bench serve`` (``bench`` is a group, so more benchmarks can join it)."""
    b = subparsers.add_parser("bench", help="benchmarks")
    sub = b.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser("serve", help="online benchmark against a running server (Poisson arrivals)",
                       description="Sends requests at Poisson-distributed times to a running OpenAI-compatible "
                                   "server; reports TTFT, TPOT, ITL (mean/median/p99) and throughput per rate.")
    from jaxserve.server.bench import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_bench_serve)
    return b


def cmd_bench_serve(args) -> int:
    from jaxserve.server.bench import main

    return main(args)


if __name__ == "__main__":  # python -m jaxserve.server.cli serve ...
    parser = argparse.ArgumentParser(prog="jaxserve")
    subs = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(subs)
    add_bench_parser(subs)
    ns = parser.parse_args()
    sys.exit(ns.func(ns))
