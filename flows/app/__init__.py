"""The application: what ``make run``, ``make <stage>``, ``make ui`` and ``make serve`` start.

It is the only code that may import both the flows and the runtime of ``tasks``: the make driver
(``run``), the Prefect and MLflow servers (``servers``) and the deployments (``serve``).
"""
