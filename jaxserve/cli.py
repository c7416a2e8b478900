"""The command line: ``jaxserve generate | chat | convert | plan | serve | bench serve``.

Every command's parser is built here; the commands run lazily imported code (``serve``: ``jaxserve.server.cli``,
``bench serve``: ``jaxserve.benchmarks.serve``), so ``jaxserve --help`` imports neither jax nor the server.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def add_model_args(p: argparse.ArgumentParser, **defaults) -> None:
    """The model and every engine setting (one flag per ``EngineConfig`` field): shared by generate, chat and
    serve. ``defaults`` overrides a setting's default for this command."""
    from jaxserve.config import EngineConfig

    p.add_argument(
        "--model",
        default=None,
        help="GGUF file, HF directory, orbax directory, preset or hub id (default: SmolLM2-135M-Instruct)",
    )
    EngineConfig.add_cli_args(p, **defaults)


# generate and chat run one request at a time: a small batch compiles fewer, smaller buckets.
_ONE_STREAM = dict(max_num_seqs=1, max_num_batched_tokens=256)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--json-schema",
        default=None,
        metavar="SCHEMA",
        help="constrain the output to JSON valid under this schema (JSON text, or @file.json)",
    )
    g.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    g.add_argument("--regex", default=None, help="constrain the output to match this regular expression")
    g.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")
    g.add_argument(
        "--grammar",
        default=None,
        metavar="GRAMMAR",
        help="constrain the output to a Lark or GBNF grammar (text, or @file)",
    )


def _structured_outputs(args) -> dict | None:
    def text(value: str) -> str:
        return Path(value[1:]).read_text() if value.startswith("@") else value

    if args.json_schema is not None:
        return {"json": text(args.json_schema)}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": args.choice}
    if args.grammar is not None:
        return {"grammar": text(args.grammar)}
    return None


def _sampling_params(args):
    from jaxserve import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        structured_outputs=_structured_outputs(args),
    )


def _engine(args):
    from jaxserve import LLMEngine
    from jaxserve.config import EngineConfig

    return LLMEngine(args.model, EngineConfig.from_cli_args(args))


def _stream(engine, request_id: str, prompt, params, out=None) -> str:
    """Streams one request's text to ``out`` (stdout) as it is generated; returns the whole text."""
    out = out or sys.stdout
    engine.add_request(request_id, prompt, params)
    shown = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            text = o.outputs[0].text
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    return shown


def cmd_generate(args) -> int:
    t0 = time.perf_counter()
    engine = _engine(args)
    load_s = time.perf_counter() - t0
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
    _stream(engine, "cli", prompt, _sampling_params(args))
    print()
    if args.verbose:
        print(f"[model {engine.model_name}: loaded in {load_s:.1f}s; {engine.get_stats()}]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    engine = _engine(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"jaxserve chat with {engine.model_name}; an empty line or Ctrl-D quits.", file=sys.stderr)
    for turn in range(10**9):
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        ids = engine.tokenizer.apply_chat_template(messages, tokenize=True)
        reply = _stream(engine, f"chat-{turn}", ids, _sampling_params(args))
        print()
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_convert(args) -> int:
    from jaxserve.loading import convert

    config = convert(args.src, args.dst, args.dtype, args.quantization)
    print(
        f"wrote {args.dst} ({config.architecture}, {args.dtype}{', ' + args.quantization if args.quantization else ''})"
    )
    return 0


def cmd_plan(args) -> int:
    import dataclasses

    from jaxserve.aot import parse_topology, plan
    from jaxserve.config import EngineConfig

    chips = parse_topology(args.topology)[1] * args.num_slices
    settings = vars(args) | {"tensor_parallel_size": args.tensor_parallel_size or chips // args.pipeline_parallel_size}
    config = EngineConfig(**{f.name: settings[f.name] for f in dataclasses.fields(EngineConfig)})
    result = plan(
        args.model,
        args.topology,
        config.tensor_parallel_size,
        config=config,
        seq_len=args.seq_len,
        compile=False if args.no_compile else None,
        variants="all" if args.all_variants else "corners",
        num_slices=args.num_slices,
    )
    print(result.summary())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="JAX/XLA LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("-v", "--verbose", action="store_true", help="print load time and engine stats")
    add_model_args(g, **_ONE_STREAM)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat on the terminal")
    c.add_argument("--system", default=None, help="system prompt")
    add_model_args(c, **_ONE_STREAM)
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    v = sub.add_parser("convert", help="write an orbax checkpoint from a GGUF file or HF directory")
    v.add_argument("src")
    v.add_argument("dst")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    v.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "w8a8", "gguf"],
        help="write quantized weights (gguf: a GGUF file's own Q8_0/Q4_x/Qn_K blocks); served quantized when loaded",
    )
    v.set_defaults(func=cmd_convert)

    from jaxserve.config import EngineConfig

    pl = sub.add_parser(
        "plan",
        help="will a model fit a TPU/GPU slice? compile its steps for that TPU or GPU here",
        description="Plans one replica on a topology: per-chip weights, KV pool and activations, how "
        "many sequences fit, a decode roofline; it also compiles the step for that TPU or GPU on this "
        "machine, which needs none (TPU: libtpu, pip install 'jax[tpu]'; GPU: JAX's CUDA plugin, pip install "
        "jax-cuda13-plugin jax-cuda13-pjrt at jax's version, else arithmetic only).",
    )
    pl.add_argument("--model", default="smollm2-135m", help="a preset (configs/) or an HF config.json / directory")
    pl.add_argument(
        "--topology", required=True, help="v5e:2x4, v6e:2x4, v5p:2x2x1, v5e:4x4, ..., or GPUs: h100:8, h200:1, a100:4"
    )
    pl.add_argument("--seq-len", type=int, default=None, help="context per sequence (default: --max-model-len)")
    pl.add_argument("--all-variants", action="store_true", help="compile every bucket (default: the largest ones)")
    pl.add_argument("--no-compile", action="store_true", help="arithmetic only")
    pl.add_argument(
        "--num-slices", type=int, default=1, help="copies of --topology joined over the data-center network"
    )
    EngineConfig.add_cli_args(pl, tensor_parallel_size=0, dtype="bfloat16")
    pl.set_defaults(func=cmd_plan)

    _add_serve_parser(sub)
    _add_bench_parser(sub)
    return parser


