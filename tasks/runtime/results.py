"""The results of a pipeline run: one summary dict, its MLflow metrics, and the table printed at the end.

The table shows the privacy spent (ε of the target, δ, the number of DP steps) and, a row per pair of the
evaluation suite and metric, the ViP encoder's number beside the same job on a randomly initialised encoder (its
baseline, when the config runs it) and the paper's ViP-Base figure where the paper reports one.
"""

from __future__ import annotations

from typing import Any, Mapping

from tasks.runtime.tracking import numeric_leaves
from vip_core.config import VipConfig
from vip_core.eval.paper import paper_figure

# What a single run's numbers can say: no confidence interval, one seed, the preset's scale.
SCALE_NOTE = ("one run, no confidence intervals: at the {preset} preset's scale these numbers show that the stages run, "
              "not what pre-training gives (make reproduce measures that, with CIs and verdicts: docs/reproduce.md)")
AUDIT_KEYS = ("epsilon_lower_bound", "epsilon_claimed", "canaries", "correct_guesses", "guesses")
PRIVACY_KEYS = ("epsilon", "delta", "steps", "noise_multiplier", "sample_rate", "dataset_size")


def summarize(
    *,
    config: VipConfig,
    flow_run_id: str,
    mlflow_run_id: str,
    workdir: str,
    ingest: Mapping[str, Any],
    render: Mapping[str, Any],
    pretrain_syn: Mapping[str, Any],
    pretrain_dp: Mapping[str, Any],
    evaluations: Mapping[str, Mapping[str, Any]],
    registered_model: str,
    audit: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON-able summary of one pipeline run, the flow's return value."""
    privacy = {key: pretrain_dp[key] for key in PRIVACY_KEYS if key in pretrain_dp}
    privacy.update(target_epsilon=config.privacy.target_epsilon, accountant=config.privacy.accountant)
    privacy.setdefault("steps", 0)
    return {
        "preset": config.name,
        "flow_run_id": flow_run_id,
        "mlflow_run_id": mlflow_run_id,
        "workdir": workdir,
        "ingest": _numbers(ingest),
        "render": _numbers(render),
        "pretrain_syn": {"checkpoint": pretrain_syn.get("checkpoint"), **_numbers(pretrain_syn)},
        "privacy": privacy,
        "checkpoint": pretrain_dp["checkpoint"],
        "registered_model": registered_model,
        "evaluations": {task: {"result": dict(metrics["result"]), "baseline": dict(metrics.get("baseline") or {})}
                        for task, metrics in evaluations.items()},
        "audit": None if audit is None else {key: audit.get(key) for key in AUDIT_KEYS},
    }


def summary_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """The parent run's metrics: ``privacy/epsilon`` and the evaluation metrics."""
    metrics = {f"privacy/{key}": float(value) for key, value in summary["privacy"].items()
               if key in PRIVACY_KEYS and isinstance(value, (int, float))}
    return {**metrics, **evaluation_metrics(summary["evaluations"])}


def evaluation_metrics(evaluations: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """``eval/<task>/<metric>`` for the ViP encoder, ``eval/<task>/<metric>_random_init`` for its baseline."""
    metrics: dict[str, float] = {}
    for task, values in evaluations.items():
        metrics.update(numeric_leaves(values["result"], f"eval/{task}"))
        baseline = numeric_leaves(values.get("baseline") or {}, f"eval/{task}")
        metrics.update({f"{name}_random_init": value for name, value in baseline.items()})
    return metrics


def rows(evaluations: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str, float | None, float | None, float | None]]:
    """``(pair, metric, ViP, random init, paper's ViP-Base)`` for every numeric evaluation metric."""
    table = []
    for pair, values in evaluations.items():
        vip = numeric_leaves(values["result"], "")
        baseline = numeric_leaves(values.get("baseline") or {}, "")
        for name in dict.fromkeys([*vip, *baseline]):
            metric = name.lstrip("/")
            table.append((pair, metric, vip.get(name), baseline.get(name), paper_figure(pair, metric)))
    return table


def privacy_line(summary: Mapping[str, Any]) -> str:
    """``ε = 7.91 spent of 8 (δ = 1.0e-03, 10 DP steps, prv accountant)``."""
    privacy = summary["privacy"]
    epsilon = privacy.get("epsilon")
    spent = "not recorded" if epsilon is None else f"{epsilon:.3f}"
    details = [f"{privacy['steps']} DP steps", f"{privacy['accountant']} accountant"]
    if privacy.get("delta") is not None:
        details.insert(0, f"δ = {privacy['delta']:.1e}")
    if privacy.get("noise_multiplier") is not None:
        details.insert(1, f"σ = {privacy['noise_multiplier']:.3f}")
    return f"ε = {spent} spent of target {privacy['target_epsilon']:g} ({', '.join(details)})"


def audit_line(summary: Mapping[str, Any]) -> str | None:
    """``empirical ε ≥ 0.420 from 1000 canaries, ... (the recipe's accountant claims 7.997)``, or None without an
    audit; the claimed ε is printed as the privacy line prints the spent one."""
    audit = summary.get("audit")
    if not audit:
        return None
    claimed = audit.get("epsilon_claimed")
    claim = "" if claimed is None else f" (the recipe's accountant claims {claimed:.3f})"
    return (f"empirical ε ≥ {audit['epsilon_lower_bound']:.3f} from {audit['canaries']} canaries, "
            f"{audit['correct_guesses']}/{audit['guesses']} guesses right{claim}")


def text_table(summary: Mapping[str, Any]) -> str:
    """The table printed at the end of ``make run``."""
    lines = [f"ViP results, preset {summary['preset']}", f"  privacy: {privacy_line(summary)}"]
    if audit_line(summary):
        lines.append(f"  audit: {audit_line(summary)}")
    lines += ["", *evaluation_table(summary["evaluations"])]
    lines += ["", f"  {SCALE_NOTE.format(preset=summary['preset'])}"]
    lines += ["", f"  encoder: {summary['checkpoint']} (registered as {summary['registered_model']})"]
    return "\n".join(lines)


def evaluation_table(evaluations: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Each evaluation metric beside its random-init baseline, the difference and the paper's figure, as aligned
    text lines."""
    header = ("evaluation", "metric", "ViP", "random init", "difference", "paper ViP-Base")
    body = [(pair, metric, _fmt(vip), _fmt(base), _difference(vip, base), _fmt(paper))
            for pair, metric, vip, base, paper in rows(evaluations)]
    widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header))]
    return ["  " + "  ".join(str(cell).ljust(w) if i < 2 else str(cell).rjust(w)
                             for i, (cell, w) in enumerate(zip(row, widths)))
            for row in [header, tuple("-" * w for w in widths), *body]]


def one_line(result: Mapping[str, Any]) -> str:
    """A stage's result in one line: its top-level numbers, then its output folder or checkpoint."""
    numbers = [f"{key} {value:g}" for key, value in result.items() if _is_plain_number(value)]
    where = result.get("checkpoint") or result.get("output")
    return ", ".join(numbers) + (f"; {where}" if where else "")


def markdown_table(summary: Mapping[str, Any]) -> str:
    """The same table as Markdown, for the flow run's artifact in the Prefect UI."""
    lines = [f"# ViP results, preset {summary['preset']}", "", f"**Privacy:** {privacy_line(summary)}", "",
             *([f"**Audit:** {audit_line(summary)}", ""] if audit_line(summary) else []),
             "| evaluation | metric | ViP | random init | difference | paper ViP-Base |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {pair} | {metric} | {_fmt(vip)} | {_fmt(base)} | {_difference(vip, base)} | {_fmt(paper)} |"
              for pair, metric, vip, base, paper in rows(summary["evaluations"])]
    lines += ["", SCALE_NOTE.format(preset=summary["preset"]).capitalize() + "."]
    lines += ["", f"Encoder `{summary['checkpoint']}`, registered as `{summary['registered_model']}`.",
              "", "The (ε, δ) guarantee covers the private pre-training data only; evaluation data is public."]
    return "\n".join(lines)


def _numbers(result: Mapping[str, Any]) -> dict[str, float]:
    return {key.lstrip("/"): value for key, value in numeric_leaves(result, "").items()}


def _is_plain_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _difference(vip: float | None, baseline: float | None) -> str:
    return _fmt(None if vip is None or baseline is None else vip - baseline, signed=True)


def _fmt(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    if float(value).is_integer() and abs(value) >= 1:
        return f"{int(value):+d}" if signed else f"{int(value)}"
    return f"{value:+.4f}" if signed else f"{value:.4f}"
