"""Gather the facts preflight judges, one module per family; nothing here imports torch or creates a CUDA context.

Gathering (I/O) is kept apart from judging (``preflight.checks``): ``preflight.facts.gather.gather`` fills one
``preflight.facts.context.Context``, and every check is a pure function of it, so tests build a Context by hand and
assert verdicts. The families: ``environment`` (torch build, RECORD hashes), ``paths`` (PATH, CUDA libraries),
``gpus`` (NVML), ``source`` (model source, compile cache), ``run`` (run dir, checkpoints, disk, target shape),
``dataset`` (shards, manifest).
"""
