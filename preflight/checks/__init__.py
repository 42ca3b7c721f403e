"""Preflight checks: pure functions ``check_<id>(ctx) -> CheckResult`` over gathered facts, one module per family.

Each check exists because a real drafter run lost hours to exactly that failure (docs/design.md, "The incident"). A check never does
I/O: ``preflight.facts.gather.gather`` collected everything first. Findings name the measured value, the expected
value, and the command that fixes it. gpu-memory and disk ask the one memory model (``dflash.memory``), a pure
function of the run config and the target shape that ``gather`` read. The families: ``environment`` (profile,
torch-build, env-drift, cuda-libs), ``env_vars``, ``gpus`` (visibility, memory, processes), ``source`` (compile-cache,
model-source), ``run`` (config, run-dir, disk), ``dataset``; ``registry`` lists them all and runs them.
"""
