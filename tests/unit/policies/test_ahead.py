"""Re-rooting a tree drafted ahead."""

from cosine.engine.tree import DraftTree
from cosine.scheduler.ahead import main_chain_tokens, subtree_after


def test_main_chain_tokens():
    assert main_chain_tokens([5, 6, 7, 9], [-1, 0, 1, 0]) == [5, 6, 7]
    assert main_chain_tokens([], []) == []


def test_subtree_after_reroots_below_the_guessed_token():
    #      5 ─ 6 ─ 7          guesses for the bonus token: 5 and 8
    #      └── 9
    #      8 ─ 4
    tree = DraftTree([5, 6, 7, 9, 8, 4], [-1, 0, 1, 0, -1, 4], [0.9, 0.8, 0.7, 0.1, 0.2, 0.3])
    below5 = subtree_after(tree, [5])
    assert (below5.tokens, below5.parents, below5.probs) == ([6, 7, 9], [-1, 0, -1], [0.8, 0.7, 0.1])
    below8 = subtree_after(tree, [8])
    assert (below8.tokens, below8.parents) == ([4], [-1])
    assert subtree_after(tree, [3]) is None  # the bonus token was not guessed
    assert subtree_after(tree, [5, 6]).tokens == [7]
    cut = subtree_after(tree, [5], max_depth=1)
    assert (cut.tokens, cut.parents) == ([6, 9], [-1, -1])
    whole = subtree_after(tree, [], max_depth=2)
    assert whole.tokens == [5, 6, 9, 8, 4] and whole.parents == [-1, 0, 0, -1, 3]
    assert len(subtree_after(DraftTree.chain([1]), [1])) == 0
