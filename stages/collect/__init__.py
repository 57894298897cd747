"""Collect: robot logs (telemetry, demonstrations, sim rollouts) into versioned, validated datasets."""