def _add_serve_parser(subparsers) -> None:
    from jaxserve.server import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_PROMPT_CHARS

    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, /v1/responses).",
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("JAXSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $JAXSERVE_API_KEY, else none)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients send as 'model' (default: the model's name)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="requests queued without a first token beyond which new ones get 503 + Retry-After",
    )
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger request bodies get 413")
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=DEFAULT_MAX_PROMPT_CHARS,
        help="longer prompts (chat: all messages' content together) get 400 before they are tokenized; "
        "0: no limit (default: %(default)s)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        help="seconds a client may take to send a request's line and headers; then 408 and the "
        "connection is closed (default: %(default)s)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests may take to finish before they are aborted",
    )
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", "hermes", "llama3_json", "mistral"],
        help="the format the model writes tool calls in (<tool_call>{...}</tool_call>, Llama 3.1's JSON, "
        "[TOOL_CALLS][...]); auto: the one the chat template uses (default: %(default)s)",
    )
    p.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        metavar="JSON",
        help="publish KV-cache events for prefix-aware routers, as vLLM's flag: e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}\' '
        "(process 0 publishes; needs the kv-events extra: pyzmq, msgpack)",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip compiling every shape bucket before serving")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    m = p.add_argument_group("several hosts (one command per host; process 0 serves HTTP, the others follow)")
    m.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="process 0's address for jax.distributed (with --num-processes and --process-id)",
    )
    m.add_argument("--num-processes", type=int, default=None)
    m.add_argument("--process-id", type=int, default=None)
    m.add_argument(
        "--distributed-auto",
        action="store_true",
        help="let jax.distributed.initialize() find the group itself (Cloud TPU VMs of a multi-host slice)",
    )
    p.set_defaults(func=cmd_serve)


def _kv_events_config(text: str):
    from jaxserve.core.kv_events import KVEventsConfig

    try:
        return KVEventsConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--kv-events-config: ")) from None


def cmd_serve(args) -> int:
    from jaxserve.server.cli import serve

    return serve(args)


def _add_bench_parser(subparsers) -> None:
    """``jaxserve bench serve`` (``bench`` is a group, so more benchmarks can join it)."""
    from jaxserve.benchmarks import serve as bench_serve

    b = subparsers.add_parser("bench", help="benchmarks")
    sub = b.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser(
        "serve",
        help="online benchmark against a running server (Poisson arrivals)",
        description="Sends requests at Poisson-distributed times to a running OpenAI-compatible "
        "server; reports TTFT, TPOT, ITL (mean/median/p99) and throughput per rate.",
    )
    bench_serve.add_arguments(p)
    p.set_defaults(func=bench_serve.main)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        rc, why = 2, f"{type(e).__name__}: {e}"
    except KeyboardInterrupt:
        rc, why = 130, "interrupted"
    else:
        why = f"exited with status {rc}"
    distributed = sys.modules.get("jaxserve.parallel.distributed")  # imported only by commands that may join a group
    return distributed.exit_group(rc, why) if rc and distributed else rc


if __name__ == "__main__":
    sys.exit(main())
