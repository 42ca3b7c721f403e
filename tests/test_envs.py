"""dflash-env: one environment per profile, built from its committed lock, and nothing done for one profile touches
another's environment (the incident: syncing the inference stack into the training environment)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.commands.env import main
from preflight import envs
from preflight.envs import EnvError, env_drift, locate, run_command, run_environ, sync_command
from preflight.profiles import ENVS_DIR

REPO = Path(__file__).resolve().parent.parent
STANDIN = """name = "standin"
group = "standin"
role = "infer"
torch = "2.14.1"
cuda = "13.0"
driver_min = "580.65.06"
compile_cache = "~/.cache/dflash/inductor/standin"
"""


def lock_entry(lock: Path, package: str) -> str:
    """One package's pin with its hashes, copied from a committed lock (so no hash is written in a test)."""
    out, on = [], False
    for line in lock.read_text().splitlines():
        if line.startswith(f"{package}=="):
            on = True
        elif on and not line.startswith("    --hash"):
            break
        if on:
            out.append(line)
    assert out, f"{package} not in {lock.name}"
    return "\n".join(out) + "\n"


def standin(tmp_path: Path, lock: str | None = None, envs_dir: Path | None = None) -> Path:
    """A CPU-installable stand-in for the inference profile: one pure-Python package of envs/infer-cu130.lock."""
    d = envs_dir or tmp_path / "envs"
    d.mkdir(exist_ok=True)
    (d / "standin.toml").write_text(STANDIN)
    (d / "standin.lock").write_text(lock if lock is not None else lock_entry(ENVS_DIR / "infer-cu130.lock", "mdurl"))
    return d


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def fake_venv(root: Path, dists: dict[str, str], version: str = "3.11.7") -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text(f"home = /x\nversion_info = {version}\n")
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    for name, v in dists.items():
        info = site / f"{name}-{v}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {v}\n")
    return root


# ---------------------------------------------------------------- where each profile lives


def test_each_profile_has_its_own_environment():
    train, infer = locate("train-cu128"), locate("infer-cu130")
    assert train.default and train.path == REPO / ".venv"  # uv's default groups: the env `uv run` uses
    assert not infer.default and infer.path == REPO / ".venvs" / "infer-cu130"
    assert train.lock == ENVS_DIR / "train-cu128.lock" and infer.lock == ENVS_DIR / "infer-cu130.lock"


def test_fix_commands_work_from_a_fresh_clone():
    assert sync_command("infer-cu130") == "uv run --isolated --no-default-groups dflash-env sync --profile infer-cu130"
    assert sync_command("train-cu128", ["transformers"]).endswith("sync --profile train-cu128 --reinstall transformers")
    assert run_command("infer-cu130", "dflash-preflight --profile infer-cu130") == (
        "uv run --isolated --no-default-groups dflash-env run --profile infer-cu130 -- dflash-preflight --profile infer-cu130")


def test_run_environ_puts_the_profile_first_and_other_python_envs_off_path(tmp_path):
    envs_dir = standin(tmp_path)
    env = locate("standin", envs_dir)
    fake_venv(env.path, {})
    other = fake_venv(tmp_path / "sglang-env", {})
    conda = tmp_path / "conda"
    (conda / "bin").mkdir(parents=True)
    (conda / "conda-meta").mkdir()
    path = os.pathsep.join([str(other / "bin"), "/usr/bin", str(conda / "bin"), str(env.bin), "/bin"])
    environ, dropped = run_environ(env, {"PATH": path, "PYTHONHOME": "/x", "HOME": "/h"})
    assert environ["PATH"].split(os.pathsep) == [str(env.bin), "/usr/bin", "/bin"]
    assert dropped == [str(other / "bin"), str(conda / "bin")]
    # a `uv run` inside runs in this environment as it is, never re-synced to uv's default groups
    assert environ["VIRTUAL_ENV"] == environ["UV_PROJECT_ENVIRONMENT"] == str(env.path) and environ["UV_NO_SYNC"] == "1"
    assert "PYTHONHOME" not in environ and environ["HOME"] == "/h"


