"""Our Inverting Gradients beside breaching's, on the same model, gradient, budget and images.

The setting: the federation's ``cnn28-same`` model at its initial weights (seed 0), one SGD step
(lr 0.05) on one image, the upload read back as a scaled gradient; images that are not MNIST:
photographs of ``skimage.data`` (grey, centre-cropped, resized to 28x28), labelled 0, 1, 2, ... in
turn. Both attacks get the same iterations and one start each, one image at a time, and are timed
around the whole call: ours with its closed-form stage, its final stage and the forward-model check
that the harness runs after every attack (``attacks.inversion.forward_check.check``); breaching's
``invertinggradients`` attack (Inverting Gradients: cosine matching, total variation 0.2, signed
Adam, step 0.1, learning rate decay) from breaching 0.1.2 with the true label (ours infers it).
Breaching's total variation is written for three channels, so it optimises an RGB image that a
wrapper turns grey before our model: the model's parameters and gradient are the same. Both are
scored with ``attacks.metrics`` against the image, the prior being the bench images' mean.

breaching is an optional bench dependency, never needed by the suite; beside the pinned torch:

    pip install --no-deps breaching==0.1.2 hydra-core lpips && pip install 'omegaconf>=2.2,<2.4' antlr4-python3-runtime==4.9.3
    python bench/vs_breaching.py [--images 8] [--iterations 1000] [--threads 1] [--json FILE]

Prints one row per image (seconds and PSNR of each), then the means, and as the last line
``ours_s <x> breaching_s <y> ratio <ours/breaching> ours_db <a> breaching_db <b> gain_db <a-b>``.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import os
import statistics
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from attacks import ATTACKS
from attacks.base import Budget, LocalHyperparameters, Observation
from attacks.inversion.forward_check import check
from attacks.metrics import score_reconstructions
from fedecouple.data import load_dataset
from fedecouple.engine import derive_seed
from fedecouple.methods import make_method
from fedecouple.methods.base import BatchRecord
from fedecouple.models import build_model, get_params

# skimage.data photographs (bundled with scikit-image: no download)
PHOTOS = ("astronaut", "camera", "coffee", "chelsea", "rocket", "moon", "coins", "page", "horse", "clock",
          "text", "immunohistochemistry")
LR = 0.05
ARCH = "cnn28-same"


def photo(name: str, size: int = 28) -> torch.Tensor:
    """A ``skimage.data`` photograph as a grey (1, size, size) image in [0, 1]: centre-cropped square."""
    from skimage import data, transform
    from skimage.color import rgb2gray, rgba2rgb
    from skimage.util import img_as_float

    image = img_as_float(getattr(data, name)())
    if image.ndim == 3:
        image = rgb2gray(rgba2rgb(image) if image.shape[-1] == 4 else image)
    h, w = image.shape
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    square = image[top:top + side, left:left + side]
    small = transform.resize(square, (size, size), anti_aliasing=True)
    return torch.from_numpy(np.clip(small, 0.0, 1.0)).to(torch.float32)[None]


def textbook_update(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    """(download, upload, gradient list in ``model.parameters()`` order) of one SGD step on (x, y)."""
    start = get_params(model)
    params = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    grads = torch.autograd.grad(F.cross_entropy(functional_call(model, params, (x,)), y), list(params.values()))
    upload = {k: (v - LR * g).detach() for (k, v), g in zip(params.items(), grads)}
    return start, upload, [g.detach() for g in grads]


def ours(model, start, upload, x, y, iterations: int, seed: int) -> tuple[torch.Tensor, float, dict]:
    """Our IG on the scaled gradient, then the harness's forward-model check: (image, seconds, check)."""
    spec = ATTACKS["ig"]
    obs = Observation(method=make_method("fedavg"), round=0, client_id=0, download=start, upload=upload,
                      previous_upload=None, make_model=lambda: copy.deepcopy(model), image_shape=tuple(x.shape[1:]),
                      num_classes=10, known_hyperparameters=LocalHyperparameters(lr=LR, steps=1, batch_size=1))
    began = time.perf_counter()
    result = spec.attack_one(obs, Budget(iterations=iterations, restarts=1, batch=1), seed)
    mode = str(result.trace.get("mode", "auto")).replace("scaled-gradient", "scaled")
    record = BatchRecord("train", np.array([0]), np.array([0]))
    verdict = check(obs, mode, spec.matching, result, x, y, [record])
    return result.images[:1], time.perf_counter() - began, verdict


class Grey(torch.nn.Module):
    """Breaching's RGB candidate made grey before our model (which normalises its input itself):
    breaching optimises in normalised units, so the wrapper undoes its normalisation first."""

    def __init__(self, model: torch.nn.Module, mean: float, std: float):
        super().__init__()
        self.model, self.mean, self.std = model, mean, std

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.model((z * self.std + self.mean).mean(dim=1, keepdim=True))


