"""MLflow: runs per pipeline and stage, model versions with lineage tags, aliases."""
