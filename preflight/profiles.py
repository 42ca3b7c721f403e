"""Environment profiles: envs/<name>.toml (manifest) + envs/<name>.lock (hash-pinned export)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dflash.errors import DflashError

REPO_ROOT = Path(__file__).resolve().parent.parent
ENVS_DIR = REPO_ROOT / "envs"


class ProfileError(DflashError):
    """A profile that is unknown or does not validate; the message is one line."""


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="profile name, equal to the file stem")
    group: str = Field(description="uv dependency group holding the profile's pins")
    with_groups: list[str] = Field(default_factory=list, description="other groups locked with it")
    role: Literal["train", "infer"]
    torch: str = Field(description="exact torch version, without local label")
    cuda: str = Field(description="CUDA major.minor the torch build targets")
    driver_min: str = Field(description="minimum NVIDIA driver for that CUDA")
    compile_cache: str = Field(description="TORCHINDUCTOR_CACHE_DIR (~ expands)")
    foreign_cuda_allowed: list[str] = Field(
        default_factory=list, description="reviewed wheels of another CUDA major that carry no CUDA runtime"
    )
    env: dict[str, str] = Field(default_factory=dict, description="environment variables the profile requires")

    @field_validator("cuda")
    @classmethod
    def _cuda(cls, v: str) -> str:
        if not re.fullmatch(r"\d+\.\d+", v):
            raise ValueError(f"cuda must be major.minor like 12.8, got {v!r}")
        return v

    @property
    def cuda_major(self) -> int:
        return int(self.cuda.split(".")[0])

    @property
    def groups(self) -> list[str]:
        return [self.group, *self.with_groups]

    @property
    def compile_cache_path(self) -> Path:
        return Path(self.compile_cache).expanduser()


def profile_names(envs_dir: Path = ENVS_DIR) -> list[str]:
    return sorted(p.stem for p in envs_dir.glob("*.toml"))


def load_profile(name: str, envs_dir: Path = ENVS_DIR) -> Profile:
    path = envs_dir / f"{name}.toml"
    if not path.exists():
        known = ", ".join(profile_names(envs_dir)) or "none"
        raise ProfileError(f"unknown profile {name!r} (known: {known})")
    try:
        raw = tomllib.loads(path.read_text())
        prof = Profile.model_validate(raw)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{path.name}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ProfileError(f"{path.name}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ProfileError(f"{path.name}: {where}: {first['msg']}") from None
    if prof.name != name:
        raise ProfileError(f"{path.name}: name is {prof.name!r}, expected {name!r}")
    return prof


def lock_path(name: str, envs_dir: Path = ENVS_DIR) -> Path:
    return envs_dir / f"{name}.lock"


def profile_env(name: str) -> dict[str, str]:
    """The environment variables profile `name` requires (envs/<name>.toml `env`). Raises ProfileError."""
    return dict(load_profile(name).env)


def compile_cache_dir(name: str) -> Path:
    """The inductor cache dir of profile `name` (``~`` expanded). Raises ProfileError."""
    return load_profile(name).compile_cache_path


def triton_cache_dir(name: str) -> Path:
    """Triton's cache dir for profile `name`'s runs (TRITON_CACHE_DIR): beside its inductor cache dir, so fla's
    kernels and autotuning results are the profile's own (not ~/.triton/cache, which another profile's Triton
    fills) and the compile cache artifact carries them alone. Raises ProfileError."""
    cache = compile_cache_dir(name)
    return cache.with_name(f"{cache.name}.triton")
