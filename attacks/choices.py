"""The threat model's choices the command line offers (``--mode``, ``--augmentations``, ``--start``),
declared here so that the help reads them without importing torch."""

# how the server models the client's local training (``attacks.inversion.observation.resolve_mode``)
MODES = ("auto", "method", "replay", "scaled")
COPY_MODELS = ("free", "family")  # the augmented copies' model where the draws are unknown
AUGMENTATION_MODELS = (*COPY_MODELS, "oracle")  # oracle: the draws are known (KnownSchedule)
STARTS = ("noise", "mean")  # where an inversion starts (``attacks.base.Budget.start``)
