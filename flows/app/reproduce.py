"""``make reproduce [FULL=1]``: the flow vip-reproduce on local Prefect, Ray and MLflow, then its results printed.

The table, each finding's verdict, the plot's path and the wall clock, for the person at the terminal.
"""

from __future__ import annotations

import argparse
import sys
import time

from tasks.runtime.environment import configure_environment
from vip_core.reproduce import EXPERIMENTS


def summary(result: dict, seconds: float) -> list[str]:
    """The table, each finding's verdict, the plot's path and the wall clock, as printed at the end."""
    lines = ["", result["table"], "", "Verdicts (findings fixed before running; docs/reproduce.md):"]
    lines += [f"  ({f['number']}) {f['claim']}: {f['verdict'].upper()}" for f in result["findings"]]
    lines += ["", f"plot: {result['plot']}", f"table: {result['table_file']}",
              f"wall clock: {seconds / 60:.1f} min (the flow: {result['seconds'] / 60:.1f} min)"]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.app.reproduce", description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", choices=sorted(EXPERIMENTS), default="default",
                        help="default: 42 min measured here; full: the longer recipe; smoke: minutes, for tests")
    parser.add_argument("--workdir", default="", help="default: $VIP_HOME/runs/<experiment name>")
    args = parser.parse_args(argv)
    configure_environment()
    from flows.app.run import prepare_console, say, stage_states

    prepare_console()  # before Prefect is imported: it reads its settings then
    from flows.app.progress import TrainingProgress
    from flows.reproduce import reproduce_flow

    experiment = EXPERIMENTS[args.experiment]()
    say(f"experiment {experiment.name}: seeds {list(experiment.seeds)}, arms {', '.join(experiment.arms)}")
    started = time.perf_counter()
    with TrainingProgress(interval_s=30):
        state = reproduce_flow(experiment=experiment, workdir=args.workdir, return_state=True)
    seconds = time.perf_counter() - started
    print(f"\nmake reproduce: {state.name} in {seconds / 60:.1f} min")
    for name, task_state in stage_states(state):
        print(f"  {name}  {task_state}")
    if not state.is_completed():
        print(f"  {state.message}", file=sys.stderr)
        return 1
    print("\n".join(summary(state.result(), seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
