"""The frozen target: loading it, and pulling out only the hidden states the drafter reads.

The feature of target layer l is the output of decoder layer l (hidden_states[l + 1] of a
Hugging Face `output_hidden_states=True` forward). `target_features` runs the decoder only as
far as the deepest selected layer unless the last hidden state is wanted (soft labels), and
never computes logits over the sequence.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import logging
import pickle
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import CellType, FunctionType, MethodType, ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from dflash.config import resolve_target_dir
from dflash.errors import DflashError
from dflash.models.custom_code import custom_code_problem
from dflash.models.weights import RANDOM_INIT_FLAG, WEIGHT_FILES


class _TorchaoExtensionNote(logging.Filter):
    """Drops torchao's import-time note that it skips its C++ extensions (built for torch 2.11) on torch 2.10: its
    float8 linear (target.precision = "fp8") does not use them, and transformers imports torchao at every model load
    once it is installed, so every command would print it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Skipping import of cpp extensions")


logging.getLogger("torchao").addFilter(_TorchaoExtensionNote())

# The one map from a config's dtype name (target.dtype) to the torch dtype.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a name in DTYPES (a torch dtype passes through); ValueError names the allowed ones."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"target dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class TargetError(DflashError):
    """A target folder that cannot be loaded as asked; one line with the fix."""

    exit_code = 2


# ---------------------------------------------------------------------------------------------
# The target folder. Every load of its config, tokenizer and weights goes through the functions below, and none
# runs code the folder carries: trust_remote_code=False on every call, and a folder that would need its own code
# is refused before transformers is asked (transformers' own question about it reads stdin).



