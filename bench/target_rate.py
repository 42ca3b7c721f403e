"""The target role's rate: tokens per second of the frozen target's feature forward (dflash.train.loss.target_step).

The target is built with random weights on the GPU from the run config's target.path config.json
(real shapes), fed batches of token_budget tokens split into --rows rows (the last one 1/8 padded when
rows > 1), and timed over --steps batches after --warmup. It prints which Gated DeltaNet and causal
conv1d implementations transformers bound (fla / causal_conv1d kernels, or the PyTorch fallbacks), the
rate, and the torch and NVML peaks, and writes them as JSON with --out.

Run from the repository root. In the train-cu128 environment (fla-core locked) a CUDA target runs fla's kernels;
--pytorch-linear-attention measures transformers' PyTorch fallback on the same install:

    uv run python bench/target_rate.py --config configs/qwen3.6-27b-5t3d.toml --out .cache/out/target_rate_fla.json
    uv run python bench/target_rate.py --config configs/qwen3.6-27b-5t3d.toml --pytorch-linear-attention \
        --out .cache/out/target_rate_fallback.json

On a device image without uv (python3 with torch), bench/runner.py runs both (fla-core installed from carried
wheels), and the padding mask and compiled-layer comparisons (--list shows the recipes):

    PYTHONPATH=. python3 bench/runner.py target-kernels-q36 --deadline 570   # fallback, then fla-core, eager
    PYTHONPATH=. python3 bench/runner.py target-compile --deadline 570       # eager vs compiled, 8B and 27B
    uv run python bench/target_rate.py --config configs/qwen3.6-27b-5t3d.toml --tiny --device cpu   # smoke run

The fp8 target's fidelity on a real checkpoint (issue #55): the demo's SmolLM2-135M with its own weights, every decoder
linear in fp8 (the CPU emulation of torchao's arithmetic; its linears are below the production size filter), against
the same weights in bf16, on one packed row of the demo's chitchat text (data prepared by `dflash-train --demo`):

    uv run python bench/target_rate.py --config configs/demo-cpu.toml --device cpu --weights real \
        --text demo --packed 300,0.6 --fp8-min-features 1 \
        --set target.precision=fp8 --set target.dtype=bfloat16 --vs-bf16 --steps 1 --warmup 0
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Nvml, NvmlPeak, environment, gib, parse_sets, write_json  # noqa: E402


def kernels(model) -> dict:
    """Where the Gated DeltaNet functions the model's linear-attention layers call come from (fla / causal_conv1d
    kernels, or transformers' PyTorch fallbacks): transformers' import-time binding, or the PyTorch references
    dflash.models.target binds per model off CUDA (and with --pytorch-linear-attention)."""
    from dflash.models.target import linear_attention_kernels

    layer = next((m for m in model.modules() if linear_attention_kernels(m)), None)
    if layer is None:
        return {}
    out = {}
    for name, fn in linear_attention_kernels(layer).items():
        if name not in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
            continue
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
        impl = cells.get("implementation", fn)  # the hub wrapper's chosen implementation
        out[name] = f"{impl.__module__}.{impl.__name__}"
    return out


def text_tokens(folder: str, count: int):
    """`count` token ids of real text: a dataset folder's samples (input_ids) end to end, from the first, repeated
    when the folder holds fewer. "demo" is the demo's training data (its 160 chitchat completions)."""
    import numpy as np
    import torch

    from dflash.data.identity import DatasetError
    from dflash.data.shards import ShardDataset

    if folder == "demo":
        from dflash.commands.demo import MAX_NEW_TOKENS, PROMPTS
        from dflash.models.smollm2 import cache_root

        found = sorted((cache_root() / "demo").glob(f"*-chitchat-{PROMPTS}x{MAX_NEW_TOKENS}"))
        if not found:
            raise DatasetError("the demo's data is not prepared yet; run uv run dflash-train --demo once")
        folder = str(found[0])
    if not Path(folder).is_dir():
        raise DatasetError("no such folder; give a dataset folder of *.arrow shards (dflash-data import or prepare "
                           "writes one) or 'demo'")
    data = ShardDataset(folder)
    stream = np.concatenate([data.get(i)[0] for i in range(len(data.lengths))])
    return torch.from_numpy(np.resize(stream, count).astype(np.int64))


