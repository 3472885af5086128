"""What a malicious server reads of a client's labels before it crafts: the label counts of the client's
latest exchange it saw (the download it sent and the upload it got back, before the attacked round),
by the toolkit's label inference (``attacks.inversion.label_distribution``), and the SGD steps the
client takes against the classifier. Classifier fishing picks the class it fishes from them.
"""
from __future__ import annotations

import torch

from fedecouple.methods.base import phase_steps
from fedecouple.methods.facets import local_phases

from ..base import NotApplicable, Observation
from ..inversion.label_distribution import label_inference
from ..registry import CraftRequest


def label_counts(request: CraftRequest) -> tuple[torch.Tensor, int]:
    """((C,) the client's label counts as the server reads them from ``request.earlier``, zeros where
    there is none before ``request.round``; the SGD steps it takes against the classifier, from its
    uploaded sample count and the federation's ``train`` settings (1 where either is unknown))."""
    num_classes = request.make_model().num_classes
    earlier = request.earlier
    if earlier is None or earlier[2] is None or earlier[0] >= request.round:
        return torch.zeros(num_classes, dtype=torch.float64), 1
    steps = 1
    if request.train is not None and "sample_count" in earlier[2]:
        n = int(earlier[2]["sample_count"])
        steps = sum(phase_steps(e, n, request.train.batch_size) for phase, e, _ in
                    local_phases(request.method, request.train.local_epochs) if phase in ("local", "classifier")) or 1
    observation = Observation(request.method, earlier[0], request.client, earlier[1], earlier[2], None,
                              request.make_model, tuple(request.public.shape[1:]), num_classes)
    try:
        result = label_inference(observation, None, 0)
    except NotApplicable:
        return torch.zeros(num_classes, dtype=torch.float64), steps
    return torch.as_tensor(result.trace["label_counts"], dtype=torch.float64), steps
