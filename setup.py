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
    packages=find_packages(include=["scheduler", "scheduler.*", "modules", "modules.*"]),
    package_data={"modules": ["quant/*.cu"]},
    py_modules=["dist_runner"],
    install_requires=[
        "numpy>=1.24",
        "scipy>=1.10",
        "networkx>=3.0",
        "matplotlib>=3.7",
        "paramiko>=3.0",
        "torch>=2.2",
    ],
    extras_require={
        "gpu": ["cupy-cuda12x>=13"],
        "netem": ["NetfilterQueue>=1.1"],
        "dev": ["pytest>=7", "pytest-timeout>=2.2", "ruff>=0.5"],
    },
)
