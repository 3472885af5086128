"""fedsec audit: field classification, verified claims, a leaking variant caught."""
from dataclasses import dataclass
import json

import pandas as pd
import pytest
import torch

from fedecouple.methods import METHODS
from fedecouple.methods.base import FieldSpec, make_upload
from fedecouple.methods.fedecouple import FedeCouple
from fedsec.jobs.audit import anchor_check, classify_field, run_audit
from fedsec.runner import RunConfig
from helpers import TEST_THREADS

TINY = dict(dataset="digits", clients=3, rounds=1, threads=TEST_THREADS)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "local"])
def test_every_uploaded_field_is_classified_by_the_manifest(tmp_path, method):
    result = run_audit(RunConfig.of(method=method, **TINY), tmp_path, evidence=False, progress=False)
    frame = pd.read_csv(tmp_path / "audit.csv")
    assert len(frame) and "other" not in set(frame["kind"])
    assert {"method", "round", "client", "field", "kind", "shape", "dtype", "bytes"} == set(frame.columns)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["total_upload_bytes"] == frame["bytes"].sum()
    codes = {f["code"] for f in result["findings"]}
    if method in ("fedpac", "fedproto"):
        assert {"LABEL_DISTRIBUTION_DISCLOSED", "CLASS_PRESENCE_DISCLOSED", "PROTOTYPES_DISCLOSED"} <= codes
    if method == "fedecouple":
        assert "NO_PER_CLASS_COUNTS" in codes
        (anchor,) = [f for f in result["findings"] if f["code"].startswith("ANCHORS")]
        cosine, grade = anchor["evidence"]["max_cosine"], anchor["evidence"]["disclosure"]
        assert grade == ("none" if cosine < 0.5 else "approximate") and cosine < 0.999
        assert anchor["code"] == {"none": "ANCHORS_NOT_UPLOADED", "approximate": "ANCHORS_APPROXIMATELY_DISCLOSED"}[grade]
    assert (tmp_path / "audit.md").read_text().startswith("# Upload audit")


@pytest.mark.parametrize("method, kept", [("fedper", ["classifier.weight", "classifier.bias"]), ("fedavg", None)])
def test_parameters_that_never_left_the_clients_are_verified(tmp_path, method, kept):
    result = run_audit(RunConfig.of(method=method, **TINY), tmp_path, evidence=False, progress=False)
    found = [f for f in result["findings"] if f["code"] == "PARAMETERS_NEVER_UPLOADED"]
    if kept is None:
        assert not found
    else:
        (finding,) = found
        assert finding["evidence"]["parameters"] == kept and finding["evidence"]["uploads_checked"] == 3
        assert "the classifier never left the clients" in finding["finding"]


def test_local_sends_nothing(tmp_path):
    result = run_audit(RunConfig.of(method="local", **TINY), tmp_path, evidence=False, progress=False)
    assert "NOTHING_UPLOADED" in {f["code"] for f in result["findings"]}
    assert result["summary"]["total_upload_bytes"] == 0


@dataclass
class LeakyFedeCouple(FedeCouple):
    """Test-only: FedeCouple that also uploads its anchors, declared as a statistic."""

    name = "leaky-fedecouple"

    def manifest(self, model):
        return super().manifest(model) + [FieldSpec("debug_summary", "statistic", (0,))]

    def client_update(self, ctx, state, download):
        new_state, upload = super().client_update(ctx, state, download)
        tensors = dict(upload.tensors)
        tensors["debug_summary"] = ctx.private["anchors"].clone()
        return new_state, make_upload(ctx, {k: v for k, v in tensors.items() if k != "sample_count"})


@pytest.fixture
def leaky():
    METHODS.declare("leaky-fedecouple", f"{__name__}:LeakyFedeCouple")
    yield
    METHODS.remove("leaky-fedecouple")


def test_anchor_check_catches_a_leaking_variant(tmp_path, leaky):
    result = run_audit(RunConfig.of(method="leaky-fedecouple", **TINY), tmp_path, evidence=False, progress=False)
    leak = [f for f in result["findings"] if f["code"] == "ANCHORS_UPLOADED"]
    assert leak and leak[0]["severity"] == "high"
    assert leak[0]["evidence"]["field"] == "debug_summary" and leak[0]["evidence"]["exact_matches"] > 0


def test_anchor_check_sees_rows_inside_larger_tensors():
    anchors = torch.randn(3, 4)
    hidden = torch.cat([torch.randn(5, 4), anchors[1:2] * 2.0])  # scaled copy: cosine 1, not exact
    res = anchor_check({"w": hidden, "n": torch.tensor(5)}, anchors)
    assert res["max_cosine"] > 0.999 and res["exact_matches"] == 0 and res["field"] == "w"
    assert anchor_check({"w": torch.randn(6, 4)}, anchors)["max_cosine"] < 0.999


def test_classify_per_class_patterns():
    specs = [FieldSpec("proto.{k}", "prototype", (8,), per_class=True), FieldSpec("sample_count", "sample_count", ())]
    assert classify_field("proto.7", specs).kind == "prototype"
    assert classify_field("proto.x", specs) is None
    assert classify_field("sample_count", specs).kind == "sample_count"
