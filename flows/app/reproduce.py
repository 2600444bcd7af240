"""``make reproduce [FULL=1]``: the flow vip-reproduce on local Prefect, Ray and MLflow, then its results printed.

The table, each finding's verdict per task, the plot's path and the wall clock, for the person at the terminal. The
flow runs supervised, as ``make run``'s (:func:`flows.app.run.supervise`): Ctrl-C stops it and everything it started,
then the temporary Prefect server, and one line says what was kept.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tasks.runtime.environment import configure_environment, state_paths
from tasks.runtime.stopping import is_supervised
from vip_core.reproduce import EXPERIMENTS, with_recipe


def summary(result: dict, seconds: float) -> list[str]:
    """The table, each finding's verdict per task with its interval, the plot's path and the wall clock, as
    printed at the end."""
    lines = ["", result["table"], "", "Verdicts (findings fixed before running; docs/reproduce.md):", result["split"]]
    for task in result["tasks"].values():
        lines.append(f"  {task['description']}:")
        lines += [f"    ({f['number']}) {f['claim']}: {f['verdict'].upper()} ({f['difference']['mean']:+.3f} "
                  f"[{f['difference']['low']:+.3f}, {f['difference']['high']:+.3f}])" for f in task["findings"]]
    lines += ["", f"plot: {result['plot']}", f"table: {result['table_file']}",
              f"wall clock: {seconds / 60:.1f} min (the flow: {result['seconds'] / 60:.1f} min)"]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m flows.app.reproduce", description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", choices=sorted(EXPERIMENTS), default="default",
                        help="default: the held-out tasks, about 20 min here; development: the tasks that choose "
                        "the recipe; full: the longer recipe; smoke: minutes, for tests")
    parser.add_argument("--workdir", default="", help="default: $VIP_HOME/runs/<experiment name>")
    parser.add_argument("--recipe", action="append", metavar="FIELD=VALUE", help="the vip-recipe arm's overrides "
                        "instead of the experiment's (repeatable; e.g. private.lr=0.002), for choosing a recipe")
    args = parser.parse_args(argv)
    experiment = EXPERIMENTS[args.experiment]()
    if args.recipe:
        try:
            experiment = with_recipe(experiment, args.recipe)
        except ValueError as error:
            parser.error(str(error))
    configure_environment()
    if not is_supervised():
        return supervise(args, argv)
    from flows.app.run import noting_flow_run, prepare_console, say, stage_states, stop_flow_with_supervisor

    stop_flow_with_supervisor()

    prepare_console()  # before Prefect is imported: it reads its settings then
    from flows.app.progress import TrainingProgress
    from flows.reproduce import reproduce_flow

    say(f"experiment {experiment.name}: seeds {list(experiment.seeds)}, arms {', '.join(experiment.arms)}, "
        f"tasks {', '.join(task.name for task in experiment.tasks)}")
    started = time.perf_counter()
    with TrainingProgress(interval_s=30):
        state = noting_flow_run(reproduce_flow)(experiment=experiment, workdir=args.workdir, return_state=True)
    seconds = time.perf_counter() - started
    print(f"\nmake reproduce: {state.name} in {seconds / 60:.1f} min")
    for name, task_state in stage_states(state):
        print(f"  {name}  {task_state}")
    if not state.is_completed():
        print(f"  {state.message}", file=sys.stderr)
        return 1
    print("\n".join(summary(state.result(), seconds)), flush=True)
    return 0


def supervise(args: argparse.Namespace, argv: list[str]) -> int:
    """The experiment in a supervised child (:func:`flows.app.run.run_flow_supervised`); returns the exit status."""
    from flows.app.run import run_flow_supervised

    workdir = Path(args.workdir) if args.workdir else state_paths()["runs"] / EXPERIMENTS[args.experiment]().name

    def kept() -> str:
        finished = len(list(workdir.rglob("result.json")))
        return (f"[vip] make reproduce: stopped. Kept in {workdir}: {finished} finished stage folders. To resume, run "
                "the same command again: finished stages are Cached, pre-training goes on from its last checkpoint.")

    return run_flow_supervised("make reproduce", ["flows.app.reproduce", *argv], kept)


if __name__ == "__main__":
    sys.exit(main())
