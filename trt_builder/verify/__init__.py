"""Verify: the checkpoint against transformers, with gates, a diagnosis of disagreements and the reports (the verify stage)."""
