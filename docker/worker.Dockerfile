# Pipeline worker for Prefect docker/kubernetes work pools (x86_64, CPU torch by default).
#   docker build -f docker/worker.Dockerfile -t sim2edge-worker .
# A CUDA base works too: --build-arg BASE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 (bring python3.11)
# and --build-arg CONSTRAINTS=/dev/null to let pip pick the CUDA torch build.
# A base that already has the dependencies (tests/test_docker_daemon.py, offline):
#   --build-arg APT_PACKAGES= --build-arg PIP_ARGS="--no-deps --no-build-isolation"
# The team stack's servers (docker/compose.yaml) run from it too, with --build-arg EXTRAS="[team]"
# (psycopg2 for PostgreSQL, MLflow's basic-auth app).
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG CONSTRAINTS=constraints.txt
ARG APT_PACKAGES="git libegl1 libopengl0"
ARG PIP_ARGS=
ARG EXTRAS=
ENV PYTHONUNBUFFERED=1 MUJOCO_GL=egl SIM2EDGE_HOME=/workspace
RUN [ -z "${APT_PACKAGES}" ] || { apt-get update && apt-get install -y --no-install-recommends ${APT_PACKAGES} \
        && rm -rf /var/lib/apt/lists/*; }
WORKDIR /opt/sim2edge
COPY pyproject.toml constraints.txt ./
COPY stages stages
COPY flows flows
COPY registry registry
COPY edge edge
RUN python3 -m pip install --no-cache-dir ${PIP_ARGS} -c ${CONSTRAINTS} ".${EXTRAS}"
WORKDIR /workspace
ENTRYPOINT ["sim2edge"]
CMD ["--help"]
