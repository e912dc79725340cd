"""The outcome of a run: every level's records and summary, and the JSON document `--json` writes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ember.bench.config import BenchConfig, Level
from ember.bench.limits import Bounds
from ember.bench.records import RequestRecord
from ember.bench.stats import LevelSummary
from ember.bench.workload import Calibration

JSON_FORMAT_VERSION = 1


@dataclass(slots=True)
class LevelResult:
    index: int
    level: Level
    started_at: float  # Unix time; the records' times count from here
    records: list[RequestRecord]
    stopped_by: str | None  # None, "max_seconds" or "interrupt"
    summary: LevelSummary


@dataclass(slots=True)
class BenchResult:
    config: BenchConfig
    target: str
    model: str
    calibration: Calibration
    levels: list[LevelResult]
    bounds: Bounds | None = None  # the machine's limits for this model (offline runs on the CPU)

    @property
    def interrupted(self) -> bool:
        return any(level.stopped_by == "interrupt" for level in self.levels)

    def to_json(self) -> dict:
        config = asdict(self.config)
        config["api_key"] = "(set)" if self.config.api_key else None  # never written out
        return {
            "ember_bench": JSON_FORMAT_VERSION,
            "target": self.target,
            "model": self.model,
            "config": config,
            "calibration": asdict(self.calibration),
            "bounds": self.bounds.to_json() if self.bounds is not None else None,
            "levels": [{
                "label": level.level.label,
                "concurrency": level.level.concurrency,
                "request_rate": level.level.request_rate,
                "started_at": level.started_at,
                "stopped_by": level.stopped_by,
                "summary": level.summary.to_json(),
                "requests": [record.to_json() for record in level.records],
            } for level in self.levels],
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
