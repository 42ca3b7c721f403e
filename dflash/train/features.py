"""Feature sources: where a drafter step's (context, last hidden) come from, one class per layout.

    LocalTarget     the frozen target in this process (co-located runs, and a split run's target ranks)
    CachedTarget    the local target, its features kept after their first batch (train.cache_features)
    RemoteTargets   a split drafter rank's: target ranks compute the features and send them over torch.distributed

The trainer holds one of them (`FeatureSource`) and never asks which; the step itself is dflash.train.step.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch
import torch.distributed as dist

from dflash.config import RunConfig, default_target_layer_ids
from dflash.memory.pace import busy_rates, suggested_splits
from dflash.models.target import compile_target, load_target, target_embed_and_head, target_text_config, torch_dtype
from dflash.train.layout import Rank
from dflash.train.loss import target_step
from dflash.train.step import autocast


def feature_layer_ids(cfg: RunConfig, num_target_layers: int) -> list[int]:
    """The target layers the drafter reads: the config's list, else spread evenly (dflash.config)."""
    return list(cfg.drafter.target_layer_ids or default_target_layer_ids(num_target_layers, cfg.drafter.num_layers))


def target_folder(path: str, log=print) -> str:
    """The target's HF folder (the embedded default converted once, then cached; smollm2_convert.resolve_target)."""
    from dflash.models.smollm2_convert import resolve_target

    return str(resolve_target(path, log=log))


