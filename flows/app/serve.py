"""``make serve``: the pipeline and each stage as Prefect deployments, so runs start from the Prefect UI.

Needs the Prefect server (``make ui``, or ``PREFECT_API_URL`` naming a team's server). The deployments'
default parameters are the preset's config and the demo's inputs (the sample web, served by this process
while it serves, and the offline evaluation data), so "Run" in the UI works as it is; the form shows every
field of the config, and a team points ``url_list`` and ``eval_data`` at its own data.
"""

from __future__ import annotations

import argparse
import sys

from prefect import serve

from flows.eval import evaluate_flow
from flows.ingest import ingest_flow
from flows.pipeline import default_workdir, stage_folders, vip_pipeline
from flows.pretrain import pretrain_dp_flow, pretrain_syn_flow
from flows.render import render_flow
from flows.app.run import WEB_IMAGES, WEB_PORT, make_eval_data, make_url_list, sample_web, use_running_prefect_server
from vip_core.config import VipConfig, get_preset
from tasks.runtime.environment import configure_environment


def deployments(config: VipConfig, url_list: str, eval_data: str) -> list:
    """The pipeline's and the stages' deployments, named after the preset."""
    common = {"config": config.model_dump(mode="json")}
    folders = stage_folders(config, default_workdir(config), url_list, eval_data)
    description = f"preset {config.name}; every field of the config is editable in the run form"
    return [
        vip_pipeline.to_deployment(
            config.name, parameters={**common, "url_list": url_list, "eval_data": eval_data},
            description=f"The whole ViP pipeline: {description}", tags=["vip"],
        ),
        ingest_flow.to_deployment(
            config.name, parameters={**common, "url_list": url_list, "eval_images": eval_data},
            description=f"Ingest web images: {description}", tags=["vip", "stage"],
        ),
        render_flow.to_deployment(config.name, parameters=common, tags=["vip", "stage"]),
        pretrain_syn_flow.to_deployment(config.name, parameters=common, tags=["vip", "stage"]),
        pretrain_dp_flow.to_deployment(
            config.name, parameters={**common, "data": folders["ingest"]}, tags=["vip", "stage"],
        ),
        evaluate_flow.to_deployment(
            config.name, parameters={**common, "checkpoint": folders["pretrain-dp"], "eval_data": eval_data},
            tags=["vip", "stage"],
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.app.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="the config preset the deployments default to")
    parser.add_argument("--web-port", type=int, default=WEB_PORT, help="the sample web's port on 127.0.0.1")
    args = parser.parse_args(argv)
    home = configure_environment()
    if use_running_prefect_server() is None:
        print("make serve: error: no Prefect server at http://127.0.0.1:4200; start it with `make ui` "
              "(or set PREFECT_API_URL)", file=sys.stderr)
        return 2
    config = get_preset(args.preset)
    eval_data = make_eval_data(home / "demo" / "eval", config.model.img_size)
    with sample_web(home / "demo" / "web", args.web_port) as base_url:
        url_list = make_url_list(home / "demo" / f"urls-{args.web_port}.parquet", base_url, WEB_IMAGES)
        serve(*deployments(config, str(url_list), str(eval_data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
