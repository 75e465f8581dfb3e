"""Training recipes -> trainers for speculators (draft distillation, Medusa, EAGLE).

Depends on ``specfoundry.runtime`` only (never on ``specfoundry.export``).
Not built yet: see the training issue.
"""