class FeatureSource(Protocol):
    """What the trainer needs from the target side, whatever the layout: every source has every member, so the
    trainer never asks which one it holds (a member with nothing to do returns {}, "" or None)."""

    target_config: object  # the target's HF config (vocab_size, hidden_size, num_hidden_layers, pad_token_id)
    model: torch.nn.Module | None  # the target when it runs in this process (held-out eval decodes with it), else None

    def frozen_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding [V, H], lm_head [V, H]) of the target, on the trainer's device."""

    def expect(self, k: int, batch: dict) -> None:
        """Global batch k will be asked for soon (remote targets post its receive now)."""

    def features(self, k: int, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(context [B, S, n*H], last hidden [B, S, H] or None) of global batch k, on the trainer's device."""

    def counters(self) -> dict:
        """Timing counters since the last call (summed over ranks by the trainer), for the metrics."""

    def rates(self, counters: dict, dt: float, world: int) -> dict:
        """Fields a metrics row adds from a log window's summed counters over `dt` seconds ({}: none)."""

    def rates_line(self, rec: dict) -> str:
        """What the progress line adds from those fields of metrics row `rec` ("": nothing)."""

    def describe(self) -> str:
        """One line for the run's plan."""

    def cache_bytes(self, num_tokens: int) -> int | None:
        """Bytes its feature cache grows to over `num_tokens` tokens (None: it caches nothing)."""

    def summary(self, rows: list[dict]) -> str | None:
        """Lines for the end of the run from this process's metrics rows past the first logged window (whose first
        step is mostly compilation); None: nothing to add."""


class LocalTarget:
    """The frozen target in this process: features computed on the spot."""

    def __init__(self, cfg: RunConfig, device: torch.device, log=print):
        self.cfg, self.device = cfg, device
        self.model = load_target(target_folder(cfg.target.path, log), torch_dtype(cfg.target.dtype), device,
                                 cfg.target.random_init, cfg.target.precision, log)
        if cfg.target.compile and device.type == "cuda":
            compile_target(self.model)
        self.target_config = self.model.config
        self.layer_ids = feature_layer_ids(cfg, self.target_config.num_hidden_layers)
        self.want_last = cfg.train.kl_weight > 0

    def frozen_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return target_embed_and_head(self.model)

    def expect(self, k: int, batch: dict) -> None:
        pass

    def features(self, k: int, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        with autocast(self.device):
            return target_step(self.model, batch, self.layer_ids, self.want_last)

    def counters(self) -> dict:
        return {}

    def rates(self, counters: dict, dt: float, world: int) -> dict:
        return {}

    def rates_line(self, rec: dict) -> str:
        return ""

    def describe(self) -> str:
        fp8 = ", fp8 linears" if self.cfg.target.precision == "fp8" else ""
        return f"target {self.cfg.target.path} ({self.cfg.target.dtype}{fp8}) on {self.device}, layers {self.layer_ids}"

    def cache_bytes(self, num_tokens: int) -> int | None:
        return None

    def summary(self, rows: list[dict]) -> str | None:
        return None


class CachedTarget(LocalTarget):
    """The local target, whose features of every sample seen so far are kept (train.cache_features).

    Rows are stored unpadded by sample index; a batch whose samples are all cached is rebuilt
    right-padded, as the target would have produced it (padded positions are masked anyway), so
    later epochs run the drafter alone.
    """

    def __init__(self, cfg: RunConfig, device: torch.device, log=print):
        super().__init__(cfg, device, log)
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def features(self, k: int, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids, lengths = batch["sample_ids"].tolist(), batch["lengths"].tolist()
        if "cu_seqlens" in batch:  # a packed row: sample j is [cu[j], cu[j+1]) of row 0
            spans = [(0, s, e) for s, e in zip(batch["cu_seqlens"][:-1].tolist(), batch["cu_seqlens"][1:].tolist())]
        else:
            spans = [(r, 0, n) for r, n in enumerate(lengths)]
        if any(i not in self.rows for i in ids):
            context_BSF, last_BSH = super().features(k, batch)
            for i, (r, s, e) in zip(ids, spans):
                last = last_BSH[r, s:e].clone() if last_BSH is not None else None
                self.rows.setdefault(i, (context_BSF[r, s:e].clone(), last))
            return context_BSF, last_BSH
        if "cu_seqlens" in batch:
            context_BSF = torch.cat([self.rows[i][0] for i in ids])[None]
            last_BSH = torch.cat([self.rows[i][1] for i in ids])[None] if self.want_last else None
            return context_BSF, last_BSH
        S = batch["input_ids"].shape[1]
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, S - t.shape[0]))  # noqa: E731
        context_BSF = torch.stack([pad(self.rows[i][0]) for i in ids])
        last_BSH = torch.stack([pad(self.rows[i][1]) for i in ids]) if self.want_last else None
        return context_BSF, last_BSH

    def cache_bytes(self, num_tokens: int) -> int:
        H = self.target_config.hidden_size
        width = len(self.layer_ids) * H + (H if self.want_last else 0)
        return num_tokens * width * self.frozen_weights()[0].element_size()

    def describe(self) -> str:
        return super().describe() + "; features cached after their first batch (the target runs in epoch 1 only)"


def local_source(cfg: RunConfig, device: torch.device, log=print) -> LocalTarget:
    return (CachedTarget if cfg.train.cache_features else LocalTarget)(cfg, device, log)


class RemoteTargets:
    """A drafter rank's feature source: target ranks compute the features and send them here.

    `expect` posts the receives of a batch as soon as the trainer knows it (a step ahead), so the
    transfer overlaps the current step; `features` waits for its arrival.
    """

    def __init__(self, cfg: RunConfig, me: Rank, share_group, device: torch.device):
        self.cfg, self.me, self.device = cfg, me, device
        self.target_config = target_text_config(target_folder(cfg.target.path))
        self.model = None  # the target runs on the target ranks
        self.n_layers = len(feature_layer_ids(cfg, self.target_config.num_hidden_layers))
        self.want_last = cfg.train.kl_weight > 0
        self.wire = torch_dtype(cfg.target.dtype)
        V, H = self.target_config.vocab_size, self.target_config.hidden_size
        self.embed = torch.empty(V, H, dtype=self.wire, device=device)
        self.head = torch.empty(V, H, dtype=self.wire, device=device)
        dist.broadcast(self.embed, src=me.n_drafters, group=share_group)
        dist.broadcast(self.head, src=me.n_drafters, group=share_group)
        self.posted: dict[int, tuple] = {}
        self._counters = dict.fromkeys(("recv_wait_s", "target_compute_s", "target_wait_s"), 0.0)

    def frozen_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed, self.head

    def expect(self, k: int, batch: dict) -> None:
        B, S = batch["input_ids"].shape
        H = self.target_config.hidden_size
        src = self.me.n_drafters + k % self.me.n_targets
        bufs = [torch.empty(2, dtype=torch.float64, device=self.device),
                torch.empty(B, S, self.n_layers * H, dtype=self.wire, device=self.device)]
        if self.want_last:
            bufs.append(torch.empty(B, S, H, dtype=self.wire, device=self.device))
        self.posted[k] = ([dist.irecv(b, src=src) for b in bufs], bufs)

    def features(self, k: int, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        handles, bufs = self.posted.pop(k)
        t0 = time.perf_counter()
        for h in handles:
            h.wait()
        if self.device.type == "cuda":  # NCCL's wait() only orders streams; sync to see the real arrival time
            torch.cuda.current_stream(self.device).synchronize()
        self._counters["recv_wait_s"] += time.perf_counter() - t0
        compute_s, wait_s = bufs[0].tolist()
        self._counters["target_compute_s"] += compute_s
        self._counters["target_wait_s"] += wait_s
        return bufs[1], (bufs[2] if self.want_last else None)

    def counters(self) -> dict:
        out, self._counters = self._counters, dict.fromkeys(self._counters, 0.0)
        return out

    def rates(self, c: dict, dt: float, world: int) -> dict:
        """Per-role rates and wait fractions of a log window (counters summed over drafter ranks)."""
        tokens = c["tokens"]
        return {
            "drafter_wait_frac": c["recv_wait_s"] / (world * dt),
            "target_wait_frac": c["target_wait_s"] / max(1e-9, c["target_wait_s"] + c["target_compute_s"]),
            "target_tok_s_per_gpu": tokens / max(1e-9, c["target_compute_s"]),
            "drafter_tok_s_per_gpu": tokens / max(1e-9, world * dt - c["recv_wait_s"]),
            "n_targets": self.me.n_targets, "n_drafters": self.me.n_drafters,
        }

    def rates_line(self, rec: dict) -> str:
        return (f"(target {rec['target_tok_s_per_gpu']:.0f}/GPU, drafter {rec['drafter_tok_s_per_gpu']:.0f}/GPU) "
                f"wait: drafters {rec['drafter_wait_frac']:.0%} targets {rec['target_wait_frac']:.0%}")

    def describe(self) -> str:
        return (f"{self.me.n_targets} target rank(s) over torch.distributed, {self.n_layers} layers"
                + (" + last hidden" if self.want_last else "") + f" sent as {self.cfg.target.dtype}")

    def cache_bytes(self, num_tokens: int) -> int | None:
        return None

    def summary(self, rows: list[dict]) -> str | None:
        """Busy per-role rates of the run's steady rows and the split they suggest for this run's GPU count and 8.

        The rates are busy rates (RemoteTargets.rates): a target's tokens over its compute time (send waits left
        out), a drafter's over its time not waiting for features. `rows` leaves out the first logged window, whose
        first step is mostly compilation."""
        busy = busy_rates(rows)
        if busy is None:
            return ("no per-role rates past the first logged window (it holds the compilation); log more often "
                    "(train.log_every) for a suggested split")
        t_rate, d_rate, n_rows = busy
        lines = [f"busy: target {t_rate:.0f} tok/s per GPU, drafter {d_rate:.0f} tok/s per GPU "
                 f"(mean of {n_rows} logged window(s), the first left out)"]
        for n, t, d, tok_s in suggested_splits(t_rate, d_rate, (self.me.world, 8)):
            lines.append(f"suggested split for {n} GPUs: {t} target + {d} drafter, expected {tok_s:.0f} tok/s")
        return "\n".join(lines)
