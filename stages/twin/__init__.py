"""The digital twin: calibration from logs, evaluation of the shipped artifact, gates."""
