#!/usr/bin/env bash
# The redesign step's benchmarks, one after the other (nothing else should run): each one's last JSON line appended
# to benchmarks/results/plan_cpu.jsonl with the commit, the date and WHEN ("before" or "after").
# Usage: bash scripts/bench_redesign.sh WHEN [BENCHMARK ...] (default: all four, e.g. "streaming.py --quick")
set -euo pipefail
when="${1:?before or after}"
cd "$(dirname "$0")/.."
out=benchmarks/results/plan_cpu.jsonl
code=$(git rev-parse --short HEAD)
benches=("${@:2}")
[ ${#benches[@]} -gt 0 ] || benches=("e2e.py --quick" "packing.py --quick" "streaming.py --quick" "agents.py --quick")
for bench in "${benches[@]}"; do
  name=${bench%% *}
  start=$(date +%s)
  .venv/bin/python benchmarks/$bench > "/tmp/bench_${name%.py}_$when.log" 2>&1
  line=$(grep '^{' "/tmp/bench_${name%.py}_$when.log" | tail -1)
  .venv/bin/python - "$line" "$code" "$when" "$(( $(date +%s) - start ))" >> "$out" <<'PY'
import json, sys, datetime
record = json.loads(sys.argv[1])
record.update(code=sys.argv[2], date=str(datetime.date.today()), machine="2-core CPU, nothing else running",
              when=sys.argv[3], wall_s=int(sys.argv[4]))
print(json.dumps(record))
PY
done