def _short(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _folder_json(folder: Path, name: str, required: bool) -> dict | None:
    """A JSON object file of the target folder; None when absent and not required; TargetError when unusable."""
    file = folder / name
    if not required and not file.exists():
        return None
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TargetError(f"target {folder}: no {name} there (expected a Hugging Face model folder); give the model's "
                          "folder") from None
    except OSError as e:
        raise TargetError(f"target {file}: cannot read it ({e.strerror}); check the path and its permissions") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError both
        raise TargetError(f"target {file}: not valid JSON ({_short(e, 120)}); restore it from the model's source") from None
    if not isinstance(raw, dict):
        raise TargetError(f"target {file}: not a JSON object; restore it from the model's source")
    return raw


def refuse_custom_code(folder: str | Path) -> Path:
    """The folder, checked to load with classes transformers ships; TargetError (one line) when it needs its own code.

    The rule is dflash.models.custom_code's (preflight asks the same one without importing transformers); here it
    is asked with transformers' own maps. That is refused, never asked about.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    folder = Path(folder)
    config = _folder_json(folder, "config.json", required=True)
    tokenizer = _folder_json(folder, "tokenizer_config.json", required=False)
    problem = custom_code_problem(folder, config, tokenizer, f"transformers {transformers.__version__}",
                                  CONFIG_MAPPING_NAMES.__contains__, lambda name: tokenizer_class_from_name(name) is not None)
    if problem:
        raise TargetError(problem)
    return folder


def load_target_config(path: str | Path):
    """The target's HF config (AutoConfig with transformers' own classes only); TargetError when it cannot load."""
    from transformers import AutoConfig

    folder = refuse_custom_code(resolve_target_dir(str(path)))
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TargetError(f"target {folder}: its config.json does not load ({_short(e)}); restore it from the model's "
                          "source") from None


def target_text_config(path: str | Path):
    """The target's language-model HF config: a vision-language wrapper's text_config, else the config itself."""
    return load_target_config(path).get_text_config()


def load_target_tokenizer(path: str | Path):
    """The target folder's tokenizer (transformers' own classes only); TargetError when it has none or it cannot load."""
    from transformers import AutoTokenizer

    folder = refuse_custom_code(resolve_target_dir(str(path)))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TargetError(f"target {folder}: cannot load its tokenizer ({_short(e)}); give a Hugging Face model folder "
                          "with tokenizer files") from None
    if len(tokenizer) < 2:  # transformers builds an empty tokenizer when the folder has no tokenizer files
        raise TargetError(f"target {folder}: its tokenizer has no vocabulary (tokenizer files missing); give a Hugging "
                          "Face model folder with tokenizer files")
    return tokenizer


def weight_files(folder: Path) -> list[Path]:
    """The files transformers will read `folder`'s weights from, each checked to be a readable file (a safetensors
    one also complete: header and size); TargetError names the first that is not."""
    from safetensors import SafetensorError, safe_open

    first = next((folder / name for name in WEIGHT_FILES if (folder / name).exists()), None)
    if first is None:
        raise TargetError(f"target {folder}: no weights there ({' or '.join(WEIGHT_FILES[1::2])}); copy the model's "
                          f"weights into the folder (for memory and speed measurements on its shapes alone: "
                          f"{RANDOM_INIT_FLAG})")
    files = [first]
    if first.name.endswith(".index.json"):
        weight_map = _folder_json(folder, first.name, required=True).get("weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))] if isinstance(weight_map, dict) else []
        if not files or not all(isinstance(f, Path) and f.parent == folder for f in files):
            raise TargetError(f"target {first}: no usable weight_map; restore it from the model's source")
    for file in files:
        if not file.is_file():
            what = "a directory where the weights file should be" if file.is_dir() else "missing"
            raise TargetError(f"target {file}: {what}; copy the model's weights into the folder again")
        try:
            with open(file, "rb") as f:
                f.read(1)
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="numpy") as f:
                    f.keys()
        except OSError as e:
            raise TargetError(f"target {file}: cannot read it ({e.strerror}); check its permissions") from None
        except SafetensorError as e:
            raise TargetError(f"target {file}: not a complete safetensors file ({_short(e)}); copy the model's weights "
                              "again") from None
    return files


def load_target(
    path_or_name: str | Path, dtype: str | torch.dtype, device: str | torch.device, random_init: bool = False,
    precision: str = "bf16", log=None,
) -> nn.Module:
    """An HF causal LM from a folder, frozen and in eval mode; random_init builds it on the device from config.json.

    precision "fp8" (target.precision): the model loads on the CPU, then each decoder linear large enough is
    quantised to e4m3 onto the device in turn (dflash.models.target_fp8), so the device never holds the
    target.dtype model and its fp8 copy at once; `log` gets one line saying how many. With random_init (shapes for
    measurements) it is built on the device one decoder layer at a time, each layer quantised before the next
    exists (`build_random`; on the CPU, torch's random init of a 27B model takes many minutes).

    A vision-language wrapper folder (Qwen3.5/3.6: config.json with text_config, text weights under
    model.language_model.*) loads as its causal LM alone: transformers maps the wrapper's config to
    the text model's class and its weight names onto it, and never builds the vision tower.
    A pickled pytorch_model.bin loads with torch's weights_only (tensors only); one that holds anything else, and
    any unreadable weights file, is a TargetError naming the file.
    """
    from transformers import AutoModelForCausalLM

    path = resolve_target_dir(str(path_or_name))  # the rule preflight and the memory model apply
    config = load_target_config(path)  # refuses a folder that needs its own code
    dtype, device = torch_dtype(dtype), torch.device(device)
    if precision not in ("bf16", "fp8"):
        raise TargetError(f"target.precision must be one of ['bf16', 'fp8'], got {precision!r}")
    final, fp8 = device, precision == "fp8"
    if fp8:
        from dflash.models.target_fp8 import fp8_problem

        problem = fp8_problem(device)  # before minutes of loading
        if problem:
            raise TargetError(problem)
        if not random_init:  # real weights: the device never holds the dtype model beside its fp8 copy
            device = torch.device("cpu")
    count = None  # decoder linears in fp8, once quantised
    if random_init and fp8:
        model, count = build_random(config, dtype, device, fp8=True)
    elif random_init:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        files = weight_files(path)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, device_map={"": device},
                                                         trust_remote_code=False)
        except pickle.UnpicklingError as e:  # torch.load(weights_only=True) met more than tensors
            raise TargetError(f"target {_named(files)}: holds more than tensors, refused by torch's weights_only load "
                              f"({_short(e, 120)}); use the model's safetensors weights") from None
        except (OSError, EOFError, RuntimeError) as e:
            raise TargetError(f"target {_named(files)}: the weights do not load ({_short(e)}); copy the model's "
                              "weights again") from None
    if any(name.startswith(("visual.", "model.visual.")) for name, _ in model.named_parameters()):
        raise TargetError(f"target {str(path_or_name)!r}: transformers built a vision tower ({type(model).__name__}); "
                         "upgrade transformers to a version that loads this model as a causal LM alone")
    if fp8:
        from dflash.models.target_fp8 import quantize_target

        if count is None:
            count = quantize_target(freeze(model), decoder_of(model).layers, final)
        named = str(dtype).removeprefix("torch.")
        if log is not None and count:
            log(f"target: {count} decoder linears in fp8 (e4m3, per-row scales"
                f"{'' if final.type == 'cuda' else ', emulated in float32 on ' + final.type}), the rest in {named}")
        elif log is not None:
            from dflash.models.target_fp8 import MIN_FEATURES

            log(f"target: target.precision = \"fp8\" but no decoder linear has in and out features >= {MIN_FEATURES:,}; "
                f"the whole target runs in {named}")
    model = freeze(bind_linear_attention(model, final))
    if final.type == "cuda" and fla_installed():  # fla's kept autotuning choices for this GPU, before its first call
        from dflash.models.fla_tuning import use_kept

        use_kept(torch.cuda.get_device_name(final), log or (lambda *_: None))
    return model


def build_random(config, dtype: torch.dtype, device: torch.device, fp8: bool) -> tuple[nn.Module, int]:
    """(model, linears in fp8): random weights at `config`'s shapes built one module at a time. The model is made on
    the meta device; each module outside the decoder layers, then each layer in order, gets storage on `device` and
    transformers' own init (norms, rotary buffers, a Gated DeltaNet's A_log), and with fp8 each layer's large
    linears are quantised as soon as it exists: the device holds the finished part and one layer in dtype, never
    the whole dtype model. The same seed gives the same weights with fp8 on or off (bench/target_rate.py's
    --vs-bf16 builds its reference so). A head tied to the embedding gets no storage of its own."""
    from transformers import AutoModelForCausalLM

    from dflash.models.target_fp8 import quantize_linears

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = (head is not None and embed is not None and head.weight is embed.weight  # the embedding's storage serves
            and len(list(head.parameters(recurse=False))) == 1)  # a head with a bias gets storage of its own
    layers = decoder_of(model).layers
    in_layers = {id(m) for m in layers.modules()} | ({id(head)} if tied else set())

    def materialise(module: nn.Module) -> None:
        module.to_empty(device=device, recurse=False)
        model._init_weights(module)

    count = 0
    with torch.no_grad():
        for module in model.modules():
            if id(module) not in in_layers:
                materialise(module)
        for layer in layers:
            for module in layer.modules():
                materialise(module)
            count += quantize_linears(layer, device) if fp8 else 0
    model.tie_weights()
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"build_random left tensors without storage: {left[:3]}"
    return model, count


def _named(files: list[Path]) -> str:
    return str(files[0]) if len(files) == 1 else f"{files[0].parent} ({', '.join(f.name for f in files)})"


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


# ---------------------------------------------------------------------------------------------
# Linear-attention kernels (Gated DeltaNet layers of Qwen3.5-family hybrid targets)

# The functions a Gated DeltaNet layer's forward calls by module-global name. transformers decorates each
# with `use_kernel_func_from_hub_with_fallback` (integrations/hub_kernels.py), which imports the kernel
# package when the modeling module is imported (fla: chunk_gated_delta_rule, fused_recurrent_gated_delta_rule;
# causal_conv1d: causal_conv1d_fn, causal_conv1d_update) and binds the name to it for every device, else to
# the PyTorch reference it wraps (reachable as the wrapper's __wrapped__).
DELTA_RULES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
KERNEL_FUNCTIONS = (*DELTA_RULES, "causal_conv1d_fn", "causal_conv1d_update")


def linear_attention_path(device_type: str, fla_installed: bool) -> str:
    """'fla' (its Triton kernels) for a target on CUDA when fla is installed, else 'torch' (transformers' reference).

    Triton needs a GPU driver: on a CPU (or any non-CUDA) target fla's kernels fail at the first forward
    ("0 active drivers"), so the target keeps transformers' PyTorch Gated DeltaNet there.
    """
    return "fla" if device_type == "cuda" and fla_installed else "torch"


def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def bind_linear_attention(model: nn.Module, device: str | torch.device) -> nn.Module:
    """Give `model`'s linear-attention layers the PyTorch path unless linear_attention_path picks fla for `device`.

    transformers binds the Gated DeltaNet's kernels once per process, at import, for every device (see
    KERNEL_FUNCTIONS), so with fla installed a CPU target would run Triton. The seam is per loaded model:
    each such layer gets its own forward whose kernel names resolve to the PyTorch references; transformers'
    module, the class and every other model in the process are left as they are. A target keeps the path it
    was loaded with: load it on the device it runs on.
    """
    if linear_attention_path(torch.device(device).type, fla_installed()) == "torch":
        return use_torch_linear_attention(model)
    for module in model.modules():
        if linear_attention_kernels(module):  # fla's kernels, reading a packed batch's boundaries
            module.forward = MethodType(_packed_forward(type(module)), module)
    return model


def use_torch_linear_attention(model: nn.Module) -> nn.Module:
    """Bind every linear-attention layer of `model` (a layer whose forward calls KERNEL_FUNCTIONS) to the PyTorch path."""
    for module in model.modules():
        if linear_attention_kernels(module):
            module.forward = MethodType(_torch_forward(type(module)), module)
    return model


def linear_attention_kernels(module: nn.Module) -> dict[str, Callable]:
    """{name in KERNEL_FUNCTIONS: the function `module`'s forward calls under it}; {} if it calls none."""
    return _kernels_called(module.forward)


def _kernels_called(forward: Callable) -> dict[str, Callable]:
    body = inspect.unwrap(forward)  # the forward's own code, under its decorators
    code = getattr(body, "__code__", None)  # None for a compiled (C++) forward
    return {name: body.__globals__[name] for name in KERNEL_FUNCTIONS if code and name in code.co_names}


@functools.cache
def _torch_forward(layer_class: type) -> FunctionType:
    """`layer_class.forward` with the KERNEL_FUNCTIONS it calls resolving to transformers' PyTorch references, each
    reading a packed batch's sequence boundaries (`packing_aware`)."""
    references = {name: packing_aware(name, inspect.unwrap(kernel))
                  for name, kernel in _kernels_called(layer_class.forward).items()}
    return _rebuilt(layer_class.forward, references)


@functools.cache
def _packed_forward(layer_class: type) -> FunctionType:
    """`layer_class.forward` with the kernels transformers bound (fla's) as `packing_aware` calls them."""
    kernels = {name: packing_aware(name, _dispatched(kernel)) for name, kernel in _kernels_called(layer_class.forward).items()}
    return _rebuilt(layer_class.forward, kernels)


def packing_aware(name: str, kernel: Callable) -> Callable:
    """`kernel` (one of KERNEL_FUNCTIONS) as it must run on a packed batch (sequences end to end in one row, their
    starts in the `cu_seqlens` / `cu_seq_lens_q` keyword transformers' Gated DeltaNet passes on): the causal
    convolution restarts at each sequence (`causal_conv1d_shifts`), a delta rule without `cu_seqlens` of its own
    (transformers' PyTorch reference) runs one sequence at a time. Without boundaries, `kernel` as it was. The
    wrapper's __wrapped__ is `kernel`."""
    if getattr(kernel, "dflash_packing_aware", False) or name == "causal_conv1d_update":  # decoding: one token
        return kernel
    if name == "causal_conv1d_fn":
        @functools.wraps(kernel)
        def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
            if kwargs.get("cu_seq_lens_q") is not None:
                return causal_conv1d_shifts(hidden_states, weight, bias, activation, **kwargs)
            return kernel(hidden_states, weight, bias, activation=activation, **kwargs)

        conv.dflash_packing_aware = True
        return conv
    takes_boundaries = "cu_seqlens" in inspect.signature(_implementation(kernel)).parameters

    @functools.wraps(kernel)
    def delta_rule(query, key, value, *args, cu_seqlens=None, **kwargs):
        if cu_seqlens is None:  # a transformers version that passes the layer's keywords on as they came
            cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
        for name in PACKED_KEYWORDS:
            kwargs.pop(name, None)
        if cu_seqlens is None or takes_boundaries:
            return kernel(query, key, value, *args, cu_seqlens=cu_seqlens, **kwargs)
        if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            raise ValueError("a packed batch runs the delta rule without a recurrent state")
        g, beta = kwargs.pop("g"), kwargs.pop("beta")
        bounds = cu_seqlens.tolist()
        outs = [kernel(query[:, s:e], key[:, s:e], value[:, s:e], *args, g=g[:, s:e], beta=beta[:, s:e], **kwargs)[0]
                for s, e in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outs, dim=1), None

    delta_rule.dflash_packing_aware = True
    return delta_rule


def _rebuilt(function: FunctionType, names: dict[str, Callable]) -> FunctionType:
    """A copy of `function` whose innermost body (through the __wrapped__ chain of decorators such as
    transformers' force_accelerate_hooks) looks `names` up in a copy of its globals with those names replaced."""
    inner = getattr(function, "__wrapped__", None)
    if inner is None:
        globals_ = _module_globals(function.__globals__, names)
        copy = FunctionType(function.__code__, globals_, function.__name__, function.__defaults__, function.__closure__)
    else:
        new_inner = _rebuilt(inner, names)
        cells = tuple(CellType(new_inner) if cell.cell_contents is inner else cell for cell in function.__closure__ or ())
        if sum(cell.cell_contents is new_inner for cell in cells) != 1:
            raise RuntimeError(f"{function.__qualname__}: a decorator does not call the function it wraps from its closure; "
                               "this transformers version cannot keep the PyTorch linear-attention path per model")
        copy = FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__, cells)
    copy.__kwdefaults__ = function.__kwdefaults__
    functools.update_wrapper(copy, function)
    if inner is None:
        del copy.__wrapped__
    else:
        copy.__wrapped__ = new_inner
    return copy


