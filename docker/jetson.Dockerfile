# The Jetson runtime image (arm64, L4T base chosen by the target): the device agent (edge/ alone) and one
# verified, installed bundle. `sim2edge package BUNDLE --image` writes this file's build context and builds it:
#   DOCKER_BUILDKIT=0 docker build --platform linux/arm64 --build-arg BASE=nvcr.io/nvidia/l4t-jetpack:r36.4.0 \
#       --build-arg L4T_VERSION=36.4.0 --build-arg ORT_INDEX=https://pypi.jetson-ai-lab.io/jp6/cu126 -t IMAGE CONTEXT
# The context holds: this Dockerfile, edge/ (the agent package), bundle.tar, trust.pub, install_bundle.py.
ARG BASE=nvcr.io/nvidia/l4t-jetpack:r36.4.0
FROM ${BASE}
# L4T of the base image (its /etc/nv_tegra_release is often absent in containers; the agent honours L4T_VERSION)
ARG L4T_VERSION=36.4.0
# Jetson AI Lab index with onnxruntime-gpu for this JetPack; without it (or offline) PyPI's CPU onnxruntime is used
ARG ORT_INDEX=
ENV L4T_VERSION=${L4T_VERSION} SIM2EDGE_DEVICE_ROOT=/var/lib/sim2edge PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN command -v pip3 >/dev/null || { apt-get update && apt-get install -y --no-install-recommends python3-pip \
        && rm -rf /var/lib/apt/lists/*; }
COPY edge /opt/sim2edge/edge
RUN { [ -z "${ORT_INDEX}" ] || pip3 install --extra-index-url "${ORT_INDEX}" onnxruntime-gpu; } \
    && pip3 install /opt/sim2edge/edge \
    && python3 -c "import onnxruntime, edge.cli; print('providers', onnxruntime.get_available_providers())"
COPY bundle.tar trust.pub install_bundle.py /opt/sim2edge/
# verify (signature, hashes, target against L4T_VERSION) and install into the store; the image holds no key but the public one
RUN python3 /opt/sim2edge/install_bundle.py /opt/sim2edge/bundle.tar --trust /opt/sim2edge/trust.pub \
        --root /var/lib/sim2edge && rm /opt/sim2edge/bundle.tar
HEALTHCHECK --interval=60s --timeout=30s --start-period=20s --retries=3 \
    CMD sim2edge-agent verify --root /var/lib/sim2edge --trust /opt/sim2edge/trust.pub \
        && python3 -m edge.smoke --root /var/lib/sim2edge
EXPOSE 5600/udp
ENTRYPOINT ["sim2edge-agent", "run", "--root", "/var/lib/sim2edge"]
CMD ["--listen", "udp://0.0.0.0:5600"]
