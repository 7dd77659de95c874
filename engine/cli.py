"""`moeferry` command line: every subcommand (`python -m moeferry.engine.cli SUBCOMMAND` runs the same).
The console script is app/cli.py, which opens the desktop app when given no command; this
module never imports the app.

Errors reach the user as one sentence on stderr: exit 2 for bad usage or input, 1 for a
failed check. Set MOEFERRY_DEBUG=1 to see tracebacks of unexpected errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from moeferry.engine.errors import UserError
from moeferry.engine.progress import ProgressLine
from moeferry.engine.runtime import vram


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("moeferry")
    except PackageNotFoundError:
        return "(not installed: run `pip install -e .` in the source folder)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeferry", description="Chat with Mixtral-8x7B on a gaming GPU.")
    p.add_argument("--version", action="version", version=f"moeferry {package_version()}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="command")

    s = sub.add_parser("probe", help="GPU/CPU/RAM/disk report and the recommended plan")
    s.add_argument("--json", action="store_true", help="print one JSON object")

    s = sub.add_parser("fetch", help="download a Hugging Face repo (resumable, verified)")
    s.add_argument("repo_id", help="the repo, e.g. mistralai/Mixtral-8x7B-Instruct-v0.1")
    s.add_argument("dest", help="the folder to download into (created)")
    s.add_argument("--revision", help="a branch, tag or commit (default: main)")
    s.add_argument("--endpoint", help="another hub's address (default: $HF_ENDPOINT or huggingface.co)")

    s = sub.add_parser("convert", help="Hugging Face Mixtral checkpoint -> MoE Ferry store")
    s.add_argument("src", help="a Mixture-of-Experts checkpoint folder: Hugging Face (Mixtral, Qwen3-MoE, "
                               "Qwen2-MoE, OLMoE, gpt-oss) or the paper's Mixtral format")
    s.add_argument("dest", help="the store folder to write (must not exist)")
    s.add_argument("--expert-bits", type=int, choices=(2, 3, 4, 16),
                   help="bits per expert weight (16 keeps the source precision)")
    s.add_argument("--attn-bits", type=int, choices=(4, 8, 16),
                   help="bits per attention weight (16 keeps the source precision)")
    s.add_argument("--expert-group-size", type=int,
                   help="rows sharing one scale and zero (default 16 at 2 bits, 64 at 3 and 4; 32 at 2 bits "
                        "takes 2.5 bits per weight instead of 3.0: more experts fit the GPU, less accurate; docs/BENCHMARKS.md)")
    s.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to quantize (default: the GPU if there is one)")
    s.add_argument("--tokenizer", help="folder (or cached repo) to take the tokenizer files from")

    s = sub.add_parser("verify", help="re-hash every file of a store against its manifest")
    s.add_argument("store", help="a store folder or `demo`")

    add_generate_parser(sub)

    s = sub.add_parser("serve", help="serve the model with a local OpenAI-compatible API")
    s.add_argument("store")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (any but 127.0.0.1 needs a key)")
    s.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free port)")
    s.add_argument("--api-key", metavar="KEY", help="require this key (Authorization: Bearer KEY); or set "
                                                    "MOEFERRY_API_KEY")
    s.add_argument("--no-auth", action="store_true", help="serve another address without a key")
    s.add_argument("--queue-size", type=int, default=8, help="requests that may wait (one is served at a "
                                                             "time); more get 429")
    s.add_argument("--device", default="auto")
    s.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    s.add_argument("--cache-experts", type=int)
    s.add_argument("--vram-budget")
    s.add_argument("--prefetch", type=int, default=1)
    s.add_argument("--kernels", default="auto", choices=("auto", "reference", "fused"))
    s = sub.add_parser("trace", help="record a routing trace of a model on a text (for `bench --routing trace:PATH`)")
    s.add_argument("store")
    s.add_argument("--text", required=True, help="UTF-8 text file; paragraphs are separated by blank lines")
    s.add_argument("--out", required=True, help="the trace file to write (safetensors)")
    s.add_argument("--max-tokens", type=int, help="at most this many tokens of the text (default 131,072)")
    s.add_argument("--device", default="auto")
    s.add_argument("--json", action="store_true", help="print the trace's statistics as JSON")

    # bench and demo parse their own options (engine/measure/bench.py, engine/setup/demo.py)
    sub.add_parser("bench", help="the offloading benchmark (synthetic full-size Mixtral)", add_help=False)
    sub.add_parser("demo", help="the embedded demo model: its path, a self-test, the locality study",
                   add_help=False)
    return p


PASS_THROUGH = ("bench", "demo")


def add_generate_parser(sub) -> None:
    s = sub.add_parser("generate", help="generate text from a prompt")
    s.add_argument("store", help="a store folder or `demo`")
    s.add_argument("--prompt", required=True, help="the text to continue, or with --chat the message")
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    s.add_argument("--max-new-tokens", type=int, default=128,
                   help="stop after this many tokens (default 128; cut to what the context leaves)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default); e.g. 0.7")
    s.add_argument("--top-p", type=float, default=0.9,
                   help="sample from the smallest set of tokens this likely (default 0.9)")
    s.add_argument("--seed", type=int, help="random seed for sampling (repeatable output)")
    s.add_argument("--repeat-penalty", type=float,
                   help="as llama.cpp's: >1 makes recent tokens less likely (1.0 = off; "
                        "default: the model's generation_config.json, else 1.0)")
    s.add_argument("--repeat-last-n", type=int, default=64,
                   help="how many recent tokens --repeat-penalty looks at (default 64; -1 = all)")
    s.add_argument("--no-repeat-ngram", type=int, metavar="N",
                   help="never repeat a sequence of N tokens already in the context (0 = off; "
                        "default: the model's generation_config.json, else 0)")
    s.add_argument("--device", default="auto", help="auto (the default), cpu or cuda")
    s.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default: bfloat16 on the GPU, float32 on the CPU)")
    s.add_argument("--cache-experts", type=int, help="experts kept on the GPU per layer (default: from the budget)")
    s.add_argument("--vram-budget", help="GPU memory the engine may allocate, e.g. 12GiB; the CUDA runtime holds "
                                         "about 0.7 GiB more (default: what is free, less 512 MiB)")
    s.add_argument("--prefetch", type=int, default=1, help="layers ahead to guess and copy experts (0 = off)")
    s.add_argument("--kernels", default="auto", choices=("auto", "reference", "fused"),
                   help="fused = the Triton GPU kernels; reference = dequantize then matmul")
    s.add_argument("--cpu-experts", choices=("auto", "off", "all"),
                   help="compute missed experts on the CPU too: off, all of them, or auto (a cost model); "
                        "default: off on a GPU; on a CPU, all unless every expert fits the CPU's 4 GiB expert cache")
    s.add_argument("--cpu-format", choices=("hqq", "int4", "int8", "dense"),
                   help="how the CPU runs experts: hqq (default for 2-4 bit stores: the stored bytes in "
                        "place, no extra RAM) or a CPU copy in int4 (default for 16-bit stores), int8, dense")
    s.add_argument("--cpu-threads", type=int, help="threads of the CPU experts (default: every core; without a GPU, "
                                                   "fewer while other programs keep some busy)")
    s.add_argument("--ram-budget", help="RAM for the CPU copies, e.g. 24GiB (default: what is available)")
    s.add_argument("--expert-units", type=int, default=1,
                   help="cut each HQQ expert into this many units along its FFN at load (exact, the same "
                        "outputs) so that --cpu-experts serves one miss part over the link and part on the CPU")
    s.add_argument("--json", action="store_true", help="print one JSON object: text, token ids, stats")


TEXT_OPTIONS = ("--prompt",)  # options whose value is free text


def glue_text_options(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--prompt TEXT` as `--prompt=TEXT` where TEXT starts with "-": argparse takes such a value
    for an option of its own ("- a list", "-x") and stops with "expected one argument". A
    value that is one of the command's options (`--prompt --json`: the text forgotten) stays
    apart, so argparse still says so."""
    options = {o for a in parser._subparsers._group_actions for sub in a.choices.values()  # noqa: SLF001
               for o in sub._option_string_actions} if parser._subparsers else set()  # noqa: SLF001
    out, i = [], 0
    while i < len(argv):
        if argv[i] in TEXT_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and argv[i + 1].split("=", 1)[0] not in options:
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    vram.use_expandable_segments()
    if argv and argv[0] in PASS_THROUGH:
        args = argparse.Namespace(command=argv[0], rest=argv[1:])
    else:
        parser = build_parser()
        args = parser.parse_args(glue_text_options(argv, parser))
    try:
        return run(args)
    except UserError as e:
        print(f"moeferry: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("moeferry: interrupted.", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the last line of defence against tracebacks
        if os.environ.get("MOEFERRY_DEBUG"):
            raise
        if type(e).__name__ == "OutOfMemoryError":
            print("moeferry: the GPU ran out of memory; lower --cache-experts or --vram-budget "
                  "and try again.", file=sys.stderr)
            return 1
        print(f"moeferry: unexpected error ({type(e).__name__}: {e}); run again with MOEFERRY_DEBUG=1 "
              f"for details and report it.", file=sys.stderr)
        return 1


def run(args) -> int:
    if args.command is None:
        build_parser().print_usage(sys.stderr)
        print("moeferry: give a command (`moeferry` alone opens the desktop app).", file=sys.stderr)
        return 2
    if args.command == "probe":
        from moeferry.engine.setup.hardware import cli_probe
        return cli_probe(args.json)
    if args.command == "fetch":
        from moeferry.engine.setup.download import cli_fetch
        return cli_fetch(args.repo_id, args.dest, args.revision, args.endpoint)
    if args.command == "convert":
        return cmd_convert(args)
    if args.command == "verify":
        return cmd_verify(args)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "serve":
        from moeferry.engine.api.serve import cli_serve
        return cli_serve(args)
    if args.command == "trace":
        from moeferry.engine.measure.routing import cli_trace
        return cli_trace(args.store, args.text, args.out, args.max_tokens, args.device, args.json)
    if args.command == "bench":
        from moeferry.engine.measure.bench import cli_bench
        return cli_bench(args.rest)
    if args.command == "demo":
        from moeferry.engine.setup.demo import cli_demo
        return cli_demo(args.rest)
    raise UserError(f"Unknown command {args.command}.")


def cmd_convert(args) -> int:
    from moeferry.engine.storage.convert import convert_checkpoint, detect_format
    kind = detect_format(args.src)
    if kind == "paper":
        if args.expert_group_size is not None:
            raise UserError("--expert-group-size applies to Hugging Face checkpoints; the paper's format "
                            "keeps its own groups.")
        from moeferry.engine.storage.paper_format import import_paper_checkpoint
        dest = import_paper_checkpoint(args.src, args.dest, expert_bits=args.expert_bits,
                                       attn_bits=args.attn_bits, tokenizer=args.tokenizer,
                                       progress=ProgressLine())
    else:
        if args.expert_bits is None or args.attn_bits is None:
            raise UserError("convert needs --expert-bits {2,3,4,16} and --attn-bits {4,8,16} "
                            "(16 keeps the source precision).")
        dest = convert_checkpoint(args.src, args.dest, args.expert_bits, args.attn_bits, args.device,
                                  tokenizer=args.tokenizer, progress=ProgressLine(),
                                  expert_group_size=args.expert_group_size,
                                  notice=lambda sentence: print(f"moeferry: {sentence}", file=sys.stderr))
    print(f"Wrote and verified the store {dest}.", file=sys.stderr)
    return 0


def cmd_verify(args) -> int:
    from moeferry.engine.storage.store import verify_store
    bad = verify_store(args.store)
    for line in bad:
        print(f"BAD {line}", file=sys.stderr)
    if bad:
        print(f"moeferry: {len(bad)} file(s) of {args.store} are damaged; convert or download the "
              f"model again.", file=sys.stderr)
        return 1
    print(f"{args.store}: every file matches its manifest.")
    return 0


def check_text(text: str, flag: str) -> None:
    """Command-line text that is not valid UTF-8 arrives with lone surrogates: refuse it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{flag} is not valid UTF-8 text; give it as UTF-8 (check the terminal's "
                        f"encoding).") from None


def encode_prompt(engine, prompt: str, chat: bool) -> list[int]:
    """The prompt's token ids; a chat template that fails (a syntax error, or the sandbox refusing
    what it tries) is one sentence."""
    from jinja2 import TemplateError
    try:
        return engine.encode(prompt, chat)
    except TemplateError as e:
        raise UserError(f"The model's chat template failed ({type(e).__name__}: {str(e)[:120]}); run without "
                        f"--chat, or convert the model again with a sound chat template.") from None


def cmd_generate(args) -> int:
    """Exit 0, or 130 when Ctrl-C stopped the reply (what came so far is printed)."""
    from moeferry.engine.runtime.generate import SamplingSettings, check_sampling, load_engine
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be 1 or more.")
    sampling = SamplingSettings(args.temperature, args.top_p, args.max_new_tokens, args.seed,
                                args.repeat_penalty, args.repeat_last_n, args.no_repeat_ngram)
    check_sampling(sampling)
    check_text(args.prompt, "--prompt")
    engine = load_engine(args.store, device=args.device, dtype=args.dtype,
                         cache_experts=args.cache_experts, vram_budget=args.vram_budget,
                         prefetch=args.prefetch, kernels=args.kernels, cpu_experts=args.cpu_experts,
                         cpu_format=args.cpu_format, cpu_threads=args.cpu_threads, ram_budget=args.ram_budget,
                         expert_units=args.expert_units)
    if engine.note:
        print(f"moeferry: {engine.note}", file=sys.stderr)
    prompt_tokens = len(encode_prompt(engine, args.prompt, args.chat))
    room = engine.max_context - prompt_tokens
    if 0 < room < args.max_new_tokens:
        print(f"moeferry: --max-new-tokens {args.max_new_tokens} is cut to {room}: the prompt's "
              f"{prompt_tokens} tokens leave that much of the model's {engine.max_context}-token "
              f"context.", file=sys.stderr)
    pieces, ids, interrupted = [], [], False
    try:
        for piece in engine.stream(args.prompt, sampling, chat=args.chat):
            pieces.append(piece.text)
            ids.append(piece.token_id)
            if not args.json:
                print(piece.text, end="", flush=True)
    except KeyboardInterrupt:
        interrupted = True
    stats = engine.last_stats
    if args.json:
        print(json.dumps({"text": "".join(pieces), "token_ids": ids, "interrupted": interrupted,
                          "stats": stats.contract()}))
    else:
        print()
        print(f"[{'interrupted after ' if interrupted else ''}{stats.new_tokens} tokens, "
              f"{stats.tokens_per_s:.2f} tokens/s, first token {stats.first_token_s:.2f} s, cache hits "
              f"{stats.cache_hits}/{stats.cache_hits + stats.cache_misses}]", file=sys.stderr)
    if not (interrupted or args.chat) and len("".join(pieces).strip()) < 8 \
            and getattr(engine.tokenizer, "chat_template", None):
        print(f"moeferry: the model stopped after {stats.new_tokens} token(s); it is made for chat: "
              f"add --chat to wrap the prompt in its chat template.", file=sys.stderr)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