# ---------------------------------------------------------------------------------------------
# Regional compilation of the target's decoder layers

COMPILE_BACKEND = "inductor"  # tests swap in a cheaper backend


def compile_target(model: nn.Module, backend: str | None = None) -> nn.Module:
    """Run every decoder layer of `model` through torch.compile: one graph per layer class and type, any batch shape.

    Eager transformers spends a fifth of a dense target's forward in elementwise kernels (RMSNorm, RoPE, SiLU * up,
    residual adds); compiled, each layer's are fused around its matmuls. Each layer's forward becomes the compiled
    form of its class's forward taking the layer as an argument (dynamo lifts the weights to inputs, so one graph
    serves every layer of a class), with the batch and sequence sizes marked dynamic (no recompile per bucket
    shape). Forward hooks stay outside the compiled code, so target_features still stops after its deepest layer.
    The gated delta rule (DELTA_RULES: fla's Triton kernels, or transformers' PyTorch loop over sequence chunks,
    which would unroll per length) runs uncompiled between two graphs. Compilation itself happens at the first forward, in the calling thread.
    """
    if getattr(model, "dflash_compiled", False):
        return model
    layers = decoder_of(model).layers
    kinds = [layer_kind(layer) for layer in layers]
    for layer, kind in zip(layers, kinds):
        for module in layer.modules():
            if linear_attention_kernels(module):
                module.forward = MethodType(_kernels_uncompiled(_function_of(module.forward)), module)
        kind = kind if len(set(kinds)) > 1 else None  # a hybrid's layer types: a compiled function each
        layer.forward = MethodType(_compiled_layer_forward(_function_of(layer.forward), backend or COMPILE_BACKEND,
                                                           kind), layer)
    model.dflash_compiled = True
    return model


