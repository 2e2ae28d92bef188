#!/usr/bin/env bash
# The main job: build flce and run the comparison demo on this machine's default device.
source "$(dirname "$0")/env.sh"
source scripts/build.sh
cd benchmarks && python demo.py "$@"
