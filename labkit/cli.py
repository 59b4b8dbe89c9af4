"""The `labkit` command line.

    labkit generate "PROMPT" --max-tokens N [--temperature T --top-p P --top-k K --seed S]
                             [--chat] [--json] [--model NAME] [--threads N]
                             [--weights gguf|f32|bf16|gguf-int8]
    labkit model fetch [NAME]        download, verify and dequantize a registry model
    labkit model info [NAME] [--json] config, parameter count and byte accounting
    labkit model list
    labkit serve [--model NAME] [--host H] [--port P] [--api-key-file F] ...
                                     the OpenAI-compatible HTTP service (labkit.serve)
    labkit book run [--profile ci|full] [CHAPTER ...]
    labkit book build
    labkit book stale [CHAPTER ...] [--verbose]
                                     records older than the code they describe (exit 1)
"""

from __future__ import annotations

import argparse
import json
import sys

def _cmd_generate(args) -> int:
    import torch

    from labkit.engine.loop import generate
    from labkit.models import load_model
    from labkit.sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop or ()),
        )
    except ValueError as exc:
        print(f"labkit generate: {exc}", file=sys.stderr)
        return 2
    from labkit.engine.backends import prepare_weights

    loaded = load_model(args.model)
    try:  # no --weights: the preferred mode, or f32 where it cannot run here
        prepared = prepare_weights(loaded, args.weights)
    except ValueError as exc:  # a mode asked for by name that cannot run: an error
        print(f"labkit generate: {exc}", file=sys.stderr)
        return 2
    if prepared.fallback:
        print(f"labkit generate: {prepared.fallback}; using f32 weights", file=sys.stderr)
    model, weights = prepared.model, prepared.weights
    stream = None if args.json else (lambda piece: print(piece, end="", flush=True))
    if stream:
        print(args.prompt, end="", flush=True) if not args.chat else None
    result = generate(model, args.prompt, params, chat=args.chat, on_text=stream)
    if args.json:
        out = result.to_dict()
        out["model"], out["weights"] = args.model, weights
        out["load_seconds"] = loaded.load_report.seconds
        print(json.dumps(out))
        return 0
    t = result.timings
    print()
    print(f"\n[{len(result.prompt_token_ids)} prompt tokens, {len(result.token_ids)} generated, "
          f"finish={result.finish_reason}] time to first token {t.time_to_first_token * 1e3:.0f} ms, "
          f"decode {t.decode * 1e3:.0f} ms for {len(t.decode_steps)} steps, total {t.total:.2f} s, "
          f"load {sum(loaded.load_report.seconds.values()):.2f} s", file=sys.stderr)
    return 0


def model_info(name: str) -> dict:
    from labkit.models import fetch, get_spec
    from labkit.models.gguf_file import byte_accounting
    from labkit.models.loader import load_model

    spec = get_spec(name)
    path = fetch(name)
    model = load_model(name, with_tokenizer=False)
    c = model.config
    params = model.num_parameters()
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    return {
        "name": name,
        "description": spec.description,
        "source": f"{spec.source} :: {' + '.join(chunk.member for chunk in spec.chunks)}",
        "quantization": spec.quantization,
        "license": spec.license,
        "gguf_sha256": spec.gguf_sha256,
        "gguf_path": str(path),
        "config": c.to_dict(),
        "parameters": params,
        "float32_bytes": params * 4,
        "bfloat16_bytes": params * 2,
        "kv_cache_bytes_per_token_float32": kv_per_token,
        "gguf": byte_accounting(path),
    }


def _cmd_model(args) -> int:
    from labkit.models import REGISTRY

    if args.action == "list":
        for name, spec in REGISTRY.items():
            print(f"{name:16s} {spec.description}")
        return 0
    if args.action == "fetch":
        from labkit.models.loader import ensure_dequantized, load_tokenizer
        from labkit.models.registry import fetch

        path = fetch(args.name, verify_cached=True)
        weights, _, warm = ensure_dequantized(args.name)
        load_tokenizer(args.name)
        print(f"{args.name}: {path} (sha256 ok)\n  dequantized: {weights} "
              f"({'cached' if warm else 'built now'})")
        return 0
    info = model_info(args.name)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    c, g = info["config"], info["gguf"]
    print(f"{info['name']}: {info['description']}\n  source: {info['source']}"
          f"\n  license: {info['license']}\n  sha256: {info['gguf_sha256']}")
    print("config:")
    for key, value in c.items():
        print(f"  {key:26s} {value}")
    print(f"parameters: {info['parameters']:,} (tied embedding counted once)")
    print(f"  float32 {info['float32_bytes']:,} B, bfloat16 {info['bfloat16_bytes']:,} B")
    print(f"  KV cache per token (float32): {info['kv_cache_bytes_per_token_float32']:,} B")
    print(f"GGUF file: {g['file_bytes']:,} B")
    for key in ("header_bytes", "tokenizer_bytes", "other_metadata_bytes", "tensor_info_bytes",
                "alignment_padding_bytes", "tensor_bytes"):
        print(f"  {key:26s} {g[key]:>12,}")
    for qtype, nbytes in g["tensor_bytes_by_type"].items():
        n = g["parameters_by_type"][qtype]
        print(f"    {qtype:6s} {nbytes:>12,} B for {n:>12,} values ({8 * nbytes / n:.2f} bits each)")
    return 0


