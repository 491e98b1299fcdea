"""Install the planner (scheduler), the runtime library (modules) and the operations scripts."""

from setuptools import find_packages, setup

setup(
    name="scattered-train",
    version="0.1.0",
    description=(
        "Plan and run foundation-model training on scattered, mismatched, "
        "badly connected GPUs"
    ),
    python_requires=">=3.10",
    # testkit, benchmarks and the NAT lab too: their scripts import through the installed
    # packages (no sys.path edits), as the entry points' do
    packages=find_packages(include=["formats", "formats.*", "scheduler", "scheduler.*", "modules",
                                    "modules.*", "scripts", "scripts.*", "testkit", "testkit.*",
                                    "benchmarks", "udp_hole_punching_test"]),
    package_data={"modules": ["quant/*.cu"]},
    py_modules=["dist_runner"],
    # the same commands as `python scheduler/scheduler.py ...`, `python dist_runner.py ...`, ...
    entry_points={"console_scripts": [
        "st-plan = scheduler.scheduler:entry",
        "st-run = dist_runner:entry",
        "st-launch = scripts.launch_local:entry",
        "st-netemu = scripts.local_cluster:entry",
        "st-tc = scripts.tc:entry",
        "st-ssh = scripts.cluster_ssh:entry",
        "st-measure = scripts.measure:entry",
        "st-coord = scripts.coordinator:entry",
        "st-dht = scripts.dht_node:entry",
        "st-train-tokenizer = scripts.train_tokenizer:entry",
        "st-prepare-data = scripts.prepare_data:entry",
        "st-export-hf = scripts.export_hf:entry",
    ]},
    install_requires=[
        "numpy>=1.24",
        "scipy>=1.10",
        "networkx>=3.0",
        "matplotlib>=3.7",
        "paramiko>=3.0",
        "torch>=2.6",  # group_dst/group_src in torch.distributed p2p and broadcast (gloo.py)
        "pyarrow>=14",  # .parquet corpora (modules/data/corpus.py)
        "tokenizers>=0.15",  # --tokenizer tokenizer.json, scripts/train_tokenizer.py
        "safetensors>=0.4",  # --init-from, scripts/export_hf.py
    ],
    extras_require={
        # cupy for torch's CUDA major: gpu (CUDA 13, the tested stack) or gpu-cuda12; the
        # error naming what to install picks it from torch.version.cuda (modules/comm/nccl.py)
        "gpu": ["cupy-cuda13x>=13"],
        "gpu-cuda12": ["cupy-cuda12x>=13"],
        "netem": ["NetfilterQueue>=1.1"],
        # transformers: tests load scripts/export_hf.py's output with AutoModelForCausalLM
        "dev": ["pytest>=7", "pytest-timeout>=2.2", "ruff>=0.5", "transformers>=4.40"],
        # --tracker tensorboard (setup_env.sh installs it); wandb: pip install -e .[wandb]
        "track": ["tensorboard>=2.14"],
        "wandb": ["wandb>=0.16"],
        # --outer-backend hivemind, scripts/dht_node.py (setup_env.sh installs it); the wheel
        # ships its p2pd binary
        "hivemind": ["hivemind==1.1.12"],
    },
)