def packed_lengths(budget: int, mean: float, sigma: float) -> list[int]:
    """Lognormal sequence lengths (mean `mean`, sigma `sigma`, seed 0) laid end to end until `budget` tokens, the last
    one cut to fit: one packed row's sequences."""
    import random

    rng, mu, lengths = random.Random(0), math.log(mean) - sigma * sigma / 2, []
    while sum(lengths) < budget:
        lengths.append(max(1, min(round(rng.lognormvariate(mu, sigma)), budget - sum(lengths))))
    return lengths


def forward_flops(model, layer_ids: list[int], want_last: bool, lengths: list[int]) -> float:
    """Matmul FLOPs of the target's feature forward over sequences of `lengths` tokens (each row, or each sequence of
    a packed row): 2 x the linear weights of the layers it runs (up to the deepest feature layer, or all with
    want_last) per token, plus causal attention's two products in the full-attention layers (the linear-attention
    layers' recurrence is not counted)."""
    import torch

    from dflash.models.target import decoder_of

    layers = decoder_of(model).layers
    run = layers if want_last else layers[: max(layer_ids) + 1]
    from dflash.models.target_fp8 import EmulatedFp8Linear

    weights = sum(m.in_features * m.out_features for layer in run for m in layer.modules()
                  if isinstance(m, (torch.nn.Linear, EmulatedFp8Linear)))
    config = model.config
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    full = sum(1 for layer in run if getattr(layer, "self_attn", None) is not None)
    per_square = full * 2 * (2 / 2 * config.num_attention_heads * hd)  # causal QK^T and PV, per token pair
    return 2 * weights * sum(lengths) + per_square * sum(n * n for n in lengths)


