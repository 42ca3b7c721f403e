"""Random-weight targets and synthetic Arrow datasets, built offline for tests, benches and smoke runs.

    from dflash.data.synthetic import target_config, write_pattern_dataset, write_target
    target = write_target(root / "tiny", target_config(vocab_size=128))  # 4 layers, hidden 64
    data = write_pattern_dataset(root / "data")                           # learnable from context

Targets: `target_config` gives the config.json fields of a shape (a tiny Qwen3 or Llama unless
fields override it; a real-size shape by giving its fields). `write_target` saves random weights
drawn right after ``torch.manual_seed(seed)``, so the same fields and seed give bit-identical
weights; optionally it adds the word-level tokenizer and chat template, or writes config.json
alone for ``load_target(..., random_init=True)`` to build a real-size model on the device.

Datasets: `write_pattern_dataset` writes sequences a drafter can learn from context;
`write_random_dataset` writes random tokens of a given sample count and length mix, for speed
and memory measurements (the work per step depends on shapes, not on token values).

Every writer records what it wrote in ``synthetic.json`` and reuses a folder whose record
matches. torch and transformers are imported only where weights are built.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np

from dflash.data.shards import write_shard, write_shard_arrays

RECORD = "synthetic.json"

# The causal-LM class of each model_type a synthetic target can have.
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
# Qwen3.5-family hybrids (Gated DeltaNet + gated full attention): the text-only model, and the
# published vision-language wrapper whose text weights sit under model.language_model.*.
HYBRID_ARCHITECTURES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration"}

# The tiny shape: 4 layers, hidden 64, 4 query heads / 2 KV heads of 16, untied lm_head, 512 positions.
TINY_SHAPE = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}  # fmt: skip

# The word-level tokenizer: 6 special tokens, then 58 words "w0".."w57" (vocabulary 64).
SPECIAL_TOKENS = ["<pad>", "<eos>", "<user>", "<assistant>", "<unk>", "<mask>"]
WORDS = [f"w{i}" for i in range(58)]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<user> ' if m['role'] == 'user' else '<assistant> ' }}{{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}"
)
# config.json fields of a target that uses the word-level tokenizer.
WORD_TOKENIZER_IDS = {"vocab_size": len(SPECIAL_TOKENS) + len(WORDS), "pad_token_id": 0, "eos_token_id": 1,
                      "bos_token_id": None}

# The pattern data: token ids PATTERN_FIRST .. PATTERN_FIRST + PATTERN_TOKENS - 1.
PATTERN_FIRST, PATTERN_TOKENS = 10, 12


# ---------------------------------------------------------------------------------------------
# Targets


def target_config(model_type: str = "qwen3", **fields) -> dict:
    """config.json fields of a target: TINY_SHAPE, then `fields` (any HF config field) on top."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r}: synthetic targets are one of {sorted(ARCHITECTURES)}")
    return {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type, **TINY_SHAPE, **fields}


def hybrid_target_config(wrapper: bool = False, **fields) -> dict:
    """config.json fields of a tiny Qwen3.5-family hybrid: TINY_SHAPE with 3 of 4 layers Gated DeltaNet.

    wrapper=True nests them as the published vision-language checkpoint does (text_config, plus a
    tiny vision tower that loading the target must never build); `fields` go into the text config.
    """
    text = {"model_type": "qwen3_5_text", **TINY_SHAPE, **TINY_LINEAR_ATTENTION, **fields}
    n = text["num_hidden_layers"]
    text.setdefault("layer_types", ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)])
    if not wrapper:
        return {"architectures": [HYBRID_ARCHITECTURES["qwen3_5_text"]], **text}
    return {"architectures": [HYBRID_ARCHITECTURES["qwen3_5"]], "model_type": "qwen3_5", "text_config": text,
            "vision_config": dict(TINY_VISION), "tie_word_embeddings": text["tie_word_embeddings"]}


# Gated DeltaNet sizes of the tiny hybrid: 2 key heads / 4 value heads of 16, conv kernel 4.
TINY_LINEAR_ATTENTION = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                         "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
# The tiny wrapper's vision tower: one block of width 32 (present on disk, never loaded as a target).
TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
               "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2}


def random_target(config: dict, seed: int = 0, head_scale: float = 1.0):
    """The causal LM of `config` in memory, weights drawn right after torch.manual_seed(seed).

    head_scale multiplies the lm_head weight: a sharper output makes greedy decoding wander over
    the vocabulary instead of repeating one token. A hybrid's linear-attention layers get the path of
    the device it is built on (dflash.models.target.bind_linear_attention).
    """
    import torch
    import transformers
    from transformers import AutoConfig

    from dflash.models.target import bind_linear_attention

    fields = dict(config)
    model_type = fields.pop("model_type")
    model_class = getattr(transformers, {**ARCHITECTURES, **HYBRID_ARCHITECTURES}[model_type])
    hf_config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = model_class(hf_config)
    if head_scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(head_scale)
    return bind_linear_attention(model, model.get_output_embeddings().weight.device)


