"""Loading Qwen3.5-family hybrid targets (text-only folder and the vision-language wrapper) and their features."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.data.synthetic import hybrid_target_config, random_target, write_target
from dflash.memory.shape import load_target_shape
from dflash.models.target import (
    bind_linear_attention,
    decoder_of,
    linear_attention_kernels,
    linear_attention_path,
    load_target,
    target_embed_and_head,
    target_features,
    target_text_config,
    use_torch_linear_attention,
)

LAYOUTS = ("text", "wrapper")


@pytest.fixture(scope="module")
def hybrid_folders(tmp_path_factory):
    """{layout: folder} of one tiny random hybrid (8 layers, 2 of them full attention), saved in both layouts."""
    root = tmp_path_factory.mktemp("hybrid")
    fields = {"num_hidden_layers": 8, "vocab_size": 256, "initializer_range": 0.1}
    return {
        "text": write_target(root / "text", hybrid_target_config(**fields)),
        "wrapper": write_target(root / "wrapper", hybrid_target_config(wrapper=True, **fields)),
    }


def test_the_wrapper_folder_holds_the_published_layout(hybrid_folders):
    from safetensors import safe_open

    raw = json.loads((hybrid_folders["wrapper"] / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5" and raw["text_config"]["model_type"] == "qwen3_5_text"
    with safe_open(str(hybrid_folders["wrapper"] / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("model.language_model.layers.0.linear_attn.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_target_gives_the_language_model_alone(hybrid_folders, layout):
    model = load_target(hybrid_folders[layout], "float32", "cpu")
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not any("visual" in name for name, _ in model.named_parameters())
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    # Every parameter is the saved one (the wrapper's model.language_model.X is the model's model.X).
    stored = load_file(str(hybrid_folders[layout] / "model.safetensors"))
    stored = {k.replace("model.language_model.", "model."): v for k, v in stored.items() if "visual" not in k}
    assert stored.keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(p, stored[name]) for name, p in model.named_parameters())
    embed, head = target_embed_and_head(model)
    assert embed.shape == head.shape == (256, 64)
    assert target_text_config(hybrid_folders[layout]).num_hidden_layers == 8
    assert load_target_shape(str(hybrid_folders[layout])).num_layers == 8


@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_init_from_config_builds_no_vision_tower(hybrid_folders, layout, tmp_path):
    folder = write_target(tmp_path / layout, json.loads((hybrid_folders[layout] / "config.json").read_text()), weights=False)
    model = load_target(folder, "bfloat16", "cpu", random_init=True)
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and model.lm_head.weight.dtype == torch.bfloat16
    assert not any("visual" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hybrid_features_match_hf_hidden_states(hybrid_folders, layout):
    model = load_target(hybrid_folders[layout], "float32", "cpu")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, 9:] = 0  # right padding, as the batches have
    hs = model(ids, attention_mask=am, output_hidden_states=True).hidden_states
    for layer_ids, want_last in (([1, 3, 4, 7], True), ([0, 2, 5], False)):  # with/without the last (normed) layer
        ctx, last = target_features(model, ids, am, layer_ids, want_last)
        want = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
        diff = (ctx - want).abs().max().item()
        assert diff < 1e-5, f"layers {layer_ids}: max |target_features - hidden_states| = {diff}"
        if want_last:
            assert (last - hs[-1]).abs().max().item() < 1e-5
        else:
            assert last is None


def test_hybrid_random_target_in_memory_matches_its_saved_folder(hybrid_folders):
    model = random_target(hybrid_target_config(num_hidden_layers=8, vocab_size=256, initializer_range=0.1))
    loaded = load_target(hybrid_folders["text"], "float32", "cpu")
    ids = torch.randint(0, 256, (1, 9))
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def _gated_deltanet_layers(model) -> list:
    return [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]


def _torch_reference(name: str):
    """transformers' PyTorch implementation behind the module-global kernel function `name` of modeling_qwen3_5."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(getattr(modeling_qwen3_5, name))


def test_transformers_binds_fla_at_import_for_every_device():
    """The premise of bind_linear_attention: with fla installed, transformers' module-global Gated DeltaNet
    functions call fla's Triton kernels whatever the device (so a CPU target needs its own binding)."""
    pytest.importorskip("fla")
    from transformers.models.qwen3_5 import modeling_qwen3_5

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        implementation = inspect.getclosurevars(getattr(modeling_qwen3_5, name)).nonlocals["implementation"]
        assert implementation.__module__.startswith("fla."), f"{name} is bound to {implementation.__module__}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("random_init", [False, True])
