"""``vip config show``: the whole config a command would run on, as YAML, to save, edit and pass back.

    vip config show --preset tiny > my.yaml          # edit privacy.target_epsilon in my.yaml, then
    vip pretrain --config my.yaml ...                 # or make run CONFIG=my.yaml
"""

from __future__ import annotations

import argparse
from typing import Any

from tasks.cli.options import add_command, add_preset, config_from


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("config", help="the resolved configuration")
    actions = parser.add_subparsers(dest="action", required=True)
    show = add_command(
        actions, "show", handle_show, help="print the whole resolved config as YAML",
        description="Prints every field of the config that the same --preset, --config and --set give any other "
        "command, as YAML. A config file may hold all of it or only the fields it changes.",
    )
    add_preset(show)


def handle_show(args: argparse.Namespace) -> int:
    from tasks.cli import report
    from vip_core.config import config_yaml

    report(config_yaml(config_from(args)), end="")
    return 0
