"""The pipeline's stages for one config and one set of inputs, submitted to Prefect on demand, upstream first.

```
url list ──► ingest ─────────────────────────────────┐
render ──► pretrain-syn (MAE, no DP) ──► checkpoint ──► pretrain-dp (DP-AdamW) ──► eval.map(suite)
                                                        audit (canaries)
```
Every flow (the pipeline and each stage's own) asks a :class:`StageGraph` for the stages it needs; the
graph submits each stage once, after the stages it reads, with the same folder and arguments whichever
flow asks. So a stage has the same cache key in every flow: what the pipeline finished is Cached when the
stage's own flow runs (``make eval`` after ``make run``), and the other way round (``make run`` after
``make pretrain-syn``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from prefect.futures import PrefectFuture
from prefect.utilities.annotations import quote

from flows.caching import audit_folder, default_workdir, eval_folder, stage_folders
from flows.stages import audit, evaluate, flow_tracking, ingest, pretrain, register_encoder, render
from tasks.runtime import tracking
from tasks.runtime.environment import configure_environment
from tasks.runtime.folders import RESULT_FILE
from tasks.runtime.names import EVAL_METRICS_FILE
from vip_core.config import TRAINING_TASKS, EvalPair, VipConfig, with_overrides
from vip_core.data import storage

EVAL_THREADS = 4  # evaluation jobs (and the audit) running side by side in a flow
AUDIT_CANARIES = 1000
AUDIT_DELTA = 1e-5


class StageGraph(contextlib.ExitStack):
    """The stages of one config, used as a context manager inside a flow (it holds the flow's Ray session).

    Args:
        config: the run's configuration.
        url_list: the private pre-training data: a LAION-format url list.
        image_folder: the private pre-training data as image files, instead of ``url_list``: a folder or fsspec URL.
        eval_data: the public evaluation data (``classification/``, ``coco/``, ``ade20k/``), also what the web
            images are decontaminated against: a local folder or an fsspec URL (``s3://bucket/eval``).
        workdir: where the stages' folders are.
        parent_run_id: the flow run's MLflow run; each stage logs a child run under it.
    """

    def __init__(self, config: VipConfig, *, url_list: str, eval_data: str, workdir: str, parent_run_id: str,
                 image_folder: str = "") -> None:
        super().__init__()
        self.config = config
        self.eval_data = eval_data
        self.workdir = workdir
        self.parent_run_id = parent_run_id
        self.url_list = url_list
        self.image_folder = image_folder
        self.folders = stage_folders(config, workdir, url_list, eval_data, image_folder)
        self._futures: dict[str, PrefectFuture] = {}
        self._ray_started = False

    def ingest(self) -> PrefectFuture:
        """The private images from the url list (or the image folder): fetched, filtered, deduplicated, decontaminated."""
        folder = self.folders["ingest"]
        return self._once("ingest", lambda: _submit(
            _fresh_if_missing(ingest, folder), self.config, self.url_list, folder, self.eval_data, self.parent_run_id,
            self.image_folder))

    def render(self) -> PrefectFuture:
        """Synthetic images from procedural shader programs."""
        folder = self.folders["render"]
        return self._once("render", lambda: _submit(
            _fresh_if_missing(render, folder), self.config, folder, self.parent_run_id))

    def pretrain_syn(self) -> PrefectFuture:
        """MAE pre-training on the rendered images, without privacy."""
        synthetic, folder = self.render(), self.folders["pretrain-syn"]
        return self._once("pretrain-syn", lambda: _submit(
            self._pretrain(folder), self.config, "synthetic", self.folders["render"], folder, None,
            self.parent_run_id, upstream=[synthetic]))

    def pretrain_dp(self) -> PrefectFuture:
        """Private MAE pre-training on the web images with DP-AdamW, from the synthetic stage's weights."""
        web, warm, folder = self.ingest(), self.pretrain_syn(), self.folders["pretrain-dp"]
        return self._once("pretrain-dp", lambda: _submit(
            self._pretrain(folder), self.config, "private", self.folders["ingest"], folder,
            warm.result()["checkpoint"], self.parent_run_id, upstream=[web, warm]))

    def audit(self, canaries: int, delta: float) -> PrefectFuture:
        """The privacy audit of the private recipe at δ = ``delta``, with ``canaries`` canaries."""
        audited = with_overrides(self.config, {"privacy.delta": delta})
        folder = self.folders["audit"] = audit_folder(audited, self.workdir, canaries)
        return self._once("audit", lambda: _submit(
            _fresh_if_missing(audit, folder), audited, canaries, folder, self.parent_run_id))

    def register_encoder(self) -> PrefectFuture:
        """The private stage's encoder registered in the MLflow model registry (``vip-encoder``)."""
        trained = self.pretrain_dp()
        return self._once("register-encoder", lambda: _submit(
            register_encoder, trained.result()["checkpoint"], self.parent_run_id, upstream=[trained]))

    def evaluations(self, checkpoint: str | None = None) -> dict[str, dict[str, Any]]:
        """Every pair of the evaluation suite (``config.evaluation.pairs``) on the encoder of ``checkpoint``
        (default: the private stage's), each beside its random-init baseline when the config asks, in parallel:
        each pair a task of its own, with its own folder, cache key and MLflow child run.

        Returns:
            ``{pair name: metrics}`` with ``metrics["result"]`` and ``metrics["baseline"]``.
        """
        upstream = [] if checkpoint else [self.pretrain_dp()]
        checkpoint = checkpoint or self.pretrain_dp().result()["checkpoint"]
        pairs = self.config.evaluation.pairs
        for pair in pairs:
            self.folders[f"eval-{pair.name}"] = eval_folder(self.config, self.workdir, pair, checkpoint, self.eval_data)
        self._ray_for_evaluations(pairs)
        futures = [_submit(evaluate, self.config, pair.task, pair.name, checkpoint, self._eval_data(pair),
                           self.folders[f"eval-{pair.name}"], self.parent_run_id, upstream=upstream)
                   for pair in pairs]
        return {pair.name: future.result() for pair, future in zip(pairs, futures)}

    def _eval_data(self, pair: EvalPair) -> str:
        """The folder (or URL) of ``pair``'s data set below the evaluation data."""
        return str(storage.join(self.eval_data, pair.data))

    def _ray_for_evaluations(self, pairs: Sequence[EvalPair]) -> None:
        """Ray for the jobs that run on Ray Train workers and have no stored metrics yet (started once, from the
        flow's thread: the jobs' threads then join it)."""
        waiting = [pair for pair in pairs if pair.task in TRAINING_TASKS
                   and not (Path(self.folders[f"eval-{pair.name}"]) / EVAL_METRICS_FILE).is_file()]
        if self.config.evaluation.num_workers and waiting:
            self._start_ray()

    def _once(self, stage: str, submit: Callable[[], PrefectFuture]) -> PrefectFuture:
        """The stage's future, submitted on the first call."""
        if stage not in self._futures:
            self._futures[stage] = submit()
        return self._futures[stage]

    def _pretrain(self, folder: str) -> Any:
        """The pre-training task, with Ray started (from the flow's thread) unless the stage has finished."""
        if not (Path(folder) / RESULT_FILE).is_file():
            self._start_ray()
        return _fresh_if_missing(pretrain, folder)

    def _start_ray(self) -> None:
        if not self._ray_started:
            self.enter_context(_local_ray(self.config))
            self._ray_started = True


@contextlib.contextmanager
def stage_graph(flow_name: str, config: VipConfig, *, url_list: str = "", eval_data: str = "",
                workdir: str = "", image_folder: str = "") -> Iterator[StageGraph]:
    """A flow's graph, inside the flow run's MLflow parent run; ``workdir`` empty: ``$VIP_HOME/runs/<preset>``."""
    configure_environment()
    with flow_tracking(flow_name, config) as parent_run_id, StageGraph(
        config, url_list=url_list, eval_data=eval_data, workdir=workdir or default_workdir(config),
        parent_run_id=parent_run_id, image_folder=image_folder,
    ) as graph:
        yield graph


def log_stage_result(graph: StageGraph, stage: str, result: dict[str, Any]) -> dict[str, Any]:
    """The stage's result, also logged to the flow run's MLflow run; returns it."""
    tracking.log_result(graph.parent_run_id, stage, result)
    return result


@contextlib.contextmanager
def _local_ray(config: VipConfig) -> Iterator[dict]:
    """One Ray for the flow's training stages and evaluation jobs, sized for the largest: ``RAY_ADDRESS``, or a
    local one.

    The stages find it running and join it, rather than each starting and stopping its own from a task thread.
    """
    from tasks.runtime.ray_session import ray_session

    stages = (config.synthetic, config.private, config.evaluation)
    with ray_session(max(s.num_workers for s in stages), max(s.cpus_per_worker for s in stages)) as ray_info:
        yield ray_info


def _submit(stage_task: Any, *parameters: Any, upstream: Sequence[PrefectFuture] = ()) -> PrefectFuture:
    """``stage_task`` submitted with ``parameters``, after ``upstream``: its edges in the Prefect run graph.

    The parameters are quoted: Prefect otherwise links a parameter to any earlier task whose result held the same
    object (by ``id``; PrefectHQ/prefect#20558), and every evaluation job returns the checkpoint path it was given,
    which drew edges between evaluation jobs and into register-encoder that are no data dependency.
    """
    return stage_task.submit(*(quote(parameter) for parameter in parameters), wait_for=list(upstream))


def _fresh_if_missing(stage_task: Any, output: str) -> Any:
    """The task as it is when its output folder exists; otherwise set to refresh its cache entry.

    A cached result names files; when they have been deleted, the stage runs again instead of handing
    the next stage a path to nothing.
    """
    return stage_task if Path(output).exists() else stage_task.with_options(refresh_cache=True)