def _function_of(method) -> FunctionType:
    return getattr(method, "__func__", method)


@functools.cache
def _kernels_uncompiled(forward: FunctionType) -> FunctionType:
    """`forward` (a linear-attention layer's) calling its delta-rule kernels as opaque custom ops (no graph break), and
    its other kernels as the implementation transformers' hub wrapper dispatches to (traced directly)."""
    kernels = _kernels_called(forward)
    return _rebuilt(forward, {name: _opaque_delta_rule(fn) if name in DELTA_RULES else _traceable(name, fn)
                              for name, fn in kernels.items()})


def _traceable(name: str, kernel: Callable) -> Callable:
    """`kernel` (as dispatched), or for transformers' own causal conv1d (a depthwise F.conv1d: on CUDA a generic
    kernel, 6.5% of a compiled Qwen3.6-27B forward) the same function written as shifted multiply-adds the compiler
    fuses, while compiling."""
    implementation = inspect.unwrap(_implementation(kernel))
    eager = _dispatched(kernel)
    if name != "causal_conv1d_fn" or not getattr(implementation, "__module__", "").startswith("transformers."):
        return eager

    @functools.wraps(causal_conv1d_shifts)
    def conv(*args, **kwargs):  # a layer that fell back to eager keeps transformers' conv (no float32 temporaries)
        if torch.compiler.is_compiling() or kwargs.get("cu_seq_lens_q") is not None:  # packed: `packing_aware`'s rule
            return causal_conv1d_shifts(*args, **kwargs)
        return eager(*args, **kwargs)

    conv.dflash_packing_aware = True
    return conv


