"""``jaxserve generate | chat | convert``: the command line."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_model_args(p: argparse.ArgumentParser, **defaults) -> None:
    """The model and every engine setting (one flag per ``EngineConfig`` field): shared by generate, chat and
    serve. ``defaults`` overrides a setting's default for this command."""
    from jaxserve.config import EngineConfig

    p.add_argument("--model", default=None,
                   help="GGUF file, HF directory, orbax directory, preset or hub id (default: SmolLM2-135M-Instruct)")
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
    g.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="constrain the output to JSON valid under this schema (JSON text, or @file.json)")
    g.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    g.add_argument("--regex", default=None, help="constrain the output to match this regular expression")
    g.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")
    g.add_argument("--grammar", default=None, metavar="GRAMMAR",
                   help="constrain the output to a Lark or GBNF grammar (text, or @file)")


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

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=args.stop, structured_outputs=_structured_outputs(args))


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
            out.write(text[len(shown):])
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
    from pathlib import Path

    from jaxserve.loading import load_model, orbax_ckpt, resolve_model_path

    src = resolve_model_path(args.src)
    loaded = load_model(src, args.dtype, keep_quantized=args.quantization == "gguf")
    params = loaded.params
    if args.quantization not in (None, "gguf"):
        import jax
        import numpy as np

        from jaxserve import quant

        params = {name: jax.tree.map(np.asarray, quant.quantize(value, args.quantization, axis=quant.weight_axis(name)))
                  if name in quant.QUANTIZED_PARAMS else value for name, value in params.items()}
    orbax_ckpt.save(args.dst, loaded.config, params, args.dtype)
    orbax_ckpt.copy_tokenizer(src, Path(args.dst))
    print(f"wrote {args.dst} ({loaded.config.architecture}, {args.dtype}"
          f"{', ' + args.quantization if args.quantization else ''})")
    return 0


def cmd_plan(args) -> int:
    import dataclasses

    from jaxserve.aot import parse_topology, plan
    from jaxserve.config import EngineConfig

    chips = parse_topology(args.topology)[1]
    settings = vars(args) | {"tensor_parallel_size": args.tensor_parallel_size or chips}
    config = EngineConfig(**{f.name: settings[f.name] for f in dataclasses.fields(EngineConfig)})
    result = plan(args.model, args.topology, config.tensor_parallel_size, config=config, seq_len=args.seq_len,
                  compile=not args.no_compile,
                  variants="all" if args.all_variants else "corners")
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
    v.add_argument("--quantization", default=None, choices=["int8", "int4", "w8a8", "gguf"],
                   help="write quantized weights (gguf: a GGUF file's own Q8_0/Q4_x/Qn_K blocks); served quantized "
                        "when loaded")
    v.set_defaults(func=cmd_convert)

    from jaxserve.config import EngineConfig

    pl = sub.add_parser("plan", help="will a model fit a TPU/GPU slice? compile its steps for a TPU slice here",
                        description="Plans one replica on a topology: per-chip weights, KV pool and activations, how "
                                    "many sequences fit, a decode roofline; on a TPU topology it also compiles the "
                                    "step for that TPU on this machine (needs libtpu: pip install 'jax[tpu]').")
    pl.add_argument("--model", default="smollm2-135m", help="a preset (configs/) or an HF config.json / directory")
    pl.add_argument("--topology", required=True, help="v5e:2x4, v6e:2x4, v5p:2x2x1, v5e:4x4, ..., or h100:8 "
                                                      "(GPUs: arithmetic only)")
    pl.add_argument("--seq-len", type=int, default=None, help="context per sequence (default: --max-model-len)")
    pl.add_argument("--all-variants", action="store_true", help="compile every bucket (default: the largest ones)")
    pl.add_argument("--no-compile", action="store_true", help="arithmetic only")
    EngineConfig.add_cli_args(pl, tensor_parallel_size=0, dtype="bfloat16")
    pl.set_defaults(func=cmd_plan)

    from jaxserve.server.cli import add_bench_parser, add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
