"""Round-level attacks: what a curious or malicious server learns under secure aggregation, where it
holds each round's sum and never one client's upload.

The round-level path parallels the per-client one: ``observation`` (the ``RoundObservation`` every
round-level attack takes, built from a recorded run by ``observe_round``), the attacks, one file each
with its ``RoundAttackSpec`` or ``MaliciousRoundSpec`` (kind ``"aggregate"``; ``sum_labels``: the round's
label histogram; ``sum_inversion``: gradient matching of the sum as one batch; ``disaggregation``: per-client counts and
updates by least squares over many rounds; a malicious server's ``sum_binning``, ``inconsistency`` and
``sybil``, which share the binning craft sized to the protocol, ``sized_binning``), and ``harness``
(``attack_rounds``: run and score them on a recorded run). This package imports none of them:
``attacks/__init__.py`` declares each (its spec is imported on first use), and ``fedsec`` imports the
harness.
"""
