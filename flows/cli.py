"""``sim2edge``: run the pipeline, start the servers, list tasks and targets.

The commands live by group in ``cli_pipeline``, ``cli_tune``, ``cli_fleet``, ``cli_rollout``, ``cli_catalog``,
``cli_artifacts`` and ``cli_team``; this module only assembles them, in the order ``--help`` lists them."""

from __future__ import annotations

import os
import sys

import typer

from flows import cli_artifacts, cli_catalog, cli_fleet, cli_pipeline, cli_rollout, cli_team, cli_tune

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="sim2edge: run the pipeline, start the servers, list tasks and targets.")
for command in (cli_pipeline.run, cli_pipeline.collect, cli_pipeline.calibrate, cli_pipeline.evaluate,
                cli_tune.tune, cli_fleet.publish, cli_fleet.devices, cli_fleet.up, cli_fleet.serve, cli_fleet.deploy,
                cli_catalog.tasks, cli_catalog.targets):
    app.command()(command)
app.add_typer(cli_catalog.gate_app, name="gate")
app.add_typer(cli_artifacts.keys_app, name="keys")
app.add_typer(cli_artifacts.dataset_app, name="dataset")
app.add_typer(cli_team.users_app, name="users")
app.add_typer(cli_rollout.rollout_app, name="rollout")
app.add_typer(cli_fleet.tuf_app, name="tuf")
app.command("package")(cli_artifacts.package_image)
app.command("import")(cli_artifacts.import_policy)


def main() -> None:
    # like `python -m`, make the working directory importable, for `--task mypkg.mymodule:MyTask`
    sys.path.insert(0, os.getcwd())
    app()
