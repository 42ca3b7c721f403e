"""DDTree evaluation: a tree of drafts from one drafter pass, checked against the target (Ringel and Romano,
arXiv 2604.12989; reference code liranringel/ddtree). The trained DFlash drafter is used unchanged.

Each round, at the committed prefix whose last token is `last` (the tree's root):
- build: one drafter pass gives a distribution per block slot 1..K; a best-first heap takes the `budget` most
  probable prefixes, a prefix scored by the sum of its slots' log-probabilities (`build_tree`). A child never
  scores above its parent, so the chosen set is closed under prefixes;
- verify (targets whose attention takes a 4D mask: dense Llama, Qwen3, SmolLM2): the target runs once over
  [root, every node], each node at position n + its depth and seeing the committed past plus its own ancestors
  (`ancestor_mask`); its KV cache then keeps the root and the accepted path only;
- walk (T = 0): from the root, follow the child whose token is the target's greedy token; the tokens on the path are
  accepted, plus the target's token after the last of them. Acceptance length = path length + 1.
Hybrid targets (Gated DeltaNet layers take no tree mask) get the same walk computed instead (`computed_round`): the
target decodes the path greedily one token at a time (its recurrent state only ever sees committed tokens), which
gives the exact T = 0 tree acceptance; it is labelled computed, not verified, and its speed means nothing.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass
class Tree:
    """Nodes 0..n-1 below the root (the last committed token, not a node)."""

    tokens: list[int]
    parents: list[int]  # parent node, -1 = the root
    depths: list[int]  # 1 = a child of the root (block slot 1)

    def children(self) -> dict[tuple[int, int], int]:
        """(parent, token) -> node; the root is -1."""
        return {(p, t): i for i, (p, t) in enumerate(zip(self.parents, self.tokens))}

    def walk(self, next_token) -> tuple[list[int], int]:
        """(nodes on the accepted path, the target's token after its end): next_token(node or -1) is the target's
        greedy token after that node's prefix."""
        kids, node, path = self.children(), -1, []
        token = next_token(node)
        while (node, token) in kids:
            node = kids[(node, token)]
            path.append(node)
            token = next_token(node)
        return path, token


def build_tree(logp_KV: torch.Tensor, budget: int) -> Tree:
    """The `budget` most probable prefixes of slots 1..K under per-slot log-probs [K, V], best first.

    Candidates on the heap are (score, parent, rank): the rank-th most probable token at the slot below `parent`.
    Taking one pushes its next sibling and its first child, so every node's prefix is taken before it.
    """
    if budget < 1:
        raise ValueError(f"tree budget must be >= 1, got {budget}")
    K = logp_KV.shape[0]
    top = logp_KV.float().topk(min(budget, logp_KV.shape[1]), dim=-1)
    vals, idx = top.values.tolist(), top.indices.tolist()
    tree, scores = Tree([], [], []), []
    heap = [(-vals[0][0], 0, -1, 0)]  # (-score, order (ties: first pushed first), parent, rank)
    pushed = 1
    while heap and len(tree.tokens) < budget:
        neg, _, parent, rank = heapq.heappop(heap)
        depth = tree.depths[parent] + 1 if parent >= 0 else 1
        node = len(tree.tokens)
        tree.tokens.append(idx[depth - 1][rank])
        tree.parents.append(parent)
        tree.depths.append(depth)
        scores.append(-neg)
        base = scores[parent] if parent >= 0 else 0.0
        if rank + 1 < len(vals[depth - 1]):
            heapq.heappush(heap, (-(base + vals[depth - 1][rank + 1]), pushed, parent, rank + 1))
            pushed += 1
        if depth < K:
            heapq.heappush(heap, (-(-neg + vals[depth][0]), pushed, node, 0))
            pushed += 1
    return tree


def chain_tree(tokens: list[int]) -> Tree:
    """A tree that is one chain: the linear draft (tests: it must accept as linear speculative decoding does)."""
    return Tree(list(tokens), list(range(-1, len(tokens) - 1)), list(range(1, len(tokens) + 1)))


def ancestor_mask(tree: Tree) -> torch.Tensor:
    """[n+1, n+1] bool over [root, nodes]: row i sees column j when j is i itself or one of its ancestors."""
    n = len(tree.tokens)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(tree.parents):  # parents come before their children
        row = i + 1
        if p >= 0:
            mask[row] = mask[p + 1]
        mask[row, row] = True
    return mask


def cache_rolls_back(target) -> bool:
    """Every layer is attention, whose KV cache can drop rejected drafts (a Gated DeltaNet state cannot)."""
    types = set(getattr(target.config, "layer_types", None) or ["full_attention"])
    return types <= {"full_attention", "sliding_attention"}


def tree_verifiable(target) -> str | None:
    """None when the target's attention takes a tree mask here, else why not (then the walk is computed)."""
    c = target.config
    types = set(getattr(c, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"layer types {sorted(types)}: only full-attention layers take a tree mask"
    if getattr(c, "use_sliding_window", True) and getattr(c, "sliding_window", None):
        return "sliding-window attention"
    impl = getattr(c, "_attn_implementation", None) or "sdpa"
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl} (sdpa or eager take a 4D mask)"
    return None


def _keep_in_cache(cache, past: int, keep: list[int]) -> None:
    """Keep the first `past` cached positions and the new ones at `keep` (indices into the verified tokens)."""
    layers = getattr(cache, "layers", None)
    assert layers is not None, "a DynamicCache of transformers >= 4.56 (layers with keys and values)"
    device = layers[0].keys.device
    idx = torch.cat([torch.arange(past, device=device), past + torch.tensor(keep, device=device)])
    for layer in layers:
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)


def verified_round(dec, cache, last: int, tree: Tree) -> tuple[list[int], int, torch.Tensor]:
    """One target forward over [last, tree nodes] under the tree mask: (accepted tokens, next token, their target
    features [1 + accepted, F] for the drafter's context); the cache keeps `last` and the accepted path."""
    past = cache.get_seq_length()
    n = len(tree.tokens)
    dtype = dec.head_w.dtype
    visible = torch.ones(n + 1, past + n + 1, dtype=torch.bool)
    visible[:, past:] = ancestor_mask(tree)
    mask = torch.zeros(1, 1, n + 1, past + n + 1, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    ids = torch.tensor([[last, *tree.tokens]], device=dec.device)
    pos = past + torch.tensor([[0, *tree.depths]], device=dec.device)
    out = dec.target(input_ids=ids, position_ids=pos, attention_mask=mask.to(dec.device), past_key_values=cache,
                     use_cache=True, output_hidden_states=True)
    greedy = out.logits[0].float().argmax(dim=-1).tolist()  # greedy[i]: the target's token after input i
    path, bonus = tree.walk(lambda node: greedy[node + 1])
    keep = [0] + [i + 1 for i in path]
    _keep_in_cache(cache, past, keep)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in dec.drafter.config.target_layer_ids], dim=-1)
    return [tree.tokens[i] for i in path], bonus, feats[keep]


