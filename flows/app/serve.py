"""``make serve``: the pipeline, each stage's flow and ``vip-reproduce`` as Prefect deployments, so runs start from the
Prefect UI.

Needs the Prefect server (``make ui``, or ``PREFECT_API_URL`` naming a team's server): the API URL is set
before Prefect is imported (Prefect reads it then; without one it would start a temporary server of its own),
and without a server it stops with one line. The deployments'
default parameters are the config (the preset, ``CONFIG=``'s file and ``SET=``'s settings, as ``make run`` reads
them; the deployments are named after its ``name``) and the demo's inputs (the sample web, served by this process
while it serves, and the offline evaluation data), so "Run" in the UI works as it is and shares its stages
with ``make run`` and ``make <stage>``; the form shows every field of the config, and a team points
``url_list`` and ``eval_data`` at its own data. Ctrl-C (or SIGTERM) pauses the deployments on the server, so the
UI shows them as not served, and exits with code 0.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import signal
import sys

from flows.app.run import WEB_PORT, flow_inputs
from flows.app.servers import is_healthy, prefect_url, use_running_prefect_server
from tasks.cli.options import add_config_sources, config_from
from tasks.runtime.environment import configure_environment
from vip_core.config import VipConfig


def deployments(config: VipConfig, inputs: dict[str, str]) -> list:
    """Every make target's flow as a deployment named after the config's name, with the inputs it takes."""
    from flows.targets import FLOWS

    description = f"config {config.name}; every field of the config is editable in the run form"
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
    from flows.reproduce import reproduce_flow
    from vip_core.reproduce import reproduce  # loads torch: only once a Prefect server answers

    experiment = reproduce()
    return reproduce_flow.to_deployment(
        "default", parameters={"experiment": experiment.model_dump(mode="json")}, tags=["vip", "experiment"],
        description="make reproduce: every arm on every seed, then the table, the plot and a verdict per finding")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.app.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="the config preset the deployments default to")
    add_config_sources(parser)
    parser.add_argument("--web-port", type=int, default=WEB_PORT, help="the sample web's port on 127.0.0.1")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_environment()
    try:
        config = config_from(args)
    except ValueError as error:
        print(f"make serve: error: {error}", file=sys.stderr)
        return 2
    api_url = use_running_prefect_server() or f"{prefect_url()}/api"
    if not is_healthy(f"{api_url}/health"):
        print(f"make serve: error: no Prefect server answers at {api_url}; start it with `make ui` "
              "(or set PREFECT_API_URL to a running server)", file=sys.stderr)
        return 2
    from prefect import serve  # only now: Prefect reads PREFECT_API_URL when it is imported

    served: list = []
    try:
        with flow_inputs(config, {"url_list", "eval_data"}, web_port=args.web_port) as inputs:
            served = deployments(config, inputs)
            serve(*served, pause_on_shutdown=False)  # Prefect's pause skips a Ctrl-C before its runner starts
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the pausing short
        pause(served)
    print("make serve: stopped; the deployments are paused", flush=True)
    return 0


def pause(served: list) -> None:
    """Pauses the served deployments that exist on the server, so that the UI does not offer them as served."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for deployment in served:
            with contextlib.suppress(ObjectNotFound):  # Ctrl-C came before it was created
                client.pause_deployment(client.read_deployment_by_name(f"{deployment.flow_name}/{deployment.name}").id)

if __name__ == "__main__":
    sys.exit(main())
