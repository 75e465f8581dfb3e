"""A Medusa tree fitted to measured heads (``speculator.choices: fit``): the joint rank-path
counts of :meth:`MedusaMethod.path_counts` on stub heads with fixed logits, the fit that maximises
the expected accepted tokens on them, and the stored tree's validation and use."""

import json

import pytest
import torch

from specfoundry.runtime.speculators import default_medusa_choices, fit_medusa_choices, tree_accepted
from specfoundry.runtime.speculators.checkpoint import choices_problem, drafter_option_problems
from specfoundry.train.methods import MedusaMethod


def test_fit_takes_the_most_often_right_paths_and_fills_from_the_default():
    counts = {(0,): 50, (0, 0): 30, (1,): 20, (0, 0, 0): 25, (0, 1): 5, (2,): 1, (1, 0): 1}
    fitted = fit_medusa_choices(counts, num_heads=3, num_nodes=4)
    assert fitted == [[0], [0, 0], [0, 0, 0], [1]]
    # no other prefix-closed 4-node tree accepts more on these counts
    assert tree_accepted(fitted, counts, 100) == pytest.approx((50 + 30 + 25 + 20) / 100)
    for other in ([[0], [1], [2], [0, 0]], default_medusa_choices(3, 4)):
        assert tree_accepted(other, counts, 100) <= tree_accepted(fitted, counts, 100)
    # fewer measured paths than nodes: the default tree's paths fill the rest, still prefix-closed
    wide = fit_medusa_choices(counts, num_heads=3, num_nodes=24)
    assert len(wide) == 24 == len({tuple(c) for c in wide}) and wide[:7] == fit_medusa_choices(counts, 3, 7)
    assert choices_problem(wide, 63, 3) is None
    assert fit_medusa_choices({}, 2, 5) == default_medusa_choices(2, 5)


class _StubHeads(torch.nn.Module):
    """K=2 heads over V=4 tokens whose logits at every position rank the tokens as given."""

    num_heads, draft_to_target = 2, None

    def __init__(self, order):  # order[k] = token ids from rank 0 down, per head
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.order = order

    def forward(self, h):
        B, n, _ = h.shape
        logits = torch.zeros(B, n, 2, 4)
        for k, toks in enumerate(self.order):
            for r, t in enumerate(toks):
                logits[..., k, t] = 4.0 - r
        return logits


def test_path_counts_count_every_prefix_of_heads_that_are_all_right():
    # the target's LM head is the identity, so its greedy token after position j is argmax(h[j]);
    # head k read at position t is right when it ranks that token after position t + 1 + k
    seq = [0, 2, 2, 3, 1, 1]
    h = torch.nn.functional.one_hot(torch.tensor([seq]), 4).float()  # [1, 6, 4]
    lm = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        lm.weight.copy_(torch.eye(4))
    # head 0 ranks 2 > 3 > 1 > 0, head 1 ranks 3 > 2 > 1 > 0 at every position
    method = MedusaMethod(_StubHeads([[2, 3, 1, 0], [3, 2, 1, 0]]), lm)
    ones = torch.ones(1, 6, dtype=torch.long)
    counts, positions = method.path_counts({"last_hidden": h, "attention_mask": ones, "loss_mask": ones}, ranks=2)
    # positions t = 0..2 (both labels exist):
    # t=0: head 0 wants seq[1]=2 (rank 0), head 1 seq[2]=2 (rank 1) -> (0,), (0, 1)
    # t=1: seq[2]=2 (rank 0), seq[3]=3 (rank 0) -> (0,), (0, 0)
    # t=2: seq[3]=3 (rank 1), seq[4]=1 (rank 2, beyond ranks=2: a miss) -> (1,)
    assert positions == 3 and dict(counts) == {(0,): 2, (0, 1): 1, (0, 0): 1, (1,): 1}
    # a position whose labels are masked out is not counted (t=2's head-1 label is token 5)
    mask = ones.clone()
    mask[0, 5] = 0
    counts, positions = method.path_counts({"last_hidden": h, "attention_mask": ones, "loss_mask": mask}, ranks=2)
    assert positions == 2 and dict(counts) == {(0,): 2, (0, 1): 1, (0, 0): 1}
    # the fit on these counts: the two (0, .) paths before the rarer (1,)
    assert fit_medusa_choices(counts, 2, 3) == [[0], [0, 0], [0, 1]]


@pytest.mark.parametrize("choices, problem", [
    ([[0], [0, 0]], None),
    ([], "non-empty list"),
    ([[0], [1, 0]], "prefix [1]"),
    ([[0], [0]], "distinct"),
    ([[0], [0, -1]], "ranks >= 0"),
    ([[0], [0, True]], "ranks >= 0"),
    ([[0, 0, 0, 0]], "deeper than 3"),
    ("fit", "non-empty list"),
])
def test_a_stored_tree_is_validated(choices, problem):
    found = choices_problem(choices, 63, 3)
    assert (found is None) if problem is None else (problem in found)
    # a checkpoint's stored tree: the same checks (its depth bound is the runtime's)
    assert [k for k, _ in drafter_option_problems({"choices": choices})] == ([] if problem is None else ["choices"])


def test_a_checkpoints_tree_is_its_drafters_default_and_a_bad_one_is_refused(tmp_path, tiny_target):
    from specfoundry.runtime import load_drafter
    from specfoundry.runtime.speculators import CheckpointError, MedusaHeads, save_speculator
    from specfoundry.runtime.speculators.checkpoint import set_drafter_options

    heads = MedusaHeads.from_target(tiny_target, seed=0, num_heads=2, num_layers=1)
    out = save_speculator(heads, tmp_path / "spec", tiny_target)
    assert sorted(load_drafter(str(out), target=tiny_target).paths) == sorted(default_medusa_choices(2))
    set_drafter_options(out, {"choices": [[0], [1], [0, 0]]})
    assert load_drafter(str(out), target=tiny_target).paths == [[0], [1], [0, 0]]
    assert load_drafter(str(out), target=tiny_target, choices=[[0]]).paths == [[0]]  # a caller's tree wins
    cfg = json.loads((out / "config.json").read_text())
    cfg["training"]["drafter_options"]["choices"] = [[0], [2, 0]]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="prefix"):
        load_drafter(str(out), target=tiny_target)