def test_env_drift_compares_an_environment_with_its_lock(tmp_path):
    lock = lock_entry(ENVS_DIR / "infer-cu130.lock", "mdurl") + lock_entry(ENVS_DIR / "infer-cu130.lock", "idna")
    env = fake_venv(tmp_path / "env", {"mdurl": "0.1.2", "idna": "3.20", "dflash": "0.1.0"})
    assert env_drift(env, lock) == []  # the project itself is never drift
    env = fake_venv(tmp_path / "env2", {"mdurl": "0.1.1", "torch": "2.10.0"})
    assert env_drift(env, lock) == ["idna 3.20 missing", "mdurl 0.1.1 installed (lock 0.1.2)", "torch 2.10.0 not in lock"]


# ---------------------------------------------------------------- refusals, one line each


def test_unknown_profile_is_a_usage_error(capsys):
    code, out, err = cli(capsys, "path", "--profile", "nope")
    assert code == 2 and out == "" and err == "dflash-env: error: unknown profile 'nope' (known: infer-cu130, train-cu128)\n"


def test_path_and_run_refuse_an_environment_not_built_yet(capsys, tmp_path):
    envs_dir = standin(tmp_path)
    for args in (["path"], ["run"]):
        extra = ["--", "python", "-V"] if args == ["run"] else []
        code, out, err = cli(capsys, "--envs-dir", str(envs_dir), *args, "--profile", "standin", *extra)
        assert code == 1 and out == "" and len(err.splitlines()) == 1
        assert err.startswith("dflash-env: error: profile standin has no environment yet at ")
        assert err.rstrip().endswith("`uv run --isolated --no-default-groups dflash-env sync --profile standin`")


@pytest.mark.parametrize("lock, problem", [
    ("mdurl==0.1.2\n", "mdurl has no --hash"),
    ("mdurl @ file:///nonexistent/mdurl.whl \\\n    --hash=sha256:00\n", "line 1 holds a URL"),
])
def test_sync_refuses_a_lock_that_is_not_a_hashed_host_free_install_source(capsys, tmp_path, lock, problem):
    envs_dir = standin(tmp_path, lock)
    code, out, err = cli(capsys, "--envs-dir", str(envs_dir), "sync", "--profile", "standin")
    assert code == 1 and len(err.splitlines()) == 1 and problem in err
    assert not (tmp_path / ".venvs").exists()  # refused before anything was built


def test_sync_refuses_a_folder_that_is_not_an_environment_and_an_unknown_reinstall(capsys, tmp_path):
    envs_dir = standin(tmp_path)
    code, _, err = cli(capsys, "--envs-dir", str(envs_dir), "sync", "--profile", "standin", "--reinstall", "torch")
    assert code == 1 and "--reinstall torch: not in envs/standin.lock" in err
    (tmp_path / ".venvs" / "standin").mkdir(parents=True)
    code, _, err = cli(capsys, "--envs-dir", str(envs_dir), "sync", "--profile", "standin")
    assert code == 1 and "exists but is not a Python environment (no pyvenv.cfg); move it aside" in err


# ---------------------------------------------------------------- the real thing


def site_listing() -> dict[str, int]:
    """Every entry of this (the training) environment's site-packages with its mtime."""
    out = {}
    for sp in envs.site_packages(Path(sys.prefix)):
        for e in os.scandir(sp):
            out[e.name] = e.stat(follow_symlinks=False).st_mtime_ns
    return out


def env_drift_verdict() -> tuple[str, str]:
    from preflight.checks.environment import check_env_drift
    from preflight.facts.gather import gather

    r = check_env_drift(gather("train-cu128"))
    return r.status, re.sub(r", [0-9.]+ s\)", ")", r.summary)  # the verdict without the time it took


