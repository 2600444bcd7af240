"""Where a stage's independent pieces of work run: in this process, or as Ray tasks across the cluster.

A stage written against :class:`Runner` submits plain module-level functions and passes what they return
(handles) to the next functions; the same code runs in one process (:class:`LocalRunner`: a handle is the
value itself) or on Ray (:class:`RayRunner`: a handle is an ``ObjectRef``; a handle passed as a positional
argument reaches the function as its value, on whichever node it runs, through Ray's object store).
:func:`task_runner` picks one by name: ``"multiprocessing"`` (this machine) or ``"ray"`` (joins
``RAY_ADDRESS``, else starts a local Ray, as pre-training does).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

from vip_core.config import DISTRIBUTORS

LOCAL, RAY = DISTRIBUTORS
TASK_RETRIES = 3  # a task lost with its node (or its worker process) runs again elsewhere


class LocalRunner:
    """Runs each function at once, in this process; a handle is the value."""

    def submit(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)``: a handle to its result."""
        return function(*args, **kwargs)

    def submit_split(self, function: Callable, *args: Any, count: int, **kwargs: Any) -> list[Any]:
        """``function(*args, **kwargs)``, which returns a sequence of ``count`` items: a handle to each."""
        return list(function(*args, **kwargs))

    def share(self, value: Any) -> Any:
        """A handle to ``value`` that many submissions can take (stored once on Ray)."""
        return value

    def environment(self) -> dict[str, str]:
        """The variables a child process needs to submit work to the same place (``RAY_ADDRESS`` on Ray)."""
        return {}

    def get(self, handles: Sequence[Any]) -> list[Any]:
        """The values of ``handles``, waiting for them."""
        return list(handles)

    def wait(self, handles: Sequence[Any]) -> None:
        """Waits until ``handles`` are computed, without fetching them here."""
        return None


class RayRunner:
    """Runs each function as a Ray task of ``cpus`` CPUs, retried :data:`TASK_RETRIES` times if its worker or
    node dies (Ray must be initialised)."""

    def __init__(self, cpus: float) -> None:
        import ray

        self._ray = ray
        self.cpus = cpus
        self._remote = ray.remote(max_retries=TASK_RETRIES)(_call)
        self._remote_listed = ray.remote(max_retries=TASK_RETRIES)(_call_listed)

    def submit(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        return self._remote.options(num_cpus=self.cpus).remote(function, kwargs, *args)

    def submit_split(self, function: Callable, *args: Any, count: int, **kwargs: Any) -> list[Any]:
        remote = self._remote_listed.options(num_cpus=self.cpus, num_returns=count)
        handles = remote.remote(function, kwargs, *args)
        return [handles] if count == 1 else list(handles)

    def share(self, value: Any) -> Any:
        return self._ray.put(value)

    def environment(self) -> dict[str, str]:
        return {"RAY_ADDRESS": self._ray.get_runtime_context().gcs_address}

    def get(self, handles: Sequence[Any]) -> list[Any]:
        return self._ray.get(list(handles))

    def wait(self, handles: Sequence[Any]) -> None:
        self._ray.wait(list(handles), num_returns=len(handles), fetch_local=False)


def _call(function: Callable, kwargs: dict[str, Any], *args: Any) -> Any:
    return function(*args, **kwargs)


def _call_listed(function: Callable, kwargs: dict[str, Any], *args: Any) -> Any:
    """A sequence-returning function's result as Ray's ``num_returns`` wants it: the one item when one."""
    items = list(function(*args, **kwargs))
    return items[0] if len(items) == 1 else items


Runner = LocalRunner | RayRunner  # both also meet vip_core.data.global_dedup.Runner, what the deduplication needs


@contextlib.contextmanager
def task_runner(distributor: str, cpus_per_task: float = 1.0) -> Iterator[Runner]:
    """A runner by name: :data:`LOCAL` runs here; :data:`RAY` joins ``RAY_ADDRESS`` or starts a local Ray for the
    block (:func:`~tasks.runtime.ray_session.ray_session`)."""
    if distributor == LOCAL:
        yield LocalRunner()
        return
    if distributor != RAY:
        raise ValueError(f"distributor must be one of {', '.join(DISTRIBUTORS)}, got {distributor!r}")
    from tasks.runtime.ray_session import ray_session

    with ray_session(num_workers=1, cpus_per_worker=cpus_per_task):
        yield RayRunner(cpus_per_task)
