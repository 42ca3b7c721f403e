"""dflash-eval: speculative decoding must reproduce target-only greedy decoding token for token."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dflash.commands.eval import eval_command
from dflash.data.prompts import chat_prompt_ids
from dflash.data.synthetic import word_text
from dflash.eval.evaluate import find_drafter_folder
from dflash.eval.results import EvalError
from dflash.eval.speculative import Decoder, evaluate_drafters, load_eval_target
from dflash.models.drafter import DFlashDrafter, drafter_config_from_target
from trainkit import chat_target

MASK_ID = 5  # "<mask>" in the tiny tokenizer


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("eval")


def _drafter(model, block_size=4, seed=0):
    torch.manual_seed(seed)
    cfg = drafter_config_from_target(model.config, 1, block_size, mask_token_id=MASK_ID)
    return DFlashDrafter(cfg).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_random_drafter_is_lossless(root, arch):
    model, tok = load_eval_target(str(chat_target(root, arch)), "cpu")
    prompts = [word_text(3 + i, start=i) for i in range(3)]
    lines = []
    reports = evaluate_drafters(model, tok, {"random": _drafter(model)}, prompts, None, 24, lines.append,
                                progress=False, ddtree=[4])
    r = reports["random"]
    assert r.lossless, r.mismatches
    assert r.new_tokens > 0 and r.verify_steps > 0
    assert 1.0 <= r.mean_accept_len <= 4.0
    assert sum(r.histogram.values()) == r.verify_steps
    # no bar: a line per prompt of each pass as it finishes, the last with what the report says
    for desc in ("target-only greedy", "speculative (random)", f"ddtree 4 ({r.ddtree[0]['mode']})"):
        mine = [line for line in lines if line.startswith(f"  {desc}: prompt ")]
        assert [m.split(": ")[1] for m in mine] == ["prompt 1/3", "prompt 2/3", "prompt 3/3"], lines
    last = [line for line in lines if line.startswith("  speculative (random): prompt 3/3")][0]
    assert f"mean acceptance length {r.mean_accept_len:.2f} so far" in last
    tree_last = [line for line in lines if line.startswith("  ddtree 4 (") and "prompt 3/3" in line][0]
    assert f"mean acceptance length {r.ddtree[0]['mean_accept_len']:.2f} so far" in tree_last


class _Oracle:
    """Drafts the target's true greedy continuation, wrong from slot `wrong_at` on (None: never)."""

    def __init__(self, reference: list[int], prompt_len: int, wrong_at: int | None):
        self.reference, self.prompt_len, self.wrong_at = reference, prompt_len, wrong_at

    def __call__(self, ctx_SF, last, block_size):
        done = ctx_SF.shape[0] - self.prompt_len + 1  # tokens generated so far (incl. `last`)
        true = (self.reference[done:] + [0] * block_size)[: block_size - 1]
        if self.wrong_at is not None:
            true = true[: self.wrong_at] + [(t + 1) % 64 for t in true[self.wrong_at:]]
        return true


@pytest.mark.parametrize("wrong_at, expect", [(None, 4), (0, 1), (2, 3)])
def test_cache_rollback_keeps_output_exact(root, monkeypatch, wrong_at, expect):
    """Accepting all, none or part of a block: output still equals greedy, acceptance is as drafted."""
    model, tok = load_eval_target(str(chat_target(root, "llama")), "cpu")
    prompt = chat_prompt_ids(tok, word_text(6))
    base = Decoder(model, None, [tok.eos_token_id])
    reference, _ = base.greedy(prompt, 30)
    dec = Decoder(model, _drafter(model), [tok.eos_token_id])
    monkeypatch.setattr(dec, "draft", _Oracle(reference, len(prompt), wrong_at))
    tokens, accept = dec.speculative(prompt, 30, 4)
    assert tokens == reference
    assert all(a == expect for a in accept[:-1]), accept  # the last step may run past the end


def test_detects_a_lossy_decoder(root, monkeypatch):
    """A verify step that accepts a wrong draft must be reported, not hidden."""
    model, tok = load_eval_target(str(chat_target(root, "llama")), "cpu")

    def lossy(self, prompt, max_new, block_size):
        tokens, accept = real(self, prompt, max_new, block_size)
        return [(tokens[0] + 1) % 64] + tokens[1:], accept

    real = Decoder.speculative
    monkeypatch.setattr(Decoder, "speculative", lossy)
    r = evaluate_drafters(model, tok, {"d": _drafter(model)}, [word_text(4)], None, 8, progress=False)["d"]
    assert not r.lossless
    assert "token 0" in r.mismatches[0]


