"""Investigator: scheduler, context builder, reply contract, validation, stages,
checkpoints, summary."""
