"""Held-out evaluation during training (the run config's [eval]).

Every `eval.every` steps and at the end, the trainer measures the drafter on data it never trains on:

- teacher-forced, on every held-out sample (target features kept between evaluations with
  train.cache_features): the loss, per-slot accuracy and simulated acceptance
  length of the training step's own math (`dflash.train.loss.drafter_step_math`, no gradient), anchors drawn
  from a fixed generator per held-out batch, so two evaluations of the same weights give the same numbers;
  batches are summed, then divided once (a mean over all held-out blocks, tokens and slot weights);
- optionally, real speculative decoding on the prompts of the first `eval.real_prompts` held-out samples
  (their tokens before the first loss_mask = 1) against the target: the `dflash-eval` loop
  (`dflash.eval.speculative.Decoder`), its acceptance length and the lossless check. Target-only greedy
  decoding, the reference, is computed once per run (the target is frozen).

The held-out data is `eval.path` (its own Arrow dataset) or `eval.holdout` samples taken out of
`data.path` by sample id: a seeded choice, never trained on (`training_dataset` removes them from
every layout's batch sequence, since `dflash.data.plan.schedule` builds it) and written to heldout.json.
Numbers are logged beside the training metrics as heldout_* keys of metrics.jsonl.
Split runs refuse [eval] for now (dflash.config): their target ranks do not serve held-out batches.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash.data.plan import SubsetDataset, batch_sampler

BATCH_INDEX_OFFSET = 1 << 40  # anchor generator index of held-out batch i: never a training batch's index
BEST_KEYS = {"linear": "heldout_accept_len", "ddtree": "heldout_ddtree_accept_len"}  # eval.best_by -> metric


def best_key(cfg) -> str:
    """The held-out metric checkpoints/best maximises (eval.best_by)."""
    return BEST_KEYS[cfg.eval.best_by]












def write_ids(out: Path, cfg, dataset) -> None:
    """heldout.json: where the held-out samples come from (and their ids in data.path for eval.holdout)."""
    from dflash.runs.rundir import HELDOUT_NAME

    rec = {"source": cfg.eval.path or cfg.data.path, "samples": dataset.num_samples, "tokens": dataset.num_tokens}
    if isinstance(dataset, SubsetDataset):
        rec["sample_ids"] = dataset.ids.tolist()
    (Path(out) / HELDOUT_NAME).write_text(json.dumps(rec) + "\n")


def prompt_of(ids: np.ndarray, loss_mask: np.ndarray) -> list[int]:
    """A sample's prompt: its tokens before the first loss_mask = 1 (empty when it starts with a trained token)."""
    trained = np.flatnonzero(loss_mask)
    return ids[: int(trained[0]) if trained.size else 0].tolist()


