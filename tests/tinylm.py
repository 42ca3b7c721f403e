"""A tiny random causal LM with a word-level tokenizer and a chat template, built offline.

Used by the prepare/eval tests: a real transformers model folder (config.json + weights +
tokenizer), nothing downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["<pad>", "<eos>", "<user>", "<assistant>", "<unk>", "<mask>"]
WORDS = [f"w{i}" for i in range(58)]  # vocab = 64
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<user> ' if m['role'] == 'user' else '<assistant> ' }}{{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}"
)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_target_folder(root: Path, arch: str = "llama", context: int = 256, seed: int = 0) -> Path:
    """A random-weight Llama or Qwen3 (4 layers, hidden 64) + tokenizer saved under root/arch."""
    path = Path(root) / f"tiny-{arch}-{context}"
    if (path / "config.json").exists():
        return path
    tok = tiny_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=context,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=False))
    # Sharpen the output so greedy decoding wanders instead of repeating one token forever.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def words(n: int, start: int = 0) -> str:
    return " ".join(WORDS[(start + 7 * i) % len(WORDS)] for i in range(n))
