#!/usr/bin/env bash
# Stand-in base images for docker/compose.yaml where no public image registry is reachable (only Debian's mirror
# and PyPI): a Debian bookworm root file system from debootstrap, imported, and two images built on it under the
# names compose.yaml and worker.Dockerfile ask for, so both run unchanged:
#   python:3.11-slim  Debian's python3.11 + pip; pip reads only a wheel folder baked in (WHEELS, from `pip download`
#                     of ".[team]" with constraints.txt) and apt's sources are empty, so the Dockerfile's
#                     `apt-get install git libegl1` (already installed) and `pip install ".[team]"` work offline
#   postgres:16       a stand-in: Debian's PostgreSQL **15** behind an entrypoint that does what the official image's
#                     does for compose.yaml (POSTGRES_USER/PASSWORD/DB, /docker-entrypoint-initdb.d/*.sql on an
#                     empty data volume, listen on every interface, scram passwords)
# Names other than these: STANDIN_PYTHON / STANDIN_POSTGRES (then build the worker image with
# `--build-arg BASE=$STANDIN_PYTHON` and retag the postgres one; compose.yaml's only image variable is
# SIM2EDGE_IMAGE, the worker image's name).
# Usage (as root, a daemon at $DOCKER_HOST, classic builder):
#   WORK=/tmp/stk/standin DOCKER_BUILDKIT=0 bash docker/standin_images.sh
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/tmp/sim2edge-standin}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-python3}                       # a Python 3.11 with pip that can reach PyPI (for `pip download`)
STANDIN_BASE=${STANDIN_BASE:-sim2edge-standin/debian:bookworm}
STANDIN_PYTHON=${STANDIN_PYTHON:-python:3.11-slim}
STANDIN_POSTGRES=${STANDIN_POSTGRES:-postgres:16}
export DOCKER_BUILDKIT=0
mkdir -p "$WORK"

# 1. the root file system: minbase + what the Dockerfile's apt step and the postgres stand-in need
if ! docker image inspect "$STANDIN_BASE" >/dev/null 2>&1; then
  if [ ! -f "$WORK/rootfs.tar" ]; then
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase \
      --include=python3,python3-pip,python3-venv,git,libegl1,libopengl0,ca-certificates,postgresql-15,postgresql-client-15,gosu \
      bookworm "$WORK/rootfs" "$MIRROR"
    chroot "$WORK/rootfs" apt-get clean
    rm -rf "$WORK/rootfs/var/lib/apt/lists/"*
    tar -C "$WORK/rootfs" --numeric-owner -cf "$WORK/rootfs.tar" .
    rm -rf "$WORK/rootfs"
  fi
  docker import "$WORK/rootfs.tar" "$STANDIN_BASE"
fi

# 2. the wheels of ".[team]" (and the build backend), for this image's Python: 3.11, manylinux x86_64
mkdir -p "$WORK/py/wheels"
"$PYTHON" -m pip download -q -d "$WORK/py/wheels" -c "$REPO/constraints.txt" "$REPO[team]" setuptools wheel \
  'async-timeout>=4.0.3'   # redis wants it on Python < 3.11.3: Debian's is 3.11.2, the downloading one may be newer
rm -f "$WORK/py/wheels/sim2edge-"*   # the project itself is built from the checkout by the Dockerfile
cat > "$WORK/py/Dockerfile" <<'EOF'
ARG STANDIN_BASE
FROM ${STANDIN_BASE}
ENV LANG=C.UTF-8 PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore
COPY wheels /wheels
RUN rm -f /usr/lib/python3*/EXTERNALLY-MANAGED && ln -sf python3 /usr/bin/python \
 && printf '[global]\nno-index = true\nfind-links = /wheels\n' > /etc/pip.conf \
 && : > /etc/apt/sources.list && rm -f /etc/apt/sources.list.d/*
CMD ["python3"]
EOF
docker build -q --build-arg STANDIN_BASE="$STANDIN_BASE" -t "$STANDIN_PYTHON" "$WORK/py"

# 3. postgres: Debian's PostgreSQL 15 with an entrypoint like the official image's
mkdir -p "$WORK/pg"
cat > "$WORK/pg/entrypoint.sh" <<'EOF'
#!/bin/bash
# The official postgres image's entrypoint, in short: first start on an empty PGDATA runs initdb with
# POSTGRES_USER/POSTGRES_PASSWORD, creates POSTGRES_DB, runs /docker-entrypoint-initdb.d/*.sql on a socket-only
# server, then serves on every interface.
set -euo pipefail
BIN=/usr/lib/postgresql/15/bin
export PGDATA=${PGDATA:-/var/lib/postgresql/data}
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
mkdir -p "$PGDATA" /var/run/postgresql
chown -R postgres:postgres "$PGDATA" /var/run/postgresql && chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  printf '%s\n' "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD}" > /tmp/pwfile && chown postgres /tmp/pwfile
  gosu postgres "$BIN/initdb" -D "$PGDATA" --username="$POSTGRES_USER" --pwfile=/tmp/pwfile \
    --auth-local=trust --auth-host=scram-sha-256 -E UTF8 >/dev/null
  rm -f /tmp/pwfile
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  gosu postgres "$BIN/pg_ctl" -D "$PGDATA" -o "-c listen_addresses=''" -w start
  if [ "$POSTGRES_DB" != postgres ]; then
    gosu postgres psql -v ON_ERROR_STOP=1 -U "$POSTGRES_USER" -d postgres -c "CREATE DATABASE \"$POSTGRES_DB\""
  fi
  for f in /docker-entrypoint-initdb.d/*; do
    case "$f" in *.sql) echo "running $f"; gosu postgres psql -v ON_ERROR_STOP=1 -U "$POSTGRES_USER" -d "$POSTGRES_DB" -f "$f";; esac
  done
  gosu postgres "$BIN/pg_ctl" -D "$PGDATA" -m fast -w stop
fi
exec gosu postgres "$BIN/postgres" -D "$PGDATA" -c listen_addresses='*' "$@"
EOF
cat > "$WORK/pg/Dockerfile" <<'EOF'
ARG STANDIN_BASE
FROM ${STANDIN_BASE}
ENV LANG=C.UTF-8
COPY entrypoint.sh /usr/local/bin/docker-entrypoint.sh
RUN chmod +x /usr/local/bin/docker-entrypoint.sh && mkdir -p /docker-entrypoint-initdb.d
EXPOSE 5432
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
EOF
docker build -q --build-arg STANDIN_BASE="$STANDIN_BASE" -t "$STANDIN_POSTGRES" "$WORK/pg"
docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "^(${STANDIN_BASE%%:*}|${STANDIN_PYTHON%%:*}|${STANDIN_POSTGRES%%:*}):"
