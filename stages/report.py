"""One-line reports the stage commands print when they finish."""


def stage_done(run, k: int, stage: str, manifest: dict | None) -> None:
    from pipeline.report.tracking import flush

    flush()  # a stage's own command: its MLflow logging is over before it says it is done
    if manifest is None:
        print(f"{stage} iteration {k}: this shard's parts are written; the manifest follows when every shard is in")
        return
    secs = manifest.timings.get("seconds", 0.0)
    print(f"{stage} iteration {k}: done, {manifest.rows} rows, {secs:.1f}s -> {run.store.display(f'iter-{k:04d}/{stage}')}")


def _fmt(v, spec: str) -> str:
    return "-" if v is None or v != v else format(v, spec)


class IterationTable:
    """Prints one line per finished iteration (plain text: readable in CI logs too)."""

    HEAD = f"{'iter':>4}  {'reward':>7}  {'eval acc':>8}  {'KL':>8}  {'zero-std':>8}  {'seconds':>7}"

    def __init__(self, run):
        self.run = run
        self.start = None
        print(self.HEAD, flush=True)

    def _before(self, k: int) -> None:
        """The eval of the policy the first printed iteration starts from (iterate makes it)."""
        from pipeline.eval.run import eval_summary

        ev = eval_summary(self.run, k) or {}
        if ev:
            print(f"{'':>4}  {'':>7}  {_fmt(ev.get('eval/accuracy'), '8.3f')}  (policy {k}, before these iterations)", flush=True)

    def add(self, row: dict) -> None:
        if self.start is None:
            self.start = row["iteration"]
            self._before(self.start)
        print(
            f"{row['iteration']:>4}  {_fmt(row.get('reward/mean'), '7.3f')}  {_fmt(row.get('eval/accuracy'), '8.3f')}  "
            f"{_fmt(row.get('kl/mean'), '8.4f')}  {_fmt(row.get('frac_reward_zero_std'), '8.2f')}  {row['seconds']:7.1f}",
            flush=True,
        )

    def finish(self, target: int) -> None:
        print(f"run {self.run.store.display()} has {self.run.completed_iters()} of {target} iterations; policies in {self.run.store.display('policy')}")
