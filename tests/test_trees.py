"""Token trees (saguaro.engine.tree): SD verifying the draft's runner-up tokens too stays exact.

Greedy SD with trees commits AR's tokens on real prompts; sampled, every committed token is
distributed as the target's (the pooled PIT test of tests/stats.py) at T = 0.7 and 1.0 with
top-k / top-p, with the bonus after a full path included. The negative controls break the two
things a tree adds: a sibling tried against the residual before the rejected one was removed,
and a mask that lets a node see a sibling's KV entry.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import saguaro.engine.runner as runner
import saguaro.engine.verifier as verification
from conftest import NEW_TOKENS
from drafts import sd_decoder
from saguaro import LLM, SamplingParams
from saguaro.config import SpeculativeConfig, TreeShape
from saguaro.engine.sampler import sample
from saguaro.engine.tree import children, depths, tree_mask, walk, walk_greedy
from saguaro.models import hub
from saguaro.models.llama import LlamaModel
from saguaro.speculation import build
from saguaro.speculation.policy.auto import Controller, auto_trees
from saguaro.speculation.local.drafters import pick_nodes
from stats import chi_square_pvalue, ks_pvalue, randomized_pit, teacher_forced_pit
from test_exactness import ALPHA, TINY_K, sampled, tiny_model, tiny_outputs, tiny_prompts

SHAPE = dict(tree_topk=3, num_draft_tokens=6)  # depth TINY_K = 2: 3 children of the root, 9 below, 6 kept


def walk_without_removal(tokens, parents, target_probs, u):
    """Broken: each sibling is tried against the target's distribution itself, not against the
    residual left once the siblings before it were rejected."""
    kids = children(parents)
    path, at = [], -1
    while True:
        p = target_probs[at + 1]
        step = next((c for c in kids[at + 1] if float(u[c]) < float(p[tokens[c]])), None)
        if step is None:
            residual = p.clone()
            residual[[tokens[c] for c in kids[at + 1]]] = 0
            return path, int(sample(residual[None], u[-1:])[0])
        path.append(step)
        at = step


def walk_with_an_earlier_bonus_uniform(tokens, parents, target_probs, u):
    """Broken: the bonus is drawn with u[N - 1], the last node's uniform (an index off by one),
    not u[N]: after that node was tried and rejected, the number is no longer uniform."""
    return walk(tokens, parents, target_probs, torch.cat((u[:-1], u[-2:-1])))


def mask_seeing_siblings(parents, starts, width, span):
    """Broken: every node sees every node before it in the pass (a causal mask), its elder
    siblings' and cousins' KV entries included."""
    mask = tree_mask(parents, starts, width, span)
    for i, start in enumerate(starts):
        n = len(parents[i])
        mask[i, :n, start:start + n] |= torch.ones(n, n, dtype=torch.bool).tril()
    return mask


# --- the tree's pieces --------------------------------------------------------------------------

def test_tree_layout():
    parents = [-1, -1, 0, 0, 2, 1]
    assert depths(parents) == [0, 0, 1, 1, 2, 1]
    assert children(parents) == [[0, 1], [2, 3], [5], [4], [], [], []]
    mask = tree_mask([parents], [3], 8, 10)[0]
    assert mask[4, :3].all() and mask[4].nonzero()[:, 0].tolist() == [0, 1, 2, 3, 5, 7]  # text, 0, 2, 4
    assert mask[6].all()  # padding sees everything
    with pytest.raises(ValueError, match="cannot be verified"):
        TreeShape(depth=2, topk=2, num_nodes=7)


def test_pick_nodes_keeps_parents_and_the_best_scores():
    tokens = [[10, 11, 12, 13]]
    parents = [[-1, -1, 0, 1]]
    scores = [[-0.1, -2.0, -0.5, -2.1]]
    assert pick_nodes(tokens, parents, scores, 3) == ([[10, 11, 12]], [[-1, -1, 0]])
    # a child scored above its parent (never so in grow_tree) waits for its parent
    assert pick_nodes(tokens, parents, [[-0.1, -0.5, -0.6, -0.2]], 2) == ([[10, 11]], [[-1, -1]])


def test_greedy_walk_follows_the_argmax():
    tokens, parents = [5, 6, 7, 8], [-1, -1, 1, 1]
    assert walk_greedy(tokens, parents, [6, 0, 8, 0, 3]) == ([1, 3], 3)
    assert walk_greedy(tokens, parents, [4, 0, 8, 0, 3]) == ([], 4)


def first_tokens(walk_rule, rows: int, vocab: int = 6, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The first committed token of `rows` walks over a root with three children (its likely
    tokens), the target's root distribution random per row: (distributions [rows, V], tokens)."""
    g = torch.Generator().manual_seed(seed)
    probs = (2 * torch.randn(rows, vocab, generator=g)).softmax(-1)
    firsts = []
    for p in probs:
        kids = p.argsort(descending=True)[[0, 2, 1]].tolist()  # tried out of order
        path, bonus = walk_rule(kids, [-1, -1, -1], torch.stack([p, p, p, p]), torch.rand(4, generator=g))
        firsts.append(kids[path[0]] if path else bonus)
    return probs, torch.tensor(firsts)


