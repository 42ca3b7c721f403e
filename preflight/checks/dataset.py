"""The dataset check: shards readable, every sample fits a batch, the manifest and target match, ids and masks
in range, something to learn."""

from __future__ import annotations

import os

from preflight.checks.common import config_arg, listing, no_shape, result
from preflight.facts.context import Context
from preflight.report import CheckResult


def check_dataset(ctx: Context) -> CheckResult:
    ds = ctx.dataset
    cfg = ctx.config
    data = dict(path=ds.path, limit=ds.limit, shards=len(ds.shards))
    if ds.error:
        return result("dataset", "fail", f"data.path {ds.error}",
                      f"set data.path in {config_arg(ctx)} to a folder of *.arrow shards (dflash-data writes them)", **data)
    broken = [s for s in ds.shards if s.error]
    if broken:
        return result("dataset", "fail", f"{len(broken)} shard(s) unreadable: " +
                      listing([f"{s.name}: {s.error}" for s in broken], 2),
                      f"regenerate or remove {', '.join(s.name for s in broken[:4])} in {ds.path}",
                      broken=[s.name for s in broken], **data)
    samples = ds.samples
    tokens = sum(s.tokens for s in ds.shards)
    longest = max(ds.shards, key=lambda s: s.max_len)
    data.update(samples=samples, tokens=tokens, longest={"shard": longest.name, "row": longest.max_row,
                                                         "index": longest.first_row + longest.max_row,
                                                         "length": longest.max_len},
                fingerprint=ds.fingerprint)
    if samples == 0:
        return result("dataset", "fail", f"{ds.path} holds no samples", "write shards with dflash-data", **data)
    mism = [s for s in ds.shards if s.mask_mismatch]
    if mism:
        s = mism[0]
        row, a, b = s.mask_mismatch
        return result("dataset", "fail", f"{s.name} row {row}: input_ids has {a} tokens but loss_mask {b}",
                      f"regenerate {s.name}", **data)
    over = [s for s in ds.shards if s.over_count]
    limit_name = "token_budget" if cfg.data.max_length is None or cfg.data.token_budget <= cfg.data.max_length \
        else "data.max_length"
    if over:
        count = sum(s.over_count for s in over)
        worst = max(((s, row, n) for s in over for row, n in s.over), key=lambda t: t[2])
        s, row, n = worst
        data["over_limit"] = [{"shard": s.name, "row": r, "index": s.first_row + r, "length": n}
                              for s in over for r, n in s.over]
        return result("dataset", "fail",
                      f"{count:,} sample(s) can never fit a batch: longest is {s.name} row {row} (sample {s.first_row + row:,}) "
                      f"with {n:,} tokens > {limit_name} {ds.limit:,}",
                      f"raise data.token_budget to >= {n} in {config_arg(ctx)}, or drop samples longer than "
                      f"{ds.limit} tokens from the shards", **data)
    fails, warns, said = _dataset_contents(ctx, data)
    if fails:
        return result("dataset", "fail", "; ".join(text for text, _ in fails),
                      "; ".join(dict.fromkeys(fix for _, fix in fails)), **data)
    fits = f"longest {longest.max_len:,} tokens ({longest.name} row {longest.max_row}) fits {limit_name} {ds.limit:,}"
    head = f"{len(ds.shards)} shard(s), {samples:,} samples, {tokens:,} tokens; {said}; {fits}"
    if warns:
        return result("dataset", "warn", f"{head}; " + "; ".join(text for text, _ in warns),
                      "; ".join(dict.fromkeys(fix for _, fix in warns if fix)) or None, **data)
    return result("dataset", "pass", head, **data)


