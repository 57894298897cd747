"""Tasks, physical parameters, and the batched MuJoCo environment."""
