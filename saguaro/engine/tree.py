"""Token trees: a proposal that keeps the draft's runner-up tokens, verified in one target pass.

A tree hangs below a sequence's last committed token (its root). Node j holds a draft token and
the index of its parent (-1: the root); parents come before their children. The target runs
the root and every node in one pass, each node at the position its depth gives and seeing only
the committed text, its ancestors and itself, then walks down from the root: at each node it
tries the node's children in order and follows the first it accepts; where it accepts none, it
draws the bonus token.

A node's token is proposed as a point mass: which tokens a tree holds is a function of the
committed text alone (the draft's most likely tokens), never of a random draw. A child x is
accepted with probability r(x), r being the target's distribution at its parent; a rejected
child is removed from r, which is renormalized before the next sibling is tried (recursive
rejection sampling, as SpecInfer and Sequoia do, with each proposal a point mass). The token
committed at each node is then distributed exactly as r: P(x_1) = r(x_1), and given that x_1
was rejected, the rest are verified against r with x_1 removed. The bonus comes from what is
left of r after every child was rejected. So a tree is exact at every temperature, whatever
its shape, and greedy decoding follows the target's argmax down the tree.
"""
from __future__ import annotations

import torch

from saguaro.engine.sampler import sample


def depths(parents: list[int]) -> list[int]:
    """Each node's depth below the chunk's first token (a root of depth 0 where parent is -1)."""
    depth: list[int] = []
    for parent in parents:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return depth


def ancestors(parents: list[int]) -> list[list[int]]:
    """Each node's ancestors and itself, by index."""
    lines: list[list[int]] = []
    for j, parent in enumerate(parents):
        lines.append((lines[parent] if parent >= 0 else []) + [j])
    return lines


def tree_mask(parents: list[list[int]], starts: list[int], width: int, span: int) -> torch.Tensor:
    """[B, width, span] bool: token j of row i (at slot starts[i] + j) sees the slots before
    starts[i], its ancestors' and its own. Padding past a row's tokens sees every slot (its
    output is never read)."""
    mask = torch.ones(len(parents), width, span, dtype=torch.bool)
    for i, (row, start) in enumerate(zip(parents, starts)):
        mask[i, :len(row), start:] = False
        for j, line in enumerate(ancestors(row)):
            mask[i, j, [start + a for a in line]] = True
    return mask


def children(parents: list[int]) -> list[list[int]]:
    """The children of the root (first) and of each node (then), in order: [N + 1] lists of node indices."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, parent in enumerate(parents):
        kids[parent + 1].append(j)
    return kids


def walk_greedy(tokens: list[int], parents: list[int], target_tokens: list[int]) -> tuple[list[int], int]:
    """A greedy target's walk: target_tokens [N + 1] are its argmaxes at the root and at each
    node. Follows the child that equals the argmax while there is one. Returns the accepted
    path (node indices, root first) and the bonus token."""
    kids = children(parents)
    path: list[int] = []
    at = -1  # the root
    while True:
        wanted = target_tokens[at + 1]
        step = next((c for c in kids[at + 1] if tokens[c] == wanted), None)
        if step is None:
            return path, wanted
        path.append(step)
        at = step


def walk(tokens: list[int], parents: list[int], target_probs: torch.Tensor,
         u: torch.Tensor) -> tuple[list[int], int]:
    """The walk at any temperature: target_probs [N + 1, V] are the target's (warped)
    distributions at the root and at each node; u [N + 1] uniforms, u[j] for trying node j
    (each node is tried at most once), u[N] for the bonus. Returns the accepted path and the
    bonus token (see the module's docstring)."""
    kids = children(parents)
    path: list[int] = []
    at = -1
    u = u.tolist()
    while True:
        residual = target_probs[at + 1].clone()
        for child in kids[at + 1]:
            x = tokens[child]
            p_x = float(residual[x])
            residual[x] = 0.0
            rest = residual.sum()
            # rest 0: x held all the mass (p_x short of 1 by round-off), nothing to renormalize
            if u[child] < p_x or rest <= 0:
                path.append(child)
                at = child
                break
            residual /= rest
        else:
            return path, int(sample(residual[None], torch.tensor([u[-1]]))[0])