def _dataset_contents(ctx: Context, data: dict) -> tuple[list[tuple[str, str]], list[tuple[str, str | None]], str]:
    """(failures, warnings, what was verified) about what the shards hold: the manifest's shard records and
    target fingerprint, token ids against the run's vocabulary, loss_mask values, something to learn."""
    from dflash.data.identity import compare_targets, whole_problem

    ds, cfg = ctx.dataset, ctx.config
    fails: list[tuple[str, str]] = []
    warns: list[tuple[str, str | None]] = []
    rebuild = (f"rebuild the data for this target (dflash-data prepare --target {cfg.target.path} ...), or set "
               f"target.path in {config_arg(ctx)} to the target it was built for")
    stamp = f"dflash-data manifest {ds.path} --target {cfg.target.path}"
    said = []
    target_ok = False  # the manifest says the data was built for this very target

    # the manifest: which shards were written, their sizes and (deep) sha256, and the target they were built for
    manifest = ds.manifest
    data["manifest"] = "unreadable" if ds.manifest_error else "absent" if manifest is None else "present"
    if ds.manifest_error:
        fails.append((f"{ds.manifest_error} in {ds.path}", f"restore {os.path.join(ds.path, 'manifest.json')}, or "
                      f"rewrite it with {stamp}"))
    elif manifest is None:
        warns.append(("no manifest.json: the target the data was built for and the shard hashes are unknown (ids "
                      "checked against the run's vocabulary only)", stamp))
    if manifest is not None:
        unwhole = whole_problem(ds.path, manifest, {s.name: (s.rows, s.tokens) for s in ds.shards})
        if unwhole:
            fails.append(unwhole)
            data["whole"] = unwhole[0]
        records = manifest.get("shards") if isinstance(manifest.get("shards"), dict) else {}
        recorded = {n: r for n, r in records.items() if isinstance(r, dict) and "bytes" in r}
        on_disk = {s.name: s for s in ds.shards}
        problems = []
        if recorded:
            problems += [f"{n} not in manifest.json" for n in on_disk if n not in recorded]
            problems += [f"{n} in manifest.json but missing" for n in recorded if n not in on_disk]
            problems += [f"{n} is {s.size_bytes:,} bytes, manifest.json recorded {recorded[n]['bytes']:,}"
                         for n, s in on_disk.items() if n in recorded and s.size_bytes != recorded[n]["bytes"]]
            if ds.deep:
                unhashed = [n for n in on_disk if n in recorded and not recorded[n].get("sha256")]
                problems += [f"{n} content differs from its sha256 in manifest.json" for n, s in on_disk.items()
                             if n in recorded and recorded[n].get("sha256") and s.sha256 != recorded[n]["sha256"]]
                if unhashed:
                    warns.append((f"no sha256 recorded for {listing(unhashed, 3)}", stamp))
            said.append(("complete; " if isinstance(manifest.get("complete"), dict) and not unwhole else "")
                        + f"shard {'sizes and sha256' if ds.deep else 'sizes'} match manifest.json")
        else:
            warns.append(("manifest.json records no shard sizes or hashes (written by an older version)", stamp))
        if problems:
            data["manifest_problems"] = problems
            fails.append((f"shards differ from what was written: {listing(problems, 3)}",
                          "regenerate or restore those shards (move a damaged one aside and rerun dflash-data prepare: "
                          f"it redoes missing shards), or if the change was intended: {stamp}"))
        recorded_target = manifest.get("target")
        data["target"] = {"recorded": recorded_target, "run": ds.target}
        if not isinstance(recorded_target, dict):
            warns.append(("manifest.json does not say which target the data was built for", stamp))
        elif ds.target is None:
            warns.append((f"target fingerprint not compared: {ds.target_error}", f"check target.path in "
                          f"{config_arg(ctx)}"))
        else:
            bad, notes = compare_targets(recorded_target, ds.target)
            if bad:
                fails.append((f"built for another target than {cfg.target.path}: {', '.join(bad)}", rebuild))
            else:
                target_ok = True
                same_tok = recorded_target.get("tokenizer_sha256") and ds.target.get("tokenizer_sha256")
                said.append(f"built for this target (vocab {ds.target['vocab_size']:,}"
                            + (", same tokenizer files)" if same_tok else "; tokenizer files not compared: none on "
                               f"{'the target' if recorded_target.get('tokenizer_sha256') else 'record'})"))
            warns += [(n, None) for n in notes]

    # the values the trainer indexes with
    vocab = ctx.target_shape.vocab if ctx.target_shape else None
    read = [s for s in ds.shards if s.values is not None and s.values.max_id is not None]
    ids_lo = min((s.values.min_id for s in read), default=None)
    ids_hi = max((s.values.max_id for s in read), default=None)
    anchors = sum(s.values.anchors for s in ds.shards if s.values is not None)
    mask_lo = min((s.values.mask_min for s in read), default=None)
    mask_hi = max((s.values.mask_max for s in read), default=None)
    data["values"] = {"min_id": ids_lo, "max_id": ids_hi, "vocab": vocab, "mask_min": mask_lo, "mask_max": mask_hi,
                      "learnable_positions": anchors}
    if vocab is None:
        warns.append((f"token ids not checked against the vocabulary: {no_shape(ctx)}",
                      f"check target.path in {config_arg(ctx)}"))
    over = [s for s in read if vocab is not None and s.values.max_id >= vocab]
    negative = [s for s in read if s.values.min_id < 0]
    damaged = (f"regenerate or restore {listing(list(dict.fromkeys(s.name for s in over + negative)))} (damaged: "
               f"dflash-preflight --verify-data compares each shard with its recorded sha256)")
    if over:
        worst = max(over, key=lambda s: s.values.max_id)
        fails.append((f"token ids up to {worst.values.max_id:,} ({worst.name}) but the target's vocabulary is "
                      f"{vocab:,} (ids must be < {vocab:,}; {len(over)} shard(s): {listing([s.name for s in over], 3)})",
                      damaged if target_ok else rebuild))
    if negative:
        fails.append((f"negative token ids (down to {min(s.values.min_id for s in negative):,}) in "
                      f"{listing([s.name for s in negative], 3)}", damaged))
    odd_mask = [s for s in read if s.values.mask_min < 0 or s.values.mask_max > 1]
    if odd_mask:
        fails.append((f"loss_mask values outside 0/1 (from {mask_lo} to {mask_hi}) in "
                      f"{listing([s.name for s in odd_mask], 3)}",
                      "rewrite those shards with loss_mask 0 (context) or 1 (to learn); dflash.data.shards.write_shard "
                      "refuses other values"))
    if anchors == 0 and not odd_mask:
        why = "loss_mask is 0 everywhere" if mask_hi == 0 else \
            "no sample has two consecutive loss_mask = 1 tokens (e.g. only 1-token samples)"
        fails.append((f"nothing to learn: {why}; a block starts at a position whose token and next token both "
                      "have loss_mask 1",
                      "mark the tokens to learn with loss_mask 1 (dflash-data prepare marks each completion) and keep "
                      "samples of 2 or more tokens"))
    if vocab is not None and ids_hi is not None and not over and not negative:
        said.append(f"ids {ids_lo:,}..{ids_hi:,} < vocab {vocab:,}")
    if not odd_mask and anchors:
        said.append(f"loss_mask 0/1 with {anchors:,} learnable positions")
    data["verified_by"] = "sizes and sha256" if ds.deep else "sizes"
    return fails, warns, "; ".join(said)
