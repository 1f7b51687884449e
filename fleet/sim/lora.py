"""LoRA adapters as vLLM 0.32 keeps them: `--lora-modules`, the adapter registry, load and unload.

Each shape here is copied from vLLM 0.32's source (paths below are under site-packages/vllm/); an
adapter lives in the API server's memory only, so a new process knows only the static ones.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass

from fleet.sim.protocol import ApiError


@dataclass
class LoRAModulePath:
    """One adapter: `--lora-modules` item or runtime load (entrypoints/openai/models/protocol.py,
    LoRAModulePath)."""

    name: str
    path: str
    base_model_name: str | None = None
    is_3d_lora_weight: bool = False


def parse_lora_modules(values: list[str]) -> list[LoRAModulePath]:
    """`--lora-modules` items: `name=path`, or vLLM's JSON form `{"name", "path", "base_model_name"}`.

    Raises ValueError with the message vLLM's parser.error prints (entrypoints/launchers/cli_args.py,
    LoRAParserAction).
    """
    modules = []
    for item in values or []:
        if item in (None, ""):
            continue
        if "=" in item and "," not in item:  # the old form, name=path
            name, path = item.split("=", 1)
            modules.append(LoRAModulePath(name, path))
            continue
        try:
            modules.append(LoRAModulePath(**json.loads(item)))
        except json.JSONDecodeError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        except TypeError as e:
            raise ValueError(f"Invalid fields for --lora-modules: {item} - {e}") from None
    return modules


def not_found(name: str, path: str) -> ApiError:
    """vLLM's LoRAAdapterNotFoundError (exceptions.py) through create_error_response: 404, no param."""
    return ApiError(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")


def permission() -> dict:
    """A ModelPermission as vLLM 0.32 lists it (entrypoints/serve/engine/protocol.py)."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": int(time.time()),
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}


class Adapters:
    """The adapters an engine serves, in load order (vLLM's OpenAIServingModels.lora_requests,
    entrypoints/openai/models/serving.py)."""

    def __init__(self, served_names: list[str], enabled: bool, max_lora_rank: int):
        self.served_names = served_names
        self.enabled = enabled
        self.max_lora_rank = max_lora_rank
        self.loaded: dict[str, LoRAModulePath] = {}

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and name in self.loaded

    def load(self, name, path, load_inplace: bool = False, base_model_name: str | None = None) -> str:
        """Load an adapter; vLLM's success text, or ApiError with its status and body
        (_check_load_lora_adapter_request, then the engine's add_lora)."""
        if not name or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in self.served_names:
            raise ApiError(400, f"The lora adapter '{name}' conflicts with a served base model.",
                           "InvalidUserInput")
        if not load_inplace and name in self.loaded:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded. If you want to load "
                                "the adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        self._engine_add(name, path)
        # --max-loras is not checked here: vLLM's LRU cache (lora/worker_manager.py,
        # LRUCacheWorkerLoRAManager) evicts the least recently used adapter instead of refusing.
        base = base_model_name if base_model_name in self.served_names else None
        self.loaded[name] = LoRAModulePath(name, path, base)
        return f"Success: LoRA adapter '{name}' added successfully."

    def _engine_add(self, name: str, path: str) -> None:
        """What the engine core's add_lora refuses. Its failures come back to the API server as
        "Call to add_lora method failed: ..." (v1/engine/core.py); a missing adapter is recognised and
        answered 404 (LoRAAdapterNotFoundError), anything else 500."""
        if not self.enabled:  # v1/worker/lora_model_runner_mixin.py, _ensure_lora_enabled
            raise ApiError(500, "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to "
                                "enable LoRA.", "InternalServerError")
        full = os.path.expanduser(path)
        if not os.path.isdir(full):  # PEFTHelper.from_local_dir finds no adapter_config.json
            raise not_found(name, path)
        try:
            with open(os.path.join(full, "adapter_config.json")) as f:
                rank = int(json.load(f).get("r", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            return  # the sim takes any directory as an adapter; only a readable config's rank is checked
        if rank > self.max_lora_rank:  # lora/peft_helper.py, validate_legal
            raise ApiError(500, f"Call to add_lora method failed: LoRA rank {rank} is greater than "
                                f"max_lora_rank {self.max_lora_rank}.", "InternalServerError")

    def unload(self, name) -> str:
        """Forget an adapter (static ones too); vLLM's success text, or ApiError."""
        if not name:
            raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if name not in self.loaded:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.loaded[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def model_cards(self) -> list[dict]:
        """The adapters' /v1/models entries (OpenAIServingModels.show_available_models)."""
        return [{"id": a.name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                 "root": a.path, "parent": a.base_model_name or self.served_names[0], "max_model_len": None,
                 "permission": [permission()]} for a in self.loaded.values()]
