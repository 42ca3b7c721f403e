"""The co-located trainer: one process, one device (CPU or one GPU), target and drafter together.

Reads as a plain loop: build -> (resume) -> step -> log -> checkpoint -> finish.
The math of a step lives in dflash.loss; this file owns the run's life.
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash import checkpoint as ckpt
from dflash.config import RunConfig, dump_config
from dflash.data import BucketBatchSampler, ShardDataset, collate, prefetch
from dflash.loss import drafter_step_math, target_step
from dflash.model import DFlashDrafter, drafter_config_from_target
from dflash.target import load_target, target_embed_and_head
from dflash.errors import DflashError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def cosine_lr(step: int, total: int, warmup_ratio: float) -> float:
    """LR multiplier: linear warmup over warmup_ratio of the steps, then cosine to 0."""
    warmup = max(1, int(round(total * warmup_ratio)))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class RunError(DflashError):
    """A run that cannot start as configured; the message is one line."""


DUPLICATE_SIGNAL_S = 2.0  # the same signal again within this many seconds is the same stop


@dataclass
class StopFlag:
    """Set by SIGINT/SIGTERM; the loop finishes its step, checkpoints and exits 0."""
    requested: bool = False
    signame: str = ""
    _at: float = 0.0
    _old: dict = field(default_factory=dict)

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            if signal.Signals(signum).name != self.signame or time.monotonic() - self._at < DUPLICATE_SIGNAL_S:
                # torchrun's SIGTERM after a Ctrl-C, or one stop delivered twice (a scheduler signals every
                # process and a launcher forwards it): the same stop, already under way
                return
            raise KeyboardInterrupt  # the same signal again, later: leave now
        self.requested = True
        self.signame = signal.Signals(signum).name
        self._at = time.monotonic()
        print(f"\n{self.signame}: finishing this step, then saving a checkpoint (send again to abort)",
              file=sys.stderr, flush=True)


def anchor_generator(cfg: RunConfig, device: torch.device, batch_index: int) -> torch.Generator:
    """Anchors depend only on (seed, global batch index): resumes and split runs draw the same ones."""
    return torch.Generator(device=device).manual_seed(cfg.train.seed * 1_000_003 + batch_index)


def micro_step(drafter, embed_w, head_w, batch: dict, cfg: RunConfig, device, attn_backend: str, batch_index: int,
               target=None, context=None):
    """Forward + loss for one batch (graph kept for backward). Features come from `target` or `context`."""
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        if context is None:
            layer_ids = getattr(drafter, "module", drafter).config.target_layer_ids
            context = target_step(target, batch, layer_ids, cfg.train.kl_weight > 0)
        context_BSF, last_BSH = context
        return drafter_step_math(drafter, embed_w, head_w, batch, context_BSF, last_BSH, cfg,
                                 anchor_generator(cfg, device, batch_index), attn_backend)


def average_metrics(parts: list[tuple[float, dict]]) -> dict:
    """Mean loss and metrics over a step's batches (lists averaged element-wise)."""
    out: dict = {"loss": sum(loss for loss, _ in parts) / len(parts)}
    for key, value in parts[0][1].items():
        values = [m[key] for _, m in parts]
        if isinstance(value, list):
            out[key] = [round(sum(col) / len(col), 4) for col in zip(*values)]
        elif isinstance(value, (int, float)):
            out[key] = sum(values) / len(values)
    return out


def target_folder(path: str, log=print) -> str:
    """The target's HF folder: `smollm2` names the embedded default (converted once, then cached)."""
    if path == "smollm2":
        from dflash.smollm2 import resolve_target

        return str(resolve_target(path, log=log))
    return path


def resolve_mask_token_id(cfg: RunConfig, target_config) -> int:
    if cfg.drafter.mask_token_id is not None:
        return cfg.drafter.mask_token_id
    vocab = target_config.vocab_size
    pad = getattr(target_config, "pad_token_id", None)
    # A token the data never asks the drafter to predict: the pad token if there is one, else the last id.
    return int(pad) if isinstance(pad, int) and 0 <= pad < vocab else vocab - 1


