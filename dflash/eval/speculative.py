"""Greedy speculative decoding of a drafter against its target, checked lossless (the torch half of dflash-eval).

Per prompt (batch 1), the target prefills the prompt and emits the first token. Then each
verify step: the drafter drafts one block at anchor n = the position of the last token (slot 0
= that token, slots 1..B-1 = the mask token, context = the target features of positions < n),
the target runs once over [last token, draft_1..draft_{B-1}], and the leading drafted tokens
equal to the target's own greedy tokens are accepted, plus the target's next token. The step's
acceptance length is accepted + 1.

The target keeps a KV cache (rolled back past the first rejected token), so a verify step costs
one forward over B new tokens. The drafter recomputes its context projection over the whole
prefix each step (it is 1-5 layers; cheap at these lengths).
Target-only greedy decoding (the same cached forward, one token at a time) is the reference:
the speculative output must equal it token for token, else the report says where and exit 1.
``dflash.eval.evaluate`` checks the inputs without torch first and reports.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash.data.prepare import eos_ids_of
from dflash.data.prompts import prompts_within
from dflash.eval.ddtree import cache_rolls_back
from dflash.eval.results import EvalError, EvalReport, TreeReport
from dflash.models.attention import build_layer_masks
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import target_embed_and_head
from dflash.models.target_fp8 import fp8_linears


def check_pair(target, drafter: DFlashDrafter) -> None:
    t, d = target.config, drafter.config
    layers = t.num_hidden_layers
    problems = []
    if d.vocab_size != t.vocab_size:
        problems.append(f"vocab {d.vocab_size} vs the target's {t.vocab_size}")
    if d.hidden_size != t.hidden_size:
        problems.append(f"hidden {d.hidden_size} vs {t.hidden_size}")
    if d.num_target_layers != layers or max(d.target_layer_ids) >= layers:
        problems.append(f"trained on a {d.num_target_layers}-layer target, this one has {layers}")
    if problems:
        raise EvalError("the drafter does not belong to this target: " + "; ".join(problems))


class Decoder:
    """The target (with KV cache) and, optionally, a drafter; batch 1."""

    def __init__(self, target, drafter: DFlashDrafter | None, eos_ids: list[int]):
        self.target, self.drafter, self.eos_ids = target, drafter, set(eos_ids)
        self.device = next(target.parameters()).device
        self.embed_w, self.head_w = target_embed_and_head(target)
        # Logits closer than this relative gap are a tie at the target's precision (one bf16 ulp: 2^-7 of the value).
        self.tie_eps = torch.finfo(self.head_w.dtype).eps

    def new_cache(self):
        """An empty KV cache shaped by the target's config (a hybrid's Gated DeltaNet layers keep their state there)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.target.config)

    def _forward(self, ids: list[int], cache, last_only: bool = False):
        from_ids = torch.tensor([ids], device=self.device)
        out = self.target(input_ids=from_ids, past_key_values=cache, use_cache=True,
                          output_hidden_states=self.drafter is not None, logits_to_keep=1 if last_only else 0)
        feats = None
        if self.drafter is not None:
            # feature of target layer l = hidden_states[l + 1], as in dflash.models.target.target_features
            feats = torch.cat([out.hidden_states[i + 1][0] for i in self.drafter.config.target_layer_ids], dim=-1)
        return out.logits[0].float(), feats

    def _finished(self, tokens: list[int], max_new: int) -> bool:
        return len(tokens) >= max_new or bool(self.eos_ids.intersection(tokens))

    def _truncate(self, tokens: list[int], max_new: int) -> list[int]:
        for i, t in enumerate(tokens):
            if t in self.eos_ids:
                return tokens[: i + 1][:max_new]
        return tokens[:max_new]

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
        """Target-only greedy tokens and the top-2 logit margin behind each (for mismatch reports)."""
        cache = self.new_cache()
        logits, _ = self._forward(prompt, cache, last_only=True)
        tokens, margins = [], []
        while True:
            top = logits[-1].topk(2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            if self._finished(tokens, max_new):
                return tokens, margins
            logits, _ = self._forward([tokens[-1]], cache, last_only=True)

    @torch.no_grad()
    def not_greedy_at(self, prompt: list[int], tokens: list[int]) -> int | None:
        """The first index of tokens that is not a greedy choice of the target after prompt + tokens before it,
        within one ulp of the top logit in the target's dtype (|top| x eps), or None: one forward over them all."""
        ids = torch.tensor([prompt + tokens], device=self.device)
        logits = self.target(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1: len(prompt) - 1 + len(tokens)]
        logits = logits.float()
        top = logits.max(dim=-1).values
        chosen = logits.gather(1, torch.tensor(tokens, device=self.device)[:, None])[:, 0]
        bad = (chosen < top - top.abs() * self.tie_eps).nonzero()
        return int(bad[0, 0]) if len(bad) else None

    @torch.no_grad()
    def draft(self, ctx_SF: torch.Tensor, last: int, block_size: int) -> list[int]:
        """The drafter's tokens for slots 1..B-1 of a block anchored at n = len(ctx) (slot 0 = last)."""
        return self.draft_logits(ctx_SF, last, block_size).argmax(dim=-1).tolist()

    @torch.no_grad()
    def draft_logits(self, ctx_SF: torch.Tensor, last: int, block_size: int) -> torch.Tensor:
        """The drafter's logits [B-1, V] for slots 1..B-1 of a block anchored at n = len(ctx) (slot 0 = last)."""
        d = self.drafter
        n = ctx_SF.shape[0]
        block = torch.full((1, block_size), d.config.mask_token_id, device=self.device)
        block[0, 0] = last
        noise_BQH = F.embedding(block, self.embed_w)
        attn = build_layer_masks(torch.tensor([[n]]), torch.tensor([[True]]), n, block_size, self.device, "sdpa",
                                 d.config.layer_types, d.config.sliding_window)
        ctx_pos = torch.arange(n, device=self.device)[None]
        q_pos = torch.arange(n, n + block_size, device=self.device)[None]
        hidden_QH = d(ctx_SF[None], noise_BQH, ctx_pos, q_pos, attn)[0, 1:]
        return hidden_QH.to(self.head_w.dtype) @ self.head_w.T

    @torch.no_grad()
    def speculative(self, prompt: list[int], max_new: int, block_size: int) -> tuple[list[int], list[int]]:
        """Speculative greedy tokens and the acceptance length of every verify step."""
        cache = self.new_cache()
        logits, ctx_SF = self._forward(prompt, cache, last_only=True)
        tokens = [int(logits[-1].argmax())]
        accept = []
        while not self._finished(tokens, max_new):
            drafted = self.draft(ctx_SF, tokens[-1], block_size)
            logits, feats = self._forward([tokens[-1], *drafted], cache)
            greedy = logits.argmax(dim=-1).tolist()  # greedy[i]: the target's token after slot i
            a = 0
            while a < len(drafted) and drafted[a] == greedy[a]:
                a += 1
            accept.append(a + 1)
            tokens += drafted[:a] + [greedy[a]]
            ctx_SF = torch.cat([ctx_SF, feats[: a + 1]])  # positions n..n+a are now final
            if block_size - 1 - a:
                cache.crop(-(block_size - 1 - a))  # drop the rejected drafts' keys/values
        return self._truncate(tokens, max_new), accept


def first_difference(tokens: list[int], ref: list[int], margins: list[float]) -> str:
    """Where speculative tokens first differ from target-only greedy ref, with greedy's top-2 margin there."""
    k = next((j for j, (a, b) in enumerate(zip(tokens, ref)) if a != b), min(len(tokens), len(ref)))
    if k >= min(len(tokens), len(ref)):
        return f"lengths {len(tokens)} vs {len(ref)}"
    return f"token {k}: speculative {tokens[k]} vs greedy {ref[k]} (greedy top-2 logit margin {margins[k]:.2e})"


def check_output(dec: Decoder, prompt: list[int], tokens: list[int], ref: list[int], margins: list[float]
                 ) -> tuple[str, str] | None:
    """None when the speculative tokens equal target-only greedy's; else ("tie", where) when every one of them is
    still a greedy choice of the target within one ulp of its top logit (a bf16 target on a GPU ties now and then,
    and the batched verify pass breaks the tie the other way), or ("differs", where): a lossy decoder."""
    if tokens == ref:
        return None
    where = first_difference(tokens, ref, margins)
    bad = dec.not_greedy_at(prompt, tokens)
    if bad is None:
        return "tie", where
    return "differs", where + f"; token {bad} is not a greedy choice of the target"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class PromptPhase:
    """One pass of an evaluation over its prompts, shown as it goes: a bar on a terminal (`progress`), else a line per
    prompt through `log` (None: silent, as the trainer's held-out decoding is), each with what it measured so far."""

    def __init__(self, desc: str, prompt_ids: list[list[int]], progress: bool, log=None):
        from tqdm import tqdm

        self.desc, self.n, self.log, self.t0 = desc, len(prompt_ids), None if progress else log, time.perf_counter()
        self.bar = tqdm(prompt_ids, desc=desc, unit="prompt", disable=not progress, dynamic_ncols=True)

    def __iter__(self):
        return iter(enumerate(self.bar))

    def done(self, i: int, text: str) -> None:
        """Prompt i is decoded: `text` is what the phase measured so far."""
        if self.log is not None:
            self.log(f"  {self.desc}: prompt {i + 1}/{self.n}: {text} ({time.perf_counter() - self.t0:.1f} s)")
        else:
            self.bar.set_postfix_str(text, refresh=False)


def _mean(values: list[int]) -> float:
    return sum(values) / max(1, len(values))


def evaluate_drafters(target, tokenizer, drafters: dict[str, DFlashDrafter], prompts: list[str],
                      block_size: int | None, max_new_tokens: int, log=print, progress: bool | None = None,
                      ddtree: list[int] | None = None, ddtree_mode: str = "auto", ddtree_drafters: set | None = None
                      ) -> dict[str, EvalReport]:
    """Reports per drafter on the same prompts; target-only greedy runs once and is the reference.

    ddtree: node budgets for DDTree decoding beside the linear one (dflash.eval.ddtree); ddtree_mode auto verifies
    the tree where the target takes a tree mask and computes the walk elsewhere, or force verified | computed;
    ddtree_drafters: the names it runs for (None = all)."""
    import sys

    eos_ids = eos_ids_of(target, tokenizer)
    prompt_ids = prompts_within(tokenizer, prompts, getattr(target.config, "max_position_embeddings", None))
    device = next(target.parameters()).device
    progress = sys.stderr.isatty() if progress is None else progress
    base = Decoder(target, None, eos_ids)
    base.greedy(prompt_ids[0], 4)  # warm-up: first calls allocate
    reference, base_time = [], 0.0
    phase = PromptPhase("target-only greedy", prompt_ids, progress, log)
    for i, ids in phase:
        _sync(device)
        t0 = time.perf_counter()
        reference.append(base.greedy(ids, max_new_tokens))
        _sync(device)
        base_time += time.perf_counter() - t0
        phase.done(i, f"{len(reference[-1][0])} tokens, {sum(len(t) for t, _ in reference) / base_time:.1f} tok/s")
    ref_tokens = sum(len(t) for t, _ in reference)
    fp8_count = fp8_linears(target)  # the precision the report names is the one the verifying target ran in

    reports = {}
    for name, drafter in drafters.items():
        check_pair(target, drafter)
        bs = block_size or drafter.config.block_size
        dec = Decoder(target, drafter, eos_ids)
        report = EvalReport(name, len(prompts), bs, max_new_tokens,
                            linear_mode="verified" if cache_rolls_back(target) else "computed",
                            target_precision="fp8" if fp8_count else "bf16", target_fp8_linears=fp8_count)
        linear = Decoder.speculative if report.linear_mode == "verified" else computed_linear
        accepts, spec_time = [], 0.0
        phase = PromptPhase(f"speculative ({name})", prompt_ids, progress, log)
        for i, ids in phase:
            _sync(device)
            t0 = time.perf_counter()
            tokens, acc = linear(dec, ids, max_new_tokens, bs)
            _sync(device)
            spec_time += time.perf_counter() - t0
            accepts += acc
            ref, margins = reference[i]
            found = check_output(dec, ids, tokens, ref, margins)
            if found and found[0] == "tie":
                report.ties.append(f"prompt {i}: differs from target-only greedy at {found[1]}, every token a greedy "
                                   "choice within one ulp (a tie)")
            elif found:
                report.lossless = False
                report.mismatches.append(f"prompt {i}: output differs from target-only greedy at {found[1]}")
            phase.done(i, f"{len(tokens)} tokens in {len(acc)} verify steps; mean acceptance length "
                          f"{_mean(accepts):.2f} so far{'' if found is None or found[0] == 'tie' else '; NOT lossless'}")
        report.verify_steps = len(accepts)
        report.new_tokens = ref_tokens
        report.mean_accept_len = round(sum(accepts) / max(1, len(accepts)), 3)
        report.histogram = dict(sorted(Counter(accepts).items()))
        report.spec_tok_s = round(ref_tokens / max(spec_time, 1e-9), 1)
        report.target_tok_s = round(ref_tokens / max(base_time, 1e-9), 1)
        report.speedup = round(report.spec_tok_s / max(report.target_tok_s, 1e-9), 2)
        for budget in (ddtree or []) if ddtree_drafters is None or name in ddtree_drafters else []:
            report.ddtree.append(asdict(tree_report(dec, prompt_ids, reference, bs, budget, max_new_tokens,
                                                    ddtree_mode, report.target_tok_s, ref_tokens, progress, log)))
        reports[name] = report
    return reports


def computed_linear(dec: Decoder, prompt: list[int], max_new: int, block_size: int) -> tuple[list[int], list[int]]:
    """Linear speculative decoding's tokens and acceptance where the target's cache cannot roll back (a hybrid's
    recurrent state): the walk of the one-chain tree, computed by greedy decoding (dflash.eval.ddtree)."""
    from dflash.eval.ddtree import chain_tree, ddtree_decode

    tokens, accept, _ = ddtree_decode(dec, prompt, max_new, block_size, 1, verified=False,
                                      tree_of=lambda _logp, top1: chain_tree(top1))
    return tokens, accept


def tree_mode(target, mode: str = "auto") -> str:
    """verified where the target's attention takes a tree mask (dflash.eval.ddtree.tree_verifiable), else computed."""
    from dflash.eval.ddtree import tree_verifiable

    why = tree_verifiable(target)
    if mode == "verified" and why:
        raise EvalError(f"--ddtree: this target cannot verify a tree in one forward ({why}); its walk is computed")
    return mode if mode != "auto" else ("computed" if why else "verified")


def tree_report(dec: Decoder, prompt_ids: list[list[int]], reference: list, block_size: int, budget: int,
                max_new_tokens: int, mode: str, target_tok_s: float, ref_tokens: int, progress: bool = False,
                log=None) -> TreeReport:
    """DDTree decoding of every prompt at one budget, checked against target-only greedy as the linear one is
    (a line per prompt through `log` where no bar shows; None: silent)."""
    from dflash.eval.ddtree import ddtree_decode

    mode = tree_mode(dec.target, mode)
    r = TreeReport(budget, mode)
    accepts, nodes, spent = [], [], 0.0
    phase = PromptPhase(f"ddtree {budget} ({mode})", prompt_ids, progress, log)
    for i, ids in phase:
        _sync(dec.device)
        t0 = time.perf_counter()
        tokens, acc, n = ddtree_decode(dec, ids, max_new_tokens, block_size, budget, verified=mode == "verified")
        _sync(dec.device)
        spent += time.perf_counter() - t0
        accepts += acc
        nodes += n
        ref, margins = reference[i]
        found = check_output(dec, ids, tokens, ref, margins)
        if found and found[0] == "tie":
            r.ties.append(f"prompt {i}: differs from target-only greedy at {found[1]} (a tie)")
        elif found:
            r.lossless = False
            r.mismatches.append(f"prompt {i}: output differs from target-only greedy at {found[1]}")
        phase.done(i, f"{len(tokens)} tokens in {len(acc)} rounds; mean acceptance length {_mean(accepts):.2f} so far"
                      f"{'' if found is None or found[0] == 'tie' else '; NOT lossless'}")
    r.rounds = len(accepts)
    r.mean_accept_len = round(sum(accepts) / max(1, len(accepts)), 3)
    r.histogram = dict(sorted(Counter(accepts).items()))
    r.nodes_per_round = round(sum(nodes) / max(1, len(nodes)), 1)
    if mode == "verified":
        r.tok_s = round(ref_tokens / max(spent, 1e-9), 1)
        r.speedup = round(r.tok_s / max(target_tok_s, 1e-9), 2)
    return r


def _short(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def load_eval_target(target: str, device: str, log=print, precision: str = "bf16"):
    """(model, tokenizer) for 'smollm2' or an HF folder; float32 on CPU, bfloat16 on CUDA. precision "fp8": its
    decoder linears run e4m3 matmuls (target.precision; dflash.models.target_fp8: torchao on CUDA, emulated on CPU)."""
    from dflash.models.smollm2_convert import resolve_target
    from dflash.models.target import load_target, load_target_tokenizer

    path = resolve_target(target, log=log)
    if not (path / "config.json").is_file():
        raise EvalError(f"--target {target}: no config.json there (expected a Hugging Face model folder or 'smollm2')")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvalError(f"--device {device}: no CUDA device is visible; use --device cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tokenizer = load_target_tokenizer(path)  # TargetError (one line) for custom code, missing or broken files
    return load_target(path, dtype, device, precision=precision, log=log), tokenizer


def load_drafter(folder: Path, device: str) -> DFlashDrafter:
    """The drafter of a checked folder (dflash.eval.evaluate.check_drafter_files) in float32, in eval mode."""
    try:
        return DFlashDrafter.from_pretrained(folder, device=device, dtype=torch.float32).eval()
    except (ValueError, KeyError, TypeError, RuntimeError) as e:  # fields missing, tensors of other shapes
        raise EvalError(f"--drafter {folder}: not a drafter this version can load ({_short(e)}); use the drafter/ "
                        "folder a run writes") from None
