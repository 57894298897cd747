"""Worked examples of using sim2edge with your own robot."""