def causal_conv1d_shifts(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         activation: str | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                         **kwargs) -> torch.Tensor:
    """transformers' causal_conv1d_fn (a causal depthwise convolution of [B, C, S] by [C, K], then the activation) as
    K shifted multiply-adds in float32: compiled, one elementwise kernel. With cu_seq_lens_q (a packed row's
    sequence starts) a tap never reads across a start: each sequence gets the zeros it would see alone. Its other
    keywords (seq_idx...) it ignores as transformers' does."""
    from transformers.activations import ACT2FN

    K, S = weight.shape[-1], hidden_states.shape[-1]
    x = F.pad(hidden_states.float(), (K - 1, 0))
    w = weight.float()
    offset_S = None if cu_seq_lens_q is None else position_in_sequence(cu_seq_lens_q, S)

    def tap(k: int) -> torch.Tensor:  # reads the input K - 1 - k positions back
        term = x[..., k:k + S] * w[:, k, None]
        back = K - 1 - k
        return term if offset_S is None or back == 0 else torch.where(offset_S >= back, term, 0.0)

    out = tap(0)
    for k in range(1, K):
        out = out + tap(k)
    if bias is not None:
        out = out + bias.float()[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def _dispatched(kernel: Callable) -> Callable:
    """The function a hub-kernel wrapper (transformers' use_kernel_func_from_hub_with_fallback) calls; else `kernel`."""
    implementation = _implementation(kernel)
    if implementation is kernel:
        return kernel
    params = frozenset(inspect.signature(implementation).parameters)

    def call(*args, **kwargs):  # the wrapper's own rule: pass on only the keywords the implementation takes
        return implementation(*args, **{k: v for k, v in kwargs.items() if k in params})

    return call


def _implementation(kernel: Callable) -> Callable:
    """The implementation a hub-kernel wrapper chose (in its closure), or `kernel` itself."""
    code = getattr(kernel, "__code__", None)
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in kernel.__closure__ or ()))) if code else {}
    implementation = cells.get("implementation")
    return implementation if callable(implementation) else kernel


