"""The feature head on the real (tiny) native engine: the features the target keeps, the head's files, its
training, and the verifier's steps with it: the same tokens with it on and off, greedy and seeded."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

from cosine.engine.feature_head import FeatureHead, TargetWeights, load_for_target
from cosine.engine.native_target import make_target
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree
from cosine.verifier.lookup import RunLookup
from cosine.zoo.distill import Sample
from cosine.zoo.head import Features, HeadConfig, _losses, build_head, evaluate, extract, fit_temperatures, halves
from tests.unit.verifier.test_lookup import run_rounds

pytestmark = pytest.mark.unit

PROMPT = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5]


def random_head(path, seed=0) -> FeatureHead:
    weights = TargetWeights(path)
    torch.manual_seed(seed)
    head = FeatureHead(weights.embed, torch.arange(weights.embed.shape[0]), weights.intermediate_size, weights.eps,
                       weights.lm_head)
    head.init_from_target(weights.last_layer, weights.final_norm)
    return head.eval()


def test_the_kept_feature_is_the_one_the_target_chose_its_last_token_from(tiny_models):
    target = make_target(tiny_models["llama"], "cpu", "float32", n_slots=2, max_context=64, backend="native")
    target.open("r", [5, 9, 12, 40], 4)
    assert target.hidden("r") is None  # before its first step
    embed = TargetWeights(tiny_models["llama"]).embed
    for tree in (DraftTree(), DraftTree([7, 8, 9], [-1, 0, 0]), DraftTree([3, 4], [-1, 0])):
        target.verify("r", tree, Sampling())
        logits = F.linear(target.hidden("r").float(), embed)
        assert int(logits.argmax()) == target.committed("r")[-1]  # greedy: the feature's own choice
    with pytest.raises(KeyError):
        target.hidden("nobody")


def test_a_saved_head_loads_and_drafts_the_same(tiny_models, tmp_path):
    path = tiny_models["llama"]
    head = random_head(path)
    features = torch.randn(3, head.hidden_size)
    tokens, probs = head.draft(features, [1, 2, 3], 4)
    assert len(tokens) == 3 and all(len(t) == 4 for t in tokens)
    assert all(0 < p <= 1 for row in probs for p in row)
    head.save(tmp_path / "h", target=path.name)
    again = load_for_target(str(tmp_path / "h"), path, "float32")
    assert again.draft(features, [1, 2, 3], 4) == (tokens, probs)
    assert load_for_target("off", path) is None


def test_a_head_for_another_shape_is_refused(tiny_models, tmp_path):
    random_head(tiny_models["llama"]).save(tmp_path / "h", target="llama")
    with pytest.raises(ValueError, match="hidden size|vocabulary"):
        load_for_target(str(tmp_path / "h"), tiny_models["tinyvocab"], "float32")


def test_training_learns_a_pattern_the_features_carry(tiny_models, tmp_path, monkeypatch):
    """A target continuing a repeating text: the head learns to draft the text's next tokens, held-out samples of
    the same text agree more than the untrained head, and the head is saved where the verifier finds it."""
    path = tiny_models["llama"]
    rng = random.Random(0)
    cycle = [rng.randrange(3, 90) for _ in range(7)]

    def sample(offset: int) -> Sample:
        tokens = [cycle[(offset + i) % len(cycle)] for i in range(40)]
        return Sample(tokens, 6, torch.zeros(0), torch.zeros(0))

    train, held = [sample(i) for i in range(14)], [sample(i) for i in range(3)]
    from cosine.engine.llama import NativeLlama

    held_features = extract(NativeLlama.from_pretrained(path), held)
    before = evaluate(random_head(path), held_features, dtype=torch.float32)
    monkeypatch.setenv("COSINE_CACHE", str(tmp_path))
    out = tmp_path / "models" / "feature-head"
    report = build_head(path, train, held, out, HeadConfig(train_seconds=6.0, batch=64, lr=3e-3, vocab=64))
    assert report["training"]["steps"] > 0 and report["training"]["positions"] == 14 * 34  # every continuation token
    after = report["held_out"]["accepted"]
    assert after[0] > max(0.5, before["accepted"][0])
    calibration = report["calibration"]  # fitted on held-out samples 0 and 2, checked on 1
    assert len(calibration["temperatures"]) == 4 and calibration["fitted_on"] + calibration["checked_on"] == 3 * 34
    trees = report["held_out_trees"]["batch 1"]
    assert trees["chain"]["tokens_per_step"] > 1.5 and trees["tree"]["tokens_per_step"] > 1.5  # the pattern is learnt
    assert trees["tree"]["nodes_per_step"] <= 8 and trees["nodes"] == 8
    from cosine.zoo.registry import find

    entry = find("feature-head")
    assert entry is not None and entry.kind == "head"
    head = load_for_target("auto", path, "float32")  # trained for this target: the verifier takes it
    assert head.temperatures == calibration["temperatures"]
    # the less often the target writes what the head is sure of, the hotter its fitted temperature, and the
    # calibrated confidence is then about the share of first tokens the target wrote
    fit, _ = halves(held_features)
    fitted = []
    for share in (0.0, 0.1, 0.25):
        noisy = copy.deepcopy(held_features)
        flip = torch.rand(len(noisy.tokens), generator=torch.Generator().manual_seed(1)) < share
        noisy.tokens[flip] = (noisy.tokens[flip] + 1) % 90 + 3  # tokens the head never saw follow these features
        fitted.append(fit_temperatures(head, noisy, fit, depth=1)[0])
        head.temperatures = fitted[-1:]
        first = evaluate(head, noisy, depth=1, dtype=torch.float32, index=fit)
        if share:
            assert first["path_probability"][0] == pytest.approx(first["accepted"][0], abs=0.1)
    assert fitted[0] < fitted[1] < fitted[2]


@torch.no_grad()
def test_each_unrolled_step_adds_its_weighted_loss_where_the_sample_goes_on_that_far(tiny_models):
    head = random_head(tiny_models["llama"])
    gen = torch.Generator().manual_seed(0)
    lengths = [6, 2, 5]  # rows of three samples: the second has a first step's pair and nothing after it
    rows = sum(lengths)
    end = torch.cat([torch.full((n,), sum(lengths[:i + 1]) - 1) for i, n in enumerate(lengths)])
    every = torch.arange(rows)
    vocab = head.vocab_ids.numel()
    data = Features(torch.randn(rows, head.hidden_size, generator=gen).to(torch.bfloat16),
                    torch.randint(0, vocab, (rows,), generator=gen), end, every[every + 1 <= end])
    vmap = torch.arange(vocab)

    def loss(weights, index=data.pairs):
        return float(_losses(head, data, index, vmap, HeadConfig(unrolled=weights)))

    one, two, three = loss((1.0,)), loss((1.0, 0.8)), loss((1.0, 0.8, 0.6))
    assert one < two < three
    assert loss((1.0, 0.8, 0.0)) == pytest.approx(two, rel=1e-6)  # a zero weight adds nothing
    assert loss((1.0, 0.0, 0.6)) > one  # the third step learns though the second's own loss is not counted
    short = torch.tensor([6])  # the second sample's only pair: no row two ahead in its sample
    assert loss((1.0, 0.8, 0.6), short) == pytest.approx(loss((1.0,), short), rel=1e-6)
    with pytest.raises(ValueError):
        HeadConfig(unrolled=())  # no step: nothing to learn


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9, top_p=0.95, seed=7)], ids=["greedy", "seeded"])
def test_the_target_writes_the_same_tokens_with_the_head_on_and_off(tiny_models, sampling):
    path = tiny_models["tinyvocab"]
    outs = {}
    for name, lookup in (("off", None), ("head", RunLookup(0.05, head=random_head(path)))):
        target = make_target(path, "cpu", "float32", n_slots=2, max_context=128, backend="native")
        target.open("r", PROMPT, len(PROMPT))
        (o,), _ = run_rounds(target, [("r", 64, 8 if lookup else 0)], lookup=lookup, sampling=sampling)
        outs[name] = o
        assert target.committed("r") == PROMPT + o.token_ids
    assert outs["head"].token_ids[:64] == outs["off"].token_ids
    assert outs["head"].head_drafted > 0 and outs["head"].head_accepted <= outs["head"].head_drafted


def test_the_build_keeps_the_features_as_it_generates_and_the_head_trains_on_them_alone(tiny_models, tmp_path):
    """`generate(features=True)`: each row's kept feature is the one its token was chosen from, so the head needs no
    teacher-forced pass of its own (no model is loaded when every sample has them)."""
    from cosine.engine.llama import NativeLlama
    from cosine.zoo.distill import generate

    path = tiny_models["llama"]
    model = NativeLlama.from_pretrained(path)
    prompts = [[5, 9, 12, 40, 7, 3], [11, 2, 60], [8, 8, 30, 31, 32]]
    samples = generate(model, prompts, 12, stop_ids=set(), batch=2, features=True)
    plain = generate(model, prompts, 12, stop_ids=set(), batch=2)
    assert [s.tokens for s in samples] == [s.tokens for s in plain] and plain[0].features is None
    embed = TargetWeights(path).embed
    for s in samples:
        assert s.features.shape == (len(s.tokens) - 1, embed.shape[1])
        logits = F.linear(s.features.float(), embed)[s.prompt_len - 1:]  # the rows that chose the continuation
        written = torch.tensor(s.tokens[s.prompt_len:])
        # greedy: each feature's own choice, up to the bf16 rounding of the kept feature (a near tie may flip)
        gap = logits.max(-1).values - logits.gather(1, written[:, None])[:, 0]
        assert (gap <= 0.02 * logits.abs().max(-1).values).all()
        assert (logits.argmax(-1) == written).float().mean() >= 0.8
    # fewer pairs than the default minibatch (a tiny build's): training still takes steps and ends on time
    report = build_head(path, samples, samples[:1], tmp_path / "feature-head", HeadConfig(train_seconds=1.0))
    assert report["training"]["steps"] > 0
    assert report["training"]["positions"] == sum(len(s.tokens) - s.prompt_len for s in samples)
    assert (tmp_path / "feature-head" / "head.safetensors").exists()


def test_trees_branch_where_two_tokens_pass_the_floor_and_their_main_chain_is_the_greedy_chain(tiny_models):
    path = tiny_models["llama"]
    head = random_head(path)
    features = torch.randn(3, head.hidden_size)
    greedy, _ = head.draft(features, [1, 2, 3], 4)
    head.prepare()
    _, logits = head._fast_step(features, torch.tensor([1, 2, 3]))
    second = float(head.probs(logits, 0).topk(2, -1).values[:, 1].max())  # the likeliest runner-up of a first step
    for floor in (0.9 * second, 0.5 * second):  # at least one root has two children that pass
        trees = head.trees(features, [1, 2, 3], 6, floor)
        assert any(not t.is_chain() for t in trees)
        for tree, chain in zip(trees, greedy):
            assert all(parent < i for i, parent in enumerate(tree.parents))  # parents first
            paths = tree.path_probs()
            assert all(x >= floor for x in paths) and paths == sorted(paths, reverse=True) and len(tree) <= 6
            main = [tree.tokens[i] for i in tree.main_chain()]
            assert main == chain[:len(main)]
    chains = head.trees(features, [1, 2, 3], 4, 0.6)  # no two siblings pass 0.6: the greedy chains, cut at the floor
    assert all(t.is_chain() and t.tokens == g[:len(t)] for t, g in zip(chains, greedy))
    chains = head.trees(features, [1, 2, 3], 4, 0.5 * second, chains=True)  # chains asked for (the verifier's head_trees off)
    assert all(t.is_chain() and t.tokens == g[:len(t)] for t, g in zip(chains, greedy)) and any(len(t) for t in chains)


def test_the_temperatures_are_saved_and_change_probabilities_not_choices(tiny_models, tmp_path):
    path = tiny_models["llama"]
    head = random_head(path)
    features = torch.randn(2, head.hidden_size)
    tokens, probs = head.draft(features, [1, 2], 3)
    head.temperatures = [2.0, 3.0]
    hotter, hot_probs = head.draft(features, [1, 2], 3)
    assert hotter == tokens and all(h < p for hs, ps in zip(hot_probs, probs) for h, p in zip(hs, ps))
    head.save(tmp_path / "h", target=path.name)
    again = load_for_target(str(tmp_path / "h"), path, "float32")
    assert again.temperatures == [2.0, 3.0] and again.draft(features, [1, 2], 3) == (hotter, hot_probs)

