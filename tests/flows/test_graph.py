"""The Prefect run graph shows the stages' data dependencies and nothing else, under stable task run names."""

from __future__ import annotations

import asyncio

from prefect import Task, flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import StateType
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

import flows.stages
from flows.graph import _submit


@task(task_run_name="train")
def _train() -> dict:
    return {"checkpoint": "/runs/pretrain-dp/checkpoint.pt"}


@task(task_run_name="job-{name}")
def _job(name: str, checkpoint: str) -> dict:
    return {"task": name, "checkpoint": str(checkpoint)}  # hands its input back, as the evaluation jobs do


@task(task_run_name="register")
def _register(checkpoint: str) -> str:
    return checkpoint


@flow(task_runner=ThreadPoolTaskRunner(max_workers=1))  # the second job's run is created after the first ends
def _jobs_then_register() -> str:
    trained = _submit(_train)
    checkpoint = trained.result()["checkpoint"]
    for job in [_submit(_job, name, checkpoint, upstream=[trained]) for name in ("a", "b")]:
        job.wait()
    _submit(_register, checkpoint, upstream=[trained]).wait()
    return str(flow_run.id)


def _edges(flow_run_id: str, task_runs: int) -> dict[str, set[str]]:
    """Each task run's upstream task runs, once the server has recorded ``task_runs`` of them, each completed (it
    does so from the client's events, a moment after the flow ends; a run first recorded from its earliest event
    still has the name Prefect generated, until its later events arrive)."""
    async def read() -> list:
        async with get_client() as client:
            for _ in range(120):
                runs = await client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
                if len(runs) == task_runs and all(run.state_type == StateType.COMPLETED for run in runs):
                    return runs
                await asyncio.sleep(0.5)
        return runs

    runs = asyncio.run(read())
    names = {run.id: run.name for run in runs}
    return {run.name: {names[i.id] for inputs in run.task_inputs.values() for i in inputs if i.id in names}
            for run in runs}


def test_jobs_sharing_a_checkpoint_depend_on_its_stage_only(prefect_api):
    assert _edges(_jobs_then_register(), task_runs=4) == {"train": set(), "job-a": {"train"}, "job-b": {"train"},
                                            "register": {"train"}}


def test_every_stage_task_has_a_stable_run_name():
    stage_tasks = [value for value in vars(flows.stages).values() if isinstance(value, Task)]
    assert {stage.name for stage in stage_tasks} == {"ingest", "render", "pretrain", "eval", "audit", "register-encoder"}
    assert all(stage.task_run_name for stage in stage_tasks)
