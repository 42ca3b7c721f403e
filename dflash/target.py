"""The frozen target: loading it, and pulling out only the hidden states the drafter reads.

The feature of target layer l is the output of decoder layer l (hidden_states[l + 1] of a
Hugging Face `output_hidden_states=True` forward). `target_features` runs the decoder only as
far as the deepest selected layer unless the last hidden state is wanted (soft labels), and
never computes logits over the sequence.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

# The one map from a config's dtype name (target.dtype) to the torch dtype.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a name in DTYPES (a torch dtype passes through); ValueError names the allowed ones."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"target dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def target_text_config(path: str | Path):
    """The target's language-model HF config: a vision-language wrapper's text_config, else the config itself."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).get_text_config()


def load_target(
    path_or_name: str | Path, dtype: str | torch.dtype, device: str | torch.device, random_init: bool = False
) -> nn.Module:
    """An HF causal LM from a folder, frozen and in eval mode; random_init builds it on the device from config.json.

    A vision-language wrapper folder (Qwen3.5/3.6: config.json with text_config, text weights under
    model.language_model.*) loads as its causal LM alone: transformers maps the wrapper's config to
    the text model's class and its weight names onto it, and never builds the vision tower.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path_or_name)
    if not (path / "config.json").is_file():
        raise ValueError(f"target {str(path_or_name)!r}: no config.json there (expected a Hugging Face model folder)")
    dtype, device = torch_dtype(dtype), torch.device(device)
    if random_init:
        config = AutoConfig.from_pretrained(path)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": device})
    if any(name.startswith(("visual.", "model.visual.")) for name, _ in model.named_parameters()):
        raise ValueError(f"target {str(path_or_name)!r}: transformers built a vision tower ({type(model).__name__}); "
                         "upgrade transformers to a version that loads this model as a causal LM alone")
    return freeze(model)


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack (`model.model` for *ForCausalLM) holding `.layers` and `.norm`."""
    decoder = getattr(model, "model", model)
    if not hasattr(decoder, "layers"):
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (expected model.model.layers)")
    return decoder


class _StopForward(Exception):
    pass


def _layer_output(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def target_features(
    model: nn.Module,
    input_ids_BS: torch.Tensor,
    attention_mask_BS: torch.Tensor | None,
    layer_ids: list[int],
    want_last: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(context [B, S, n*H] = selected layer outputs concatenated, last hidden [B, S, H] after the final norm or None)."""
    decoder = decoder_of(model)
    layers = decoder.layers
    num_layers = len(layers)
    if not layer_ids or any(not 0 <= i < num_layers for i in layer_ids):
        raise ValueError(f"target layer ids {layer_ids} must be within [0, {num_layers - 1}]")
    deepest = max(layer_ids)
    captured: dict[int, torch.Tensor] = {}

    def capture(index):
        def hook(_module, _args, output):
            captured[index] = _layer_output(output)
            if index == deepest and not want_last:
                raise _StopForward

        return hook

    handles = [layers[i].register_forward_hook(capture(i)) for i in sorted(set(layer_ids))]
    last_BSH = None
    try:
        out = decoder(input_ids=input_ids_BS, attention_mask=attention_mask_BS, use_cache=False)
        last_BSH = out.last_hidden_state
    except _StopForward:
        pass
    finally:
        for h in handles:
            h.remove()
    feats = [captured[i] for i in layer_ids]
    if deepest == num_layers - 1:
        # HF reports the last layer's output after the final norm; match it.
        feats = [decoder.norm(f) if i == num_layers - 1 else f for i, f in zip(layer_ids, feats)]
    return torch.cat(feats, dim=-1), last_BSH


def target_embed_and_head(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding weight [V, H], lm_head weight [V, H]), detached: the drafter uses them frozen."""
    embed = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head)")
    return embed, head.weight.detach()
