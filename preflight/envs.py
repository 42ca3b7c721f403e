"""One environment per profile, built from its committed lock alone: where it lives, how it is built, how to run in it.

    uv run --isolated --no-default-groups dflash-env sync --profile infer-cu130   # from a fresh clone, touches no other env
    dflash-env run --profile infer-cu130 -- dflash-data prepare --engine sglang ...
    dflash-env path --profile train-cu128

Where: the profile whose groups are pyproject's ``[tool.uv] default-groups`` lives in ``.venv`` (the
environment ``uv run`` builds and uses, with the same versions: ``dflash-lock check`` proves the lock is
the export of those groups); every other profile in ``.venvs/<profile>``. How: ``uv venv``, then
``uv pip sync --require-hashes --link-mode copy envs/<profile>.lock`` (exactly the lock, every wheel
hash-checked; uv.lock is git-ignored and never used), then the project itself editable without dependencies.
Files are copied, not hard-linked into uv's cache (uv's default): a hard link is one file shared by every
environment built from that cache, so an edit in one profile's environment would edit the other's. uv skips a
distribution already installed at the locked version without reading it, so on an existing environment ``sync``
first verifies each one against what the last sync recorded (VERIFIED_FILE) and re-copies those that differ. Nothing
here touches any environment but the named profile's. The ``dflash-env`` command (``dflash.commands.env``) only
formats what these functions return.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import subprocess
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.utils import canonicalize_name

from dflash.errors import DflashError
from preflight.lockfile import LockToolError, Pin, parse_lock
from preflight.lockfile import _uv as uv_binary
from preflight.profiles import ENVS_DIR, REPO_ROOT, Profile, load_profile

# Runs dflash-env from the checkout in a throw-away environment of the project's base dependencies:
# works on a fresh clone (nothing built yet) and never syncs .venv or any profile environment.
LAUNCHER = "uv run --isolated --no-default-groups dflash-env"
PROJECT_DIST = "dflash"
PROFILE_ENVS_DIR = ".venvs"  # non-default profiles: .venvs/<profile>


class EnvError(DflashError):
    """A profile environment that cannot be built, found or run in; the message is one line."""


class CommandNotFound(EnvError):
    """`dflash-env run` was given a command that is not on the profile environment's PATH."""

    exit_code = 127


@dataclass
class ProfileEnv:
    profile: Profile
    path: Path  # the environment's root (holds pyvenv.cfg)
    lock: Path  # envs/<profile>.lock, the only install source
    default: bool  # the uv project environment (.venv), the one `uv run` uses

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    @property
    def exists(self) -> bool:
        return (self.path / "pyvenv.cfg").is_file()


@dataclass
class SyncResult:
    env: ProfileEnv
    created: bool
    pins: int  # distributions installed from the lock for this interpreter
    python: str | None
    reinstalled: list[str] = field(default_factory=list)
    seconds: float = 0.0
    recopied: dict[str, str] = field(default_factory=dict)  # installed distributions that failed verification: why


# ---------------------------------------------------------------- where


