"""IG's final stage (the inversion template's ``polish``), the smoothed model it runs through
(``attacks.inversion.smoothing``), and FedPAC's replay leaving out what the attack does not read."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.func import grad_and_value, vmap

from attacks.base import LocalHyperparameters
from attacks.inversion.forward_model import GradientMatcher, replay_context
from attacks.inversion.observation import observe, update_target
from attacks.inversion.optimise import polish
from attacks.inversion.smoothing import smoothed
from fedecouple.engine import VictimSetting
from fedecouple.methods.replay import Step, features
from fedecouple.models import build_model

from helpers import TEST_THREADS, tiny_federation

ONE_IMAGE = LocalHyperparameters(lr=0.05, steps=1, batch_size=1, epochs=1, samples=1, steps_per_phase=1)


def _fedpac_targets(digits, clients=(0, 1, 2)):
    """FedPAC round 0, each client one step on one image: (observations, their images, labels)."""
    victim = VictimSetting(batch=1, steps=1, targets={(0, c) for c in clients})
    fed = tiny_federation(digits, "fedpac", clients=3, rounds=1, victim=victim)
    model = copy.deepcopy(fed.model)
    fed.run(1)
    out = []
    for c in clients:
        obs = observe(fed.channel.recorder, 0, c, method=fed.method, make_model=lambda: copy.deepcopy(model),
                      image_shape=(1, 8, 8), num_classes=10, known_hyperparameters=ONE_IMAGE)
        idx = torch.from_numpy(fed.ground_truth.samples(0, c))
        out.append((obs, digits.images[idx], digits.labels[idx]))
    return out


def test_the_smoothed_model_tends_to_the_model_and_is_restored(digits):
    torch.set_num_threads(TEST_THREADS)
    model = build_model("cnn28", 1, 28, 10, digits.mean, digits.std)
    x = torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model(x)
        gaps = []
        for temperature in (1e-2, 1e-4):
            with smoothed(model, temperature) as replaced:
                assert replaced == 5  # 3 LeakyReLU, 2 max-pools
                gaps.append(float((model(x) - exact).abs().max()))
        assert gaps[1] < gaps[0] and gaps[1] < 1e-3
        with smoothed(model, 0.0) as replaced:
            assert replaced == 0
        assert torch.equal(model(x), exact)  # every module is back
    assert sum(isinstance(m, torch.nn.LeakyReLU) for m in model.modules()) == 3


def test_the_final_stage_never_raises_the_data_term(digits):
    """Three targets stacked: one at its truth (data term at float rounding), two from noisy copies of
    theirs. No data term rises; the noisy ones fall; every pixel stays in [0, 1]."""
    torch.set_num_threads(TEST_THREADS)
    targets = _fedpac_targets(digits)
    lead = GradientMatcher(targets[0][0], "auto")
    matchers = [lead] + [GradientMatcher(obs, "auto") for obs, _, _ in targets[1:]]
    assert all(m.shares_model_with(lead) for m in matchers)
    noise = torch.rand(3, 1, 1, 8, 8, generator=torch.Generator().manual_seed(1)) - 0.5
    images = torch.stack([x for _, x, _ in targets])
    start = (images + torch.tensor([0.0, 0.2, 0.2]).view(3, 1, 1, 1, 1) * noise).clamp(0, 1)
    probs = torch.stack([torch.nn.functional.one_hot(y, 10).float() for _, _, y in targets])
    stacked = [torch.stack(ts) for ts in zip(*[m.target for m in matchers])]

    def data_term(x, p, t):
        return lead.cosine_objective(lead.dummy(x, p, None, target=t), t)

    transform = vmap(grad_and_value(data_term))

    def evaluate(x, rows):
        gradients, values = transform(x, probs[rows], [t[rows] for t in stacked])
        return values, gradients

    stage = polish(evaluate, lead.model, start, iterations=5)  # floor 0: the truth takes part too
    assert bool((stage.after <= stage.before).all())
    assert float(stage.before[0]) < 1e-9 and bool((stage.after[1:] < stage.before[1:]).all())
    assert float(stage.images.min()) >= 0.0 and float(stage.images.max()) <= 1.0
    torch.testing.assert_close(evaluate(stage.images, torch.arange(3))[0], stage.after, rtol=1e-4, atol=1e-12)
    assert stage.evaluations > 3


@pytest.mark.parametrize("round_", [0, 1])
def test_fedpac_replay_of_only_the_weights_gives_the_same_update(digits, round_):
    """Leaving out the statistics and prototypes an attack does not read (and reusing the features it
    computed before training) changes none of the replayed weights (round 1: the prototype term, which
    needs the client's own class means, is on)."""
    torch.set_num_threads(TEST_THREADS)
    fed = tiny_federation(digits, "fedpac", clients=3, rounds=round_ + 1)
    model = copy.deepcopy(fed.model)
    fed.run(round_ + 1)
    obs = observe(fed.channel.recorder, round_, 0, method=fed.method, make_model=lambda: copy.deepcopy(model),
                  image_shape=(1, 8, 8), num_classes=10,
                  known_hyperparameters=LocalHyperparameters(lr=0.05, steps=1, batch_size=10))
    records = fed.ground_truth.schedule(round_, 0)
    target = update_target(obs)
    full = replay_context(obs, target.before, [Step(r.phase, tuple(int(p) for p in r.positions)) for r in records])
    idx = torch.from_numpy(fed.ground_truth.training_set(round_, 0))
    x, y = digits.images[idx], digits.labels[idx]
    copies = [None] * len(records)
    weights = list(target.names)
    lean = dataclasses.replace(full, outputs=frozenset(weights),
                               features_before=features(obs.make_model(), target.before, x))
    everything = fed.method.replay(obs.make_model(), full, x, y, copies)
    only = fed.method.replay(obs.make_model(), lean, x, y, copies)
    assert "h" in everything and not any(n.startswith("prototype.") for n in only)
    assert ("h" in only) == (round_ > 0)  # round 0 has no prototype term: no statistics at all
    for name in weights:
        torch.testing.assert_close(only[name], everything[name], rtol=0, atol=1e-7)
