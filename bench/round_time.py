"""Time one FedeCouple round through the framework against a straight-line torch implementation
of the same round (same losses, same batches, same augmentation draws, no channel, no framework).

Both run in this process on the same data (mnist5k, 20 clients, pathological K=3, 1 local
epoch, batch 10); they also must end with the same global model, which this script checks.
Before that, one framework round of every method (``--methods``) is timed on the same setup,
sequential backend (one line per method: round seconds, of which client updates and evaluation).
Last line: ``ratio <framework seconds / straight-line seconds>`` (target <= 1.15).

    python bench/round_time.py [--clients 20] [--repeats 2] [--methods all|none|fedavg,fedper,...] [--threads 1]
"""
from __future__ import annotations

import argparse
import copy
import time

import numpy as np
import torch
import torch.nn.functional as F

from fedecouple.backends import SequentialBackend
from fedecouple.data import BatchAugmenter, load_dataset, make_partition
from fedecouple.engine import Federation, FederationConfig, derive_seed
from fedecouple.methods import METHODS, make_method
from fedecouple.methods.base import TrainConfig


def straight_line_round(images, labels, partition, model, states, server, seed, lr=0.05, bs=10,
                        lam=0.8, mu=2.0, tau=2.0, num_classes=10):
    """One FedeCouple round written out in plain torch. Returns (new states, new server, accuracies)."""
    t = 0
    aug = BatchAugmenter(images.shape[-1])
    uploads, counts = [], []
    for cid in range(partition.num_clients):
        idx = torch.from_numpy(partition.train[cid])
        x_all, y_all = images[idx], labels[idx]
        n = len(y_all)
        gen = torch.Generator().manual_seed(derive_seed(seed, t, cid, 1))
        torch.manual_seed(derive_seed(seed, t, cid, 2))

        def batches():
            order = torch.randperm(n, generator=gen)
            for s in range(0, n, bs):
                sel = order[s:s + bs]
                if len(sel) < bs:
                    break  # ragged last batch dropped, as the framework does
                x, y = x_all[sel], y_all[sel]
                yield torch.cat([x, aug(x)]), torch.cat([y, y])

        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(states[cid][name])
        # classifier phase: personal classifier with KD, teacher adapted by CE
        teacher = copy.deepcopy(model.classifier)
        teacher.weight.data.copy_(server["global.classifier.weight"])
        teacher.bias.data.copy_(server["global.classifier.bias"])
        opt_s = torch.optim.SGD(model.classifier.parameters(), lr=lr)
        opt_t = torch.optim.SGD(teacher.parameters(), lr=lr)
        for x, y in batches():
            with torch.no_grad():
                f = model.features(x)
            s_logits = model.classifier(f)
            t_logits = teacher(f)
            loss = F.cross_entropy(s_logits, y) + lam * F.kl_div(
                F.log_softmax(s_logits / tau, 1), F.softmax(t_logits.detach() / tau, 1), reduction="batchmean")
            opt_s.zero_grad(); loss.backward(); opt_s.step()
            tl = F.cross_entropy(teacher(f), y)
            opt_t.zero_grad(); tl.backward(); opt_t.step()
        # extractor phase: reset to the global extractor, anchors from it, GLF epoch, personal epoch
        with torch.no_grad():
            for name, p in model.extractor.named_parameters():
                p.copy_(server["global.extractor." + name])
            feats = model.features(x_all)
            anchors = torch.zeros(num_classes, feats.shape[1]).index_add_(0, y_all, feats)
            anchors /= torch.bincount(y_all, minlength=num_classes).clamp_min(1).unsqueeze(1)
        frozen = copy.deepcopy(model.classifier)
        frozen.weight.data.copy_(server["global.classifier.weight"])
        frozen.bias.data.copy_(server["global.classifier.bias"])
        for head in (frozen, model.classifier):
            head.requires_grad_(False)
            opt = torch.optim.SGD(model.extractor.parameters(), lr=lr)
            for x, y in batches():
                f = model.features(x)
                loss = F.cross_entropy(head(f), y) + mu * (f - anchors[y]).pow(2).mean()
                opt.zero_grad(); loss.backward(); opt.step()
            head.requires_grad_(True)
        states[cid] = {k: v.detach().clone() for k, v in model.named_parameters()}
        uploads.append(states[cid])
        counts.append(n)
    # eq. 16
    names = list(uploads[0])
    vec = torch.stack([torch.cat([u[k].flatten() for k in names]) for u in uploads])
    alpha = torch.tensor(counts, dtype=torch.float32) / sum(counts)
    avg = (alpha.unsqueeze(1) * vec).sum(0)
    cos = F.cosine_similarity(vec, avg.unsqueeze(0), dim=1).clamp_min(0)
    iota = cos / cos.sum()
    server = {"global." + k: sum(w * u[k] for w, u in zip(iota, uploads)) for k in names}
    accs = []
    with torch.no_grad():
        for cid in range(partition.num_clients):
            for name, p in model.named_parameters():
                p.copy_(states[cid][name])
            tidx = torch.from_numpy(partition.test[cid])
            accs.append(float((model(images[tidx]).argmax(1) == labels[tidx]).float().mean()))
    return states, server, accs


