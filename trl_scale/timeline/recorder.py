"""One process's timeline as Chrome trace events (the JSON format chrome://tracing and Perfetto read).

A group is a trace process (the trainer, each rollout server), a lane a thread in it. Spans that nest or follow
each other on one lane are "complete" events; a server's requests overlap one another, so each is an async event
pair of its own id, which the viewers lay out on as many rows as are in flight at once; a figure measured at a moment
(a server's mismatch) is a counter event, drawn as a track of its values. Times are
`time.perf_counter()` seconds, written as microseconds since the timeline began. Appending an event is all the
recording costs; the JSON is built when written."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time

# the counter the mismatch gate records per server and step (`values`: kl, step, the weights' sync count)
MISMATCH_COUNTER = "mismatch"


class Timeline:
    def __init__(self):
        self.began = time.perf_counter()
        self._lock = threading.Lock()
        self._groups: dict[str, int] = {}
        self._lanes: dict[tuple[str, str], int] = {}
        self._events: list[tuple] = []  # (kind, group, lane, name, start, end, args)
        self._ids = itertools.count(1)

    def span(self, group: str, lane: str, name: str, start: float, end: float, **args) -> None:
        """`name` on `lane` of `group` from `start` to `end`, not overlapping another span of that lane."""
        self._events.append(("X", group, lane, name, start, end, args))

    def overlapping(self, group: str, name: str, start: float, end: float, **args) -> None:
        """`name` in `group` from `start` to `end`, alongside others of the group (a server's requests)."""
        self._events.append(("async", group, "", name, start, end, args))

    def counter(self, group: str, name: str, at: float, **values: float) -> None:
        """`name`'s values in `group` at time `at` (a counter track: a server's mismatch figures at each step)."""
        self._events.append(("C", group, "", name, at, at, values))

    def counters(self, group: str | None = None) -> list[tuple[str, str, float, dict]]:
        """The counter values recorded so far as (group, name, time, values), time in seconds since `began`."""
        return [
            (g, name, start - self.began, args)
            for kind, g, _, name, start, _, args in list(self._events)
            if kind == "C" and (group is None or g == group)
        ]

    def spans(self, group: str | None = None) -> list[tuple[str, str, str, float, float, dict]]:
        """The events recorded so far as (group, lane, name, start, end, args), in seconds since `began`."""
        return [
            (g, lane, name, start - self.began, end - self.began, args)
            for kind, g, lane, name, start, end, args in list(self._events)
            if kind != "C" and (group is None or g == group)
        ]

    def trace(self) -> dict:
        """The trace-event JSON object: metadata naming each group and lane, then the events."""
        body = []
        for kind, group, lane, name, start, end, args in list(self._events):
            pid, ts = self._pid(group), round((start - self.began) * 1e6, 1)
            if kind == "C":
                body.append({"ph": "C", "name": name, "pid": pid, "ts": ts, "args": args})
            elif kind == "async":
                event_id = next(self._ids)
                common = {"cat": name, "name": name, "id": event_id, "pid": pid, "tid": 0}
                body.append({**common, "ph": "b", "ts": ts, "args": args})
                body.append({**common, "ph": "e", "ts": round((end - self.began) * 1e6, 1)})
            else:
                dur = round(max(0.0, end - start) * 1e6, 1)
                tid = self.lane_id(group, lane)
                body.append({"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args})
        return {"traceEvents": self._metadata() + body, "displayTimeUnit": "ms"}

    def write(self, path: str) -> str:
        """Write the trace JSON to `path` (whole, then renamed: a reader never sees half a file)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        partial = f"{path}.partial"
        with open(partial, "w") as handle:
            json.dump(self.trace(), handle)
        os.replace(partial, path)
        return path

    @classmethod
    def read(cls, path: str) -> Timeline:
        """A timeline as `write` wrote it: its spans, overlapping events and lanes (in their order), times in seconds
        from its start (`began` is 0). For drawing a run's timeline again (the docs draw a stored one)."""
        with open(path) as handle:
            events = json.load(handle)["traceEvents"]
        timeline = cls()
        timeline.began = 0.0
        groups = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
        lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        for pid, tid in sorted(lanes, key=lambda key: key[1]):  # the lanes in the order they were named
            timeline.lane_id(groups[pid], lanes[(pid, tid)])
        begun = {}
        for event in events:
            if event["ph"] == "X":
                start = event["ts"] / 1e6
                lane = lanes[(event["pid"], event["tid"])]
                timeline.span(
                    groups[event["pid"]], lane, event["name"], start, start + event["dur"] / 1e6, **event["args"]
                )
            elif event["ph"] == "C":
                timeline.counter(groups[event["pid"]], event["name"], event["ts"] / 1e6, **event["args"])
            elif event["ph"] == "b":
                begun[event["id"]] = event
            elif event["ph"] == "e":
                first = begun.pop(event["id"])
                group = groups[first["pid"]]
                timeline.overlapping(
                    group, first["name"], first["ts"] / 1e6, event["ts"] / 1e6, **first.get("args", {})
                )
        return timeline

    def _pid(self, group: str) -> int:
        with self._lock:
            return self._groups.setdefault(group, len(self._groups) + 1)

    def lane_id(self, group: str, lane: str) -> int:
        """The trace thread id of `lane` in `group` (given in the order lanes are first named: the order drawn)."""
        with self._lock:
            return self._lanes.setdefault((group, lane), len(self._lanes) + 1)

    def _metadata(self) -> list[dict]:
        meta = []
        for group, pid in self._groups.items():
            meta.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": group}})
            meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        for (group, lane), tid in self._lanes.items():
            meta.append(
                {"ph": "M", "name": "thread_name", "pid": self._groups[group], "tid": tid, "args": {"name": lane}}
            )
            meta.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": self._groups[group],
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        return meta
