"""DDTree evaluation: the tree is the budget's most probable prefixes, its verification (one target forward under
a tree mask) reproduces greedy decoding token for token, a chain accepts as linear decoding does, and the computed
walk (hybrid targets) agrees with the verified one round for round."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash.data.prompts import chat_prompt_ids
from dflash.data.synthetic import word_text
from dflash.eval.ddtree import ancestor_mask, build_tree, chain_tree, ddtree_decode, tree_verifiable
from dflash.eval.speculative import Decoder, load_eval_target
from dflash.models.drafter import DFlashDrafter, drafter_config_from_target
from trainkit import chat_target

MASK_ID = 5  # "<mask>" in the tiny tokenizer


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ddtree")


def _decoder(model, tok, block_size=4):
    torch.manual_seed(0)
    cfg = drafter_config_from_target(model.config, 1, block_size, mask_token_id=MASK_ID)
    return Decoder(model, DFlashDrafter(cfg).eval(), [tok.eos_token_id])


def test_tree_is_the_budgets_most_probable_prefixes_closed_under_prefixes():
    g = torch.Generator().manual_seed(0)
    K, V = 3, 4
    logp = torch.randn(K, V, generator=g).log_softmax(-1)
    prefixes = [p for d in range(1, K + 1) for p in itertools.product(range(V), repeat=d)]
    score = {p: sum(float(logp[k, t]) for k, t in enumerate(p)) for p in prefixes}
    by_score = sorted(prefixes, key=lambda p: -score[p])
    for budget in (1, 2, 5, 11, len(prefixes)):
        tree = build_tree(logp, budget)
        paths = []
        for i in range(len(tree.tokens)):
            path, node = [], i
            while node >= 0:
                path.append(tree.tokens[node])
                node = tree.parents[node]
            paths.append(tuple(reversed(path)))
        assert len(paths) == budget and len(set(paths)) == budget
        assert all(p[:-1] in paths for p in paths if len(p) > 1), "not closed under prefixes"
        assert [len(p) for p in paths] == tree.depths
        assert sorted(score[p] for p in paths) == pytest.approx(sorted(score[p] for p in by_score[:budget]))
    assert build_tree(logp, 1).tokens == [int(logp[0].argmax())]


def test_ancestor_mask_by_hand():
    # root -> 0 -> 1, root -> 2 -> 3 -> 4, 0 -> 5
    from dflash.eval.ddtree import Tree

    tree = Tree([7, 8, 9, 10, 11, 12], [-1, 0, -1, 2, 3, 0], [1, 2, 1, 2, 3, 2])
    m = ancestor_mask(tree).int().tolist()
    assert m[0] == [1, 0, 0, 0, 0, 0, 0]
    assert m[2] == [1, 1, 1, 0, 0, 0, 0]  # node 1: root, node 0, itself
    assert m[5] == [1, 0, 0, 1, 1, 1, 0]  # node 4: root, 2, 3, itself
    assert m[6] == [1, 1, 0, 0, 0, 0, 1]  # node 5: root, 0, itself
    assert chain_tree([4, 5, 6]).parents == [-1, 0, 1]


class _Oracle:
    """Drafter logits [K, V] in which the target's true greedy continuation is the rank-r token at each slot,
    r cycling 1, 2, 1, 3 with the position: a linear draft fails at every rank-2/3 slot, a tree need not."""

    def __init__(self, reference: list[int], prompt_len: int, vocab: int):
        self.reference, self.prompt_len, self.vocab = reference, prompt_len, vocab

    def __call__(self, ctx_SF, last, block_size):
        done = ctx_SF.shape[0] - self.prompt_len + 1  # tokens generated so far, `last` included
        g = torch.Generator().manual_seed(done)
        logits = torch.randn(block_size - 1, self.vocab, generator=g)
        for k in range(block_size - 1):
            if done + k >= len(self.reference):
                continue
            true = self.reference[done + k]
            rank = (1, 2, 1, 3)[(done + k) % 4]
            others = [t for t in logits[k].argsort(descending=True).tolist() if t != true][: rank - 1]
            top = float(logits[k].max()) + 1.0
            for j, t in enumerate(others):
                logits[k, t] = top + 3.0 - j
            logits[k, true] = top + 2.5 - (rank - 1) + (1.0 if rank == 1 else 0.0)
        return logits


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tree_verification_is_greedy_token_for_token_and_accepts_deeper_than_a_chain(root, arch):
    model, tok = load_eval_target(str(chat_target(root, arch)), "cpu")
    assert tree_verifiable(model) is None
    prompt = chat_prompt_ids(tok, word_text(6))
    dec = _decoder(model, tok, block_size=5)
    reference, _ = Decoder(model, None, [tok.eos_token_id]).greedy(prompt, 40)
    tokens, accept, nodes = ddtree_decode(dec, prompt, 40, 5, 16)  # the random drafter: mostly rejected
    assert tokens == reference and sum(accept) >= len(reference) - 1 and set(nodes) == {16}

    dec.draft_logits = _Oracle(reference, len(prompt), model.config.vocab_size)
    linear, linear_accept = dec.speculative(prompt, 40, 5)
    tree_tokens, tree_accept, _ = ddtree_decode(dec, prompt, 40, 5, 16)
    assert linear == reference and tree_tokens == reference
    # the chain stops at every rank-2/3 slot; the tree holds the top-2 of slot 1 and more below
    assert sum(tree_accept) / len(tree_accept) > sum(linear_accept) / len(linear_accept) + 0.5, (tree_accept, linear_accept)


def test_a_chain_tree_accepts_as_linear_decoding_does(root):
    model, tok = load_eval_target(str(chat_target(root, "llama")), "cpu")
    prompt = chat_prompt_ids(tok, word_text(5, 2))
    dec = _decoder(model, tok)
    reference, _ = Decoder(model, None, [tok.eos_token_id]).greedy(prompt, 30)
    dec.draft_logits = _Oracle(reference, len(prompt), model.config.vocab_size)
    linear, linear_accept = dec.speculative(prompt, 30, 4)
    chain, chain_accept, nodes = ddtree_decode(dec, prompt, 30, 4, 1, tree_of=lambda _logp, top1: chain_tree(top1))
    assert chain == linear == reference
    assert chain_accept == linear_accept and set(nodes) == {3}


def _computed_equals_verified(model, tok, prompt, max_new, block_size, budget):
    dec = _decoder(model, tok, block_size)
    reference, _ = Decoder(model, None, [tok.eos_token_id]).greedy(prompt, max_new + block_size)
    dec.draft_logits = _Oracle(reference, len(prompt), model.config.vocab_size)
    verified = ddtree_decode(dec, prompt, max_new, block_size, budget)
    computed = ddtree_decode(dec, prompt, max_new, block_size, budget, verified=False)
    assert verified[0] == computed[0] == reference[:len(verified[0])]
    assert verified[1] == computed[1], f"acceptance per round: verified {verified[1]} vs computed {computed[1]}"
    assert max(verified[1]) > 2  # the tree reached below slot 1
    return verified[1]


def test_computed_walk_agrees_with_verified_round_for_round(root):
    model, tok = load_eval_target(str(chat_target(root, "qwen3")), "cpu")
    _computed_equals_verified(model, tok, chat_prompt_ids(tok, word_text(7, 1)), 30, 5, 12)


@pytest.mark.slow
def test_computed_walk_agrees_with_verified_on_smollm2(smollm2_path):
    """The real SmolLM2-135M (pure attention): the walk computed by greedy decoding, as on a hybrid target, and the
    one verified under the tree mask agree round for round."""
    model, tok = load_eval_target(str(smollm2_path), "cpu")
    assert tree_verifiable(model) is None
    prompt = chat_prompt_ids(tok, "What is the capital of France?")
    _computed_equals_verified(model, tok, prompt, 24, 8, 16)


def test_hybrid_layers_are_not_tree_verifiable():
    class Config:
        layer_types = ["linear_attention", "full_attention"]

    class Model:
        config = Config()

    assert "linear_attention" in tree_verifiable(Model())


def test_cli_prints_a_tau_per_budget_beside_the_linear_one(root, tmp_path):
    import json

    from click.testing import CliRunner

    from dflash.commands.eval import eval_command

    target = chat_target(root, "llama")
    model, tok = load_eval_target(str(target), "cpu")
    _decoder(model, tok).drafter.save_pretrained(tmp_path / "run" / "drafter")
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"{word_text(4)}\n{word_text(5, 3)}\n")
    out = tmp_path / "r.json"
    args = ["--target", str(target), "--drafter", str(tmp_path / "run"), "--prompts", str(prompts),
            "--max-new-tokens", "12", "--json", str(out)]
    res = CliRunner().invoke(eval_command, [*args, "--ddtree", "4,8"])
    assert res.exit_code == 0, res.output
    lines = [line for line in res.output.splitlines() if "ddtree budget" in line]
    assert len(lines) == 2 and "ddtree budget    4 (verified): mean acceptance length" in lines[0], res.output
    assert "(linear " in lines[1] and "4.0 nodes per round" in lines[0] and lines[1].endswith("lossless")
    report = json.loads(out.read_text())
    assert [t["budget"] for t in report["ddtree"]] == [4, 8] and all(t["lossless"] for t in report["ddtree"])
    assert sum(report["ddtree"][0]["histogram"].values()) == report["ddtree"][0]["rounds"] > 0

    res = CliRunner().invoke(eval_command, [*args, "--ddtree", "16,0"])
    assert res.exit_code == 2 and "--ddtree '16,0': give node budgets as integers 1..4096" in res.output


def test_a_hybrid_target_gets_both_acceptances_computed_and_lossless(root):
    """A tiny random Qwen3.5-family hybrid (3 of 4 layers Gated DeltaNet): no tree mask and no cache roll-back, so the
    linear and the tree acceptance are both computed by greedy decoding, labelled so, and still checked lossless."""
    from dflash.data.synthetic import WORD_TOKENIZER_IDS, hybrid_target_config, write_target
    from dflash.eval.speculative import evaluate_drafters

    folder = write_target(root / "tiny-hybrid", hybrid_target_config(**WORD_TOKENIZER_IDS), tokenizer=True,
                          head_scale=8.0)
    model, tok = load_eval_target(str(folder), "cpu")
    assert "linear_attention" in tree_verifiable(model)
    prompts = [word_text(6), word_text(5, 3)]
    r = evaluate_drafters(model, tok, {"d": _decoder(model, tok).drafter}, prompts, None, 12, progress=False,
                          ddtree=[8])["d"]
    assert r.linear_mode == "computed" and r.lossless and r.verify_steps > 0
    (t,) = r.ddtree
    assert t["mode"] == "computed" and t["lossless"] and t["tok_s"] == 0 and t["nodes_per_round"] == 8.0