class FeatureCache:
    """The target's features of every sample seen so far (train.cache_features): later epochs skip the target.

    Rows are stored unpadded by sample index; a batch whose samples are all cached is rebuilt
    right-padded, as the target would have produced it (padded positions are masked anyway).
    """

    def __init__(self, layer_ids: list[int], want_last: bool):
        self.layer_ids, self.want_last = layer_ids, want_last
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def context(self, target, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids, lengths = batch["sample_ids"].tolist(), batch["lengths"].tolist()
        if any(i not in self.rows for i in ids):
            context_BSF, last_BSH = target_step(target, batch, self.layer_ids, self.want_last)
            for r, (i, n) in enumerate(zip(ids, lengths)):
                last = last_BSH[r, :n].clone() if last_BSH is not None else None
                self.rows.setdefault(i, (context_BSF[r, :n].clone(), last))
            return context_BSF, last_BSH
        S = batch["input_ids"].shape[1]
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, S - t.shape[0]))  # noqa: E731
        context_BSF = torch.stack([pad(self.rows[i][0]) for i in ids])
        last_BSH = torch.stack([pad(self.rows[i][1]) for i in ids]) if self.want_last else None
        return context_BSF, last_BSH


class Trainer:
    def __init__(self, cfg: RunConfig, resume_from: Path | None = None, log=print):
        self.cfg, self.log = cfg, log
        self.out = Path(cfg.output_dir)
        self.device = torch.device("cuda" if cfg.device == "cuda" else "cpu")
        self.attn_backend = "flex" if self.device.type == "cuda" else "sdpa"
        torch.manual_seed(cfg.train.seed)

        self.dataset = ShardDataset(cfg.data.path)
        self.sampler = BucketBatchSampler(self.dataset.lengths, cfg.data.token_budget, cfg.data.max_batch_size,
                                          cfg.data.num_buckets, cfg.train.seed)
        self.accum = cfg.train.grad_accum
        self.total_steps = cfg.train.max_steps or cfg.train.epochs * self.sampler.batches_per_epoch // self.accum
        if self.total_steps < 1:
            raise RunError(f"{cfg.data.path}: {self.sampler.batches_per_epoch} batches per epoch x {cfg.train.epochs} "
                           f"epochs make no step of {self.accum} batches; add data, epochs, or set train.max_steps")

        self.target = load_target(target_folder(cfg.target.path, log), DTYPES[cfg.target.dtype], self.device,
                                  cfg.target.random_init)
        dcfg = drafter_config_from_target(self.target.config, cfg.drafter.num_layers, cfg.drafter.block_size,
                                          cfg.drafter.target_layer_ids or None, self._mask_token_id())
        self.drafter = DFlashDrafter(dcfg).to(self.device, torch.float32)
        self.embed_w, self.head_w = target_embed_and_head(self.target)
        self.features = FeatureCache(dcfg.target_layer_ids, cfg.train.kl_weight > 0) if cfg.train.cache_features else None
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.train.lr,
                                           weight_decay=cfg.train.weight_decay, betas=(0.9, 0.95),
                                           fused=self.device.type == "cuda")
        self.step = 0
        self.resumed_from = None
        if resume_from is not None:
            self._resume(resume_from)

    def _mask_token_id(self) -> int:
        return resolve_mask_token_id(self.cfg, self.target.config)

    def _dataset_meta(self) -> dict:
        return {"path": self.cfg.data.path, "samples": self.dataset.num_samples,
                "fingerprint": self.dataset.fingerprint}

    def _resume(self, path: Path) -> None:
        state, meta = ckpt.load_checkpoint(path, self.drafter, self.optimizer, self.device)
        self.step = int(state["step"])
        old = meta.get("dataset", {})
        if old.get("fingerprint") == self.dataset.fingerprint:
            self.sampler.load_state_dict(state["sampler"])
        else:
            self.sampler.load_state_dict({"epoch": state["sampler"]["epoch"], "index": 0})
            self.log(f"dataset changed since {path.name}: {old.get('samples')} -> {self.dataset.num_samples} "
                     f"samples; schedule recomputed ({self.total_steps} steps), epoch "
                     f"{state['sampler']['epoch']} restarts from its first batch")
        torch.set_rng_state(state["rng_cpu"])
        if self.device.type == "cuda" and state.get("rng_cuda") is not None:
            torch.cuda.set_rng_state(state["rng_cuda"])
        self.resumed_from = path
        self.log(f"resumed from {path} at step {self.step}")

    def save(self) -> Path:
        from preflight.gate import provenance

        state = {"step": self.step, "sampler": self.sampler.state_dict(), "rng_cpu": torch.get_rng_state(),
                 "rng_cuda": torch.cuda.get_rng_state() if self.device.type == "cuda" else None}
        path = ckpt.save_checkpoint(self.out, self.step, self.drafter, self.optimizer, state, self.cfg,
                                    self._dataset_meta(), self.cfg.train.keep_last, provenance(self.cfg.profile))
        return path

    def _set_lr(self) -> float:
        lr = self.cfg.train.lr * cosine_lr(self.step, self.total_steps, self.cfg.train.warmup_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def train_step(self, batches: list[dict], first_batch_index: int) -> dict:
        """One optimizer step over grad_accum batches; returns plain-float metrics (means over the batches)."""
        lr = self._set_lr()
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        for i, batch in enumerate(batches):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            context = None
            if self.features is not None:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                    context = self.features.context(self.target, batch)
            loss, m = micro_step(self.drafter, self.embed_w, self.head_w, batch, self.cfg, self.device,
                                 self.attn_backend, first_batch_index + i, target=self.target, context=context)
            (loss / len(batches)).backward()
            parts.append((float(loss.detach()), m))
        grad_norm = None
        if self.cfg.train.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.train.grad_clip))
        self.optimizer.step()
        self.step += 1
        out = average_metrics(parts)
        out.update(lr=lr, grad_norm=grad_norm)
        return out

    def batches(self):
        """(epoch, index, batch) from the current data position, read and collated ahead by a thread.

        The producer walks a copy of the sampler; ``self.sampler`` moves only as batches are handed
        out here, so a checkpoint records the consumed position, not the read-ahead one.
        """
        pad = getattr(self.target.config, "pad_token_id", None)
        pad = pad if isinstance(pad, int) else 0
        pin = self.device.type == "cuda"
        reader = copy.copy(self.sampler)

        def collated():
            for epoch, index, indices in reader:
                batch = collate(self.dataset, indices, pad)
                batch["sample_ids"] = torch.tensor(indices)  # the feature cache's keys
                yield epoch, index, ({k: v.pin_memory() for k, v in batch.items()} if pin else batch)

        for epoch, index, batch in prefetch(collated()):
            self.sampler.load_state_dict({"epoch": epoch, "index": index + 1})
            yield epoch, index, batch

    def print_plan(self) -> None:
        self.log(f"dataset {self.cfg.data.path}: {self.dataset.num_samples} samples, "
                 f"{int(self.dataset.lengths.sum())} tokens")
        self.log(self.sampler.summary())
        d = self.drafter.config
        n_params = sum(p.numel() for p in self.drafter.parameters())
        self.log(f"drafter: {d.num_hidden_layers} layers, block {d.block_size}, target layers {d.target_layer_ids}, "
                 f"{n_params / 1e6:.1f}M trainable params; attention {self.attn_backend} on {self.device}")
        self.log(f"schedule: {self.total_steps} steps, lr {self.cfg.train.lr} cosine, warmup "
                 f"{self.cfg.train.warmup_ratio}")
        if self.features is not None:
            width = len(d.target_layer_ids) * self.target.config.hidden_size
            width += self.target.config.hidden_size if self.features.want_last else 0
            size = int(self.dataset.lengths.sum()) * width * self.embed_w.element_size()
            self.log(f"feature cache: the target runs in epoch 1 only; the cache grows to {size / 2**30:.2f} GiB "
                     f"on {self.device}")