def breaching_ig(model, gradients, y, mean: float, std: float, iterations: int, seed: int) -> tuple[torch.Tensor, float]:
    """breaching's ``invertinggradients`` on the same gradient: (grey image, seconds)."""
    import breaching
    from omegaconf import OmegaConf

    overrides = [f"optim.max_iterations={iterations}", "restarts.num_trials=1", f"optim.callback={iterations + 1}"]
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():  # hydra's notices
        warnings.simplefilter("ignore")
        cfg = breaching.get_attack_config("invertinggradients", overrides=overrides)
    wrapped = Grey(copy.deepcopy(model), mean, std)
    setup = dict(dtype=torch.float, device=torch.device("cpu"))
    metadata = OmegaConf.create({"shape": [3, 28, 28], "mean": [mean] * 3, "std": [std] * 3, "modality": "vision",
                                 "classes": 10})
    payload = [{"parameters": [p.detach().clone() for p in wrapped.parameters()], "buffers": None, "metadata": metadata}]
    shared = [{"gradients": [g.clone() for g in gradients], "buffers": None,
               "metadata": {"num_data_points": 1, "labels": y.clone(), "local_hyperparams": None}}]
    torch.manual_seed(seed)
    began = time.perf_counter()
    attacker = breaching.attacks.prepare_attack(wrapped, torch.nn.CrossEntropyLoss(), cfg, setup)
    rebuilt, _ = attacker.reconstruct(payload, shared, {}, dryrun=False)
    seconds = time.perf_counter() - began
    image = (rebuilt["data"] * std + mean).clamp(0, 1).mean(dim=1, keepdim=True)
    return image.detach(), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=8, help=f"photographs, at most {len(PHOTOS)}")
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the rows and means to this JSON file")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.jit.script, used by breaching's imports
    try:
        import breaching  # noqa: F401
    except ImportError:
        print("error: breaching is not installed: pip install --no-deps breaching==0.1.2 hydra-core lpips "
              "&& pip install 'omegaconf>=2.2,<2.4' antlr4-python3-runtime==4.9.3", file=sys.stderr)
        sys.exit(2)
    if not 1 <= args.images <= len(PHOTOS):
        parser.error(f"--images must be between 1 and {len(PHOTOS)}")  # exit status 2
    logging.getLogger("breaching").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    dataset = load_dataset("mnist5k")  # only its normalisation constants: the model the federation builds
    torch.manual_seed(derive_seed(0, 0xC0DE))  # the federation's initialisation for seed 0
    model = build_model(ARCH, 1, 28, 10, dataset.mean, dataset.std)
    images = torch.stack([photo(n) for n in PHOTOS[:args.images]])
    prior = images.mean(dim=0)
    mean, std = float(torch.as_tensor(dataset.mean).reshape(-1)[0]), float(torch.as_tensor(dataset.std).reshape(-1)[0])
    rows = []
    print(f"{'image':<22}{'ours s':>8}{'ours dB':>9}{'breaching s':>13}{'breaching dB':>14}{'prior dB':>10}  check")
    for i, name in enumerate(PHOTOS[:args.images]):
        x, y = images[i:i + 1], torch.tensor([i % 10])
        start, upload, gradients = textbook_update(model, x, y)
        mine, my_s, verdict = ours(model, start, upload, x, y, args.iterations, args.seed + i)
        theirs, their_s = breaching_ig(model, gradients, y, mean, std, args.iterations, args.seed + i)
        (a,), (b,) = score_reconstructions(mine, x, prior), score_reconstructions(theirs, x, prior)
        state = "mis-specified" if verdict.get("mis_specified") else (
            "stopped short" if verdict.get("not_converged") else "clean")
        rows.append({"image": name, "ours_s": my_s, "ours_db": a["psnr"], "breaching_s": their_s,
                     "breaching_db": b["psnr"], "prior_db": a["prior_psnr"], "check": state})
        print(f"{name:<22}{my_s:>8.2f}{a['psnr']:>9.2f}{their_s:>13.2f}{b['psnr']:>14.2f}{a['prior_psnr']:>10.2f}  {state}",
              flush=True)
    means = {k: statistics.fmean(r[k] for r in rows) for k in ("ours_s", "ours_db", "breaching_s", "breaching_db")}
    means["ratio"] = means["ours_s"] / means["breaching_s"]
    means["gain_db"] = means["ours_db"] - means["breaching_db"]
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"rows": rows, "means": means, "iterations": args.iterations, "threads": args.threads,
                       "seed": args.seed, "torch": torch.__version__}, f, indent=1)
        os.replace(tmp, args.json)
    print(f"mean: ours {means['ours_s']:.2f} s {means['ours_db']:.2f} dB, breaching {means['breaching_s']:.2f} s "
          f"{means['breaching_db']:.2f} dB (n = {len(rows)} images)")
    print(f"ours_s {means['ours_s']:.3f} breaching_s {means['breaching_s']:.3f} ratio {means['ratio']:.3f} "
          f"ours_db {means['ours_db']:.2f} breaching_db {means['breaching_db']:.2f} gain_db {means['gain_db']:.2f}")


if __name__ == "__main__":
    main()