class TimedBackend(SequentialBackend):
    """The sequential backend, remembering how long the client updates of its last round took."""

    seconds = 0.0

    def run_updates(self, *args):
        start = time.perf_counter()
        out = super().run_updates(*args)
        self.seconds = time.perf_counter() - start
        return out


def time_methods(names, ds, part, cfg) -> None:
    """One framework round per method (fresh federation, round 0), one line each."""
    for name in names:
        backend = TimedBackend()
        fed = Federation(make_method(name), ds, part, cfg, backend=backend)
        start = time.perf_counter()
        rows = fed.run_round()
        total = time.perf_counter() - start
        acc = np.nanmean([r["accuracy"] for r in rows])
        print(f"round {name:<11} {total:6.2f} s (client updates {backend.seconds:6.2f} s, aggregation + evaluation "
              f"{total - backend.seconds:5.2f} s; mean acc {acc:.4f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2, help="alternating timed repeats of each; the best is kept")
    ap.add_argument("--methods", default="all", help="methods timed one round each first: all, none, or a comma list")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: torch's default; on a shared machine more threads can be much slower)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ds = load_dataset("mnist5k")
    part = make_partition(ds.labels.numpy(), args.clients, "pathological", classes_per_client=3, seed=0)
    cfg = FederationConfig(rounds=1, seed=0, train=TrainConfig(lr=0.05, batch_size=10, local_epochs=1))
    names = list(METHODS) if args.methods == "all" else [] if args.methods == "none" else args.methods.split(",")
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    time_methods(names, ds, part, cfg)
    best_fw, best_sl = float("inf"), float("inf")
    for _ in range(args.repeats):
        fed = Federation(make_method("fedecouple"), ds, part, cfg)
        states = {c: fed.client_state(c) for c in range(args.clients)}
        server0 = dict(fed.server)
        sl_model = copy.deepcopy(fed.model)
        start = time.perf_counter()
        rows = fed.run_round()
        best_fw = min(best_fw, time.perf_counter() - start)
        start = time.perf_counter()
        _, sl_server, sl_accs = straight_line_round(ds.images, ds.labels, part, sl_model,
                                                    {c: dict(s) for c, s in states.items()}, server0, seed=0)
        best_sl = min(best_sl, time.perf_counter() - start)
    diff = max(float((fed.server[k] - sl_server[k]).abs().max()) for k in sl_server)
    acc_fw = np.mean([r["accuracy"] for r in rows])
    print(f"framework round {best_fw:.2f} s (mean acc {acc_fw:.4f}); straight-line round {best_sl:.2f} s "
          f"(mean acc {np.mean(sl_accs):.4f}); max |global param difference| {diff:.2e}; "
          f"torch threads {torch.get_num_threads()}")
    print(f"ratio {best_fw / best_sl:.3f}")


if __name__ == "__main__":
    main()