def word_tokenizer():
    """A word-level tokenizer over SPECIAL_TOKENS + WORDS (split on whitespace) with CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def word_text(n: int, start: int = 0) -> str:
    """n words of the word-level vocabulary, a fixed walk through it from `start`."""
    return " ".join(WORDS[(start + 7 * i) % len(WORDS)] for i in range(n))


def write_target(path: str | Path, config: dict, *, seed: int = 0, weights: bool = True, tokenizer: bool = False,
                 head_scale: float = 1.0) -> Path:
    """A Hugging Face model folder for `config`: random weights (see random_target) and config.json.

    weights=False writes config.json alone (``load_target(random_init=True)`` builds the model
    from it on the device: the way to get real-size targets). tokenizer=True adds the word-level
    tokenizer; the config must then carry WORD_TOKENIZER_IDS.
    """
    path = Path(path)
    record = {"target": config, "seed": seed, "weights": weights, "tokenizer": tokenizer, "head_scale": head_scale}
    if _recorded(path, record):
        return path
    if tokenizer and any(config.get(k, "unset") != v for k, v in WORD_TOKENIZER_IDS.items()):
        raise ValueError(f"a target with the word-level tokenizer needs its ids in the config: {WORD_TOKENIZER_IDS}")
    _clear(path)
    if weights:
        random_target(config, seed, head_scale).save_pretrained(path)
    else:
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer:
        word_tokenizer().save_pretrained(path)
    _record(path, record)
    return path


# ---------------------------------------------------------------------------------------------
# Datasets


def write_pattern_dataset(path: str | Path, samples: int = 64, seed: int = 0, shards: int = 2) -> Path:
    """Rows of 24..63 tokens over PATTERN_TOKENS ids with x[i+1] = x[i] + step (mod PATTERN_TOKENS).

    The step (1, 2, 3 or 5) and the start vary per row, so the next tokens are learnable from the
    context. loss_mask is 0 on the first third of each row (the "prompt"), 1 after.
    """
    path = Path(path)
    record = {"dataset": "pattern", "samples": samples, "seed": seed, "shards": shards}
    if _recorded(path, record):
        return path
    _clear(path)
    rng = np.random.default_rng(seed)
    rows_ids, rows_mask = [], []
    for _ in range(samples):
        n = int(rng.integers(24, 64))
        step = int(rng.choice([1, 2, 3, 5]))
        start = int(rng.integers(0, PATTERN_TOKENS))
        ids = [PATTERN_FIRST + (start + step * i) % PATTERN_TOKENS for i in range(n)]
        prompt = n // 3
        rows_ids.append(ids)
        rows_mask.append([0] * prompt + [1] * (n - prompt))
    per = -(-samples // shards)
    path.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        write_shard(path / _shard_name(s), rows_ids[s * per:(s + 1) * per], rows_mask[s * per:(s + 1) * per])
    _record(path, record)
    return path


def write_random_dataset(path: str | Path, samples: int, length: int, vocab: int, *, sigma: float = 0.0,
                         max_length: int | None = None, prompt_share: float = 0.1, seed: int = 0,
                         per_shard: int = 50_000) -> Path:
    """`samples` rows of random token ids in [1, vocab - 1), per_shard rows to a shard.

    Lengths: every row `length` tokens when sigma is 0; else lognormal with mean `length` and this
    sigma (of the log), clipped to [16, max_length] (no upper cap when None). loss_mask is 0 on
    the first prompt_share of each row (the "prompt"), 1 after.
    """
    if samples < 1 or length < 1 or vocab < 3 or per_shard < 1 or not 0 <= prompt_share < 1:
        raise ValueError(f"need samples >= 1, length >= 1, vocab >= 3, per_shard >= 1, 0 <= prompt_share < 1; got "
                         f"{samples}, {length}, {vocab}, {per_shard}, {prompt_share}")
    path = Path(path)
    record = {"dataset": "random", "samples": samples, "length": length, "vocab": vocab, "sigma": sigma,
              "max_length": max_length, "prompt_share": prompt_share, "seed": seed, "per_shard": per_shard}
    if _recorded(path, record):
        return path
    _clear(path)
    rng = np.random.default_rng(seed)
    mu = math.log(length) - sigma**2 / 2  # lognormal mean = exp(mu + sigma^2 / 2)
    for s, first in enumerate(range(0, samples, per_shard)):
        n = min(per_shard, samples - first)
        if sigma > 0:
            lengths = np.clip(rng.lognormal(mu, sigma, size=n), 16, max_length).astype(np.int64)
        else:
            lengths = np.full(n, length, dtype=np.int64)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = rng.integers(1, vocab - 1, size=int(offsets[-1]), dtype=np.int32)
        position = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], lengths)
        prompt = (lengths * prompt_share).astype(np.int64)
        mask = (position >= np.repeat(prompt, lengths)).astype(np.int8)
        del position
        write_shard_arrays(path / _shard_name(s), offsets, ids, mask)
    _record(path, record)
    return path


# ---------------------------------------------------------------------------------------------
# The record of what a folder holds


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


def _recorded(path: Path, record: dict) -> bool:
    """Whether `path` holds what `record` describes (written by this module with the same arguments)."""
    try:
        return json.loads((path / RECORD).read_text()) == json.loads(json.dumps(record))
    except (OSError, ValueError):
        return False


def _clear(path: Path) -> None:
    """Empty a folder this module wrote before; refuse to touch anything else."""
    if path.is_dir() and any(path.iterdir()):
        if not (path / RECORD).is_file():
            raise ValueError(
                f"{path}: not empty and not written by dflash.data.synthetic; pick an empty folder or delete it"
            )
        shutil.rmtree(path)


def _record(path: Path, record: dict) -> None:
    (path / RECORD).write_text(json.dumps(record, indent=2) + "\n")
