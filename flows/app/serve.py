"""``make serve``: the pipeline, each stage's flow and ``vip-reproduce`` as Prefect deployments, so runs start from the
Prefect UI.

Needs the Prefect server (``make ui``, or ``PREFECT_API_URL`` naming a team's server). The deployments'
default parameters are the preset's config and the demo's inputs (the sample web, served by this process
while it serves, and the offline evaluation data), so "Run" in the UI works as it is and shares its stages
with ``make run`` and ``make <stage>``; the form shows every field of the config, and a team points
``url_list`` and ``eval_data`` at its own data.
"""

from __future__ import annotations

import argparse
import inspect
import sys

from prefect import serve

from flows.app.run import WEB_PORT, flow_inputs
from flows.app.servers import use_running_prefect_server
from flows.reproduce import reproduce_flow
from flows.targets import FLOWS
from tasks.runtime.environment import configure_environment
from vip_core.config import VipConfig, get_preset
from vip_core.reproduce import reproduce


def deployments(config: VipConfig, inputs: dict[str, str]) -> list:
    """Every make target's flow as a deployment named after the preset, with the inputs it takes."""
    description = f"preset {config.name}; every field of the config is editable in the run form"
    made = []
    for target, flow in FLOWS.items():
        accepted = inspect.signature(flow.fn).parameters
        parameters = {"config": config.model_dump(mode="json"),
                      **{key: value for key, value in inputs.items() if key in accepted}}
        made.append(flow.to_deployment(config.name, parameters=parameters, description=f"make {target}: {description}",
                                       tags=["vip"] if target == "run" else ["vip", "stage"]))
    return [*made, reproduce_deployment()]


def reproduce_deployment():
    """``make reproduce``'s flow as the deployment ``vip-reproduce/default``: the experiment's sizes as the form."""
    experiment = reproduce()
    return reproduce_flow.to_deployment(
        "default", parameters={"experiment": experiment.model_dump(mode="json")}, tags=["vip", "experiment"],
        description="make reproduce: every arm on every seed, then the table, the plot and a verdict per finding")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.app.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="the config preset the deployments default to")
    parser.add_argument("--web-port", type=int, default=WEB_PORT, help="the sample web's port on 127.0.0.1")
    args = parser.parse_args(argv)
    configure_environment()
    if use_running_prefect_server() is None:
        print("make serve: error: no Prefect server at http://127.0.0.1:4200; start it with `make ui` "
              "(or set PREFECT_API_URL)", file=sys.stderr)
        return 2
    config = get_preset(args.preset)
    with flow_inputs(config, {"url_list", "eval_data"}, web_port=args.web_port) as inputs:
        serve(*deployments(config, inputs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
