"""Make a LoRA adapter for a model made by make_tiny_model.py, in the peft layout vLLM loads
(adapter_config.json + adapter_model.safetensors), with no peft installed: rank-8 A and B matrices for
every layer's q_proj and v_proj, B non-zero so that the adapter really changes the answers. Run with the
engine's Python (torch and safetensors come with vLLM):

    ~/.cache/vllm-fleet/vllm-cpu/bin/python tests/data/make_tiny_lora.py MODEL_DIR OUT_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

RANK = 8


def main(model_dir: str, out: str) -> None:
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = hidden // heads
    out_dims = {"q_proj": heads * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    torch.manual_seed(1)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, out_dim in out_dims.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, hidden) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_dim, RANK) * 0.1
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
        "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": sorted(out_dims), "modules_to_save": None}, indent=2))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: make_tiny_lora.py MODEL_DIR OUT_DIR")
    main(sys.argv[1], sys.argv[2])
