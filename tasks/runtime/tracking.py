"""MLflow tracking for pipeline runs: one parent run per flow run, a child run per stage and per job.

Runs are created and closed through :class:`mlflow.MlflowClient` by run id, never through the active-run
stack, so a child run can be written from another thread or process (a Ray worker logs ``privacy/epsilon``
into the run id it is given). A child run is linked to its parent with the ``mlflow.parentRunId`` tag, the
same link ``mlflow.start_run(parent_run_id=...)`` writes (``nested=True`` only works inside one process).

Names of metrics are namespaced: ``train/loss``, ``privacy/epsilon``, ``eval/<task>/<metric>``; single values
(a stage's result, a flow's summary) are logged once with ``.`` for ``/`` (``ingest.kept``,
``eval.linprobe.top1``, :func:`log_summary`). MLflow's run page makes a section of charts of
each prefix before the last ``/`` (in alphabetical order) and puts names without a ``/`` last, in "Model
metrics"; a metric logged at step 0 only is a bar, one with steps a line: so the per-step ``privacy/epsilon`` and
``train/loss`` lead and the single values follow. Params are the flattened :class:`~vip_core.config.VipConfig`
(``privacy.max_grad_norm``); params are immutable, so everything that changes during a run (ε included) is a metric.

MLflow 3's UI shows an experiment as GenAI (traces) or model training (runs, charts) by the URL's
``workflowType`` (else the browser's last choice, GenAI at first); the links made here carry
``workflowType=machine_learning``, and the experiment is tagged ``mlflow.experimentKind`` for versions that
read the tag.

The tracking URI comes from ``MLFLOW_TRACKING_URI`` (by default the sqlite store in ``$VIP_HOME/mlflow``,
set by :func:`tasks.runtime.environment.configure_environment`); a team points it at its MLflow server instead.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import threading
import time
import importlib.metadata
from numbers import Real
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from mlflow import MlflowClient, get_tracking_uri
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from vip_core.config import VipConfig, flatten
from tasks.runtime.environment import state_paths
from tasks.runtime.stopping import OPENED_RUNS_ENV

EXPERIMENT = "vip"
ENCODER_MODEL_NAME = "vip-encoder"
FLOW_RUN_TAG = "prefect.flow_run_id"
PARENT_TAG = "mlflow.parentRunId"
STAGE_TAG = "vip.stage"
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
# Steps a StepLogger may fall behind before a step waits for it (a bound on its queue, not a delay).
_PENDING_STEPS = 100_000
# The UI shows a model-training experiment (runs, metric charts) rather than a GenAI one (traces).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
DEFAULT_UI_URL = "http://127.0.0.1:5000"
ML_VIEW = "workflowType=machine_learning"  # the URL query of MLflow 3's model-training view
LOCAL_SCHEMES = ("sqlite", "file", "postgresql", "mysql", "mssql")
# The published ledger's entries, as tags of a registered encoder's version.
LEDGER_TAGS = {"epsilon": "epsilon", "delta": "delta", "noise_multiplier": "sigma", "sample_rate": "q", "steps": "steps",
               "accountant": "accountant"}


def client() -> MlflowClient:
    """A client on the current tracking URI (``MLFLOW_TRACKING_URI``); the registry uses the same store."""
    return MlflowClient()


def experiment_id(name: str = EXPERIMENT) -> str:
    """The id of experiment ``name``, created on first use, tagged as a model-training experiment.

    With a database store and no server in between, artifacts go to ``$VIP_HOME/mlflow/artifacts`` (the
    folder ``make ui`` serves); through a tracking server the server chooses.
    """
    mlflow_client = client()
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        for key, value in EXPERIMENT_TAGS.items():  # an experiment made before the tag
            if experiment.tags.get(key) != value:
                mlflow_client.set_experiment_tag(experiment.experiment_id, key, value)
        return experiment.experiment_id
    location = None
    if _tracking_scheme() in LOCAL_SCHEMES:
        location = state_paths()["mlflow_artifacts"].as_uri()
    try:
        return mlflow_client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_TAGS)
    except MlflowException:
        # Another process created it in between.
        return mlflow_client.get_experiment_by_name(name).experiment_id


def start_run(
    name: str,
    *,
    config: VipConfig | None = None,
    parent_run_id: str | None = None,
    tags: Mapping[str, str] | None = None,
    experiment: str = EXPERIMENT,
) -> str:
    """Creates a run and returns its id; the caller closes it with :func:`end_run`.

    Args:
        name: the run name shown in the UI.
        config: logged as flattened params and as the artifact ``config.json``.
        parent_run_id: makes this a child run of that run.
        tags: extra tags (the Prefect flow-run id, the stage name).
        experiment: the experiment's name.
    """
    all_tags = dict(tags or {})
    if parent_run_id:
        all_tags[PARENT_TAG] = parent_run_id
    run = client().create_run(experiment_id(experiment), run_name=name, tags=all_tags)
    _note_opened(run.info.run_id)
    if config is not None:
        log_config(run.info.run_id, config)
    return run.info.run_id


def _note_opened(run_id: str) -> None:
    """Appends ``run_id`` to the file named by ``VIP_OPENED_RUNS`` (set for the processes of a command run by
    :func:`~tasks.runtime.stopping.run_supervised`), which ends the runs a stopped command left open."""
    notes = os.environ.get(OPENED_RUNS_ENV)
    if notes:
        # on another node of a cluster the supervisor's folder is absent: that run is simply not noted
        with contextlib.suppress(OSError), open(notes, "a", encoding="utf-8") as file:
            file.write(f"{run_id}\n")


def end_run(run_id: str, status: str = "FINISHED") -> None:
    """Marks the run FINISHED, FAILED or KILLED."""
    client().set_terminated(run_id, status=status)


@contextlib.contextmanager
def run(
    name: str,
    *,
    config: VipConfig | None = None,
    parent_run_id: str | None = None,
    tags: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """A run open for the ``with`` block: FINISHED after it, FAILED (and the error re-raised) on an error."""
    with _ended_after(start_run(name, config=config, parent_run_id=parent_run_id, tags=tags)) as run_id:
        yield run_id


@contextlib.contextmanager
def stage_run(parent_run_id: str | None, stage: str, config: VipConfig, name: str | None = None) -> Iterator[str]:
    """The child run of one stage under ``parent_run_id``, open for the ``with`` block.

    A retried stage continues the run its failed attempt left (so ε and the loss form one history) instead
    of starting a new one; the run ends FINISHED, or FAILED when the block raises.

    Args:
        parent_run_id: the flow run's MLflow run; None makes a top-level run.
        stage: the stage's name, the tag ``vip.stage`` (``pretrain-dp``, ``eval/linprobe``).
        config: logged as params on a new run.
        name: the run name; default ``stage``.
    """
    run_id = _unfinished_stage_run(parent_run_id, stage)
    if run_id is None:
        run_id = start_run(name or stage, config=config, parent_run_id=parent_run_id, tags={STAGE_TAG: stage})
    else:
        client().update_run(run_id, status="RUNNING")
    with _ended_after(run_id):
        yield run_id


@contextlib.contextmanager
def optional_stage_run(parent_run_id: str | None, stage: str, config: VipConfig,
                       name: str | None = None) -> Iterator[str | None]:
    """:func:`stage_run` under ``parent_run_id``, or None without a parent (the stage then opens its own run)."""
    if parent_run_id is None:
        yield None
        return
    with stage_run(parent_run_id, stage, config, name=name) as run_id:
        yield run_id


@contextlib.contextmanager
def _ended_after(run_id: str) -> Iterator[str]:
    """Yields ``run_id``, then ends the run FINISHED, or FAILED (re-raising) when the block raises."""
    try:
        yield run_id
    except BaseException:
        end_run(run_id, "FAILED")
        raise
    end_run(run_id, "FINISHED")


def _unfinished_stage_run(parent_run_id: str | None, stage: str) -> str | None:
    if parent_run_id is None:
        return None
    for child in child_runs(parent_run_id):
        if child.data.tags.get(STAGE_TAG) == stage and child.info.status != "FINISHED":
            return child.info.run_id
    return None


def log_config(run_id: str, config: VipConfig) -> None:
    """The flattened config as params (batches of 100, MLflow's limit) and ``config.json`` as an artifact."""
    params = [Param(key, value) for key, value in flatten(config).items()]
    mlflow_client = client()
    for start in range(0, len(params), PARAMS_PER_BATCH):
        mlflow_client.log_batch(run_id, params=params[start:start + PARAMS_PER_BATCH])
    mlflow_client.log_dict(run_id, config.model_dump(mode="json"), "config.json")


def log_metrics(run_id: str, metrics: Mapping[str, float], step: int = 0, timestamp_ms: int | None = None) -> None:
    """Logs finite numeric metrics at ``step`` in one batch (stamped now unless ``timestamp_ms`` is given)."""
    timestamp = _now_ms() if timestamp_ms is None else timestamp_ms
    entries = [
        Metric(key, float(value), timestamp, step)
        for key, value in metrics.items()
        if _is_number(value) and math.isfinite(float(value))
    ]
    if entries:
        client().log_batch(run_id, metrics=entries)


class StepLogger:
    """Logs each step's metrics into an MLflow run from a thread of its own, so that the step waits neither for the
    tracking server nor for a metric that is slow to compute (an accountant's ε: up to seconds a step early in a
    run with a small sampling rate). Every step is logged, with the values and the time it would have had; a
    logging failure is raised by the next :meth:`log` or by :meth:`close`.

    Args:
        run_id: the MLflow run.
        names: the metric name each logged key takes (other keys are not logged).
    """

    def __init__(self, run_id: str, names: Mapping[str, str]) -> None:
        self.run_id, self.names = run_id, dict(names)
        self.pending: queue.Queue = queue.Queue(maxsize=_PENDING_STEPS)
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._drain, name="vip-step-metrics", daemon=True)
        self.thread.start()

    def log(self, step: int, metrics: Mapping[str, Any], computed: Mapping[str, Callable[[], Any]] = {}) -> None:
        """Logs ``metrics`` and, once computed on the logging thread, ``computed``'s values at ``step``."""
        self._raise_failure()
        self.pending.put((step, dict(metrics), dict(computed), _now_ms()))

    def flush(self) -> None:
        """Returns once every step given so far is logged."""
        self.pending.join()
        self._raise_failure()

    def close(self) -> None:
        """Returns once every step given is logged, and stops the thread."""
        self.pending.put(None)
        self.thread.join()
        self._raise_failure()

    def _drain(self) -> None:
        while (item := self.pending.get()) is not None:
            try:
                if self.failure is None:  # after a failure it only takes items, so that no caller waits on it
                    self._log(*item)
            finally:
                self.pending.task_done()
        self.pending.task_done()

    def _log(self, step: int, metrics: dict[str, Any], computed: dict[str, Callable[[], Any]], timestamp: int) -> None:
        try:
            values = {**metrics, **{key: compute() for key, compute in computed.items()}}
            log_metrics(self.run_id, {self.names[k]: v for k, v in values.items() if k in self.names}, step,
                        timestamp)
        except BaseException as error:  # raised on the training thread, where it stops the run
            self.failure = error

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"logging the step metrics to MLflow run {self.run_id} failed: "
                               f"{self.failure}") from self.failure


