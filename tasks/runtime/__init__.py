"""What the stages share at run time: the environment, stage folders, MLflow tracking, the Ray session and
the results of a pipeline run."""