@pytest.mark.slow
def test_sync_builds_the_standin_profile_from_its_lock_and_leaves_the_training_env_alone(capsys, tmp_path):
    envs_dir = standin(tmp_path)
    before, verdict = site_listing(), env_drift_verdict()
    code, out, err = cli(capsys, "--envs-dir", str(envs_dir), "sync", "--profile", "standin")
    assert code == 0, err
    env = tmp_path / ".venvs" / "standin"
    assert out.startswith(f"created {env} (profile standin, Python ") and "1 distribution from envs/standin.lock" in out
    assert env_drift(env, (envs_dir / "standin.lock").read_text()) == []
    compiled = importlib.util.cache_from_source(str(next(envs.site_packages(env)[0].glob("mdurl/__init__.py"))))
    assert Path(compiled).is_file()  # compiled at the sync (where bytecode goes here): a first start compiles nothing
    assert site_listing() == before, "syncing another profile changed the training environment"
    assert env_drift_verdict() == verdict  # dflash-preflight --profile train-cu128 judges env-drift as before

    code, out, _ = cli(capsys, "--envs-dir", str(envs_dir), "path", "--profile", "standin")
    assert (code, out) == (0, f"{env}\n")
    # `run`: the profile's interpreter, its package, the project, and the training env's bin dir off PATH
    probe = ("import os, sys, mdurl, dflash; print(sys.prefix); print(os.path.dirname(dflash.__file__)); "
             "print(os.environ['UV_NO_SYNC']); print(os.environ['PATH'])")
    other = fake_venv(tmp_path / "sglang-env", {})
    here = str(Path(sys.prefix) / "bin")  # the training env, which runs dflash-env here
    environ = dict(os.environ, PATH=os.pathsep.join([here, str(other / "bin"), os.environ.get("PATH", "")]))
    p = subprocess.run([sys.executable, "-m", "dflash.commands.env", "--envs-dir", str(envs_dir), "run", "--profile",
                        "standin", "--", "python", "-c", probe], cwd=REPO, env=environ, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    prefix, package, no_sync, path = p.stdout.splitlines()
    assert (prefix, package, no_sync) == (str(env), str(REPO / "dflash"), "1")
    path = path.split(os.pathsep)
    assert path[0] == str(env / "bin") and here not in path and str(other / "bin") not in path
    assert p.stderr == f"dflash-env: left out of PATH (other Python environments): {other / 'bin'}\n"
    p = subprocess.run([sys.executable, "-m", "dflash.commands.env", "--envs-dir", str(envs_dir), "run", "--profile",
                        "standin", "--", "python", "-c", "raise SystemExit(7)"], cwd=REPO, capture_output=True, timeout=60)
    assert p.returncode == 7  # run is the command: its exit code, nothing added

    # files are copies, never hard links into uv's cache: an edit in place here cannot reach another environment
    init = next(envs.site_packages(env)[0].glob("mdurl/__init__.py"))
    assert init.stat().st_nlink == 1 and envs.linked_distributions(env) == []
    # an environment that uv linked (its default) is re-copied by the next sync
    shared = tmp_path / "cache-copy.py"
    shared.write_bytes(init.read_bytes())
    init.unlink()
    os.link(shared, init)
    assert envs.linked_distributions(env) == ["mdurl"]
    code, out, err = cli(capsys, "--envs-dir", str(envs_dir), "sync", "--profile", "standin")
    assert code == 0 and out.startswith(f"updated {env}")
    assert "1 distribution(s) are hard links into uv's cache" in err
    assert init.stat().st_nlink == 1 and shared.stat().st_nlink == 1
    assert site_listing() == before


def test_not_found_command_exits_127_with_one_line(tmp_path):
    envs_dir = standin(tmp_path)
    fake_venv(tmp_path / ".venvs" / "standin", {})
    p = subprocess.run([sys.executable, "-m", "dflash.commands.env", "--envs-dir", str(envs_dir), "run", "--profile",
                        "standin", "--", "no-such-command-xyz"], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PATH="/nonexistent"))
    assert p.returncode == 127 and p.stdout == ""
    assert p.stderr.startswith("dflash-env: error: no-such-command-xyz: not found on profile standin's PATH")


def test_sync_raises_env_error_not_a_traceback_for_a_missing_lock(tmp_path):
    envs_dir = standin(tmp_path)
    (envs_dir / "standin.lock").unlink()
    with pytest.raises(EnvError, match=r"envs/standin.lock unreadable"):
        envs.sync("standin", envs_dir, log=lambda m: None)