def numeric_leaves(result: Mapping[str, Any], namespace: str) -> dict[str, float]:
    """The numbers inside a (nested) result dict, keyed ``namespace/a/b``; booleans and strings are left out."""
    flat: dict[str, float] = {}
    for key, value in result.items():
        name = f"{namespace}/{key}"
        if isinstance(value, Mapping):
            flat.update(numeric_leaves(value, name))
        elif _is_number(value):
            flat[name] = float(value)
    return flat


def copy_history(source_run_id: str, run_id: str, key: str) -> None:
    """Logs the whole history of metric ``key`` of run ``source_run_id`` into run ``run_id`` (a flow's run then
    charts the private stage's ε over its steps); logging it again changes nothing."""
    history = client().get_metric_history(source_run_id, key)
    for start in range(0, len(history), METRICS_PER_BATCH):
        client().log_batch(run_id, metrics=history[start:start + METRICS_PER_BATCH])


def log_summary(run_id: str, metrics: Mapping[str, float]) -> None:
    """Single values (a stage's result, a flow's summary) at step 0, ``/`` written ``.`` (``eval.linprobe.top1``):
    MLflow charts them after the per-step series (see the module's note)."""
    log_metrics(run_id, {name.replace("/", "."): value for name, value in metrics.items()})


def log_result(run_id: str, namespace: str, result: Mapping[str, Any]) -> None:
    """A stage's result: its numbers as :func:`log_summary` ``<namespace>.<key>``, the whole dict as
    ``<namespace>.json``."""
    log_summary(run_id, numeric_leaves(result, namespace))
    client().log_dict(run_id, json.loads(json.dumps(result, default=str)), f"{namespace.replace('/', '-')}.json")


