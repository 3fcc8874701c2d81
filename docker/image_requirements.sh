#!/bin/bash
# Print requirements.txt (path: $1) as the container installs it: comments and blank lines dropped, and without
# the packages the NGC PyTorch image already provides as NVIDIA's builds for its CUDA and NCCL (a PyPI wheel would
# replace them). docker/Dockerfile runs it; tests/cluster/test_docker.py checks the result against requirements.txt.
PROVIDED_BY_IMAGE="torch torchvision"

requirements=${1:?usage: image_requirements.sh path/to/requirements.txt}
while IFS= read -r line || [ -n "$line" ]; do
    line=$(sed -E 's/#.*//; s/^[[:space:]]+//; s/[[:space:]]+$//' <<< "$line")
    [ -n "$line" ] || continue
    # the name (before any version, extra or marker), normalised as PEP 503 does: case, '_' and '.' do not matter
    name=$(sed -E 's/^([A-Za-z0-9._-]+).*/\1/' <<< "$line" | tr '[:upper:]_.' '[:lower:]--')
    case " $PROVIDED_BY_IMAGE " in
        *" $name "*) ;;
        *) printf '%s\n' "$line" ;;
    esac
done < "$requirements"
