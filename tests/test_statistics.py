"""The membership statistics' fast ROC (``attacks.statistics.roc_rates``, used inside the bootstraps) is
scikit-learn's ROC, float for float, ties included; advantage and TPR at low FPR read it."""
import numpy as np
import pytest
from sklearn.metrics import roc_curve

from attacks import statistics as st


@pytest.mark.parametrize("decimals", [0, 1, 6])
def test_roc_rates_equal_sklearns_roc_curve_float_for_float(decimals):
    rng = np.random.default_rng(decimals)
    for _ in range(100):
        n = int(rng.integers(2, 300))
        scores, labels = np.round(rng.normal(size=n), decimals), rng.random(n) < rng.random()
        if labels.all() or not labels.any():
            continue
        fpr, tpr, _ = roc_curve(labels, scores, drop_intermediate=False)
        fast_fpr, fast_tpr = st.roc_rates(scores, labels)
        assert np.array_equal(fpr, fast_fpr) and np.array_equal(tpr, fast_tpr)
        assert st.advantage(scores, labels) == float(np.max(tpr - fpr))
        assert st.tpr_at_fpr(scores, labels, 0.1) == float(tpr[fpr <= 0.1].max())


def test_one_class_has_no_advantage_or_tpr():
    assert np.isnan(st.advantage([0.1, 0.2], [1, 1])) and np.isnan(st.tpr_at_fpr([0.1, 0.2], [0, 0], 0.01))