def log_artifact(run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
    """A file, or a folder's files, into the run's artifacts."""
    path = Path(path)
    if path.is_dir():
        client().log_artifacts(run_id, str(path), artifact_path)
    else:
        client().log_artifact(run_id, str(path), artifact_path)


def set_tags(run_id: str, tags: Mapping[str, str]) -> None:
    client().log_batch(run_id, tags=[RunTag(key, str(value)) for key, value in tags.items()])


def register_encoder(run_id: str, checkpoint: str | Path, name: str = ENCODER_MODEL_NAME) -> str:
    """Logs the checkpoint's encoder as an MLflow PyTorch model of the run (a logged model, whose signature the
    registry's page shows) and registers it as a version of ``name``.

    ``mlflow.pytorch.load_model("models:/<name>/<version>")`` loads it with torch alone (no vip, no timm): the
    encoder exported by ``torch.export`` (MLflow's ``pt2`` format), a module that turns ImageNet-normalised
    images ``[N, 3, S, S]`` into the pooled class-token features ``[N, D]`` (the signature; any N). Only released values go with it: the
    MLmodel metadata holds the checkpoint's allow-listed entries besides the weights (config, step, ledger:
    ``PUBLISHED_ENTRIES``), and the version's tags are the ledger's ε, δ, σ, q, steps and accountant.

    Returns:
        The new version number.
    """
    import mlflow
    import mlflow.pytorch

    from vip_core.models.checkpoint import checkpoint_file, load_checkpoint, load_encoder

    file = checkpoint_file(checkpoint)
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint: no such file {file}")
    published = published_entries(load_checkpoint(file))
    encoder = load_encoder(file).eval()
    images = _example_images(encoder)
    logged = mlflow.initialize_logged_model(name="encoder", source_run_id=run_id,
                                            experiment_id=client().get_run(run_id).info.experiment_id)
    mlflow.pytorch.log_model(encoder, name="encoder", model_id=logged.model_id, serialization_format="pt2",
                             input_example=images, signature=_encoder_signature(encoder, images), metadata=published,
                             pip_requirements=_requirements("torch"))
    with contextlib.suppress(MlflowException):
        client().create_registered_model(
            name, description="ViP encoders: MAE ViT encoders pre-trained with DP-AdamW (mlflow.pytorch models).")
    version = client().create_model_version(
        name, source=f"models:/{logged.model_id}", run_id=run_id, model_id=logged.model_id,
        tags=ledger_tags(published.get("ledger")), description=f"the encoder of {file} (run {run_id})",
    )
    return str(version.version)


def published_entries(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's released entries other than the weights (``PUBLISHED_ENTRIES``: config, step, ledger);
    anything else a checkpoint holds (a training checkpoint's optimiser, loss or streams) is left out."""
    from vip_core.models.checkpoint import PUBLISHED_ENTRIES, WEIGHT_ENTRIES

    return {key: payload[key] for key in PUBLISHED_ENTRIES if key not in WEIGHT_ENTRIES and key in payload}


def ledger_tags(ledger: Mapping[str, Any] | None) -> dict[str, str]:
    """``privacy.epsilon``, ``privacy.delta``, ``privacy.sigma``, ``privacy.q``, ``privacy.steps``,
    ``privacy.accountant`` of a published ledger; none without one (a model trained without privacy)."""
    if ledger is None:
        return {}
    return {f"privacy.{tag}": str(ledger[key]) for key, tag in LEDGER_TAGS.items()}


def _example_images(encoder: Any) -> Any:
    """Two blank images ``[2, 3, S, S]`` float32 (two: the exported batch size stays free)."""
    import numpy as np

    return np.zeros((2, 3, *encoder.patch_embed.img_size), dtype=np.float32)


def _encoder_signature(encoder: Any, images: Any) -> Any:
    """Images ``[-1, 3, S, S]`` float32 to features ``[-1, D]`` float32."""
    import torch
    from mlflow.models import infer_signature

    with torch.no_grad():
        return infer_signature(images, encoder(torch.from_numpy(images)).numpy())


def _requirements(*packages: str) -> list[str]:
    """``package==version`` of the installed packages (a local build's ``+cu130`` left out)."""
    return [f"{package}=={importlib.metadata.version(package).split('+')[0]}" for package in packages]


def ui_base_url() -> str:
    """Where the MLflow UI is: the tracking server when there is one, else ``make ui``'s 127.0.0.1:5000."""
    uri = get_tracking_uri()
    return uri.rstrip("/") if uri.startswith(("http://", "https://")) else DEFAULT_UI_URL


def run_ui_url(run_id: str, base_url: str | None = None, tab: str = "") -> str:
    """The run's page in the MLflow UI, in its model-training view; ``tab="model-metrics"``: the charts."""
    info = client().get_run(run_id).info
    path = f"/#/experiments/{info.experiment_id}/runs/{run_id}" + (f"/{tab}" if tab else "")
    return f"{base_url or ui_base_url()}{path}?{ML_VIEW}"


def model_ui_url(name: str = ENCODER_MODEL_NAME, version: str | None = None, base_url: str | None = None) -> str:
    """The registered model's page (or one version's) in the MLflow UI, in its model-training view."""
    path = f"/#/models/{name}" + (f"/versions/{version}" if version else "")
    return f"{base_url or ui_base_url()}{path}?{ML_VIEW}"


def experiment_ui_url(base_url: str | None = None) -> str:
    """The experiment's runs in the MLflow UI, in its model-training view (created on first use)."""
    return f"{base_url or ui_base_url()}/#/experiments/{experiment_id()}?{ML_VIEW}"


def child_runs(parent_run_id: str) -> list:
    """The runs whose ``mlflow.parentRunId`` is ``parent_run_id``, oldest first."""
    parent = client().get_run(parent_run_id)
    return client().search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
        order_by=["attributes.start_time ASC"],
    )


def end_open_runs(run_ids: Iterable[str], status: str) -> int:
    """Ends with ``status`` (KILLED, FAILED) those of ``run_ids`` still RUNNING: the runs of a command that was stopped
    or died, whose processes could not end them; returns how many."""
    ended = 0
    for run_id in dict.fromkeys(run_ids):
        if client().get_run(run_id).info.status == "RUNNING":
            end_run(run_id, status)
            ended += 1
    return ended


def _tracking_scheme() -> str:
    return get_tracking_uri().split(":", 1)[0].split("+", 1)[0]


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _now_ms() -> int:
    return int(time.time() * 1000)