@pytest.mark.parametrize("walk_rule, exact", [(walk, True), (walk_without_removal, False)])
def test_walk_commits_the_target_distribution(walk_rule, exact):
    probs, tokens = first_tokens(walk_rule, 20_000)
    pvalue = ks_pvalue(randomized_pit(probs, tokens, torch.rand(len(tokens), generator=torch.Generator().manual_seed(4))))
    assert (pvalue > ALPHA) == exact, pvalue


# One fixed target distribution at every node, and a tree whose last node is the root's last
# child, tried just before the bonus below the root is drawn. Random target distributions per
# walk (above) average out a wrong bonus uniform, which moves probability between fixed tokens
# (here token 1's 0.05 to 0, token 5's 0.10 to 0.14): a frequency test over a fixed
# distribution sees it at p = 1e-98 (the pooled PIT of test_sd_with_trees_is_exact does not).
FIXED_TARGET = torch.tensor([0.30, 0.05, 0.20, 0.10, 0.15, 0.10, 0.05, 0.05])
FIXED_TREE = ([0, 3, 5, 2, 4], [-1, 0, 0, -1, -1])  # tokens, parents
FIXED_WALKS = 5_000


@pytest.mark.parametrize("walk_rule, exact", [(walk, True), (walk_with_an_earlier_bonus_uniform, False)])
def test_walk_commits_each_token_as_often_as_a_fixed_target_gives_it(walk_rule, exact):
    tokens, parents = FIXED_TREE
    probs = FIXED_TARGET.expand(len(tokens) + 1, -1)
    firsts = []
    for u in torch.rand(FIXED_WALKS, len(tokens) + 1, generator=torch.Generator().manual_seed(5)):
        path, bonus = walk_rule(tokens, parents, probs, u)
        firsts.append(tokens[path[0]] if path else bonus)
    pvalue = chi_square_pvalue([(torch.tensor(firsts), FIXED_TARGET)])
    assert (pvalue > ALPHA) == exact, pvalue


# --- SD with trees, tiny models ---------------------------------------------------------------

def peaked_model() -> LlamaModel:
    """A tiny model whose attention is peaked, as a trained model's is, rather than near uniform
    (its query, key and value weights 4 times the random ones): which KV entries a node sees
    then moves its distribution."""
    model = tiny_model(seed=10, layers=2)
    for layer in model.layers:
        layer.self_attn.qkv_proj.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def target():
    return peaked_model()


@pytest.fixture(scope="module")
def draft():
    """The target with noise on its head: its top choices are often but not always the target's,
    so first children, runners-up and bonus tokens are all committed often."""
    model = peaked_model()
    model.lm_head.weight.add_(0.5 * torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(1)))
    return model


def tree_outputs(target, draft, params, prompt_lookup=None, **shape) -> list[list[int]]:
    return tiny_outputs(sd_decoder(target, draft, TINY_K, prompt_lookup, **(shape or SHAPE)), params)