@functools.cache
def _opaque_delta_rule(kernel: Callable) -> Callable:
    """`kernel` (a gated delta rule) as a torch custom op for the stateless forward the target runs, so dynamo keeps
    one graph around it (fla's Triton kernels and the PyTorch chunk loop stay opaque: the loop would unroll per
    length). Calls with a recurrent state (decoding) go to the kernel itself."""
    name = f"dflash::delta_rule_{len(_DELTA_RULE_OPS)}"

    @torch.library.custom_op(name, mutates_args=())
    def op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           use_qk_l2norm_in_kernel: bool, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        bounds = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}  # a packed batch's sequence starts
        return kernel(query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **bounds)[0].contiguous()

    @op.register_fake
    def _(query, key, value, g, beta, use_qk_l2norm_in_kernel, cu_seqlens=None):
        return value.new_empty(value.shape, dtype=query.dtype)  # [B, S, value heads, value dim], contiguous like the op's

    def delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        # The decoder's own keywords (use_cache=False...) reach here too: the stateless forward ignores them.
        if cu_seqlens is None:  # a transformers version that passes the layer's keywords on as they came
            cu_seqlens = kwargs.get("cu_seq_lens_q")
        if initial_state is not None or output_final_state:
            return kernel(query, key, value, g=g, beta=beta, initial_state=initial_state,
                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          cu_seqlens=cu_seqlens, **kwargs)
        return op(query, key, value, g, beta, use_qk_l2norm_in_kernel, cu_seqlens), None

    _DELTA_RULE_OPS.append(op)
    return delta_rule


_DELTA_RULE_OPS: list = []


def layer_kind(layer: nn.Module) -> str:
    """What a decoder layer holds, by its children's names: a hybrid's linear-attention layers ('linear_attn') and
    full-attention layers ('self_attn') differ, every layer of a dense model is the same kind."""
    return "_".join(sorted(name for name, _ in layer.named_children()))


