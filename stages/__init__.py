"""The pipeline's work: plain, typed Python stages that run and test without Prefect."""