def run(cfg: RunConfig, resume_from: Path | None, log=print, progress: bool | None = None) -> int:
    """Train to the end (or to a signal). Returns the exit code."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(dump_config(cfg))
    trainer = Trainer(cfg, resume_from, log=log)
    trainer.print_plan()
    metrics_path = out / "metrics.jsonl"
    stop = StopFlag()
    stop.install()
    progress = sys.stderr.isatty() if progress is None else progress
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=trainer.total_steps, initial=trainer.step, unit="step", dynamic_ncols=True)
    last_save = trainer.step
    try:
        with metrics_path.open("a") as mfile:
            t0, tokens = time.perf_counter(), 0
            stream = trainer.batches()
            while trainer.step < trainer.total_steps:
                group = [next(stream) for _ in range(trainer.accum)]
                epoch = group[-1][0]
                batches = [b for _, _, b in group]
                m = trainer.train_step(batches, trainer.step * trainer.accum)
                tokens += sum(int(b["lengths"].sum()) for b in batches)
                if trainer.step % cfg.train.log_every == 0 or trainer.step == trainer.total_steps:
                    if trainer.device.type == "cuda":
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    m.update(step=trainer.step, epoch=epoch, tok_per_s=round(tokens / dt, 1),
                             mem_gib=_mem_gib(trainer.device))
                    mfile.write(json.dumps(m) + "\n")
                    mfile.flush()
                    line = (f"step {trainer.step}/{trainer.total_steps} loss {m['loss']:.4f} "
                            f"accept {m.get('accept_len', float('nan')):.3f} tok/s {m['tok_per_s']:.0f} "
                            f"lr {m['lr']:.2e}")
                    if bar:
                        bar.set_postfix_str(line.split(" ", 2)[2])
                    else:
                        log(line)
                    t0, tokens = time.perf_counter(), 0
                if bar:
                    bar.update(1)
                if trainer.step % cfg.train.save_every == 0:
                    trainer.save()
                    last_save = trainer.step
                if stop.requested:
                    break
        if trainer.step != last_save or not ckpt.list_checkpoints(out):
            path = trainer.save()
        else:
            path = ckpt.list_checkpoints(out)[-1]
    finally:
        stop.restore()
        if bar:
            bar.close()
    if stop.requested:
        log(f"stopped by {stop.signame} at step {trainer.step}; checkpoint {path}")
        log(f"resume with: dflash-train --config <this config> --resume latest  (output_dir {out})")
        return 0
    trainer.drafter.save_pretrained(out / "drafter")
    log(f"done: {trainer.step} steps; checkpoint {path}; drafter saved to {out / 'drafter'}")
    return 0


def _mem_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)


def warm_cache(cfg: RunConfig, log=print) -> int:
    """Compile the kernels for the configured shapes once, then write the cache manifest preflight reads."""
    from dflash.compile_manifest import write_manifest
    from preflight.gate import compile_cache_dir

    cache = compile_cache_dir(cfg.profile)
    if cfg.device != "cuda" or not torch.cuda.is_available():
        log("warm-cache: nothing to compile on CPU (flex attention is compiled on CUDA only)")
        return 0
    trainer = Trainer(cfg, None, log=log)
    t0 = time.perf_counter()
    _, _, batch = next(trainer.batches())
    trainer.train_step([batch], 0)
    torch.cuda.synchronize()
    import triton

    props = torch.cuda.get_device_properties(0)
    write_manifest(cache, {"torch": torch.__version__, "triton": triton.__version__, "gpu_name": props.name,
                           "compute_capability": f"{props.major}.{props.minor}", "drafter_hash": cfg.drafter_hash()})
    log(f"warm-cache: compiled in {time.perf_counter() - t0:.1f} s; manifest written to {cache}")
    return 0


def set_compile_cache_env(profile_name: str) -> None:
    """Point inductor at the profile's cache before torch compiles anything."""
    from preflight.gate import compile_cache_dir

    try:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir(profile_name)))
    except ValueError:
        pass
