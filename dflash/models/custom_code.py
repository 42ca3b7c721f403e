"""Does a target folder need its own code? The one rule, and a torch-free reader of what transformers ships.

A config.json whose model_type transformers does not know, or a tokenizer_config.json whose tokenizer_class it does
not know, loads only by importing the folder's own .py files (auto_map): code from wherever the model came from.
``custom_code_problem`` says so in one line. ``dflash.models.target.refuse_custom_code`` asks it with transformers'
own maps when a command loads the target; preflight and the estimator ask it with :func:`shipped_names`, which
reads the installed transformers' source files (its model-type and tokenizer maps) without importing transformers,
since importing it imports torch (seconds, and preflight never imports torch).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CUSTOM_CODE_FIX = "use a model whose architecture transformers ships (a folder without its own code), or upgrade transformers"


@dataclass(frozen=True)
class ShippedNames:
    """What the installed transformers ships, as read from its files."""

    version: str
    model_types: frozenset[str]  # the keys of CONFIG_MAPPING_NAMES
    tokenizer_classes: frozenset[str]  # the names tokenizer_class_from_name resolves, without the "Fast" aliases

    def knows_tokenizer(self, name: str) -> bool:
        """tokenizer_class_from_name's answer: a shipped class, or one with "Fast" added (5.x aliases any XFast to X)."""
        while name not in self.tokenizer_classes and name.endswith("Fast"):
            name = name[:-4]
        return name in self.tokenizer_classes


def code_files(auto_map) -> str:
    """' (auto_map: modeling_x.py, ...)': the folder's own .py files an auto_map points at, or ''."""
    refs = []
    for value in auto_map.values() if isinstance(auto_map, dict) else ():
        refs += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
    files = sorted({ref.split("--")[-1].rsplit(".", 1)[0] + ".py" for ref in refs})
    return f" (auto_map: {', '.join(files)})" if files else ""


def custom_code_problem(folder: str | Path, config: dict, tokenizer: dict | None, version: str,
                        knows_model_type: Callable[[str], bool], knows_tokenizer: Callable[[str], bool]) -> str | None:
    """The one line that refuses a folder needing its own code (folder, file, field, fix), or None when it needs none.

    ``config`` and ``tokenizer`` are its parsed config.json and tokenizer_config.json (None: absent); ``version`` is
    how to name the transformers asked ("transformers 5.19.0").
    """
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not knows_model_type(model_type):
        return (f"target {folder}: custom code is refused: config.json model_type {model_type!r} is not an architecture "
                f"{version} ships{code_files(config.get('auto_map'))}; {CUSTOM_CODE_FIX}")
    name = (tokenizer or {}).get("tokenizer_class")
    if name is not None and (not isinstance(name, str) or not knows_tokenizer(name)):
        return (f"target {folder}: custom code is refused: tokenizer_config.json tokenizer_class {name!r} is not a "
                f"tokenizer {version} ships{code_files((tokenizer or {}).get('auto_map'))}; {CUSTOM_CODE_FIX}")
    return None


_ALL = re.compile(r"^__all__\s*=\s*[\[(]([^\])]*)[\])]", re.M)


def _pairs(tree: ast.AST):
    """(key, value node) of every ("key", value) 2-tuple and {"key": value} item in a parsed file."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple) and len(node.elts) == 2:
            key, value = node.elts
        elif isinstance(node, ast.Dict):
            yield from ((k.value, v) for k, v in zip(node.keys, node.values, strict=True)
                        if isinstance(k, ast.Constant) and isinstance(k.value, str))
            continue
        else:
            continue
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            yield key.value, value


def _names(node: ast.AST) -> set[str]:
    """Every string constant inside a node that reads as a class name."""
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.isidentifier() and n.value[:1].isupper()}


def _parse(file: Path) -> ast.AST:
    try:
        return ast.parse(file.read_text(encoding="utf-8"), str(file))
    except (OSError, SyntaxError, ValueError):
        return ast.Module(body=[], type_ignores=[])


@functools.cache
def shipped_names() -> ShippedNames | None:
    """The installed transformers' model types and tokenizer classes, read from its source; None when not installed.

    Model types: the ("type", "XConfig") pairs of models/auto (auto_mappings.py in 5.x, configuration_auto.py in
    both). Tokenizer classes: the names in tokenization_auto.py's map and convert_slow_tokenizer.py's converters, and the names
    transformers exports (its __init__.py: PreTrainedTokenizerFast, TokenizersBackend; each
    models/*/tokenization_*.py's __all__). tests/test_target.py holds this
    against transformers' own answers.
    """
    spec = importlib.util.find_spec("transformers")  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    auto = root / "models" / "auto"
    model_types = {key for file in ("auto_mappings.py", "configuration_auto.py") for key, value in _pairs(_parse(auto / file))
                   if isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value.endswith("Config")}
    tokenizers: set[str] = set()
    for _key, value in _pairs(_parse(auto / "tokenization_auto.py")):
        tokenizers |= _names(value)
    # the slow tokenizers 5.x maps to a fast one by their converter (FNetTokenizer -> AlbertTokenizer)
    tokenizers |= {key for key, _ in _pairs(_parse(root / "convert_slow_tokenizer.py")) if key.endswith("Tokenizer")}
    exported = _names(_parse(root / "__init__.py"))
    for file in (root / "models").glob("*/tokenization_*.py"):  # what each model module exports (its __all__)
        try:
            exported |= {n for m in _ALL.finditer(file.read_text(encoding="utf-8")) for n in re.findall(r"[\"'](\w+)[\"']", m[1])}
        except (OSError, ValueError):
            continue
    tokenizers |= {n for n in exported if "Tokenizer" in n or n.endswith("Backend")}
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    return ShippedNames(version, frozenset(model_types), frozenset(tokenizers))


def _json(file: Path) -> dict | None:
    """A JSON object file, or None when absent or unusable (the shape reader reports an unusable config.json)."""
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return raw if isinstance(raw, dict) else None


def folder_problem(folder: str | Path) -> str | None:
    """custom_code_problem for a target folder, judged against the installed transformers' files (torch-free).

    None when the folder needs no code of its own, has no readable config.json (other readers say why), or no
    transformers is installed (nothing could load it either way).
    """
    names = shipped_names()
    folder = Path(folder)
    config = _json(folder / "config.json")
    if names is None or config is None:
        return None
    return custom_code_problem(folder, config, _json(folder / "tokenizer_config.json"), f"transformers {names.version}",
                               names.model_types.__contains__, names.knows_tokenizer)