def fresh_clone(tmp_path: Path) -> Path:
    """The files a `git clone` of this working tree would hold: tracked files only (no uv.lock, no .venv)."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    clone = tmp_path / "clone"
    for rel in filter(None, listed.decode().split("\0")):
        src, dst = REPO / rel, clone / rel
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    return clone


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_the_printed_sync_command_works_on_a_fresh_clone_and_touches_no_other_env(tmp_path):
    clone = fresh_clone(tmp_path)
    assert not (clone / "uv.lock").exists() and not (clone / ".venv").exists()
    standin(clone, envs_dir=clone / "envs")
    environ = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "UV_NO_SYNC")}
    p = subprocess.run(shlex.split(sync_command("standin")), cwd=clone, env=environ, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith(f"created {clone / '.venvs' / 'standin'} (profile standin")
    assert not (clone / ".venv").exists(), "building the stand-in profile created the training environment"
    assert env_drift(clone / ".venvs" / "standin", (clone / "envs" / "standin.lock").read_text()) == []


def _tamper_consistently(env: Path, package: str) -> Path:
    """Another build of the same locked version: one module edited and its RECORD line rewritten to agree."""
    import base64
    import hashlib

    sp = envs.site_packages(env)[0]
    init = sp / package / "__init__.py"
    data = init.read_bytes() + b"\nBUILT_ELSEWHERE = True\n"
    init.write_bytes(data)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record = next(sp.glob(f"{package}-*.dist-info")) / "RECORD"
    rows = [f"{package}/__init__.py,sha256={digest},{len(data)}" if r.startswith(f"{package}/__init__.py,") else r
            for r in record.read_text().splitlines()]
    record.write_text("\n".join(rows) + "\n")
    return init


@pytest.mark.slow
def test_resync_recopies_a_locked_distribution_that_is_another_build_of_its_version(capsys, tmp_path):
    """uv skips a distribution installed at the locked version without reading its files: sync must not."""
    envs_dir = standin(tmp_path)
    code, out, err = cli(capsys, "--envs-dir", str(envs_dir), "sync", "--profile", "standin")
    assert code == 0, err
    env = tmp_path / ".venvs" / "standin"
    init = next(envs.site_packages(env)[0].glob("mdurl/__init__.py"))
    original = init.read_bytes()
    pins = {"mdurl": envs.parse_lock((envs_dir / "standin.lock").read_text()).pins["mdurl"]}
    assert envs.unverified_distributions(env, pins) == {}

    from preflight.facts.environment import sync_record

    assert (sync_record(env).compared, sync_record(env).rebuilt) == (1, [])  # what preflight's env-drift reads
    _tamper_consistently(env, "mdurl")
    assert env_drift(env, (envs_dir / "standin.lock").read_text()) == []  # same name and version: drift cannot see it
    assert "RECORD differs" in envs.unverified_distributions(env, pins)["mdurl"]
    assert sync_record(env).rebuilt == [{"name": "mdurl", "version": pins["mdurl"].version}]
    code, out, err = cli(capsys, "--envs-dir", str(envs_dir), "sync", "--profile", "standin")
    assert code == 0, err
    assert "mdurl: RECORD differs from the one of its install" in err and "re-copying them from the lock" in err
    assert out.startswith(f"updated {env}") and "re-copied mdurl (not as installed)" in out
    assert init.read_bytes() == original and envs.unverified_distributions(env, pins) == {}

    init.write_bytes(original + b"# edited in place\n")  # an edit that leaves RECORD alone
    assert envs.unverified_distributions(env, pins) == {"mdurl": "__init__.py differs from its RECORD hash"}
    (env / envs.VERIFIED_FILE).unlink()  # an environment no sync of this version verified: nothing is trusted
    init.write_bytes(original)
    assert envs.unverified_distributions(env, pins) == {"mdurl": "no record of a hash-checked install"}
    code, out, err = cli(capsys, "--envs-dir", str(envs_dir), "sync", "--profile", "standin")
    assert code == 0 and "re-copied mdurl" in out and (env / envs.VERIFIED_FILE).is_file()
