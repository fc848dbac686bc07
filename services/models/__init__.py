"""Checkpoints PrfaaS prepares for itself: the embedded small chat model and test models."""
