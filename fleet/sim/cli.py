"""The command line: `serve` (vllm serve's flags, the unknown ones accepted and ignored) and `smi`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from fleet.sim import devices
from fleet.sim.config import settle


def parser() -> argparse.ArgumentParser:
    """The `python -m fleet.sim` argument parser."""
    top = argparse.ArgumentParser(prog="python -m fleet.sim",
                                  description="A simulated vLLM engine and its accelerator's smi.")
    sub = top.add_subparsers(dest="command", required=True)

    # allow_abbrev off: an unknown vllm flag must never be taken for a prefix of one of ours.
    serve = sub.add_parser("serve", allow_abbrev=False, help="serve a model like `vllm serve`",
                           description="Serve MODEL like `vllm serve`. Other vllm serve flags are accepted "
                                       "and ignored. Timing flags override FLEET_SIM_* variables.")
    serve.add_argument("model", nargs="?", help="the model (also --model)")
    serve.add_argument("--model", dest="model_flag", help=argparse.SUPPRESS)
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-num-seqs", type=int, default=256)
    serve.add_argument("--max-model-len", type=int, default=32768)
    serve.add_argument("--served-model-name", nargs="+",
                       help="names served (default: MODEL); answers carry the first")
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="cards the engine holds: the first N visible ones")
    serve.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    serve.add_argument("--lora-modules", nargs="+",
                       help='static adapters: name=path or {"name": ..., "path": ..., "base_model_name": ...}')
    serve.add_argument("--max-loras", type=int, default=1, help="adapters in one batch (accepted; vLLM evicts)")
    serve.add_argument("--max-lora-rank", type=int, default=16,
                       help="highest adapter rank (checked against an adapter_config.json's r)")
    serve.add_argument("--block-size", type=int,
                       help="tokens per KV cache block (vLLM's default: 16; its CPU build uses 128)")
    serve.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int,
                       help="the engine step's token budget, shared by decodes and prefill chunks (vLLM's "
                            "flag; FLEET_SIM_MAX_NUM_BATCHED_TOKENS; default 0: each request's prefill paid on "
                            "its own, the sim's older model)")
    serve.add_argument("--enforce-eager", action="store_true", help="accepted; no effect")
    serve.add_argument("--stream-interval", type=int, default=1,
                       help="tokens a streamed event carries, as vLLM's flag (the last event may carry fewer)")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage carries prompt_tokens_details.cached_tokens, as vLLM's flag does")
    serve.add_argument("--sim-load-s", dest="load_s", type=float,
                       help="'loading weights' delay, /health 503 meanwhile (FLEET_SIM_LOAD_S, 3.0)")
    serve.add_argument("--sim-overhead-ms", dest="overhead_ms", type=float,
                       help="time to first token of every request, before prefill (FLEET_SIM_OVERHEAD_MS, 20)")
    serve.add_argument("--sim-prefill-ms", dest="prefill_ms", type=float,
                       help="prefill time per 1,000 prompt tokens not in the prefix cache "
                            "(FLEET_SIM_PREFILL_MS, 100)")
    serve.add_argument("--sim-token-ms", dest="token_ms", type=float,
                       help="time per output token (FLEET_SIM_TOKEN_MS, 10)")
    serve.add_argument("--sim-kv-blocks", dest="kv_blocks", type=int,
                       help="prefix cache size in blocks of --block-size tokens (FLEET_SIM_KV_BLOCKS, 16384)")
    serve.add_argument("--sim-output-tokens", dest="output_tokens", type=int,
                       help="natural answer length in tokens (FLEET_SIM_OUTPUT_TOKENS, 200)")
    serve.add_argument("--sim-after-engine-death", dest="after_engine_death", choices=("exit", "stay"),
                       help="once the engine core died: exit like vLLM 0.32 (default) or stay up with "
                            "/health 503 like vLLM 0.11 (FLEET_SIM_AFTER_ENGINE_DEATH)")
    serve.add_argument("--sim-exit-delay-s", dest="exit_delay_s", type=float,
                       help="how long the API server lives on after its engine died, in exit mode "
                            "(FLEET_SIM_EXIT_DELAY_S, 4)")
    serve.add_argument("--sim-instant", dest="instant", action="store_true",
                       help="no load, overhead, prefill or token time (FLEET_SIM_INSTANT=1)")
    serve.add_argument("--sim-log-bytes", dest="log_bytes", type=int,
                       help="write about this many bytes of numbered log lines to standard output per "
                            "request, like an engine logging at debug level (FLEET_SIM_LOG_BYTES, 0)")
    serve.add_argument("--sim-fail-start", dest="fail_start", action="store_true",
                       help="exit at once with an engine start-up error (a crash loop on demand)")

    smi = sub.add_parser("smi", help="print `hy-smi --showmeminfo vram` for the sim's cards")
    smi.add_argument("--dev-dir", help="device directory (FLEET_SIM_DEV_DIR, ./sim-dev)")
    smi.add_argument("--showuse", action="store_true", help="also print HCU use (%%)")
    return top


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The parsed arguments and the ones ignored (vllm serve flags the sim has no use for)."""
    args, ignored = parser().parse_known_args(argv)
    if args.command != "serve" and ignored:
        parser().error(f"unrecognized arguments: {' '.join(ignored)}")
    if args.command == "serve":
        args.model = args.model or args.model_flag
        if not args.model:
            parser().error("serve: MODEL is required")
    return args, ignored


def main(argv: list[str] | None = None) -> int:
    args, ignored = parse(sys.argv[1:] if argv is None else argv)
    if args.command == "smi":
        return smi(args.dev_dir, args.showuse)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if ignored:
        logging.getLogger("fleet.sim").info("ignored vllm serve arguments: %s", " ".join(ignored))
    if args.fail_start:
        logging.getLogger("fleet.sim").error("RuntimeError: Engine core initialization failed (--sim-fail-start)")
        return 1
    try:
        config = settle(vars(args))
    except ValueError as e:
        parser().error(str(e))
    failure = config.startup_error()
    if failure:  # vLLM ends with a traceback whose last line is this, exit code 1
        logging.getLogger("fleet.sim").error("%s", failure)
        return 1
    return asyncio.run(_serve(config))


async def _serve(config) -> int:
    from fleet.sim.server import serve  # aiohttp only where it is needed: smi runs without it
    return await serve(config)


def smi(dev_dir: str | None, show_use: bool) -> int:
    """Print the smi report; 1 when DEV_DIR holds no renderD files."""
    d = dev_dir or devices.default_dev_dir()
    if not devices.cards(d):
        print(f"smi: no sim devices (renderD*) found in {d}", file=sys.stderr)
        return 1
    sys.stdout.write(devices.smi_report(d, show_use))
    return 0
