"""User prompts: the embedded chitchat set (train / held-out by conversation) or a file.

    load_prompts("chitchat")     # train split of the chitchat-dataset package (real human chats)
    load_prompts("held-out")     # its held-out split: conversations never seen in training
    load_prompts("my.txt")       # one prompt per non-empty line (lines end at "\\n" only)
    load_prompts("my.jsonl")     # one JSON object per line with a "prompt" field (or a JSON string)

The chitchat split is by conversation: a conversation is held out when the first byte of the
sha256 of its id is below HELD_OUT_BYTE, so the split never depends on file order, Python's
hash seed or the machine. Each conversation's turns become single-turn prompts, ordered turn 0
of every conversation first, then turn 1, ... so any prefix of the list is spread over many
conversations.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

from dflash.data.jsonl import JsonLineError, decode_json, text_lines
from dflash.errors import DflashError

CHITCHAT = "chitchat"
HELD_OUT = "held-out"
CHITCHAT_DISTRIBUTION = "chitchat-dataset"
HELD_OUT_BYTE = 13  # 13/256 ~ 5% of conversations are held out
MIN_CHARS, MAX_CHARS = 20, 400  # turns outside this length (characters) make poor prompts
CHARS_PER_TOKEN = 64  # generous bound on the characters one token covers: a prompt is cut to this per token of a limit


class PromptError(DflashError):
    """Prompts that cannot be used; the message is one line naming the source and the fix."""

    exit_code = 2  # bad input


def chitchat_json() -> Path:
    """dataset.json inside the installed chitchat-dataset distribution (its module is not imported)."""
    try:
        dist = importlib.metadata.distribution(CHITCHAT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise PromptError(
            f"--prompts chitchat needs the package {CHITCHAT_DISTRIBUTION} (demo group); run `uv sync`"
        ) from None
    found = [f for f in dist.files or [] if str(f).endswith("dataset.json")]
    if not found or not Path(dist.locate_file(found[0])).is_file():
        raise PromptError(f"{CHITCHAT_DISTRIBUTION} {dist.version} has no dataset.json; reinstall it with `uv sync`")
    return Path(dist.locate_file(found[0]))


def is_held_out(conversation_id: str) -> bool:
    return hashlib.sha256(conversation_id.encode()).digest()[0] < HELD_OUT_BYTE


def chitchat_prompts(held_out: bool) -> list[str]:
    data = json.loads(chitchat_json().read_text())
    ids = sorted((cid for cid in data if is_held_out(cid) == held_out),
                 key=lambda cid: hashlib.sha256(cid.encode()).hexdigest())
    per_conv = []
    for cid in ids:
        turns = (" ".join(u["text"].strip() for u in msg).strip() for msg in data[cid]["messages"])
        per_conv.append([t for t in turns if MIN_CHARS <= len(t) <= MAX_CHARS])
    prompts, depth = [], max((len(t) for t in per_conv), default=0)
    for k in range(depth):
        prompts += [turns[k] for turns in per_conv if k < len(turns)]
    return prompts


def file_prompts(path: Path) -> list[str]:
    """Prompts of a .txt (one per line) or .jsonl file; lines end at "\\n" only (dflash.data.jsonl). A path that is
    not a regular file (a FIFO would block, /dev/zero never end) is refused before it is read."""
    if path.exists() and not path.is_file():
        raise PromptError(f"{path}: not a regular file (a folder, a FIFO or a device); give a .txt/.jsonl file, "
                          "'chitchat' or 'held-out'")
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise PromptError(f"{path}: no such prompt file (give a .txt/.jsonl file, 'chitchat' or 'held-out')") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"{path}: cannot read it as UTF-8 text ({e})") from None
    lines = [(lineno, line.strip()) for lineno, line in text_lines(text) if line.strip()]
    del text
    if path.suffix == ".jsonl":
        prompts = []
        for lineno, line in lines:
            try:
                row = decode_json(line)
            except JsonLineError as e:
                raise PromptError(f"{path}:{lineno}: not valid JSON ({e})") from None
            prompt = row.get("prompt") if isinstance(row, dict) else row
            if not isinstance(prompt, str):
                raise PromptError(f"{path}:{lineno}: expected a JSON string or an object with a \"prompt\" string")
            prompts.append(prompt)
    else:
        prompts = [line for _, line in lines]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise PromptError(f"{path}: the prompt file holds no prompts (one per line, or JSONL with \"prompt\")")
    return prompts


def load_prompts(spec: str, limit: int | None = None) -> list[str]:
    """Prompts from 'chitchat', 'held-out' or a file; the first `limit` of them if given."""
    if spec == CHITCHAT:
        prompts = chitchat_prompts(held_out=False)
    elif spec == HELD_OUT:
        prompts = chitchat_prompts(held_out=True)
    else:
        prompts = file_prompts(Path(spec))
    return prompts[:limit] if limit is not None else prompts


def chat_prompt_ids(tokenizer, prompt: str, max_tokens: int | None = None) -> list[int]:
    """Token ids of one user turn in the tokenizer's chat template, ending with the assistant header.

    With `max_tokens`: at most max_tokens + 1 ids (more than max_tokens: the prompt does not fit), and
    the text is cut to CHARS_PER_TOKEN characters per token first, so a huge prompt costs what a
    max_tokens one does. A tokenizer without a chat template (tiny test tokenizers) gets the plain text.
    """
    if max_tokens is None:
        return _template_ids(tokenizer, prompt)
    bound = (max_tokens + 1) * CHARS_PER_TOKEN
    if len(prompt) > bound:
        ids = _template_ids(tokenizer, prompt[:bound])
        if len(ids) > max_tokens:
            return ids[: max_tokens + 1]
    return _template_ids(tokenizer, prompt)[: max_tokens + 1]  # short, or tokens longer than the bound


def _template_ids(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)
        return list(out["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def prompts_within(tokenizer, prompts: list[str], context: int | None) -> list[list[int]]:
    """Chat-templated ids per prompt; PromptError for a prompt that leaves no room for a reply in `context` tokens."""
    out = []
    for i, text in enumerate(prompts):
        ids = chat_prompt_ids(tokenizer, text, context)
        if context is not None and len(ids) >= context:
            size = f"{len(ids)}" if len(ids) <= context else f"more than {context}"
            raise PromptError(f"prompt {i} is {size} tokens with the chat template, the target's context is "
                              f"{context} (max_position_embeddings); shorten or drop it")
        out.append(ids)
    return out


def source_fingerprint(prompts: list[str]) -> str:
    """Hash of a prompt list (recorded in manifests so a resume never mixes two prompt sets)."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(hashlib.sha256(p.encode()).digest())
    return h.hexdigest()[:16]
