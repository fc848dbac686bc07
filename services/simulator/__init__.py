"""A discrete-event simulator of a PrfaaS deployment (prefill clusters, the cross-cluster link, decode)."""
