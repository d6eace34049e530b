# megapipe on a DGX node: NVIDIA's PyTorch container brings CUDA torch, NCCL, apex,
# TransformerEngine and Triton, which megapipe uses when they are importable.
#
#   docker build -t megapipe .                       # --build-arg USER_UID=$(id -u) to own /data
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#       -v /path/to/data:/data megapipe bash examples/pretrain_gpt_dgx_1node.sh
FROM nvcr.io/nvidia/pytorch:25.12-py3

# The container's torch is NVIDIA's own build with a pre-release version string
# (2.10.0a0+b4e4ee81d3 in 25.12). It must stay: a torch from PyPI would drop NVIDIA's CUDA,
# NCCL and apex/TransformerEngine builds that were compiled against it. So pip never resolves
# torch here:
#   - megapipe itself is installed with --no-deps (its setup.py asks for torch>=2.4,<3, and a
#     resolver that refuses pre-releases, or a later --upgrade, could fetch a PyPI torch);
#   - its other runtime dependencies (setup.py's install_requires without torch; a test keeps
#     the two lists equal) are installed by name, under the container's own constraint file
#     (/etc/pip/constraint.txt, since 25.03), which pins every package the image was built with;
#   - the build fails if torch's version is not the same at the end as at the start.
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN python -c "import torch; print(torch.__version__)" > /opt/torch-version-of-base-image \
 && pip install --constraint /etc/pip/constraint.txt \
        "numpy>=1.24" "sentencepiece>=0.1.99" "tensorboard>=2.12" "tqdm>=4.60" "safetensors>=0.4"

# A non-root user. Ubuntu 24.04 images ship a user "ubuntu" with uid 1000: it is replaced, so
# that USER_UID (1000 unless given, e.g. --build-arg USER_UID=$(id -u)) can own files on /data.
ARG USERNAME=megapipe
ARG USER_UID=1000
RUN if existing=$(getent passwd "${USER_UID}" | cut -d: -f1) && [ -n "${existing}" ]; then \
        userdel --remove "${existing}"; \
    fi \
 && useradd --create-home --uid "${USER_UID}" --shell /bin/bash "${USERNAME}" \
 && mkdir -p /data && chown "${USERNAME}:" /data

WORKDIR /workspace/megapipe
COPY --chown=${USERNAME}:${USERNAME} . .
# Editable, so that the checkout under WORKDIR is the code that runs (and can be mounted over).
RUN pip install --no-deps --no-build-isolation -e . \
 && test "$(python -c 'import torch; print(torch.__version__)')" = \
         "$(cat /opt/torch-version-of-base-image)" \
 && python -c "import megapipe, pretrain_gpt"

USER ${USERNAME}
CMD ["python", "pretrain_gpt.py", "--help"]