def test_cli_reports_and_exit_codes(root, tmp_path):
    target = chat_target(root, "llama")
    model, _ = load_eval_target(str(target), "cpu")
    run = tmp_path / "run"
    _drafter(model).save_pretrained(run / "drafter")
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"{word_text(4)}\n{word_text(5, 3)}\n")
    out = tmp_path / "r.json"
    res = CliRunner().invoke(eval_command, ["--target", str(target), "--drafter", str(run), "--prompts", str(prompts),
                                         "--max-new-tokens", "12", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "mean acceptance length" in res.output and "lossless: " in res.output
    assert json.loads(out.read_text())["lossless"] is True
    assert find_drafter_folder(run) == run / "drafter"

    res = CliRunner().invoke(eval_command, ["--target", str(target), "--drafter", str(tmp_path), "--prompts",
                                         str(prompts)])
    assert res.exit_code == 2
    assert "not a drafter folder" in res.output


def test_an_fp8_target_verifies_losslessly_and_the_report_says_fp8(root, tmp_path, monkeypatch):
    """--target-precision fp8: the target that verifies runs e4m3 linears (emulated on CPU), its own greedy output is
    the reference, the report names the precision; another precision is one line, exit 2."""
    from dflash.models import target_fp8

    target = chat_target(root, "llama")
    model, _ = load_eval_target(str(target), "cpu")
    _drafter(model).save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"{word_text(4)}\n{word_text(5, 3)}\n")
    monkeypatch.setattr(target_fp8, "MIN_FEATURES", 64)  # the tiny target's linears are far below the real filter
    args = ["--target", str(target), "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts),
            "--max-new-tokens", "12", "--ddtree", "4"]
    out = tmp_path / "r.json"
    res = CliRunner().invoke(eval_command, [*args, "--target-precision", "fp8", "--json", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["target_precision"] == "fp8" and report["target_fp8_linears"] == 20  # q, o, gate, up, down x 4 layers
    assert report["lossless"] is True and report["ddtree"][0]["lossless"] is True
    assert "against the fp8 target (20 e4m3 linears)" in res.output and "lossless: " in res.output

    res = CliRunner().invoke(eval_command, [*args, "--target-precision", "fp4"])
    assert res.exit_code == 2
    assert "'fp4' is not one of 'bf16', 'fp8'" in res.output


def test_drafter_of_another_target_is_refused(root):
    llama, tok = load_eval_target(str(chat_target(root, "llama")), "cpu")
    cfg = drafter_config_from_target(dict(llama.config.to_dict(), num_hidden_layers=8), 1, 4, mask_token_id=MASK_ID)
    with pytest.raises(EvalError, match="does not belong to this target"):
        evaluate_drafters(llama, tok, {"x": DFlashDrafter(cfg)}, [word_text(3)], None, 4, progress=False)


def test_a_tie_break_is_lossless_and_a_wrong_token_is_not(root, monkeypatch):
    """A bf16 target on a GPU ties its top-2 logits now and then, and the batched verify pass may take the other
    token: an output that differs from target-only greedy but where every token is still a greedy choice within
    one ulp of the top logit is a tie, not a lossy decoder. Here the tie is made by taking greedy's runner-up at
    the first token (then greedy again) and widening the tolerance just past that gap."""
    model, tok = load_eval_target(str(chat_target(root, "llama")), "cpu")
    prompt = chat_prompt_ids(tok, word_text(4))
    base = Decoder(model, None, [tok.eos_token_id])
    ref, _ = base.greedy(prompt, 8)
    logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    top2 = logits.topk(2)
    runner_up = int(top2.indices[1])
    rest, _ = base.greedy(prompt + [runner_up], 7)
    tie_break = [runner_up] + rest
    assert base.not_greedy_at(prompt, ref) is None and base.not_greedy_at(prompt, tie_break) == 0

    def decoding(output):
        return lambda self, prompt, max_new, block_size: (output, [1] * len(output))

    widened = float(top2.values[0] - top2.values[1]) / abs(float(top2.values[0])) * 1.5
    for output, eps, lossless, ties in ((tie_break, widened, True, 1), (tie_break, None, False, 0),
                                        ([int(logits.argmin())] + ref[1:], widened, False, 0)):
        monkeypatch.setattr(Decoder, "speculative", decoding(output))
        if eps is not None:  # every Decoder evaluate_drafters builds gets the widened tolerance
            real_init = Decoder.__init__
            monkeypatch.setattr(Decoder, "__init__", lambda self, *a, real_init=real_init, eps=eps: (
                real_init(self, *a), setattr(self, "tie_eps", eps))[0])
        r = evaluate_drafters(model, tok, {"d": _drafter(model)}, [word_text(4)], None, 8, progress=False)["d"]
        monkeypatch.undo()
        assert (r.lossless, len(r.ties)) == (lossless, ties), (output, eps, r.mismatches, r.ties)


def test_report_prints_ties_inside_a_lossless_verdict(capsys):
    from dflash.eval.evaluate import print_report
    from dflash.eval.results import EvalReport

    r = EvalReport("d", 4, 4, 8, verify_steps=3, new_tokens=8, histogram={1: 3}, ties=["prompt 2: diverged at ..."])
    print_report(r)
    out = capsys.readouterr().out
    assert "lossless: identical to target-only greedy decoding up to ties: 1 of 4 prompts differ" in out
    assert "prompt 2: diverged" in out and "NOT LOSSLESS" not in out