def tree_pvalue(target, draft, params, prompt_lookup=None) -> float:
    outputs = tree_outputs(target, draft, params, prompt_lookup)
    return ks_pvalue(teacher_forced_pit(target, tiny_prompts(len(params)), outputs, params))


@pytest.mark.parametrize("prompt_lookup", [None, 1])
def test_tiny_greedy_trees_equal_ar(target, draft, prompt_lookup):
    params = sampled(0.0, rows=40)
    ar = tiny_outputs(sd_decoder(target, draft, TINY_K, tree_topk=1), params)
    assert tree_outputs(target, draft, params, prompt_lookup) == ar


def test_tiny_greedy_trees_check_catches_a_mask_seeing_siblings(target, draft, monkeypatch):
    params = sampled(0.0, rows=40)
    ar = tiny_outputs(sd_decoder(target, draft, TINY_K, tree_topk=1), params)
    monkeypatch.setattr(runner, "tree_mask", mask_seeing_siblings)
    assert tree_outputs(target, draft, params) != ar


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sd_with_trees_is_exact(target, draft, temperature):
    assert tree_pvalue(target, draft, sampled(temperature)) > ALPHA


def test_sd_with_trees_is_exact_with_top_k_top_p_and_prompt_lookup(target, draft):
    params = sampled(0.8, top_k=5)[::2] + sampled(1.0, top_p=0.8)[1::2]
    assert tree_pvalue(target, draft, params, prompt_lookup=1) > ALPHA


def test_sd_with_trees_check_catches_siblings_tried_against_the_unupdated_residual(target, draft, monkeypatch):
    monkeypatch.setattr(verification, "walk", walk_without_removal)
    assert tree_pvalue(target, draft, sampled(1.0)) < ALPHA


def test_sd_with_trees_check_catches_a_mask_seeing_siblings(target, draft, monkeypatch):
    monkeypatch.setattr(runner, "tree_mask", mask_seeing_siblings)
    assert tree_pvalue(target, draft, sampled(1.0)) < ALPHA


def test_trees_reach_the_bonus_after_a_full_path(target):
    """The target as its own draft: most rounds accept a whole path and end in its bonus."""
    params = sampled(1.0, rows=4_000)
    outputs = tree_outputs(target, peaked_model(), params)
    assert ks_pvalue(teacher_forced_pit(target, tiny_prompts(len(params)), outputs, params)) > ALPHA


# --- SD with trees, the default model and its shipped draft -----------------------------------

