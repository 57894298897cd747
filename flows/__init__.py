"""Prefect flows, deployments and the ``sim2edge`` CLI: wiring only."""
