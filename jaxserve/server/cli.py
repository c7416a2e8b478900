"""``jaxserve serve``: builds the engine and the app and serves it (the flags are defined in ``jaxserve.cli``)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("jaxserve.server")


def serve(args) -> int:
    """Runs ``jaxserve serve`` with its parsed flags until SIGTERM / SIGINT; returns the exit code.

    With ``--coordinator`` / ``--num-processes`` / ``--process-id`` / ``--distributed-auto`` it first joins the
    multi-process runtime; processes other than 0 then follow process 0's steps instead of serving HTTP.
    """
    from jaxserve import LLMEngine
    from jaxserve.config import EngineConfig
    from jaxserve.server.app import build_app
    from jaxserve.server.launch import serve as run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.distributed_auto or args.coordinator or args.num_processes is not None or args.process_id is not None:
        from jaxserve.parallel.distributed import initialize

        initialize(args.coordinator, args.num_processes, args.process_id)
    kv_events = getattr(args, "kv_events_config", None)  # parsed by the flag
    if kv_events is not None and kv_events.enabled:  # before the model loads: say at once what is missing
        from jaxserve.core.kv_events import check_dependencies

        try:
            check_dependencies()
        except ImportError as e:
            raise ValueError(str(e)) from None
    t0 = time.perf_counter()
    engine = LLMEngine(args.model, EngineConfig.from_cli_args(args))
    if not args.no_warmup:
        n = engine.warmup()
        logger.info("compiled %d step buckets", n)
    if engine.is_follower:
        return _follow(engine)
    logger.info(
        "model %s ready in %.1fs (max_model_len %d, %d KV pages)",
        engine.model_name,
        time.perf_counter() - t0,
        engine.scheduler_config.max_model_len,
        engine.runner.num_pages,
    )
    app = build_app(
        engine,
        served_model_names=args.served_model_name,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_waiting=args.max_waiting_requests,
        shutdown_timeout=args.shutdown_timeout,
        max_prompt_chars=args.max_prompt_chars or None,
        tool_call_parser=None if args.tool_call_parser == "auto" else args.tool_call_parser,
        kv_events=kv_events,
    )
    try:
        return run_server(
            app,
            args.host,
            args.port,
            log_level=args.log_level,
            shutdown_timeout=args.shutdown_timeout,
            header_timeout=args.header_timeout,
        )
    finally:
        engine.release_followers()


def _follow(engine) -> int:
    """Processes other than 0 run process 0's steps until it shuts down (0) or is lost (1, with the cause)."""
    from jaxserve.parallel.distributed import FollowerLost

    logger.info("following process 0's steps")
    try:
        engine.follow()
    except FollowerLost as e:
        logger.error("%s; exiting", e)
        return 1
    logger.info("process 0 shut down; exiting")
    return 0