def computed_round(dec, cache, last: int, tree: Tree) -> tuple[list[int], int, torch.Tensor]:
    """The same walk computed with the target decoding greedily, one committed token per forward (any target: a
    hybrid's recurrent state never sees a token that is not committed). Same return as `verified_round`."""
    feats = []

    def next_token(node: int) -> int:
        logits, f = dec._forward([last if node < 0 else tree.tokens[node]], cache)
        feats.append(f)
        return int(logits[-1].argmax())

    path, bonus = tree.walk(next_token)
    return [tree.tokens[i] for i in path], bonus, torch.cat(feats)


def ddtree_decode(dec, prompt: list[int], max_new: int, block_size: int, budget: int, verified: bool = True,
                  tree_of=None) -> tuple[list[int], list[int], list[int]]:
    """Tokens, the acceptance length of every round, and the tree's node count of every round (greedy, batch 1).

    tree_of(logp_KV, drafted top-1 tokens) -> Tree replaces the budgeted tree (tests: a chain)."""
    cache = dec.new_cache()
    logits, ctx_SF = dec._forward(prompt, cache, last_only=True)
    tokens = [int(logits[-1].argmax())]
    accept, nodes = [], []
    round_fn = verified_round if verified else computed_round
    while not dec._finished(tokens, max_new):
        logits_KV = dec.draft_logits(ctx_SF, tokens[-1], block_size)
        logp_KV = logits_KV.float().log_softmax(dim=-1)
        tree = tree_of(logp_KV, logits_KV.argmax(dim=-1).tolist()) if tree_of else build_tree(logp_KV, budget)
        path, bonus, feats = round_fn(dec, cache, tokens[-1], tree)
        accept.append(len(path) + 1)
        nodes.append(len(tree.tokens))
        tokens += path + [bonus]
        ctx_SF = torch.cat([ctx_SF, feats])
    return dec._truncate(tokens, max_new), accept, nodes