@pytest.mark.parametrize("batch, count", [(1, 4), (4, 8)])
def test_sd_with_trees_greedy_equals_ar(prompts, ar_greedy, batch, count):
    llm = LLM(hub.DEFAULT_MODEL, method="sd", dtype="float32", num_speculative_tokens=4, tree_topk=3,
              num_draft_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outputs = []
    for i in range(0, count, batch):
        outputs += llm.generate(prompts[i:i + batch], params, use_tqdm=False)
    mismatches = [i for i, out in enumerate(outputs) if out.token_ids != ar_greedy[i]]
    assert not mismatches, f"SD with trees differs from AR on prompts {mismatches}"
    metrics = llm.metrics()
    assert metrics["spec_decode_num_draft_tokens"] > 4 * metrics["spec_decode_num_drafts"]  # more than chains
    per_depth = metrics["spec_decode_num_accepted_tokens_per_pos"]
    assert per_depth[0] > per_depth[3] > 0  # paths of every depth, the shallow ones more often


# --- auto: trees beside chains ------------------------------------------------------------------

TREE = TreeShape(TINY_K, 3, 6)


def switching_decoder(target, draft, schedule):
    """auto with the tiny draft and TREE, its choices following `schedule` round after round."""
    spec = SpeculativeConfig("auto", num_speculative_tokens=TINY_K, prompt_lookup=0)
    decoder = build.auto_decoder(target, build.sd_drafter(draft, spec), trees=[TREE])
    choices = itertools.cycle(schedule)
    controller = decoder.policy.controller
    controller.choose = lambda batch, can_try=True: controller.pick(next(choices))
    return decoder


def switching_pvalue(target, draft, params) -> float:
    outputs = tiny_outputs(switching_decoder(target, draft, [TREE, TREE, TINY_K, TREE, 0, TREE]), params)
    return ks_pvalue(teacher_forced_pit(target, tiny_prompts(len(params)), outputs, params))


def test_auto_switching_between_chains_and_trees_is_exact(target, draft):
    params = sampled(0.0, rows=40)
    greedy = tiny_outputs(switching_decoder(target, draft, [TREE, 1, TREE, 0]), params)
    assert greedy == tiny_outputs(sd_decoder(target, draft, TINY_K, tree_topk=1), params)
    assert switching_pvalue(target, draft, sampled(1.0)) > ALPHA


def test_auto_switching_check_catches_siblings_tried_against_the_unupdated_residual(target, draft, monkeypatch):
    monkeypatch.setattr(verification, "walk", walk_without_removal)
    assert switching_pvalue(target, draft, sampled(1.0)) < ALPHA


def tree_rounds(controller: Controller, target_s, step_s: float, tree_tokens: float) -> None:
    """Rounds at batch 1 as they would run: AR, every K (accepting 60% of the drafts) and the
    tree (committing tree_tokens a round), twice each (the first is a warm-up)."""
    for k in [k for k in range(controller.max_k + 1) for _ in range(2)]:
        controller.estimates.record(1, k, target_s(k + 1), k * step_s, [int(0.6 * k)], int(0.6 * k) + 1)
    tree = controller.trees[0]
    for _ in range(2):
        controller.estimates.record_tree(1, tree, target_s(tree.num_nodes + 1), tree.depth * step_s * 1.3, tree_tokens)


def test_auto_chooses_a_tree_where_its_rows_cost_little_and_a_chain_where_they_cost_much():
    tree = TreeShape(4, 3, 12)
    flat = lambda rows: 0.030 + 0.0002 * rows  # noqa: E731  a GPU-like pass: rows cost little
    steep = lambda rows: 0.004 * rows  # noqa: E731  a CPU core's: every row costs
    on_gpu = Controller(max_k=4, trees=[tree])
    tree_rounds(on_gpu, flat, 0.002, 4.0)
    assert on_gpu.choose(1) == tree
    on_cpu = Controller(max_k=4, trees=[tree])
    tree_rounds(on_cpu, steep, 0.002, 4.0)
    assert on_cpu.choose(1) != tree
    assert str(tree) in on_gpu.summary()["auto_rounds_by_k"]


def test_auto_tries_a_tree_before_it_ran_from_the_chains_acceptance():
    tree = TreeShape(4, 2, 4)
    controller = Controller(max_k=4, trees=[tree])
    for k in [k for k in range(5) for _ in range(2)]:
        controller.estimates.record(1, k, 0.030, k * 0.001, [k], k + 1)  # every draft accepted, rows free
    assert controller.rate(1, tree) > controller.rate(1, 3)  # TREE_GAIN times the chain's tokens
    assert controller.choose(1) == tree  # untried and predicted best: tried


def test_tree_options_are_checked_and_auto_takes_its_trees_from_them():
    assert SpeculativeConfig("sd", num_speculative_tokens=4, tree_topk=3).tree == TreeShape(4, 3, 8)
    with pytest.raises(ValueError, match="tree_topk must be >= 1"):
        SpeculativeConfig("sd", tree_topk=0)
    with pytest.raises(ValueError, match="set tree_topk > 1"):
        SpeculativeConfig("sd", num_draft_tokens=8)
    with pytest.raises(ValueError, match="speculate chains"):
        SpeculativeConfig("ssd", tree_topk=3)
    assert SpeculativeConfig("auto", tree_topk=3).as_method("ssd").tree is None
    assert auto_trees(5, device="cuda") == [TreeShape(5, 2, 5), TreeShape(3, 3, 5)]
    assert auto_trees(5) == auto_trees(5, topk=1, device="cuda") == []  # none of its own on a CPU
    assert auto_trees(5, 3, TreeShape(5, 3, 6)) == [TreeShape(5, 3, 6)]
