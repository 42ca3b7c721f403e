"""Fit the memory model's measured constants to real GPU peaks (pure Python, no torch).

``dflash.memory`` predicts; this module only says how well it predicts and which constants
would predict best. The measurements come from ``bench/memory_calibration.py`` on a GPU
(``tests/data/memory_calibration.json``); the fitted values are pasted into
``dflash.memory.parts.Calibration``'s defaults, and ``tests/test_memory_calibration.py`` checks
that the committed defaults are still the fit of the committed file.

    from dflash.memory.calibration import current_measurements, fit_calibration, prediction_errors
    used, _ = current_measurements(json.load(open(path))["measurements"])
    prediction_errors(used)          # (predicted - measured) / measured, one per measurement
    fit_calibration(used)            # a Calibration with the fitted context and scales
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel, ConfigDict, Field

from dflash.config import GpuRole, RunConfig, config_from_dict
from dflash.errors import DflashError
from dflash.memory.parts import DEFAULT_CALIBRATION, Calibration, fragmentation, role_parts
from dflash.memory.shape import GiB, TargetShape, cuda_major


class CalibrationError(DflashError):
    """Measurements that cannot determine the constants; the message says what to measure."""


class Measurement(BaseModel):
    """One measured peak from a real trainer step on a GPU (tests/data/memory_calibration.json)."""

    model_config = ConfigDict(extra="allow")

    config: dict = Field(description="the run config (as dump_config writes it)")
    target_config: dict = Field(description="the target's config.json content")
    role: GpuRole
    cuda: str = Field(description="CUDA major.minor of the torch build")
    nvml_used_bytes: int = Field(gt=0, description="peak NVML used memory on the GPU of that role")
    alloc_conf: str = Field("", description="PYTORCH_CUDA_ALLOC_CONF of the measuring process ('' = torch's default)")

    @property
    def expandable(self) -> bool:
        return "expandable_segments:true" in self.alloc_conf.replace(" ", "").lower()

    def model_inputs(self) -> tuple[RunConfig, TargetShape]:
        """The run config and target shape the memory model needs, parsed from the recorded dicts."""
        return (config_from_dict(self.config, source="measurement"),
                TargetShape.from_config(self.target_config, "measurement target_config"))

    def predicted_bytes(self, cal: Calibration) -> int:
        """The memory model's NVML-used peak for this measurement's config, role and allocator."""
        cfg, shape = self.model_inputs()
        return sum(p.bytes for p in role_parts(cfg, shape, self.role, self.cuda, cal, self.expandable))


def _measurement(m: Measurement | dict) -> Measurement:
    return m if isinstance(m, Measurement) else Measurement.model_validate(m)


def _decompose(m: Measurement, cal: Calibration) -> tuple[float, float, float, float]:
    """(fixed besides context, static, target activations, drafter activations) with scales at 1."""
    cfg, shape = m.model_inputs()
    unit = replace(cal, target_activation_scale=1.0, drafter_activation_scale=1.0)
    parts = [p for p in role_parts(cfg, shape, m.role, m.cuda, unit) if p.kind != "margin"]
    fixed = sum(p.bytes for p in parts if p.kind == "fixed") - unit.context_bytes(m.cuda)
    static = sum(p.bytes for p in parts if p.kind == "static")
    t_act = sum(p.bytes for p in parts if p.kind == "activation" and p.group == "target")
    d_act = sum(p.bytes for p in parts if p.kind == "activation" and p.group == "drafter")
    return fixed, static, t_act, d_act


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b: Gaussian elimination with partial pivoting on a small dense system (no numpy needed)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) < 1e-12:
            raise CalibrationError("measurements do not determine the calibration; vary token_budget, anchors and roles")
        m[c], m[piv] = m[piv], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def current_measurements(measurements: list[dict]) -> tuple[list[dict], list[dict]]:
    """(used, superseded): a measurement under torch's default allocator is superseded when the same
    configuration and role was also measured with expandable segments, the allocator the trainer runs with."""
    def key(m: dict) -> tuple[str, str]:
        return m.get("name", ""), m["role"]

    expandable = {key(m) for m in measurements if Measurement.model_validate(m).expandable}
    used, superseded = [], []
    for m in measurements:
        (superseded if key(m) in expandable and not Measurement.model_validate(m).expandable else used).append(m)
    return used, superseded


def _unknowns(ms: list[Measurement]) -> list[str]:
    """The constants the measurements can fit: one CUDA context per major, one activation scale per role seen."""
    majors = sorted({cuda_major(m.cuda) for m in ms})
    has_t = any(m.role in ("target", "colocated") for m in ms)
    has_d = any(m.role in ("drafter", "colocated") for m in ms)
    return [f"ctx{mj}" for mj in majors] + (["s_target"] if has_t else []) + (["s_drafter"] if has_d else [])


def fit_calibration(measurements: list[Measurement | dict], base: Calibration = DEFAULT_CALIBRATION) -> Calibration:
    """Least-squares fit of the CUDA context per major and one activation scale per role.

    Model: used = context[major] + fixed + (1 + fragmentation) * (static + s_t * target_act + s_d * drafter_act),
    fragmentation per the measurement's allocator settings; it and the per-tensor counts stay as in ``base``;
    relative errors are minimised. Co-located peaks are linear in the scales only while the drafter step
    outweighs the target forward (the usual case).
    """
    ms = [_measurement(m) for m in measurements]
    names = _unknowns(ms)
    if len(ms) < len(names):
        raise CalibrationError(f"{len(ms)} measurements cannot fit {len(names)} unknowns ({', '.join(names)}); measure more")
    rows, ys = [], []
    for m in ms:
        f = 1.0 + fragmentation(base, m.expandable)
        fixed, static, t_act, d_act = _decompose(m, base)
        x = {f"ctx{cuda_major(m.cuda)}": 1.0, "s_target": f * t_act, "s_drafter": f * d_act}
        # Weighted by 1 / measured: the fit minimises relative errors, which the ±10% test checks.
        wt = 1.0 / m.nvml_used_bytes
        rows.append([wt * x.get(n, 0.0) for n in names])
        ys.append(wt * (m.nvml_used_bytes - fixed - f * static))
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(len(names))] for i in range(len(names))]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(len(names))]
    sol = dict(zip(names, solve(ata, aty)))
    ctx = dict(base.cuda_context_gib)
    ctx.update({int(n[3:]): v / GiB for n, v in sol.items() if n.startswith("ctx")})
    return replace(
        base,
        cuda_context_gib=ctx,
        target_activation_scale=sol.get("s_target", base.target_activation_scale),
        drafter_activation_scale=sol.get("s_drafter", base.drafter_activation_scale),
    )


def prediction_errors(measurements: list[Measurement | dict], cal: Calibration = DEFAULT_CALIBRATION) -> list[float]:
    """Relative error (predicted - measured) / measured of each measurement's NVML peak."""
    errs = []
    for m in map(_measurement, measurements):
        errs.append((m.predicted_bytes(cal) - m.nvml_used_bytes) / m.nvml_used_bytes)
    return errs