def eos_ids(target) -> list[int]:
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(target.config, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else list(eos or [])


class HeldOut:
    """The held-out set of a run and the evaluation of a drafter on it (co-located: the target is in this process)."""

    def __init__(self, cfg, dataset, pad_id: int, log=print):
        self.cfg, self.dataset, self.pad_id, self.log = cfg, dataset, pad_id, log
        # fixed batches: the training batcher's first epoch over the held-out lengths, same budget
        self.batches = batch_sampler(cfg, dataset.lengths).epoch_batches(0)
        self.prompts = self._prompts(cfg.eval.real_prompts)
        self._reference: list[tuple[list[int], list[float]]] | None = None  # target-only greedy (tokens, margins)
        # with train.cache_features (small co-located runs) the held-out batches' target features are kept too
        self._features: dict[int, tuple] | None = {} if cfg.train.cache_features else None

    def _prompts(self, k: int) -> list[list[int]]:
        out = []
        for i in range(self.dataset.num_samples):
            if len(out) == k:
                break
            prompt = prompt_of(*self.dataset.get(i))
            if prompt:
                out.append(prompt)
        if len(out) < k:
            self.log(f"eval: {len(out)} of the {k} eval.real_prompts found (held-out samples with a prompt before "
                     "their first trained token)")
        return out

    def due(self, step: int, total: int) -> bool:
        every = self.cfg.eval.every
        return step == total or (every > 0 and step % every == 0)

    def describe(self) -> str:
        e = self.cfg.eval
        where = e.path or f"{e.holdout} samples of {self.cfg.data.path} (ids in heldout.json)"
        real = (f"; real decoding of {len(self.prompts)} prompts x {e.max_new_tokens} tokens" if self.prompts else "")
        return (f"held-out eval: {where}, {self.dataset.num_samples} samples in {len(self.batches)} batches, "
                f"{'every ' + str(e.every) + ' steps and ' if e.every else ''}at the end{real}; "
                f"checkpoints/best by {best_key(self.cfg)}")

    def evaluate(self, drafter, source, device, attn_backend: str) -> dict:
        """heldout_* metrics of the drafter now (the drafter is left in train mode)."""
        import torch

        was_training = drafter.training
        drafter.eval()
        try:
            with torch.no_grad():
                out = self.teacher_forced(drafter, source, device, attn_backend)
                if self.prompts:  # one row of a few tokens a call: uncompiled (each would be a graph of its own)
                    compiled = bool(drafter.layers) and drafter.layers[0].compiled
                    drafter.set_compile(False)
                    try:
                        out.update(self.real(drafter, source.model))
                    finally:
                        drafter.set_compile(compiled)
        finally:
            drafter.train(was_training)
        return out

    def teacher_forced(self, drafter, source, device, attn_backend: str) -> dict:
        from dflash.data.batching import collate

        embed_VH, head_VH = source.frozen_weights()
        total: dict = {}
        for i, indices in enumerate(self.batches):
            batch = {k: v.to(device) for k, v in collate(self.dataset, indices, self.pad_id,
                                                                     self.cfg.data.packing).items()}
            if self._features is not None and i in self._features:
                features = self._features[i]
            else:
                features = local_features(source, batch, device)
                if self._features is not None:
                    self._features[i] = features
            add_sums(total, batch_sums(drafter, embed_VH, head_VH, batch, features, self.cfg, device, attn_backend,
                                       BATCH_INDEX_OFFSET + i))
        return finish_sums(total)

    def real(self, drafter, target) -> dict:
        from dflash.eval.ddtree import cache_rolls_back
        from dflash.eval.speculative import Decoder, check_output, computed_linear, tree_report

        eos = eos_ids(target)
        n_new = self.cfg.eval.max_new_tokens
        if self._reference is None:
            base = Decoder(target, None, eos)
            self._reference = [base.greedy(p, n_new) for p in self.prompts]
        dec = Decoder(target, drafter, eos)
        linear = Decoder.speculative if cache_rolls_back(target) else computed_linear  # a hybrid: computed
        accepts, lossless = [], True
        for prompt, (ref, margins) in zip(self.prompts, self._reference):
            tokens, acc = linear(dec, prompt, n_new, drafter.config.block_size)
            accepts += acc
            found = check_output(dec, prompt, tokens, ref, margins)
            lossless &= found is None or found[0] == "tie"  # a tie-break of (near-)equal logits is not a lossy decoder
        out = {"heldout_real_accept_len": sum(accepts) / max(1, len(accepts)), "heldout_real_lossless": lossless,
               "heldout_real_prompts": len(self.prompts), "heldout_real_verify_steps": len(accepts)}
        budget = self.cfg.eval.ddtree_budget
        if budget:
            tree = tree_report(dec, self.prompts, self._reference, drafter.config.block_size, budget, n_new, "auto",
                               0.0, 0)
            out.update(heldout_ddtree_accept_len=tree.mean_accept_len, heldout_ddtree_budget=budget,
                       heldout_ddtree_lossless=tree.lossless, heldout_ddtree_mode=tree.mode)
        return out


def local_features(source, batch: dict, device):
    """The target's features of a held-out batch, computed on the spot (never from or into a feature cache)."""
    from dflash.train.loss import target_step
    from dflash.train.step import autocast

    with autocast(device):
        return target_step(source.model, batch, source.layer_ids, source.want_last)


def batch_sums(drafter, embed_VH, head_VH, batch: dict, features, cfg, device, attn_backend: str, index: int) -> dict:
    """Sums of one held-out batch (so batches and ranks merge exactly): the training step's math, no gradient."""

    from dflash.train.loss import batch_anchors, block_inputs, read_metrics
    from dflash.train.step import anchor_generator, micro_step

    loss, m = micro_step(drafter, embed_VH, head_VH, batch, features, cfg, device, attn_backend, index)
    (m,) = read_metrics([m])
    # the same anchors again (same generator), for the counts the means were taken over
    bs = drafter.config.block_size
    anchors_BA, valid_BA, _, end_BA = batch_anchors(batch, cfg.train, bs, anchor_generator(cfg, device, index))
    _, _, label_valid_BQ, _ = block_inputs(batch["input_ids"], anchors_BA, bs, drafter.config.mask_token_id,
                                           loss_mask_BS=batch["loss_mask"], valid_BA=valid_BA, end_BA=end_BA)
    B, A = anchors_BA.shape
    weight_sum = m.pop("weight_sum")  # sum of the loss's slot weights (train.slot_weights: they read the drafter)
    slot_tokens = label_valid_BQ.view(B, A, bs)[:, :, 1:].sum(dim=(0, 1)).tolist()
    return {
        "loss": float(loss.detach()) * weight_sum, "ce": m["ce"] * weight_sum, "weight": weight_sum,
        "accept": m["accept_len"] * m["blocks"], "blocks": m["blocks"],
        "slot_ok": [round(a * n) for a, n in zip(m["acc_slot"], slot_tokens)], "slot_tokens": slot_tokens,
        "samples": int(batch["lengths"].shape[0]),
    }


def add_sums(total: dict, part: dict) -> None:
    for k, v in part.items():
        if isinstance(v, list):
            total[k] = [a + b for a, b in zip(total[k], v)] if k in total else list(v)
        else:
            total[k] = total.get(k, 0) + v


def finish_sums(total: dict) -> dict:
    """heldout_* means over every held-out block, token and slot weight."""
    ok, n = total["slot_ok"], total["slot_tokens"]
    return {
        "heldout_loss": total["loss"] / max(total["weight"], 1e-12),
        "heldout_ce": total["ce"] / max(total["weight"], 1e-12),
        "heldout_accept_len": total["accept"] / max(total["blocks"], 1),
        "heldout_acc": sum(ok) / max(sum(n), 1),
        "heldout_acc_slot": [round(a / max(b, 1), 4) for a, b in zip(ok, n)],
        "heldout_blocks": int(total["blocks"]), "heldout_samples": int(total["samples"]),
    }