def _own_code(forward: FunctionType, kind: str | None) -> FunctionType:
    """forward, or for a layer type a copy of it with a code object of its own: torch.compile keeps graphs (and
    counts recompiles) per code object, so a hybrid's two layer types, which share their class's forward, would
    otherwise guard on which submodules a layer holds and rebuild each other's graphs."""
    if kind is None:
        return forward
    code = forward.__code__.replace(co_name=f"{forward.__name__}_{''.join(c if c.isalnum() else '_' for c in kind)}")
    fn = FunctionType(code, forward.__globals__, code.co_name, forward.__defaults__, forward.__closure__)
    fn.__kwdefaults__, fn.__dict__ = forward.__kwdefaults__, dict(forward.__dict__)
    return fn


@functools.cache
def _compiled_layer_forward(forward: FunctionType, backend: str, kind: str | None = None) -> Callable:
    own = _own_code(forward, kind)
    compiled = torch.compile(own, backend=backend)
    failed: list[str] = []  # once compilation fails, every layer of this class runs eager (said once)

    @functools.wraps(own)
    def layer_forward(self, hidden_states, *args, **kwargs):
        if not failed:
            _mark_batch_dims(hidden_states, hidden_states.shape[:2], (args, kwargs))
            try:
                return compiled(self, hidden_states, *args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:  # a compiler bug, never the layer's own error
                failed.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                warnings.warn(f"target: torch.compile failed on {type(self).__name__} ({failed[0][:300]}); its layers "
                              "run eager (set target.compile = false to skip compiling)", stacklevel=2)
        return forward(self, hidden_states, *args, **kwargs)

    return layer_forward


def _mark_batch_dims(hidden_BSH: torch.Tensor, batch_dims: torch.Size, rest) -> None:
    """Mark the batch and sequence dims dynamic in the layer's input and in every tensor argument carrying them
    (RoPE's cos/sin, position ids): one graph for every bucket shape. Sizes 0 and 1 stay specialised (dynamo's rule)."""
    torch._dynamo.maybe_mark_dynamic(hidden_BSH, 0)
    torch._dynamo.maybe_mark_dynamic(hidden_BSH, 1)
    B, S = batch_dims
    kwargs = rest[1] if isinstance(rest, tuple) and len(rest) == 2 and isinstance(rest[1], dict) else {}
    for bounds in (kwargs.get(k) for k in PACKED_KEYWORDS):  # a packed batch's sequence starts: one per sequence
        if isinstance(bounds, torch.Tensor) and bounds.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(bounds, 0)
    stack = [rest]
    while stack:
        item = stack.pop()
        if isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, torch.Tensor) and item.dim() >= 2:
            if item.shape[0] == B and B > 1:
                torch._dynamo.maybe_mark_dynamic(item, 0)
            if item.shape[1] == S and S > 1:
                torch._dynamo.maybe_mark_dynamic(item, 1)


def _module_globals(globals_: dict, names: dict[str, Callable]) -> dict:
    """A copy of a module's globals with `names` replaced, as the dict of a real module registered under its own name.

    torch.compile guards a global a traced function reads through the module its globals' __name__ names: with a
    bare copy of transformers' module dict those guards would read the original module's functions, not these."""
    name = f"{globals_['__name__']}.dflash_rebound_{len(_REBOUND_MODULES)}"
    module = ModuleType(name)
    module.__dict__.update(globals_)
    module.__dict__.update(names)
    module.__name__ = name
    sys.modules[name] = module
    _REBOUND_MODULES.append(module)
    return module.__dict__


