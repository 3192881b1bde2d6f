"""bench/results.md, the page: the main bench's tables (bench/report.py) and each side bench's
section, drawn from the JSON files the benches wrote. No bench imports this module: each
measures and writes its JSON, and every `make bench*` target runs `python -m bench.page` after it.

    python -m bench.page          # redraw bench/results.md from bench/*.json
"""

from __future__ import annotations

import json

from bench.workloads import ROOT

GPU = "## On a GPU (bench/gpu)"
"""The GPU proof's section, kept as it stands (bench/gpu/report.py writes it)."""


def side_sections() -> list[str]:
    """The side benches' sections, in page order, for those that have written their JSON."""
    from bench import agent, demo_update, endpoint, hf_engine, intervals, intervals_record, long, overlap, ray, record

    out: list[str] = []
    if hf_engine.OUT.exists():  # `make bench-hf`
        out += hf_engine.section(json.loads(hf_engine.OUT.read_text()))
    if record.OUT.exists():  # `make bench-record` (also the last step of `make bench`)
        out += record.section(json.loads(record.OUT.read_text()))
    if demo_update.OUT.exists():  # `make bench-demo-update` (also a step of `make bench`)
        out += demo_update.section(json.loads(demo_update.OUT.read_text()))
    if (ROOT / "overlap.json").exists():  # `make bench-overlap`
        out += overlap.section(json.loads((ROOT / "overlap.json").read_text()))
    if by_workload := ray.results():  # `make bench-ray`
        out += ray.section(by_workload)
    if (ROOT / "agent.json").exists():  # `make bench-agent`
        out += agent.section(json.loads((ROOT / "agent.json").read_text()))
    if endpoint.OUT.exists():  # `make bench-endpoint`
        out += endpoint.section(json.loads(endpoint.OUT.read_text()))
    if (ROOT / "long.json").exists():  # `make bench-long`
        out += long.section(json.loads((ROOT / "long.json").read_text()))
    if (ROOT / intervals.OUT_NAME).exists():  # `python -m bench.intervals`
        res = json.loads((ROOT / intervals.OUT_NAME).read_text())
        out += (intervals.section(res) if "cases" in res else []) + intervals_record.section(res.get("record", []), res.get("seconds_record", 0.0))
    return out


def write() -> None:
    """bench/results.md redrawn from bench/results.json and the side benches' files."""
    from bench import report

    page = ROOT / "results.md"
    if (ROOT / "results.json").exists():
        old = page.read_text() if page.exists() else ""
        gpu = old[old.index(GPU):] if GPU in old else ""  # written by `python -m bench.gpu report`, from no JSON here
        page.write_text(report.render(json.loads((ROOT / "results.json").read_text()), side_sections())
                        + ("\n" + gpu if gpu else ""))


if __name__ == "__main__":
    write()
