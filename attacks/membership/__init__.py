"""Membership-inference attacks: score records from a model's outputs (``fedsec mia``)."""