def _cmd_book(args) -> int:
    from labkit.book import runner

    if args.action == "run":
        return runner.run_chapters(profile=args.profile, chapters=args.chapters or None)
    if args.action == "build":
        return runner.build_book()
    if args.action == "stale":
        from labkit.book.profile import find_repo_root
        from labkit.book.stale_report import run_stale

        return run_stale(find_repo_root(), args.chapters or None, verbose=args.verbose)
    chapters = args.chapters or None
    runner.sync_install_cells(chapters=chapters)
    for source in runner.resolve_chapters(chapters):  # every cell of the .md into its .ipynb
        runner.sync_pair(source)
    runner.write_toc()
    return 0


def _cmd_bench(args) -> int:
    from labkit.bench.suite import run_bench

    if args.figures == ["soak"]:
        from labkit.bench.soak import SoakConfig, run_soak, summary_line

        record = run_soak(SoakConfig(minutes=args.minutes, clients=args.clients, model=args.model,
                                     threads=args.threads), args.out if args.out != "results/bench" else
                          "results/bench/soak")
        print(summary_line(record))
        return 0 if record["verdicts"]["passed"] else 1
    if args.figures == ["structured"]:
        from labkit.bench.structured import StructuredConfig, run_structured, summary_lines

        record = run_structured(StructuredConfig(model=args.model, quick=args.quick, repeats=args.repeats,
                                                 threads=args.threads),
                                args.out if args.out != "results/bench" else "results/bench/structured")
        print("\n".join(summary_lines(record)))
        return 0

    try:
        figures = run_bench(args.figures or None, quick=args.quick, out=args.out,
                            model_name=args.model, threads=args.threads)
    except ValueError as exc:
        print(f"labkit: {exc}", file=sys.stderr)
        return 2
    missed = [f for f in figures if f.passed is False]
    not_run = sum(f.passed is None for f in figures)
    print(f"{len(figures) - len(missed) - not_run}/{len(figures)} figures meet their targets"
          f"{f', {not_run} NOT_RUN' if not_run else ''}; records in {args.out}/")
    return 1 if args.check and missed else 0


def _cmd_serve(args) -> int:
    from labkit.serve.server import serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    from labkit.engine.backends import WEIGHTS

    parser = argparse.ArgumentParser(prog="labkit", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a continuation of a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--model", default="smollm2-135m")
    gen.add_argument("--threads", type=int, default=None)
    gen.add_argument("--weights", choices=WEIGHTS, default=None,
                     help="gguf (default: the model file's own blocks with float32 activations, the "
                          "fastest mode that keeps float32's greedy tokens on the test prompts; f32 "
                          "where the C kernels do not build); f32; "
                          "bf16 (matrices and their inputs in bfloat16); gguf-int8 (activations "
                          "rounded to 8 bits, as llama.cpp does)")
    gen.set_defaults(func=_cmd_generate)

    model = sub.add_parser("model", help="fetch, describe or list models")
    model.add_argument("action", choices=["fetch", "info", "list"])
    model.add_argument("name", nargs="?", default="smollm2-135m")
    model.add_argument("--json", action="store_true")
    model.set_defaults(func=_cmd_model)

    book = sub.add_parser("book", help="run the chapters, build the book")
    book.add_argument("action", choices=["run", "build", "sync", "stale"])
    book.add_argument("chapters", nargs="*")
    book.add_argument("--profile", choices=["ci", "full"], default="full")
    book.add_argument("--verbose", action="store_true", help="stale: every commit, pending chapters too")
    book.set_defaults(func=_cmd_book)

    bench = sub.add_parser("bench", help="benchmark the serving engine against its baselines")
    bench.add_argument("figures", nargs="*", help="decode, batch, ttft, paging, prefix, serve, lowbit (default: "
                                                  "all); or soak alone: a bounded soak of labkit serve; or "
                                                  "structured alone: what a grammar costs")
    bench.add_argument("--quick", action="store_true", help="small sizes: checks the plumbing only")
    bench.add_argument("--out", default="results/bench", help="folder for summary.json and the records")
    bench.add_argument("--model", default="smollm2-135m")
    bench.add_argument("--threads", type=int, default=None)
    bench.add_argument("--check", action="store_true", help="exit 1 if a figure misses its target")
    bench.add_argument("--minutes", type=float, default=10.0, help="soak: how long the clients run")
    bench.add_argument("--clients", type=int, default=8, help="soak: clients at once")
    bench.add_argument("--repeats", type=int, default=3, help="structured: repeats of the paired batches")
    bench.set_defaults(func=_cmd_bench)

    from labkit.serve.server import add_arguments

    serve = sub.add_parser("serve", help="serve the model over HTTP (OpenAI's API)")
    add_arguments(serve)
    serve.set_defaults(func=_cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `labkit book run --profile full 2`: chapters may follow the options.
    if extra and args.command == "book" and not any(e.startswith("-") for e in extra):
        args.chapters = list(args.chapters) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except KeyError as exc:  # unknown model name
        print(f"labkit: {exc.args[0]}", file=sys.stderr)
        return 2
    except Exception as exc:
        from labkit.models.registry import ModelFetchError

        if isinstance(exc, ModelFetchError):
            print(f"labkit: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