_REBOUND_MODULES: list[ModuleType] = []


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack (`model.model` for *ForCausalLM) holding `.layers` and `.norm`."""
    decoder = getattr(model, "model", model)
    if not hasattr(decoder, "layers"):
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (expected model.model.layers)")
    return decoder


# ---------------------------------------------------------------------------------------------
# Packed batches: sequences laid end to end in one row [1, T], their starts in cu_seqlens [n + 1] (int32, 0 first,
# T last) and each position's offset in its sequence as position_ids. Every layer then computes each sequence as if
# it ran alone: RoPE reads the offsets, full attention is causal inside a sequence (`packed_attention`), a Gated
# DeltaNet's convolution and recurrence restart at each start (`packing_aware`).

PACKED_ATTENTION = "dflash_packed"  # the attention implementation a packed forward runs under
PACKED_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k")  # how transformers' layers pass a packed row's starts on


def position_in_sequence(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """[length] int64: each position's offset from the start of its sequence (cu_seqlens: the starts, then the end)."""
    pos = torch.arange(length, device=cu_seqlens.device)
    starts = cu_seqlens[:-1].long()
    return pos - starts[torch.searchsorted(starts, pos, right=True) - 1]


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface for a packed row: query [1, Hq, T, D], key/value [1, Hkv, T, D] ->
    ([1, T, Hq, D], None), causal inside each sequence of cu_seq_lens_q. CUDA in bf16/fp16: torch's varlen flash
    attention; elsewhere (CPU, or a float32 target, which flash attention does not take) SDPA under a dense
    block-diagonal causal mask. A call without boundaries is SDPA's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"a packed batch is one row, got {query.shape[0]}")
    T, D = query.shape[2], query.shape[3]
    scale = D ** -0.5 if scaling is None else scaling
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        from torch.nn.attention.varlen import varlen_attn

        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
        causal, takes = _VARLEN[0] if _VARLEN else _varlen_keywords()
        keywords = dict(causal)
        if "scale" in takes:
            keywords["scale"] = scale
        elif scale != D ** -0.5:
            q = q * (scale * D ** 0.5)
        if q.shape[1] != k.shape[1]:  # grouped-query attention
            if "enable_gqa" in takes:
                keywords["enable_gqa"] = True
            else:
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu, cu, T, T, **keywords)[None], None
    pos = torch.arange(T, device=query.device)
    seq_T = torch.searchsorted(cu[1:-1].long(), pos, right=True)
    mask_TT = (pos[None, :] <= pos[:, None]) & (seq_T[None, :] == seq_T[:, None])
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask_TT[None, None], scale=scale,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


_VARLEN: list = []  # _varlen_keywords(), read once outside compiled code: Dynamo traces through a cached function


def _varlen_keywords() -> tuple[dict, frozenset]:
    """(the keywords that make torch's varlen_attn causal, the names it takes): is_causal=True in torch 2.10, a
    window of (-1, 0) in later versions (which also take scale and enable_gqa)."""
    from torch.nn.attention.varlen import varlen_attn

    params = frozenset(inspect.signature(varlen_attn).parameters)
    if "is_causal" in params:
        return {"is_causal": True}, params
    if "window_size" in params:
        return {"window_size": (-1, 0)}, params
    raise RuntimeError(f"torch {torch.__version__}: varlen_attn{inspect.signature(varlen_attn)} takes neither "
                       "is_causal nor window_size; packed batches need one of them")


@functools.cache
def _register_packed_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    try:
        _VARLEN.append(_varlen_keywords())
    except (ImportError, RuntimeError):  # no varlen attention in this torch: the first CUDA packed call says so
        pass


class _packed_attention_of:
    """While open, every config of `model` names PACKED_ATTENTION (its full-attention layers read their boundaries
    from the keywords; transformers builds no [T, T] mask for it); closed, each is as it was."""

    def __init__(self, model: nn.Module):
        _register_packed_attention()
        self.configs = list({id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
                             and hasattr(c, "_attn_implementation_internal")}.values())

    def __enter__(self):
        self.saved = [c._attn_implementation_internal for c in self.configs]
        for c in self.configs:
            c._attn_implementation_internal = PACKED_ATTENTION

    def __exit__(self, *exc):
        for c, saved in zip(self.configs, self.saved):
            c._attn_implementation_internal = saved


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
    packed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(context [B, S, n*H] = selected layer outputs concatenated, last hidden [B, S, H] after the final norm or None).

    packed: (position_ids [1, T], cu_seqlens [n + 1] int32) of a packed row (its sequences end to end, see
    PACKED_ATTENTION); each sequence's features are then those it gets alone."""
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
        if packed is None:
            out = decoder(input_ids=input_ids_BS, attention_mask=attention_mask_BS, use_cache=False)
        else:
            position_ids, cu_seqlens = packed
            with _packed_attention_of(model):
                out = decoder(input_ids=input_ids_BS, position_ids=position_ids, use_cache=False,
                              **dict.fromkeys(PACKED_KEYWORDS, cu_seqlens))
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