def predicted_load(cfg, path: str, nvml_peak: int | None, allocated: int | None) -> dict:
    """The load against the memory model: NVML's peak while the target loaded (its context included) and torch's
    allocation after it, beside the predicted target weights and the run's predicted peak for the GPU role that
    holds the target (target in a split run, else colocated). Printed as one line."""
    import torch

    from dflash.memory.parts import role_need_bytes, target_weight_parts
    from dflash.memory.shape import load_target_shape

    shape = load_target_shape(path)
    role = "target" if "target" in cfg.topology.roles else "colocated"
    cuda = torch.version.cuda or "12.8"
    out = {"nvml_peak_bytes": nvml_peak, "allocated_bytes": allocated, "role": role,
           "predicted_weights_bytes": sum(p.bytes for p in target_weight_parts(cfg, shape)),
           "predicted_role_peak_bytes": role_need_bytes(cfg, role, cuda, shape=shape)}
    verdict = "" if nvml_peak is None else (" (within it)" if nvml_peak <= out["predicted_role_peak_bytes"] else
                                           " (ABOVE it)")
    print(f"load ({cfg.target.precision}): NVML peak {gib(nvml_peak)} GiB during the load, torch allocated "
          f"{gib(allocated)} GiB after it; predicted weights {gib(out['predicted_weights_bytes'])} GiB, the run's "
          f"predicted {role} peak {gib(out['predicted_role_peak_bytes'])} GiB{verdict}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="run config TOML (target.path, target.dtype, data.token_budget)")
    p.add_argument("--set", action="append", default=[], help="dotted override, e.g. data.token_budget=16384")
    p.add_argument("--rows", type=int, default=1, help="rows per batch (token_budget // rows tokens each)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny hybrid target instead of target.path (smoke run)")
    p.add_argument("--pytorch-linear-attention", action="store_true",
                   help="transformers' PyTorch Gated DeltaNet even where fla is installed (the fallback's rate)")
    p.add_argument("--padding-mask", action="store_true",
                   help="pass the batch's attention mask to the target, as dflash did before it stopped (what it cost)")
    p.add_argument("--compile", choices=("off", "on", "both"), default=None,
                   help="the target's decoder layers eager, compiled (dflash.models.target.compile_target), or both "
                        "in turn on the same model (default: both on CUDA, off elsewhere, as the trainer compiles)")
    p.add_argument("--vs-bf16", action="store_true", help="with target.precision = fp8: then free the fp8 target, build "
                   "the same random weights in target.dtype (same seed) and report, per feature layer and for the "
                   "final logits of the last 2,048 positions, the fp8 target's relative error and mean cosine against "
                   "it, and the logits' top-1 agreement")
    p.add_argument("--packed", metavar="MEAN,SIGMA", help="one packed row instead of --rows padded ones: sequences of "
                   "lognormal lengths (mean MEAN tokens, sigma SIGMA, seed 0) laid end to end up to data.token_budget, "
                   "as the trainer packs them (position_ids and cu_seqlens)")
    p.add_argument("--fp8-min-features", type=int, metavar="N", help="with target.precision = fp8: quantise linears "
                   "whose in and out features are both >= N in this process (default: the production filter, "
                   "dflash.config.FP8_MIN_FEATURES; the tiny target's linears are all below it)")
    p.add_argument("--weights", choices=("random", "real"), default="random", help="random weights at target.path's "
                   "shapes (default: the rate) or the checkpoint's own (fidelity on a real model; --vs-bf16 then "
                   "loads them again in target.dtype)")
    p.add_argument("--text", metavar="FOLDER", help="the batch's tokens from this dataset folder's samples, end to end "
                   "(real text; 'demo': the demo's chitchat data; default: random ids)")
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    p.add_argument("--fla-harvest", type=Path, metavar="FILE", help="write fla's autotuning choices here at the end "
                   "(DFLASH_FLA_TUNED=FILE seeds another process's cold start with them)")
    p.add_argument("--floor", action="store_true", help="also run the eager forward with memory-efficient attention: "
                   "its difference from the default eager features is bf16's noise at this depth, the scale for the "
                   "compiled features' error")
    p.add_argument("--profile", type=Path, help="after timing each mode, profile one more step: write its 30 slowest "
                   "CUDA kernels to PROFILE/<mode>_kernels.txt and add each layer type's transient memory to the JSON")
    args = p.parse_args(argv)
    overrides = parse_sets(args.set, args.config, "target_rate")
    for name in ("rows", "steps"):
        if getattr(args, name) < 1:
            print(f"target_rate: --{name} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.warmup < 0:
        print(f"target_rate: --warmup must be >= 0, got {args.warmup}", file=sys.stderr)
        return 2

    packed_mix = None
    if args.packed and args.padding_mask:
        print("target_rate: --packed has no padding (one packed row); drop --padding-mask or --packed", file=sys.stderr)
        return 2
    if args.packed:
        try:
            packed_mix = tuple(float(v) for v in args.packed.split(","))
            assert len(packed_mix) == 2 and packed_mix[0] >= 1 and packed_mix[1] >= 0
        except (ValueError, AssertionError):
            print(f"target_rate: --packed takes MEAN,SIGMA (mean >= 1 token, sigma >= 0), got {args.packed!r}", file=sys.stderr)
            return 2

    import torch

    from dflash.config import load_config
    from dflash.errors import DflashError
    from dflash.models.target import (
        bind_linear_attention,
        build_random,
        compile_target,
        freeze,
        load_target,
        load_target_config,
        resolve_target_dir,
        target_features,
        target_text_config,
        torch_dtype,
        use_torch_linear_attention,
    )
    from dflash.train.features import feature_layer_ids
    from dflash.train.loss import target_step

    if args.fp8_min_features is not None:
        if args.fp8_min_features < 1:
            print(f"target_rate: --fp8-min-features must be >= 1, got {args.fp8_min_features}", file=sys.stderr)
            return 2
        from dflash.models import target_fp8

        target_fp8.MIN_FEATURES = args.fp8_min_features  # read at each load: this process only
    cfg = load_config(args.config, overrides)
    device = torch.device(args.device)
    path = cfg.target.path
    if args.tiny:
        import tempfile

        from dflash.data.synthetic import hybrid_target_config, write_target

        path = str(write_target(Path(tempfile.mkdtemp()) / "tiny", hybrid_target_config(num_hidden_layers=8), weights=False))
        cfg.data.token_budget = min(cfg.data.token_budget, 256)
        cfg.drafter.target_layer_ids = [1, 3, 5]
    rows = 1 if packed_mix else args.rows
    seq = cfg.data.token_budget // rows
    text = None
    if args.text:  # before the load: a wrong folder costs nothing
        try:
            text = text_tokens(args.text, rows * seq)
        except DflashError as e:
            print(f"target_rate: --text {args.text}: {e}", file=sys.stderr)
            return 2
    nvml = Nvml(enabled=device.type == "cuda")
    t0 = time.perf_counter()
    torch.manual_seed(cfg.train.seed)  # the random weights: the same again for --vs-bf16
    folder = path
    try:
        if args.weights == "real":
            from dflash.models.smollm2_convert import resolve_target

            folder = str(resolve_target(path))  # the demo's "smollm2": its converted folder
        vocab = target_text_config(folder).vocab_size
        if text is not None and int(text.max()) >= vocab:
            print(f"target_rate: --text {args.text}: token id {int(text.max()):,} is outside the target's vocabulary "
                  f"({vocab:,}); give text tokenized for this target", file=sys.stderr)
            return 2
        with NvmlPeak(nvml) as load_peak:  # target.precision = "fp8": built and quantised one layer at a time
            model = load_target(folder, cfg.target.dtype, device, random_init=args.weights == "random",
                                precision=cfg.target.precision, log=print)
    except DflashError as e:
        print(f"target_rate: {e}", file=sys.stderr)
        return 2
    if args.pytorch_linear_attention:
        use_torch_linear_attention(model)
    load_s = time.perf_counter() - t0
    print(f"target built in {load_s:.1f} s", flush=True)
    load = predicted_load(cfg, path, load_peak.peak, torch.cuda.memory_allocated() if device.type == "cuda" else None)
    layer_ids = feature_layer_ids(cfg, model.config.num_hidden_layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size - 1, (rows, seq), generator=g)
    if text is not None:
        ids = text.view(rows, seq)
    attention = torch.ones(rows, seq, dtype=torch.long)
    if rows > 1:
        attention[-1, seq - seq // 8:] = 0
    batch = {"input_ids": ids.to(device), "attention_mask": attention.to(device) if rows > 1 else None}
    lengths = [seq] * rows
    if packed_mix:
        lengths = packed_lengths(seq, *packed_mix)
        starts = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        batch["cu_seqlens"] = starts.to(device)
        batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
        print(f"packed: {len(lengths)} sequences in one row of {seq:,} tokens (lognormal mean {packed_mix[0]:,.0f}, "
              f"sigma {packed_mix[1]}; {min(lengths):,}-{max(lengths):,})", flush=True)
    want_last = cfg.train.kl_weight > 0  # timed as the trainer runs it: the last layers only for the KL term
    compare_last = want_last or args.vs_bf16  # the features kept for comparison: --vs-bf16 compares the final logits
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokens = rows * seq

    def measure(compiled: bool) -> dict:
        if compiled:
            compile_target(model)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, warmup_peak = [], None
        cuda = device.type == "cuda"
        with NvmlPeak(nvml) as peak, torch.no_grad():
            for i in range(args.warmup + args.steps):
                if i == args.warmup and cuda:  # the warm-up's peak (compilation and autotuning in it) apart
                    warmup_peak = int(torch.cuda.max_memory_allocated())
                    torch.cuda.reset_peak_memory_stats()
                sync()
                t = time.perf_counter()
                if args.padding_mask:
                    target_features(model, batch["input_ids"], batch["attention_mask"], layer_ids, want_last)
                else:
                    target_step(model, batch, layer_ids, want_last)
                sync()
                times.append(time.perf_counter() - t)
                print(f"{'compiled' if compiled else 'eager'} step {len(times)}: {times[-1]:.2f} s", flush=True)
        steady = times[args.warmup:]
        steady_peak = int(torch.cuda.max_memory_allocated()) if cuda else None
        extra = profile(compiled) if args.profile else {}
        from dflash.models.fla_tuning import tuning_seconds

        tuned_s, tuned = tuning_seconds()  # fla's autotuning so far in this process (in the first step of the first mode)
        return {**extra, "compiled": compiled, "first_step_s": round(times[0], 2), "step_s": [round(t, 4) for t in steady],
                "fla_autotune_s": round(tuned_s, 2), "fla_kernels_tuned": tuned,
                "tok_per_s": round(tokens / (sum(steady) / len(steady)), 1),
                "max_allocated_bytes": steady_peak, "warmup_max_allocated_bytes": warmup_peak,
                "nvml_peak_bytes": peak.peak}

    def profile(compiled: bool) -> dict:
        """One more step under torch.profiler (its slowest kernels to a text file), then one with each decoder
        layer's transient memory (peak during the layer minus allocated at its start), the largest per layer type."""
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        from dflash.models.target import decoder_of

        mode = "compiled" if compiled else "eager"
        args.profile.mkdir(parents=True, exist_ok=True)
        with torch.no_grad(), torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            target_step(model, batch, layer_ids, want_last)
            sync()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90)
        (args.profile / f"{mode}_kernels.txt").write_text(table)
        transient: dict[str, int] = {}
        start: dict[int, int] = {}

        def before(layer, _args):
            sync()
            torch.cuda.reset_peak_memory_stats()
            start[id(layer)] = torch.cuda.memory_allocated()

        def after(layer, _args, _out):
            sync()
            kind = f"{type(layer).__name__}:{getattr(layer, 'layer_type', '')}"
            transient[kind] = max(transient.get(kind, 0), torch.cuda.max_memory_allocated() - start[id(layer)])

        handles = [h for layer in decoder_of(model).layers
                   for h in (layer.register_forward_pre_hook(before), layer.register_forward_hook(after))]
        try:
            with torch.no_grad():
                target_step(model, batch, layer_ids, want_last)
        finally:
            for h in handles:
                h.remove()
        print(f"{mode}: transient GiB per layer type {dict((k, round(v / 2**30, 2)) for k, v in transient.items())}")
        return {"layer_transient_bytes": transient}

    if args.profile and device.type != "cuda":
        print("target_rate: --profile needs --device cuda", file=sys.stderr)
        return 2
    bound = kernels(model)  # before compile_target wraps the delta rule
    mode = args.compile or ("both" if device.type == "cuda" else "off")
    modes = {"off": [False], "on": [True], "both": [False, True]}[mode]
    runs, features = [], []

    def relative_errors(got: list, want: list) -> list[float]:
        """||got - want|| / ||want|| for each feature layer (the first output's hidden-size chunks), then the last
        hidden state when the step returns it."""
        per_layer = [*zip(got[0].chunk(len(layer_ids), -1), want[0].chunk(len(layer_ids), -1)), *zip(got[1:], want[1:])]
        return [float(f"{((g - w).norm() / w.norm()).item():.3g}") for g, w in per_layer]

    def floor(eager: list) -> None:
        """bf16's own noise at this depth: the same eager forward with another valid attention kernel."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            with torch.no_grad(), sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                other = [t.float().cpu() for t in target_step(model, batch, layer_ids, compare_last) if t is not None]
        except RuntimeError as e:
            print(f"eager with memory-efficient attention did not run: {str(e).splitlines()[0][:200]}")
            return
        runs[0]["relative_error_other_attention_kernel"] = relative_errors(other, eager)
        print(f"eager with memory-efficient attention vs eager (the noise floor): "
              f"{runs[0]['relative_error_other_attention_kernel']}")

    def against_bf16(fp8_features: list) -> dict:
        """The fp8 target's features and final logits against the same weights in target.dtype (the fp8 model
        freed first; random ones rebuilt from the same seed, real ones loaded again): per feature layer, then the last
        hidden state, relative error and mean cosine; the logits of the last 2,048 positions through the shared lm_head
        (not quantised): relative error, cosine, top-1 agreement."""
        nonlocal model
        model = None
        torch._dynamo.reset()  # its compiled graphs hold the fp8 model: the 27B's 26 GiB beside the bf16 twin's 47
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.weights == "real":
            plain = load_target(folder, cfg.target.dtype, device)
        else:
            torch.manual_seed(cfg.train.seed)  # built layer by layer as the fp8 target was: the same random weights
            config = load_target_config(resolve_target_dir(path))
            plain = freeze(bind_linear_attention(build_random(config, torch_dtype(cfg.target.dtype), device,
                                                              fp8=False)[0], device))
        if args.pytorch_linear_attention:  # the same Gated DeltaNet implementation as the fp8 target ran
            use_torch_linear_attention(plain)
        with torch.no_grad():
            ref = [t.float().cpu() for t in target_step(plain, batch, layer_ids, compare_last) if t is not None]
            head = plain.get_output_embeddings().weight
            logits = [(h[0, -2048:].to(device, head.dtype) @ head.t()).float() for h in (fp8_features[-1], ref[-1])]
        out = {"relative_error": relative_errors(fp8_features, ref), "cosine": cosines(fp8_features, ref),
               "logits": {"positions": int(logits[0].shape[0]),
                          "relative_error": float(f"{((logits[0] - logits[1]).norm() / logits[1].norm()).item():.3g}"),
                          "cosine": float(f"{torch.cosine_similarity(logits[0], logits[1], dim=-1).mean().item():.4g}"),
                          "top1_agreement": float(f"{(logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item():.4g}")}}
        print(f"fp8 vs {cfg.target.dtype} (eager {cfg.target.dtype}), per layer {layer_ids} + last: relative error "
              f"{out['relative_error']}, cosine {out['cosine']}; logits of the last {out['logits']['positions']:,} "
              f"positions: relative error {out['logits']['relative_error']}, cosine {out['logits']['cosine']}, "
              f"top-1 agreement {out['logits']['top1_agreement']}", flush=True)
        return out

    def cosines(got: list, want: list) -> list[float]:
        """Mean over tokens of the cosine between got's and want's vectors, per feature layer then the last hidden."""
        per_layer = [*zip(got[0].chunk(len(layer_ids), -1), want[0].chunk(len(layer_ids), -1)), *zip(got[1:], want[1:])]
        return [float(f"{torch.cosine_similarity(g, w, dim=-1).mean().item():.4g}") for g, w in per_layer]

    for compiled in modes:
        runs.append(measure(compiled))
        with torch.no_grad():
            # on the host: kept on the GPU they would count in the next mode's peak (5.6 GiB for the 27B target)
            features.append([t.float().cpu() for t in target_step(model, batch, layer_ids, compare_last)
                             if t is not None])
        if args.floor and not compiled:
            floor(features[0])
    if len(features) == 2:  # compiled against eager on this batch, per feature layer
        runs[1]["relative_error_vs_eager"] = relative_errors(features[1], features[0])
        print(f"compiled vs eager features, relative error per layer {layer_ids}{' + last' if compare_last else ''}: "
              f"{runs[1]['relative_error_vs_eager']}")
    tflops = round(forward_flops(model, layer_ids, want_last, lengths) / 1e12, 1)
    vs_bf16 = None
    if args.vs_bf16 and cfg.target.precision == "fp8":
        vs_bf16 = against_bf16(features[0])  # the eager fp8 features where both modes ran: eager against eager
    del features
    result = {
        "target": path, "weights": args.weights, "text": bool(args.text), "dtype": cfg.target.dtype,
        "tokens_per_batch": tokens, "rows": rows, "padding_mask": args.padding_mask,
        "packed": None if not packed_mix else {"mean": packed_mix[0], "sigma": packed_mix[1], "lengths": lengths},
        "precision": cfg.target.precision, "load": load, "vs_bf16": vs_bf16,
        "layer_ids": layer_ids, "want_last": want_last, "kernels": bound, "load_s": round(load_s, 2),
        "tflops_per_step": tflops,
        "runs": runs, "environment": environment(torch, args.device),
    }
    print(f"kernels: {result['kernels']}")
    mask = " with the padding mask" if args.padding_mask else ""
    for r in runs:
        tflops = result["tflops_per_step"] * r["tok_per_s"] / tokens
        layout = f"{len(lengths)} packed sequences" if packed_mix else f"{rows} rows"
        print(f"{'compiled' if r['compiled'] else 'eager'}: {tokens} tokens/batch in {layout}{mask} x {args.steps}: "
              f"{r['tok_per_s']:.0f} tok/s ({tflops:.0f} TFLOP/s), first step {r['first_step_s']:.1f} s; "
              f"torch peak {gib(r['max_allocated_bytes'])} (warm-up {gib(r['warmup_max_allocated_bytes'])}), NVML peak {gib(r['nvml_peak_bytes'])}")
        if r["fla_kernels_tuned"]:
            print(f"fla's autotuning: {r['fla_autotune_s']:.1f} s over {r['fla_kernels_tuned']} kernel(s) in this process")
    if args.fla_harvest:  # what fla chose here: DFLASH_FLA_TUNED=<this file> seeds a cold start with it
        from dflash.models.fla_tuning import harvest

        choices = harvest(result["environment"].get("gpu"))
        write_json(args.fla_harvest, choices)
        print(f"fla: {len(choices['kernels'])} kernel(s)' choices written to {args.fla_harvest}")
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