def default_groups(project: Path = REPO_ROOT) -> list[str]:
    """pyproject's `[tool.uv] default-groups` (what `uv run` installs into .venv); [] when there is none."""
    try:
        data = tomllib.loads((project / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return []
    groups = data.get("tool", {}).get("uv", {}).get("default-groups", [])
    return list(groups) if isinstance(groups, list) else []


def locate(name: str, envs_dir: Path = ENVS_DIR, project: Path = REPO_ROOT) -> ProfileEnv:
    """Profile `name`'s environment: `.venv` for the profile of uv's default groups, else `.venvs/<name>`, both
    beside `envs_dir`. Raises ProfileError for an unknown or invalid profile."""
    profile = load_profile(name, envs_dir)
    root = envs_dir.resolve().parent
    default = sorted(profile.groups) == sorted(default_groups(project))
    path = root / ".venv" if default else root / PROFILE_ENVS_DIR / name
    return ProfileEnv(profile, path, envs_dir / f"{name}.lock", default)


def sync_command(name: str, reinstall: list[str] | tuple[str, ...] = ()) -> str:
    """The command that builds or repairs profile `name`'s environment from its lock, on any clone."""
    extra = "".join(f" --reinstall {r}" for r in reinstall)
    return f"{LAUNCHER} sync --profile {name}{extra}"


def run_command(name: str, command: str) -> str:
    """How to run `command` in profile `name`'s environment, on any clone (after `sync_command`)."""
    return f"{LAUNCHER} run --profile {name} -- {command}"


# ---------------------------------------------------------------- building


def _lock_problems(text: str) -> list[str]:
    """What makes a lock unusable as an install source (the rest is `dflash-lock check`'s job)."""
    lock = parse_lock(text)
    out = [f"line {no} holds a URL" for no, _ in lock.urls]
    out += [f"{pkg} has no --hash" for pkg in lock.unhashed]
    out += [f"line {no} is not `name==version --hash=...`" for no, _ in lock.unparsed]
    out += [f"{pkg} is pinned twice (lines {a} and {b})" for pkg, a, b in lock.duplicates]
    return out


def _python_version(env: Path) -> str | None:
    """The interpreter version of a venv, from its pyvenv.cfg (`version_info` or `version`)."""
    try:
        for line in (env / "pyvenv.cfg").read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() in ("version_info", "version"):
                return value.strip()
    except OSError:
        pass
    return None


def site_packages(env: Path) -> list[Path]:
    return sorted(env.glob("lib/python*/site-packages"))


def env_drift(env: Path, lock_text: str) -> list[str]:
    """How the distributions installed in venv `env` differ from a lock ([] = exactly the lock + the project)."""
    from preflight.pyenv import installed_distributions

    markers = dict(default_environment())
    version = _python_version(env)
    if version:
        markers.update(python_full_version=version, python_version=".".join(version.split(".")[:2]))
    lock = parse_lock(lock_text)
    pins = {p.name: p.version for p in lock.all_pins if p.applies(markers)}
    have = installed_distributions([str(p) for p in site_packages(env)])
    have.pop(canonicalize_name(PROJECT_DIST), None)
    out = [f"{n} {v} missing" for n, v in sorted(pins.items()) if n not in have]
    out += [f"{n} {have[n][0]} installed (lock {v})" for n, v in sorted(pins.items())
            if n in have and v.split("+")[0] not in {h.split("+")[0] for h in have[n]}]
    out += [f"{n} {vs[0]} not in lock" for n, vs in sorted(have.items()) if n not in pins]
    return out


def linked_distributions(env: Path, sample: int = 5) -> list[str]:
    """Distributions in venv `env` whose files are hard links (uv's default install: links into its cache).

    A hard-linked file is one inode shared with the cache and with every other environment linked to it, so
    an edit in place in one environment edits them all; `sync` copies instead and re-copies these."""
    out = []
    for sp in site_packages(env):
        for info in sorted(sp.glob("*.dist-info")):
            try:
                rows = (info / "RECORD").read_text().splitlines()
                name = next(line[5:].strip() for line in (info / "METADATA").read_text().splitlines()
                            if line.startswith("Name:"))
            except (OSError, StopIteration):
                continue
            files = [r.split(",")[0] for r in rows if r and not r.startswith(("..", info.name))][:sample]
            for rel in files:
                try:
                    if os.stat(sp / rel).st_nlink > 1:
                        out.append(canonicalize_name(name))
                        break
                except OSError:
                    continue
    return sorted(set(out))


# ---------------------------------------------------------------- what sync verified

# Written into an environment by `sync` once every locked distribution in it is known good: for each, its version,
# the lock's wheel hashes it was installed under and the sha256 of its RECORD right after that install.
VERIFIED_FILE = "dflash-verified.json"
VERIFIED_FORMAT = "dflash-env-verified/1"


def _dist_infos(env: Path) -> dict[str, Path]:
    """Canonical name -> .dist-info folder of every distribution installed in venv `env`."""
    from preflight.pyenv import _header

    out = {}
    for sp in site_packages(env):
        for info in sorted(sp.glob("*.dist-info")):
            name, _ = _header(info / "METADATA")
            if name:
                out[canonicalize_name(name)] = info
    return out


def _record_rows(info: Path) -> tuple[str, list[list[str]]]:
    """(sha256 of the RECORD file, its rows); OSError when it cannot be read."""
    data = (info / "RECORD").read_bytes()
    return hashlib.sha256(data).hexdigest(), list(csv.reader(data.decode("utf-8", "replace").splitlines()))


def _file_matches(path: Path, algo: str, digest: str) -> bool:
    try:
        with open(path, "rb") as f:
            got = hashlib.file_digest(f, algo).digest()
    except (OSError, ValueError):  # missing, unreadable, or an algorithm this Python lacks
        return False
    return base64.urlsafe_b64encode(got).rstrip(b"=").decode() == digest


def read_verified(env: Path) -> dict[str, dict] | None:
    """{name: {version, lock_hashes, record_sha256}} from venv `env`'s VERIFIED_FILE; None when it holds none of this
    format (built before dflash-env wrote one, or by something else)."""
    try:
        raw = json.loads((env / VERIFIED_FILE).read_text())
        dists = raw["dists"] if raw.get("format") == VERIFIED_FORMAT else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return dists if isinstance(dists, dict) else None


def installed_record_digests(env: Path, names: list[str] | None = None) -> dict[str, tuple[str | None, str | None]]:
    """{name: (installed version, sha256 of its RECORD or None when unreadable)} for the distributions in venv `env`
    (only `names` when given): the digest write_verified records, one small file read per distribution."""
    from preflight.pyenv import _header

    out = {}
    for name, info in _dist_infos(env).items():
        if names is None or name in names:
            try:
                digest, _ = _record_rows(info)
            except OSError:
                digest = None
            out[name] = (_header(info / "METADATA")[1], digest)
    return out


def unverified_distributions(env: Path, pins: dict[str, Pin]) -> dict[str, str]:
    """{name: why} for each locked distribution installed in `env` that is not what `sync` verified at its install.

    A distribution passes when the environment's VERIFIED_FILE lists it at the lock's version and wheel hashes, its
    RECORD is byte for byte the one recorded right after that hash-checked install, and every file its RECORD hashes
    matches that hash (native libraries too). So another build of the same version, with files and RECORD rewritten
    to agree, fails on the RECORD; an edited file fails on its hash. Files its RECORD does not list are not looked at.
    """
    from concurrent.futures import ThreadPoolExecutor

    verified = read_verified(env) or {}
    infos = _dist_infos(env)
    out: dict[str, str] = {}
    jobs: list[tuple[str, Path, str, str]] = []
    for name, pin in sorted(pins.items()):
        if name not in infos:
            continue  # missing: uv installs it from the lock
        mine = verified.get(name) if isinstance(verified, dict) else None
        if not isinstance(mine, dict):
            out[name] = "no record of a hash-checked install"
            continue
        if mine.get("version") != pin.version or mine.get("lock_hashes") != sorted(pin.hashes):
            out[name] = "installed under another lock entry"
            continue
        try:
            record_sha, rows = _record_rows(infos[name])
        except OSError:
            out[name] = "RECORD unreadable"
            continue
        if record_sha != mine.get("record_sha256"):
            out[name] = "RECORD differs from the one of its install (another build, or rewritten)"
            continue
        base = infos[name].parent
        jobs += [(name, base / row[0], *row[1].partition("=")[::2]) for row in rows
                 if len(row) >= 2 and "=" in row[1]]
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        for (name, path, _, _), ok in zip(jobs, pool.map(lambda j: _file_matches(*j[1:]), jobs)):
            if not ok and name not in out:
                out[name] = f"{path.name} differs from its RECORD hash"
    return out


def write_verified(env: Path, pins: dict[str, Pin]) -> int:
    """Record every locked distribution installed in `env` as verified (call right after a sync that hash-checked
    or re-copied each one); returns how many were recorded."""
    infos = _dist_infos(env)
    dists = {}
    for name, pin in sorted(pins.items()):
        if name in infos:
            try:
                record_sha, _ = _record_rows(infos[name])
            except OSError:
                continue
            dists[name] = {"version": pin.version, "lock_hashes": sorted(pin.hashes), "record_sha256": record_sha}
    tmp = env / f"{VERIFIED_FILE}.tmp"
    tmp.write_text(json.dumps({"format": VERIFIED_FORMAT, "dists": dists}, indent=1, sort_keys=True) + "\n")
    tmp.replace(env / VERIFIED_FILE)
    return len(dists)


def _uv(args: list[str], cwd: Path) -> None:
    """Run uv with its progress on this terminal; a failure is one EnvError line (uv printed the details)."""
    try:
        proc = subprocess.run([uv_binary(), *args], cwd=cwd)
    except OSError as e:
        raise EnvError(f"cannot run uv ({e.strerror}); install it with `pip install uv`") from None
    if proc.returncode != 0:
        raise EnvError(f"`uv {' '.join(args[:2])}` failed (exit {proc.returncode}, uv's message above)")


def sync(
    name: str,
    envs_dir: Path = ENVS_DIR,
    project: Path = REPO_ROOT,
    python: str | None = None,
    reinstall: list[str] | tuple[str, ...] = (),
    log: Callable[[str], None] = print,
) -> SyncResult:
    """Create or update profile `name`'s environment so that it holds exactly envs/<name>.lock (hash-checked)
    plus the project, editable from `project`. Touches no other environment. Raises EnvError / ProfileError."""
    t0 = time.perf_counter()
    env = locate(name, envs_dir, project)
    try:
        text = env.lock.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise EnvError(f"{envs_dir.name}/{env.lock.name} unreadable ({e}); restore it from git or run "
                       "`uv run dflash-lock write`") from None
    problems = _lock_problems(text)
    if problems:
        raise EnvError(f"{envs_dir.name}/{env.lock.name} cannot be installed from: {problems[0]}"
                       f"{f' (+{len(problems) - 1} more)' if len(problems) > 1 else ''}; fix it with "
                       "`uv run dflash-lock write` and review the diff")
    if env.path.exists() and not env.exists:
        raise EnvError(f"{env.path} exists but is not a Python environment (no pyvenv.cfg); move it aside, then "
                       f"rerun `{sync_command(name)}`")
    unknown = [r for r in reinstall if canonicalize_name(r) not in parse_lock(text).pins]
    if unknown:
        raise EnvError(f"--reinstall {unknown[0]}: not in {envs_dir.name}/{env.lock.name}")
    created = not env.exists
    try:
        if created:
            log(f"profile {name}: creating {env.path}")
            _uv(["venv", str(env.path), "--prompt", name, *(["--python", python] if python else [])], project)
        pins = _pins_for(env.path, text)
        linked = [n for n in linked_distributions(env.path) if n in pins and n not in reinstall]
        if linked:
            log(f"profile {name}: {len(linked)} distribution(s) are hard links into uv's cache (shared with every "
                "environment linked to it): copying them")
        # uv skips a distribution already installed at the locked version without looking at its files: verify them
        recopy = {n: why for n, why in unverified_distributions(env.path, pins).items()
                  if n not in reinstall and n not in linked}
        if recopy:
            log(f"profile {name}: {len(recopy)} installed distribution(s) are not what a hash-checked install left "
                f"({'; '.join(f'{n}: {why}' for n, why in list(recopy.items())[:5])}"
                f"{f'; +{len(recopy) - 5} more' if len(recopy) > 5 else ''}): re-copying them from the lock")
        log(f"profile {name}: installing exactly {envs_dir.name}/{env.lock.name} (hashes required, files copied)")
        # --compile-bytecode: a fresh environment's first start would otherwise compile every module it imports
        # (torch and transformers: 10.2 s to import uncompiled against 4.4 compiled on 2 cores), in every rank at once
        args = ["pip", "sync", "--python", str(env.path), "--require-hashes", "--link-mode", "copy",
                "--compile-bytecode"]
        for r in [*reinstall, *linked, *recopy]:
            args += ["--reinstall-package", r]
        _uv([*args, str(env.lock)], project)
        log(f"profile {name}: installing the project from {project} (editable, no dependencies)")
        _uv(["pip", "install", "--python", str(env.path), "--no-deps", "--link-mode", "copy", "--editable", str(project)],
            project)
    except (EnvError, LockToolError) as e:
        raise EnvError(f"profile {name}: {e.one_line()}; {env.path} may be half-built: rerun "
                       f"`{sync_command(name, reinstall)}`") from None
    drift = env_drift(env.path, text)
    if drift:
        raise EnvError(f"profile {name}: after the sync {env.path} still differs from its lock: {', '.join(drift[:3])}; "
                       f"rerun `{sync_command(name)}`")
    # every locked distribution is now fresh from a hash-checked wheel, or was verified above and left alone
    write_verified(env.path, pins)
    return SyncResult(env, created, len(pins), _python_version(env.path), list(reinstall), time.perf_counter() - t0,
                      recopy)


def _pins_for(env: Path, lock_text: str) -> dict[str, Pin]:
    """The lock's pins that apply to venv `env`'s interpreter (its markers), by canonical name."""
    version = _python_version(env)
    markers = dict(default_environment())
    if version:
        markers.update(python_full_version=version, python_version=".".join(version.split(".")[:2]))
    return {p.name: p for p in parse_lock(lock_text).all_pins if p.applies(markers)}


# ---------------------------------------------------------------- running


def run_environ(env: ProfileEnv, environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The process environment for running a command in `env`, and the PATH entries dropped from it.

    Its bin dir first on PATH, bin dirs of every other Python environment (venv or conda) removed;
    VIRTUAL_ENV and UV_PROJECT_ENVIRONMENT name it and UV_NO_SYNC=1, so a `uv run` inside runs in this
    environment as it is instead of re-syncing it to uv's default groups (the incident); PYTHONHOME unset.
    """
    from preflight.pyenv import python_env_root

    me = os.path.realpath(env.path)
    keep, dropped = [], []
    for entry in environ.get("PATH", "").split(os.pathsep):
        if not entry:
            continue
        root = python_env_root(Path(entry))
        if root is not None and os.path.realpath(root) != me:
            dropped.append(entry)
        elif os.path.realpath(entry) != os.path.realpath(env.bin):
            keep.append(entry)
    out = dict(environ)
    out.pop("PYTHONHOME", None)
    out.update(PATH=os.pathsep.join([str(env.bin), *keep]), VIRTUAL_ENV=str(env.path),
               UV_PROJECT_ENVIRONMENT=str(env.path), UV_NO_SYNC="1")
    return out, list(dict.fromkeys(dropped))


def require_built(env: ProfileEnv) -> ProfileEnv:
    if not env.exists:
        raise EnvError(f"profile {env.profile.name} has no environment yet at {env.path}; build it with "
                       f"`{sync_command(env.profile.name)}`")
    return env