def test_a_cpu_target_runs_the_pytorch_gated_deltanet(hybrid_folders, layout, random_init, tmp_path):
    folder = hybrid_folders[layout]
    if random_init:
        folder = write_target(tmp_path / layout, json.loads((folder / "config.json").read_text()), weights=False)
    model = load_target(folder, "float32", "cpu", random_init=random_init)
    layers = _gated_deltanet_layers(model)
    assert len(layers) == 6  # 3 of every 4 layers
    for layer in layers:
        kernels = linear_attention_kernels(layer)
        assert set(kernels) == {"torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                                "causal_conv1d_update"}
        # each as it reads a packed batch's boundaries (dflash.models.target.packing_aware), over the reference
        assert all(inspect.unwrap(fn) is _torch_reference(name) for name, fn in kernels.items()), kernels
    # Per model: the class and transformers' module keep their binding (fla's, when it is installed).
    from transformers.models.qwen3_5 import modeling_qwen3_5

    fresh = modeling_qwen3_5.Qwen3_5GatedDeltaNet(model.config, layer_idx=0)
    assert linear_attention_kernels(fresh)["torch_chunk_gated_delta_rule"] is modeling_qwen3_5.torch_chunk_gated_delta_rule


def test_a_random_target_in_memory_on_cpu_runs_the_pytorch_gated_deltanet():
    model = random_target(hybrid_target_config(num_hidden_layers=4, vocab_size=256))
    kernels = linear_attention_kernels(_gated_deltanet_layers(model)[0])
    assert inspect.unwrap(kernels["torch_chunk_gated_delta_rule"]) is _torch_reference("torch_chunk_gated_delta_rule")


@pytest.mark.parametrize(("device_type", "fla", "path"), [
    ("cuda", True, "fla"),
    ("cuda", False, "torch"),  # transformers bound its PyTorch reference already
    ("cpu", True, "torch"),  # Triton has no CPU driver: "0 active drivers" at the first forward
    ("cpu", False, "torch"),
    ("meta", True, "torch"),
    ("xpu", True, "torch"),  # not a device this project runs on
])
def test_linear_attention_path_picks_fla_only_on_cuda(device_type, fla, path):
    assert linear_attention_path(device_type, fla) == path


def test_non_hybrid_targets_have_no_linear_attention_layers(tiny_target):
    assert not any(linear_attention_kernels(m) for m in tiny_target.modules())
    assert bind_linear_attention(tiny_target, "cpu") is tiny_target


def _gated_deltanet_inputs(model, ids_BS, am_BS) -> dict[int, tuple[tuple, dict]]:
    """{layer index: (args, kwargs)} each Gated DeltaNet layer of `model` gets in one forward of `ids_BS`."""
    inputs = {}
    layers = dict(enumerate(decoder_of(model).layers))
    handles = [layer.linear_attn.register_forward_pre_hook(
        lambda _m, args, kwargs, i=i: inputs.setdefault(i, (args, dict(kwargs))), with_kwargs=True)
        for i, layer in layers.items() if hasattr(layer, "linear_attn")]
    try:
        target_features(model, ids_BS, am_BS, [len(layers) - 1], want_last=False)
    finally:
        for h in handles:
            h.remove()
    return inputs


def _gated_deltanet_outputs(model, inputs, dtype) -> dict[int, torch.Tensor]:
    layers = decoder_of(model).layers
    outputs = {}
    for i, (args, kwargs) in inputs.items():
        args = tuple(a.to(dtype) if torch.is_floating_point(a) else a for a in args)
        kwargs = {k: v.to(dtype) if k == "hidden_states" else v for k, v in kwargs.items()}
        with torch.no_grad():
            outputs[i] = layers[i].linear_attn(*args, **kwargs).float()
    return outputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fla's Triton kernels)")
def test_a_cuda_target_runs_fla_as_closely_as_the_pytorch_path(hybrid_folders):
    """In bf16, fla's Gated DeltaNet is as close to the float32 PyTorch layer as transformers' bf16 PyTorch path.

    Layer by layer on the same input (the float32 model's), attended positions only. Whole-model features
    of two bf16 paths cannot be held to a tight bound: this tiny random target amplifies bf16 rounding over
    its layers. Measured on CPU (fla's kernels under TRITON_INTERPRET=1, bf16 tl.dot and arithmetic widened
    to float32 as a GPU does), with these inputs and layers [1, 4, 6]: bf16 PyTorch features end 3.24 from
    the float32 ones (features up to 5.50), fla's 3.07, fla vs PyTorch 1.63 (1.76 measured on an H200);
    in float32 the two paths' features agree to 1.5e-4 on every position. Per layer, on valid positions:
    bf16 errors against float32 of 0.022-0.051 (PyTorch) and 0.033-0.053 (fla), fla/PyTorch at most 1.49.
    """
    pytest.importorskip("fla")
    model = load_target(hybrid_folders["text"], "bfloat16", "cuda")
    assert all(linear_attention_kernels(layer)["torch_chunk_gated_delta_rule"] is not _torch_reference("torch_chunk_gated_delta_rule")
               for layer in _gated_deltanet_layers(model))
    torch_bf16 = use_torch_linear_attention(load_target(hybrid_folders["text"], "bfloat16", "cuda"))
    torch_fp32 = use_torch_linear_attention(load_target(hybrid_folders["text"], "float32", "cuda"))
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()  # > one 64-token chunk
    am = torch.ones_like(ids)
    am[1, 250:] = 0
    valid = am.bool()
    inputs = _gated_deltanet_inputs(torch_fp32, ids, am)
    assert len(inputs) == 6
    want = _gated_deltanet_outputs(torch_fp32, inputs, torch.float32)
    fla_out = _gated_deltanet_outputs(model, inputs, torch.bfloat16)
    torch_out = _gated_deltanet_outputs(torch_bf16, inputs, torch.bfloat16)
    for i in inputs:
        fla_err = (fla_out[i] - want[i]).abs()[valid].max().item()
        torch_err = (torch_out[i] - want[i]).abs()[valid].max().item()
        scale = want[i][valid].abs().max().item()
        assert fla_err <= 2 * torch_err, (f"layer {i}: max |fla bf16 - torch fp32| = {fla_err}, "
                                          f"max |torch bf16 - torch fp32| = {torch_err} (outputs up to {scale})")


INTERPRETED_FLA_LAYER = """
import inspect
import sys
sys.path.insert(0, sys.argv[1])
import triton_interpreter  # noqa: F401  (before fla)
import torch
import dflash.models.target
from dflash.data.synthetic import hybrid_target_config, random_target
from dflash.models.target import linear_attention_kernels, use_torch_linear_attention

dflash.models.target.linear_attention_path = lambda device_type, fla_installed: "fla"  # keep fla's kernels on the CPU
model = random_target(hybrid_target_config(num_hidden_layers=4, vocab_size=256, initializer_range=0.1))
layer = model.model.layers[0].linear_attn
kernel = linear_attention_kernels(layer)["torch_chunk_gated_delta_rule"]
assert kernel is not inspect.unwrap(kernel)  # transformers' binding (fla's), not the PyTorch reference
x_BSH = torch.randn(2, 70, 64, generator=torch.Generator().manual_seed(0))  # > one 64-token chunk
am = torch.ones(2, 70, dtype=torch.long)
am[1, 50:] = 0
with torch.no_grad():
    fla = layer(x_BSH, attention_mask=am)
    use_torch_linear_attention(model)
    ref = layer(x_BSH, attention_mask=am)
print((fla - ref).abs().max().item(), ref.abs().max().item())
"""


@pytest.mark.slow
def test_fla_gated_deltanet_matches_the_pytorch_path_under_the_triton_interpreter():
    """What transformers hands fla (layout, l2norm, g in log space, head grouping, padding) means the same to
    fla as to its PyTorch reference: float32, one Gated DeltaNet layer, a padded row, fla's kernels run by
    Triton's interpreter on the CPU (measured: 1e-6 with outputs up to 2.2)."""
    pytest.importorskip("fla")
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", INTERPRETED_FLA_LAYER, str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    diff, scale = map(float, run.stdout.split()[-2:])
    assert diff <= 1e-5 * scale, f"max |fla - torch| = {diff} (outputs up to {scale})"


@pytest.mark.parametrize("config", [
    # the real shapes: 48 Gated DeltaNet + 16 gated full-attention layers
    str(Path(__file__).resolve().parent.parent / "configs/targets/qwen3.6-27b"),
    hybrid_target_config(num_hidden_layers=8, vocab_size=256),
    hybrid_target_config(wrapper=True, num_hidden_layers=8, vocab_size=256),
])
def test_memory_model_counts_hybrid_params_as_transformers_builds_them(config):
    """dflash.memory's TargetShape (torch-free) against the parameters of the model transformers builds (on meta)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.memory.shape import TargetShape

    raw = json.loads((Path(config) / "config.json").read_text()) if isinstance(config, str) else config
    hf = AutoConfig.from_pretrained(config) if isinstance(config, str) else AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    shape = TargetShape.from_config(raw)
    assert shape.linear_layers == 3 * shape.num_layers // 4
    assert shape.params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_target_step_needs_no_mask_for_right_padded_rows(tiny_target, hybrid_folders, kind):
    """target_step passes no attention mask: each row's real positions get the features of that row alone."""
    from dflash.train.loss import target_step

    model = tiny_target if kind == "qwen3" else load_target(hybrid_folders["text"], "float32", "cpu")
    lengths = [12, 9, 5]
    ids = torch.randint(1, 256, (3, 12), generator=torch.Generator().manual_seed(1))
    am = (torch.arange(12)[None] < torch.tensor(lengths)[:, None]).long()
    batch = {"input_ids": ids.masked_fill(am == 0, 0), "attention_mask": am}
    layer_ids = [0, 2, 5] if kind == "qwen3" else [1, 3, 7]  # the last includes the final norm
    ctx, last = target_step(model, batch, layer_ids, want_last=True)
    for b, n in enumerate(lengths):
        alone_ctx, alone_last = target_features(model, batch["input_ids"][b:b + 1, :n], None, layer_ids, True)
        diff = max((ctx[b, :n] - alone_ctx[0]).abs().max().item(), (last[b, :n] - alone_last[0]).abs().max().item())
        assert diff < 1e-5, f"row {b} ({n} of 12 tokens real): max |padded batch - row alone| = {diff}"


# ---------------------------------------------------------------------------------------------
# A target folder never runs its own code, and its unusable files are one line naming them


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A good chat target, a drafter for it, prompts, conversations, and copies of the target that carry code whose
    import would write MARKER ('config': an architecture transformers does not ship; 'tokenizer': only the tokenizer)."""
    import shutil

    from dflash.models.drafter import DFlashDrafter, drafter_config_from_target
    from trainkit import chat_target

    root = tmp_path_factory.mktemp("folders")
    good = chat_target(root, "llama")
    config = json.loads((good / "config.json").read_text())
    DFlashDrafter(drafter_config_from_target(config, 1, 4, mask_token_id=5)).save_pretrained(root / "drafter")
    (root / "prompts.txt").write_text("hello there\nhow are you\n")
    (root / "chats.jsonl").write_text(json.dumps({"id": "a", "messages": [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "there"}]}) + "\n")
    marker = root / "MARKER"
    code = (f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
            "from transformers import PretrainedConfig, TokenizersBackend\n"
            "class EvilConfig(PretrainedConfig):\n    model_type = 'evil_lm'\n"
            "class EvilTokenizer(TokenizersBackend):\n    pass\n"
            "class EvilForCausalLM:\n    pass\n")
    tokenizer_map = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    for name, config_change, tokenizer_change in [
        ("config", {"model_type": "evil_lm", "architectures": ["EvilForCausalLM"],
                    "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                                 "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM", **tokenizer_map}},
         {"tokenizer_class": "EvilTokenizer", "auto_map": tokenizer_map}),
        ("tokenizer", {}, {"tokenizer_class": "EvilTokenizer", "auto_map": tokenizer_map}),
    ]:
        folder = shutil.copytree(good, root / f"code-in-{name}")
        for file, change in (("config.json", config_change), ("tokenizer_config.json", tokenizer_change)):
            (folder / file).write_text(json.dumps({**json.loads((folder / file).read_text()), **change}))
        for module in ("configuration_evil", "modeling_evil", "tokenization_evil"):
            (folder / f"{module}.py").write_text(code)
    return root


CUSTOM_CODE_COMMANDS = {
    "eval": ["dflash.commands.eval", "eval_main", "--target", "{target}", "--drafter", "{root}/drafter", "--prompts",
             "{root}/prompts.txt", "--limit", "1", "--max-new-tokens", "2"],
    "prepare": ["dflash.commands.data", "data_main", "prepare", "--target", "{target}", "--prompts", "{root}/prompts.txt",
                "--out", "{root}/out-prepare", "--limit", "1", "--max-new-tokens", "2", "--device", "cpu"],
    "import": ["dflash.commands.data", "data_main", "import", "--target", "{target}", "--out", "{root}/out-import",
               "--workers", "1", "{root}/chats.jsonl"],
}


@pytest.mark.parametrize("command, where", [("eval", "config"), ("prepare", "config"), ("import", "config"),
                                            ("eval", "tokenizer")])
def test_a_target_folder_that_carries_code_is_refused_and_its_code_never_runs(folders, tmp_path, command, where):
    """The real command, stdin answering yes to any question: exit 2, one line naming the folder and why, no
    prompt, the folder's code never imported."""
    import subprocess
    import sys

    target = folders / f"code-in-{where}"
    module, main, *args = [a.replace("{target}", str(target)).replace("{root}", str(folders))
                           for a in CUSTOM_CODE_COMMANDS[command]]
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", f"from {module} import {main}; {main}()", *args], input="y\n" * 100,
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert not (folders / "MARKER").exists(), "the target folder's own code ran"
    assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
    assert lines[0].startswith(f"dflash-{'eval' if command == 'eval' else 'data'}: error: target {target}: custom code "
                               f"is refused: {where}"), lines[0]
    assert "Evil" in lines[0] or "evil_lm" in lines[0]
    assert "use a model whose architecture transformers ships" in lines[0]
    assert "[y/N]" not in res.stdout + res.stderr
    assert not (folders / f"out-{command}").exists()


def test_the_torch_free_reader_knows_what_transformers_ships():
    """Preflight and the estimator judge custom code from transformers' files (dflash.models.custom_code); the
    loaders from transformers' own maps. Both must answer alike for every model type and tokenizer class."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    from dflash.models.custom_code import shipped_names

    shipped = shipped_names()
    assert shipped.version == transformers.__version__
    assert shipped.model_types == set(CONFIG_MAPPING_NAMES)
    names = {n for n in TOKENIZER_MAPPING_NAMES.values() if n} | {n for n in dir(transformers)
                                                                   if n.endswith(("Tokenizer", "TokenizerFast", "Backend"))}
    names |= {f"{n}Fast" for n in names} | shipped.tokenizer_classes | {"EvilTokenizer", "EvilTokenizerFast", "Fast"}
    disagree = {n for n in names if (tokenizer_class_from_name(n) is not None) != shipped.knows_tokenizer(n)}
    assert not disagree, sorted(disagree)


def test_every_target_load_refuses_custom_code_in_process(folders):
    from dflash.models.target import TargetError, load_target_tokenizer, target_text_config

    for load in (lambda p: load_target(p, "float32", "cpu"), lambda p: load_target(p, "float32", "cpu", True),
                 target_text_config, load_target_tokenizer):
        with pytest.raises(TargetError, match="custom code is refused: config.json model_type 'evil_lm'"):
            load(folders / "code-in-config")
    with pytest.raises(TargetError, match="custom code is refused: tokenizer_config.json tokenizer_class 'EvilTokenizer'"):
        load_target_tokenizer(folders / "code-in-tokenizer")
    assert not (folders / "MARKER").exists()


class _Payload:
    """A pickle whose load would run code (writes a file) instead of giving tensors."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def _weights_case(folders: Path, case: str) -> tuple[Path, Path]:
    """(target folder, the file a one-line error must name) of a copy of the good target with broken weights."""
    import shutil

    folder = shutil.copytree(folders / "tiny-llama-256", folders / f"weights-{case}")
    weights = folder / "model.safetensors"
    if case == "pickle":
        weights.unlink()
        weights = folder / "pytorch_model.bin"
        torch.save({"model.embed_tokens.weight": _Payload(folders / "PICKLE_RAN")}, weights)
    elif case == "truncated":
        weights.write_bytes(weights.read_bytes()[:300])
    elif case == "directory":
        weights.unlink()
        weights.mkdir()
    elif case == "garbage":
        weights.write_bytes(b"\x00garbage" * 64)
    return folder, weights


@pytest.mark.parametrize("case, says", [
    ("pickle", "holds more than tensors, refused by torch's weights_only load"),
    ("truncated", "not a complete safetensors file"),
    ("garbage", "not a complete safetensors file"),
    ("directory", "a directory where the weights file should be"),
])
def test_unusable_target_weights_are_one_line_naming_the_file(folders, capsys, case, says):
    from dflash.commands.eval import eval_main

    folder, weights = _weights_case(folders, case)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        eval_main(["--target", str(folder), "--drafter", str(folders / "drafter"), "--prompts",
                   str(folders / "prompts.txt"), "--limit", "1", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"dflash-eval: error: target {weights}: {says}"), lines[0]
    assert "Traceback" not in out + err
    assert not (folders / "PICKLE_RAN").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its permissions")
def test_unreadable_target_weights_are_one_line_naming_the_file(folders):
    from dflash.models.target import TargetError

    folder, weights = _weights_case(folders, "unreadable")
    weights.chmod(0)
    try:
        with pytest.raises(TargetError, match=f"target {weights}: cannot read it"):
            load_target(folder, "float32", "cpu")
    finally:
        weights.chmod(0o644)


def test_a_pickled_target_of_tensors_alone_still_loads(folders):
    import shutil

    folder = shutil.copytree(folders / "tiny-llama-256", folders / "weights-bin")
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    model = load_target(folder, "float32", "cpu")
    reference = load_target(folders / "tiny-llama-256", "float32", "cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
