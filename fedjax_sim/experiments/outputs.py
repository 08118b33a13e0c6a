"""What run and compare write besides config.json.

A run streams its history to metrics.csv (and TensorBoard) as rows arrive;
a finished comparison writes results.csv/.md, notes.json, per_seed.csv,
per_seed_metrics.csv, metrics.csv (seed means), comparison.png (and
comparison_time.png against the virtual clock, when the rows carry it), the
experiment's own plots and, on request, TensorBoard bands.
"""

from __future__ import annotations

from pathlib import Path

from fedjax_sim import compare, plots, stats
from fedjax_sim.experiments import study, tuned
from fedjax_sim.experiments.base import Comparison, Preset
from fedjax_sim.io import write_csv, write_json
from fedjax_sim.logs import MetricsCSV, TensorBoardLog, write_bands

#: The history column of the virtual clock (`experiments.clock`): a comparison whose
#: rows carry it is also drawn against it (comparison_time.png).
TIME = "virtual_time"


def _rows_writer(out_dir: Path, tensorboard: bool):
    """on_rows for a run: metrics.csv (streamed, fsynced) and optional TensorBoard events."""
    path = out_dir / "metrics.csv"
    state = {"csv": None, "tb": TensorBoardLog(out_dir / "tensorboard") if tensorboard else None}

    def on_rows(rows):
        if not rows:
            return
        if state["csv"] is None:  # the history so far: a fresh run's round 0, or a resume's
            write_csv(path, rows)
            state["csv"] = MetricsCSV(path, resume_round=int(rows[-1]["round"]))
        else:
            state["csv"].append(rows)
        if state["tb"] is not None:
            for row in rows:
                copy = next((c for c in ("restart", "seed") if c in row), None)
                tag = f"/{copy}{row[copy]}" if copy else ""
                state["tb"].write(int(row["round"]), {
                    f"{k}{tag}": v for k, v in row.items() if k not in ("round", copy)})

    def close():
        if state["tb"] is not None:
            state["tb"].close()

    return on_rows, close


def _after_first_rows(on_rows, write_config):
    """on_rows that calls write_config once, before the first rows are written."""
    pending = [write_config]

    def wrapped(rows):
        if pending:
            pending.pop()()
        on_rows(rows)

    return wrapped


def _write_comparison(preset: Preset, settings: dict, problem, results: dict, out_dir: Path,
                      tensorboard: bool) -> None:
    experiment = preset.experiment
    metrics = study.table(experiment, settings)
    seeds = settings["seeds"]
    rows = compare.results_table(results, experiment.baseline, metrics)
    table = stats.results_markdown(rows, metrics, experiment.baseline, seeds=seeds,
                                   title=f"{preset.name}: final metrics")
    chosen = tuned.chosen_means(results, settings)  # a tuned comparison's chosen values
    rows = [{**row, **chosen[row["method"]]} for row in rows]
    write_csv(out_dir / "results.csv", rows,
              compare.results_columns(metrics) + tuned.chosen_columns(settings))
    per_seed_finals = compare.table_per_seed(results, metrics)
    notes = study.comparison_notes(experiment, settings, problem, results)
    if notes:  # the experiment's caption: protocol choices, deviations, extra counts
        table = table.rstrip("\n") + "\n\n" + "\n".join(
            f"- {key}: {value}" for key, value in notes.items()) + "\n"
        write_json(out_dir / "notes.json", notes)
    (out_dir / "results.md").write_text(table)
    print(table)
    per_seed = [{"method": n, "seed": i, "diverged": r.diverged[i] is not None,
                 **{k: float(v[i]) for k, v in r.per_seed.items()}}
                for n, r in results.items() for i in range(seeds)]
    write_csv(out_dir / "per_seed.csv", per_seed)
    long_rows = [row for r in results.values() for row in r.long_rows()]
    write_csv(out_dir / "per_seed_metrics.csv", long_rows)
    histories = {n: r.seed_mean_rows() for n, r in results.items()}
    write_csv(out_dir / "metrics.csv", [{"method": n, **row} for n, rows_ in histories.items()
                                        for row in rows_])
    comparison = Comparison(per_seed_finals, histories, metrics, experiment.baseline, notes,
                            results)
    # The experiment's methods first (their colours the same in every run), then any other
    # the methods setting named from its table.
    methods = list(dict.fromkeys([*experiment.methods, *results]))
    # Curves and bands over the seeds that did not diverge, as the means of metrics.csv.
    kept = [row for row in long_rows if results[row["method"]].diverged[row["seed"]] is None]
    plots.plot_comparison(kept, out_dir / "comparison.png", list(experiment.panels),
                          title=f"{preset.name}: {seeds} seeds", methods=methods,
                          colors=plots.method_colors(methods), labels=experiment.labels,
                          log_y=experiment.log_metrics)
    if any(TIME in row for row in kept):  # the same curves against the virtual clock
        plots.plot_comparison(kept, out_dir / "comparison_time.png",
                              [p for p in experiment.panels if p[0] != TIME],
                              title=f"{preset.name}: {seeds} seeds", methods=methods,
                              colors=plots.method_colors(methods), labels=experiment.labels,
                              log_y=experiment.log_metrics, x=TIME, by="round",
                              xlabel="virtual time (s), seed mean at each evaluation")
    if experiment.plot_compare is not None:
        experiment.plot_compare(comparison, out_dir)
    if tensorboard:  # one run folder per method: the seed mean and its band per metric
        write_bands(out_dir / "tensorboard", plots.seed_bands(
            kept, [m for m, _ in experiment.panels] + [
                m for m in metrics if m not in dict(experiment.panels)]))
